#!/bin/bash
# SLURM node epilog: stop the lens-probe that lens-probe-prolog.sh started for this job.
#
# Run by slurmd as root when the job ends on this node, with SLURM_JOB_ID. Sends SIGTERM
# to the pid in <run dir>/<id>.pid; lens-probe then flushes what it traced (spans of
# processes still running end with an error status) and exits, which takes at most ~10 s.
# After LENS_PROBE_STOP_TIMEOUT seconds (default 30) it is killed. The pid file is then
# removed. Always exits 0: it never drains a node or fails a job.
#
# Settings: LENS_PROBE_RUN_DIR (/run/lens-probe), LENS_PROBE_LOG_DIR
# (/var/log/lens-probe), LENS_PROBE_STOP_TIMEOUT (30), as for the prolog.
set -u

run_dir=${LENS_PROBE_RUN_DIR:-/run/lens-probe}
log_dir=${LENS_PROBE_LOG_DIR:-/var/log/lens-probe}
stop_timeout=${LENS_PROBE_STOP_TIMEOUT:-30}
case $stop_timeout in '' | *[!0-9]*) stop_timeout=30 ;; esac
job=${SLURM_JOB_ID:-}
log_file=

log() {
    local line
    line="$(date -u '+%Y-%m-%dT%H:%M:%SZ') lens-probe-epilog: job ${job:-?}: $*"
    if [ -n "$log_file" ] && printf '%s\n' "$line" >>"$log_file" 2>/dev/null; then
        return 0
    fi
    logger -t lens-probe-epilog -- "$line" 2>/dev/null || printf '%s\n' "$line" >&2
    return 0
}

# The state letter of /proc/PID/stat (Z: exited, not yet reaped), empty when gone.
proc_state() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    printf '%s' "${stat%% *}"
}

running() {
    local state
    state=$(proc_state "$1")
    [ -n "$state" ] && [ "$state" != Z ]
}

main() {
    case $job in
        '' | *[!0-9]*)
            log "SLURM_JOB_ID is '${job}', not a job id: nothing to stop"
            return 0
            ;;
    esac
    [ -d "$log_dir" ] && [ -w "$log_dir" ] && log_file=$log_dir/$job.log
    local pid_file=$run_dir/$job.pid
    if [ ! -e "$pid_file" ]; then
        # No prolog ran here (without PrologFlags=Alloc, a node with no step), or it
        # could not start lens-probe (its log says why).
        return 0
    fi
    local pid
    pid=$(head -n 1 "$pid_file" 2>/dev/null)
    case $pid in
        '' | *[!0-9]*)
            log "$pid_file holds no pid"
            rm -f -- "$pid_file"
            return 0
            ;;
    esac
    # Only the lens-probe of this job: a pid can be reused once it has exited.
    if ! running "$pid" || ! tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null |
        grep -q -- "SLURM_JOB_ID=$job "; then
        log "lens-probe (pid $pid) had already exited"
        rm -f -- "$pid_file"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null
    local waited=0 limit=$((stop_timeout * 10))
    while running "$pid" && [ "$waited" -lt "$limit" ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    if running "$pid"; then
        log "lens-probe (pid $pid) still runs ${stop_timeout}s after SIGTERM: killed"
        kill -KILL "$pid" 2>/dev/null
    else
        log "lens-probe (pid $pid) stopped"
    fi
    rm -f -- "$pid_file"
    return 0
}

main
exit 0
