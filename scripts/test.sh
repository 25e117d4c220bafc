#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, start the local SLURM cluster (root, Debian), run
# pytest, stop the cluster. Extra arguments go to pytest (e.g. -k ac, -m "not slurm").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q -e '.[dev]' </dev/null
python3 -m ruff check .
bash scripts/slurm/start.sh
trap 'bash scripts/slurm/stop.sh' EXIT
MEMBUDGET_REQUIRE_SLURM=1 python3 -m pytest "$@"
