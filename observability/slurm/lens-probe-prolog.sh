#!/bin/bash
# SLURM node prolog: start lens-probe for this job on this node.
#
# Run by slurmd as root before the job's tasks start (PrologFlags=Alloc: at allocation,
# on every node of it), with SLURM_JOB_ID in the environment. Starts
#
#   lens-probe --node --match-env SLURM_JOB_ID=<id> --pid-file <run dir>/<id>.pid
#
# detached (own session, stdin from /dev/null, output to <log dir>/<id>.log), so it
# traces every training process of this job on this node, and only those, from their
# start until lens-probe-epilog.sh stops it. Exporter settings (NEMO_LENS_*, OTEL_*,
# LENS_PROBE_EXPORT_FILE) come from the env file, KEY=VALUE lines (`%j`: the job id).
#
# Why --match-env and not --match-cgroup: every process of the job (srun tasks, the batch
# script, torchrun's workers, containers started by pyxis/enroot) inherits SLURM_JOB_ID,
# whatever the cgroup plugin, cgroup version or path layout (/slurm/uid_U/job_N/… on v1,
# …/slurmstepd.scope/job_N/… on v2, none at all without proctrack/cgroup); and the value
# is compared whole, where the substring `job_12` also matches job_123's cgroup.
#
# It never fails the job: whatever goes wrong is logged and it exits 0. It waits at most
# LENS_PROBE_START_TIMEOUT seconds (default 10) for lens-probe to have loaded its BPF
# programs (it then writes its pid file), so that tracing is up when the tasks start.
#
# Settings (environment, for tests and unusual installs):
#   LENS_PROBE_BIN            the binary (/usr/local/bin/lens-probe)
#   LENS_PROBE_RUN_DIR        pid files (/run/lens-probe)
#   LENS_PROBE_LOG_DIR        one log per job (/var/log/lens-probe)
#   LENS_PROBE_ENV_FILE       exporter settings (/etc/lens-probe/lens-probe.env; optional)
#   LENS_PROBE_START_TIMEOUT  seconds to wait for lens-probe to be ready (10)
set -u

bin=${LENS_PROBE_BIN:-/usr/local/bin/lens-probe}
run_dir=${LENS_PROBE_RUN_DIR:-/run/lens-probe}
log_dir=${LENS_PROBE_LOG_DIR:-/var/log/lens-probe}
env_file=${LENS_PROBE_ENV_FILE:-/etc/lens-probe/lens-probe.env}
start_timeout=${LENS_PROBE_START_TIMEOUT:-10}
case $start_timeout in '' | *[!0-9]*) start_timeout=10 ;; esac
job=${SLURM_JOB_ID:-}
log_file=

# One line to the job's log file, else to syslog, else stderr (slurmd's log).
log() {
    local line
    line="$(date -u '+%Y-%m-%dT%H:%M:%SZ') lens-probe-prolog: job ${job:-?}: $*"
    if [ -n "$log_file" ] && printf '%s\n' "$line" >>"$log_file" 2>/dev/null; then
        return 0
    fi
    logger -t lens-probe-prolog -- "$line" 2>/dev/null || printf '%s\n' "$line" >&2
    return 0
}

# Exports the KEY=VALUE lines of an env file (systemd EnvironmentFile style: `#`
# comments, blank lines, optional `export `, optional quotes around the value). Nothing
# in it is executed or expanded, except `%j` in a value: the job id (as in sbatch's
# file name patterns), e.g. LENS_PROBE_EXPORT_FILE=/var/log/lens-probe/%j.spans.jsonl.
load_env_file() {
    local file=$1 line key value
    while IFS= read -r line || [ -n "$line" ]; do
        line=${line#"${line%%[![:space:]]*}"}
        case $line in '' | '#'*) continue ;; esac
        line=${line#export }
        key=${line%%=*}
        value=${line#*=}
        case $key in
            '' | [0-9]* | *[!A-Za-z0-9_]*)
                log "ignoring a line of $file that is not KEY=VALUE"
                continue
                ;;
        esac
        [ "$key" = "$line" ] && {
            log "ignoring $key in $file: no '='"
            continue
        }
        case $value in
            \"*\")
                value=${value#\"}
                value=${value%\"}
                ;;
            \'*\')
                value=${value#\'}
                value=${value%\'}
                ;;
        esac
        value=${value//%j/$job}
        export "$key=$value"
    done <"$file"
}

main() {
    case $job in
        '' | *[!0-9]*)
            log "SLURM_JOB_ID is '${job}', not a job id: lens-probe not started"
            return 0
            ;;
    esac
    if mkdir -p "$log_dir" 2>/dev/null; then
        log_file=$log_dir/$job.log
    else
        log "cannot create $log_dir: logging to syslog"
    fi
    if ! mkdir -p "$run_dir" 2>/dev/null; then
        log "cannot create $run_dir: lens-probe not started"
        return 0
    fi
    local pid_file=$run_dir/$job.pid
    if [ -s "$pid_file" ]; then
        local old
        old=$(head -n 1 "$pid_file" 2>/dev/null)
        case $old in
            '' | *[!0-9]*) ;;
            *)
                if tr '\0' ' ' <"/proc/$old/cmdline" 2>/dev/null |
                    grep -q -- "SLURM_JOB_ID=$job "; then
                    log "lens-probe already runs for this job (pid $old)"
                    return 0
                fi
                ;;
        esac
        rm -f -- "$pid_file"
    fi
    if [ ! -x "$bin" ]; then
        log "$bin is not an executable: lens-probe not started"
        return 0
    fi
    if [ -f "$env_file" ]; then
        if [ -r "$env_file" ]; then
            load_env_file "$env_file"
        else
            log "cannot read $env_file: lens-probe's defaults apply"
        fi
    fi

    local out=${log_file:-/dev/null}
    setsid nohup "$bin" --node --match-env "SLURM_JOB_ID=$job" --pid-file "$pid_file" \
        </dev/null >>"$out" 2>&1 &
    local pid=$!
    log "started $bin (pid $pid) for processes with SLURM_JOB_ID=$job"

    # Ready when it has written its pid file (BPF programs loaded). A fast exit is an
    # error it has logged (no privileges, no uprobe support, bad setting).
    local waited=0 limit=$((start_timeout * 10))
    while [ "$waited" -lt "$limit" ]; do
        if [ -s "$pid_file" ]; then
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null || [ "$(proc_state "$pid")" = Z ]; then
            log "lens-probe (pid $pid) exited at start: see the lines above"
            return 0
        fi
        sleep 0.1
        waited=$((waited + 1))
    done
    # Still loading: record its pid so that the epilog can stop it all the same.
    log "lens-probe (pid $pid) not ready after ${start_timeout}s: the job starts anyway"
    printf '%s\n' "$pid" >"$pid_file" 2>/dev/null || log "cannot write $pid_file"
    return 0
}

# The state letter of /proc/PID/stat (Z: exited, not yet reaped), empty when gone.
proc_state() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    stat=${stat##*) }
    printf '%s' "${stat%% *}"
}

main
exit 0
