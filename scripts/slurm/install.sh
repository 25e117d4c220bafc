#!/usr/bin/env bash
# Install the Debian packages of the local SLURM test cluster if any is missing:
#   munge slurmctld slurmd slurm-client  (+ slurmdbd mariadb-server, accounting)
# Idempotent (does nothing, without touching the network, when all are there)
# and noninteractive. Root only. Nothing is started: in a container
# /usr/sbin/policy-rc.d usually forbids it, and start.sh starts the daemons.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=common.sh
. "$HERE/common.sh"

[ "$(id -u)" = 0 ] || die "must run as root"
mapfile -t missing < <(missing_packages)
if [ ${#missing[@]} -eq 0 ]; then
    log "all packages installed"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
t0=$(date +%s)
log "installing: ${missing[*]}"
# Lock timeout: another apt-get (another engineer's, unattended-upgrades) may hold it.
apt_opts=(-o DPkg::Lock::Timeout=300 -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
apt-get "${apt_opts[@]}" update -qq </dev/null
apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
mapfile -t still < <(missing_packages)
[ ${#still[@]} -eq 0 ] || die "still missing after apt-get install: ${still[*]}"
log "installed in $(($(date +%s) - t0))s"
