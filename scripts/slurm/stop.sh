#!/usr/bin/env bash
# Stop the local SLURM test cluster started by start.sh. Idempotent, and fine
# when nothing runs. Queued/running jobs are cancelled first (by job id), then
# each daemon gets SIGTERM by its pid file -- after checking that the pid is
# still that program -- and SIGKILL if it is still there after
# SLURM_LOCAL_STOP_TIMEOUT seconds (default 30). Nothing is killed by name.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"
secs=${SLURM_LOCAL_STOP_TIMEOUT:-30}

[ "$(id -u)" = 0 ] || die "must run as root"

if alive "$SLURMCTLD_PIDFILE" slurmctld; then
    jobs=$(timeout 20 squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        timeout 20 scancel $jobs || true
        for _ in $(seq 100); do # up to 20 s for the jobs to end
            [ -z "$(timeout 5 squeue -h -o %A 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
fi

# Reverse order of start: compute daemon, controller, accounting, auth.
stop_pidfile "$SLURMD_PIDFILE" slurmd "$secs"
stop_pidfile "$SLURMCTLD_PIDFILE" slurmctld "$secs"
stop_pidfile "$SLURMDBD_PIDFILE" slurmdbd "$secs"
stop_pidfile "$MARIADB_PIDFILE" mariadbd "$secs"
stop_pidfile "$MUNGE_PIDFILE" munged "$secs"
log "all stopped"
exit 0
