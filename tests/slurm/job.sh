#!/bin/sh
# The batch script of tests/integration/slurm.rs: `sbatch -N1 -n2 job.sh GATE TRAINER ARGS…`.
# Waits until the test has seen lens-probe ready (it creates GATE), then runs the fake
# PyTorch trainer as the job's two tasks. srun gives each task its SLURM_PROCID (0, 1),
# SLURM_NTASKS=2 and SLURM_STEP_ID; each prints them with its pid, then becomes the
# trainer (same pid), so the test can tell which spans came from which task of which step.
gate=$1
shift
waited=0
while [ ! -e "$gate" ]; do
    waited=$((waited + 1))
    if [ "$waited" -gt 1200 ]; then
        echo "job.sh: no $gate after 120 s" >&2
        exit 3
    fi
    sleep 0.1
done
echo "job.sh: batch SLURM_JOB_ID=$SLURM_JOB_ID"
exec srun -N1 -n2 --kill-on-bad-exit=1 sh -c \
    'echo "task pid=$$ job=$SLURM_JOB_ID step=$SLURM_STEP_ID procid=$SLURM_PROCID ntasks=$SLURM_NTASKS"; exec "$@"' \
    task "$@"
