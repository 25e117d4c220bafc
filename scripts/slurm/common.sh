# shellcheck shell=bash disable=SC2034
# Helpers shared by scripts/slurm/{install,start,stop}.sh (sourced, not run).
# A single-node SLURM test cluster from Debian's packages, run as root without
# systemd: every daemon is started by hand and tracked through its pid file.

# dpkg, start-stop-daemon, runuser and the daemons live in sbin, which a
# non-login root shell (CI, `docker exec`) may not have on PATH.
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" ;; esac
export PATH

# Settings (override through the environment).
SLURM_LOCAL_CLUSTER=${SLURM_LOCAL_CLUSTER:-membudget}
SLURM_LOCAL_PARTITION=${SLURM_LOCAL_PARTITION:-debug}
# 1: also run MariaDB + slurmdbd so that `sacct` works. submitit polls sacct;
# without it a job that dies before writing its result pickle (os._exit, OOM
# kill, time limit) leaves job.result() -- and a Hydra sweep -- waiting forever.
SLURM_LOCAL_ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}

SLURM_ETC=/etc/slurm
SLURM_LOGDIR=/var/log/slurm
SLURM_RUNDIR=/run/slurm
MUNGE_PIDFILE=/run/munge/munged.pid
MARIADB_PIDFILE=/run/mysqld/mysqld.pid
SLURMDBD_PIDFILE=$SLURM_RUNDIR/slurmdbd.pid
SLURMCTLD_PIDFILE=$SLURM_RUNDIR/slurmctld.pid
SLURMD_PIDFILE=$SLURM_RUNDIR/slurmd.pid

log() { printf '[%s %s] %s\n' "${0##*/}" "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# Packages the cluster needs (accounting adds the database and slurmdbd).
slurm_packages() {
    local pkgs=(munge slurmctld slurmd slurm-client)
    [ "$SLURM_LOCAL_ACCOUNTING" = 1 ] && pkgs+=(slurmdbd mariadb-server)
    printf '%s\n' "${pkgs[@]}"
}

# missing_packages: prints the packages of slurm_packages not installed yet.
missing_packages() {
    local p
    for p in $(slurm_packages); do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
    done
}

# running PID NAME: PID is the program NAME and not a zombie. Checking the name
# matters: /run survives a container restart here, so a stale pid file may name
# an unrelated process; and PID 1 reaps orphans only every second or two, so a
# daemon that exited can linger as a zombie that `kill -0` still reports alive.
running() {
    local st
    [ "$(cat "/proc/$1/comm" 2>/dev/null)" = "$2" ] || return 1
    st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1)
    [ -n "$st" ] && [ "$st" != Z ] && [ "$st" != X ]
}

# alive PIDFILE NAME: the pid in PIDFILE is a running NAME.
alive() {
    local p
    [ -s "$1" ] || return 1
    p=$(cat "$1" 2>/dev/null) || return 1
    [[ $p =~ ^[0-9]+$ ]] || return 1
    running "$p" "$2"
}

# stop_pidfile PIDFILE NAME [SECONDS]: SIGTERM the daemon named by PIDFILE,
# SIGKILL it if it is still there after SECONDS (default 30). Only that pid is
# ever signalled; a missing or stale pid file is simply removed.
stop_pidfile() {
    local f=$1 name=$2 secs=${3:-30} p
    if ! alive "$f" "$name"; then
        rm -f "$f"
        return 0
    fi
    p=$(cat "$f")
    kill -TERM "$p" 2>/dev/null || true
    for _ in $(seq $((secs * 10))); do
        running "$p" "$name" || break
        sleep 0.1
    done
    if running "$p" "$name"; then
        log "$name (pid $p) still running ${secs}s after SIGTERM: SIGKILL"
        kill -KILL "$p" 2>/dev/null || true
        for _ in $(seq 50); do running "$p" "$name" || break; sleep 0.1; done
    fi
    rm -f "$f"
    log "stopped $name (pid $p)"
}

# wait_until SECONDS WHAT CMD...: run CMD every 0.2 s until it succeeds.
wait_until() {
    local secs=$1 what=$2
    shift 2
    for _ in $(seq $((secs * 5))); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.2
    done
    log "timed out after ${secs}s waiting for: $what"
    return 1
}

# wait_pidfile PIDFILE NAME [SECONDS]: a daemon was just started (it forks);
# wait until its pid file names a running NAME.
wait_pidfile() {
    local f=$1 name=$2 secs=${3:-20}
    for _ in $(seq $((secs * 5))); do
        if alive "$f" "$name"; then
            log "started $name (pid $(cat "$f"))"
            return 0
        fi
        sleep 0.2
    done
    log "$name did not start within ${secs}s: see $SLURM_LOGDIR"
    return 1
}

# show_logs: the tail of every daemon log, for a failure message.
show_logs() {
    local f
    for f in "$SLURM_LOGDIR"/*.log; do
        [ -f "$f" ] || continue
        echo "==> $f <==" >&2
        tail -n 25 "$f" >&2
    done
}
