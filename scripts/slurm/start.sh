#!/usr/bin/env bash
# Start (or check) a real single-node SLURM cluster on this machine, for tests.
# Debian bookworm packages, run as root, no systemd. Idempotent: installs what
# is missing, rewrites the config, starts only the daemons that are not running
# (restarting them if their config changed), waits until the node is idle and
# runs probe job steps. Prints sinfo on success; exits non-zero with log tails
# on failure.
#
# Environment (defaults in common.sh):
#   SLURM_LOCAL_ACCOUNTING=1   MariaDB + slurmdbd so that `sacct` works (0: off)
#   SLURM_LOCAL_PARTITION=debug
#   SLURM_LOCAL_CPUS           CPUs to declare for the node (default: nproc, at
#                              least 2 so a 2-task job always fits; more than the
#                              machine has means oversubscription, which is allowed)
#   SLURM_LOCAL_MEM_MB         RealMemory (default: 90 % of MemTotal)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"
T0=$(date +%s.%N)
elapsed() { awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN { printf "%.1f", a - b }'; }

[ "$(id -u)" = 0 ] || die "must run as root"

# ------------------------------------------------------------------ packages
if [ -n "$(missing_packages)" ]; then
    bash "$HERE/install.sh"
fi

# ------------------------------------------------------------------ host, dirs
HOST=$(hostname -s)
# slurmctld and srun resolve SlurmctldHost / the node name: it must resolve.
if ! getent hosts "$HOST" >/dev/null; then
    log "hostname $HOST does not resolve: adding it to /etc/hosts"
    echo "127.0.0.1 $HOST" >>/etc/hosts
fi
install -d -m 0755 "$SLURM_ETC" "$SLURM_RUNDIR" "$SLURM_LOGDIR" /var/spool/slurmctld /var/spool/slurmd
install -d -o munge -g munge -m 0755 /run/munge

# ------------------------------------------------------------------ munge key
if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 0700 /etc/munge
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0600 /etc/munge/munge.key
fi

# ------------------------------------------------------------------ config
nproc_=$(nproc)
CPUS=${SLURM_LOCAL_CPUS:-$((nproc_ < 2 ? 2 : nproc_))}
mem_total_mb=$(awk '/^MemTotal:/ { print int($2 / 1024) }' /proc/meminfo)
# Below what slurmd measures: a node reporting less memory than configured is DRAINed.
MEM_MB=${SLURM_LOCAL_MEM_MB:-$((mem_total_mb * 90 / 100))}

if [ "$SLURM_LOCAL_ACCOUNTING" = 1 ]; then
    acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819"
else
    acct="AccountingStorageType=accounting_storage/none"
fi

# write_if_changed FILE MODE < content: returns 0 if FILE was (re)written.
write_if_changed() {
    local f=$1 mode=$2 tmp
    tmp=$(mktemp "$f.XXXXXX")
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [ -f "$f" ] && cmp -s "$tmp" "$f"; then
        rm -f "$tmp"
        return 1
    fi
    mv -f "$tmp" "$f"
}

conf_changed=0
write_if_changed "$SLURM_ETC/slurm.conf" 0644 <<CONF && conf_changed=1
# Written by scripts/slurm/start.sh: single-node test cluster (no cgroups, no systemd).
ClusterName=$SLURM_LOCAL_CLUSTER
SlurmctldHost=$HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
# No cgroup plugins: they need a writable cgroup tree and systemd/dbus.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$acct
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# Start batch jobs at once (the default batch_sched_delay=3 made jobs wait 2-3 s).
SchedulerParameters=batch_sched_delay=0
# Allocate logical CPUs, not cores: with CR_Core a hyperthreaded core counts as
# one unit and a 2-task job could not fit on 2 CPUs. Memory is not consumable.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Trust the CPUs/memory written below even if they exceed the hardware
# (oversubscription) instead of DRAINing the node.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$SLURMCTLD_PIDFILE
SlurmdPidFile=$SLURMD_PIDFILE
SlurmctldLogFile=$SLURM_LOGDIR/slurmctld.log
SlurmdLogFile=$SLURM_LOGDIR/slurmd.log
SlurmctldPort=6817
SlurmdPort=6818
NodeName=$HOST CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=$SLURM_LOCAL_PARTITION Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF

dbd_conf_changed=0
if [ "$SLURM_LOCAL_ACCOUNTING" = 1 ]; then
    # slurmdbd refuses a config readable by others (it holds the DB password).
    write_if_changed "$SLURM_ETC/slurmdbd.conf" 0600 <<CONF && dbd_conf_changed=1
# Written by scripts/slurm/start.sh. MariaDB over its local socket (--skip-networking).
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$SLURMDBD_PIDFILE
LogFile=$SLURM_LOGDIR/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm-local
StorageLoc=slurm_acct_db
CONF
fi

if [ $conf_changed = 1 ]; then
    log "slurm.conf (re)written: (re)starting slurmctld and slurmd"
    # Plugin/node changes need a restart, `scontrol reconfigure` is not enough.
    stop_pidfile "$SLURMD_PIDFILE" slurmd
    stop_pidfile "$SLURMCTLD_PIDFILE" slurmctld
    # slurmctld refuses to start on a state directory of another ClusterName.
    if [ -f /var/spool/slurmctld/clustername ] &&
        [ "$(cat /var/spool/slurmctld/clustername)" != "$SLURM_LOCAL_CLUSTER" ]; then
        log "state in /var/spool/slurmctld belongs to another cluster name: clearing it"
        find /var/spool/slurmctld -mindepth 1 -delete
    fi
fi

# ------------------------------------------------------------------ munged
if ! alive "$MUNGE_PIDFILE" munged; then
    rm -f "$MUNGE_PIDFILE"
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 || {
        tail -n 20 /var/log/munge/munged.log >&2 || true
        die "munged failed to start"
    }
    wait_pidfile "$MUNGE_PIDFILE" munged
fi
munge_ok() { munge -n </dev/null | unmunge; }
wait_until 20 "munge credential round trip" munge_ok || die "munge does not work"

# ------------------------------------------------------------------ accounting
if [ "$SLURM_LOCAL_ACCOUNTING" = 1 ]; then
    install -d -o mysql -g mysql -m 0755 /run/mysqld
    if [ ! -d /var/lib/mysql/mysql ]; then
        mariadb-install-db --user=mysql --datadir=/var/lib/mysql >>"$SLURM_LOGDIR/mariadb.log" 2>&1 ||
            { show_logs; die "mariadb-install-db failed"; }
    fi
    if ! alive "$MARIADB_PIDFILE" mariadbd; then
        rm -f "$MARIADB_PIDFILE"
        # mariadbd does not daemonize: setsid + & detaches it from this shell.
        setsid mariadbd --user=mysql --pid-file="$MARIADB_PIDFILE" --skip-networking \
            </dev/null >>"$SLURM_LOGDIR/mariadb.log" 2>&1 &
        wait_until 60 "mariadbd" mariadb -e "SELECT 1" || { show_logs; die "mariadbd did not start"; }
        wait_pidfile "$MARIADB_PIDFILE" mariadbd
    fi
    mariadb <<'SQL'
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm-local';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY 'slurm-local';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
SQL
    [ $dbd_conf_changed = 1 ] && stop_pidfile "$SLURMDBD_PIDFILE" slurmdbd
    if ! alive "$SLURMDBD_PIDFILE" slurmdbd; then
        rm -f "$SLURMDBD_PIDFILE"
        slurmdbd </dev/null >/dev/null 2>&1 || { show_logs; die "slurmdbd failed to start"; }
        wait_pidfile "$SLURMDBD_PIDFILE" slurmdbd || { show_logs; exit 1; }
    fi
    # (sacctmgr reaches slurmdbd only because slurm.conf names accounting_storage/slurmdbd.)
    wait_until 60 "slurmdbd" sacctmgr -n list cluster || { show_logs; die "slurmdbd does not answer"; }
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$SLURM_LOCAL_CLUSTER"; then
        sacctmgr -i add cluster "$SLURM_LOCAL_CLUSTER" >/dev/null
        log "registered cluster $SLURM_LOCAL_CLUSTER in slurmdbd"
    fi
fi

# ------------------------------------------------------------------ slurmctld, slurmd
ctld_started=0
if ! alive "$SLURMCTLD_PIDFILE" slurmctld; then
    ctld_started=1
    rm -f "$SLURMCTLD_PIDFILE"
    slurmctld </dev/null >/dev/null 2>&1 || { show_logs; die "slurmctld failed to start"; }
    wait_pidfile "$SLURMCTLD_PIDFILE" slurmctld || { show_logs; exit 1; }
fi
ctld_up() { scontrol ping | grep -q "is UP"; }
wait_until 30 "slurmctld" ctld_up || { show_logs; die "slurmctld does not answer"; }
if ! alive "$SLURMD_PIDFILE" slurmd; then
    rm -f "$SLURMD_PIDFILE"
    slurmd </dev/null >/dev/null 2>&1 || { show_logs; die "slurmd failed to start"; }
    wait_pidfile "$SLURMD_PIDFILE" slurmd || { show_logs; exit 1; }
fi

node_ready() { sinfo -h -n "$HOST" -o %T | grep -Eqx 'idle|mixed|allocated|completing'; }
if ! wait_until 30 "node $HOST to be idle" node_ready; then
    # A node left DOWN/DRAINED by an earlier run (e.g. a killed slurmd) stays so.
    log "node state: $(sinfo -h -n "$HOST" -o '%T %E'): RESUME"
    scontrol update NodeName="$HOST" State=RESUME || true
    wait_until 30 "node $HOST to be idle after RESUME" node_ready || {
        sinfo -N -l >&2 || true
        show_logs
        die "node $HOST is not usable"
    }
fi

# Jobs that slurmctld recovered from its state after a crash (stop.sh cancels
# them on a clean stop) are orphans: they hold the node's CPUs until their time
# limit. Cancel them when this run had to start slurmctld.
if [ $ctld_started = 1 ]; then
    stale=$(squeue -h -o %A | sort -u | tr '\n' ' ')
    if [ -n "${stale// /}" ]; then
        log "cancelling jobs left from before slurmctld was (re)started: $stale"
        # shellcheck disable=SC2086
        scancel $stale || true
        queue_empty() { [ -z "$(squeue -h -o %A)" ]; }
        wait_until 30 "stale jobs to end" queue_empty || true
    fi
fi

# ------------------------------------------------------------------ probes
# Real job steps through slurmctld -> slurmd -> slurmstepd: one task, then the
# two tasks (one CPU each) on one node that the project's tests use.
probe() {
    timeout 60 srun --quiet --time=1 --job-name=probe --partition="$SLURM_LOCAL_PARTITION" "$@" true </dev/null
}
probe -N1 -n1 || { show_logs; die "probe 'srun -N1 -n1 true' failed"; }
probe -N1 -n2 --cpus-per-task=1 || { show_logs; die "probe 'srun -N1 -n2 -c1 true' failed"; }
if [ "$SLURM_LOCAL_ACCOUNTING" = 1 ]; then
    sacct -n -X -o JobID >/dev/null || die "sacct does not work"
fi
log "cluster ready in $(elapsed)s (node $HOST, $CPUS CPUs, ${MEM_MB} MB, partition $SLURM_LOCAL_PARTITION)"
sinfo
