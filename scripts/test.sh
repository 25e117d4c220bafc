#!/usr/bin/env bash
# The whole test suite on a fresh machine: install, start the local SLURM cluster (root, Debian), run
# pytest, stop the cluster. Extra arguments go to pytest (e.g. -k ac, -m "not slurm").
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/slurm/start.sh & slurm=$!  # its daemons start while pip installs (2 s of 5 here; more on a new machine)
trap 'wait; bash scripts/slurm/stop.sh' EXIT
# pip 25 or newer: on a fresh machine it installs the dev extras 13-16 s sooner than Python 3.11's pip 23.2, and
# checks an installed one in 3.9 s against 7.0 (docs/measured.md, 2026-12-06)
python3 -m pip install -q 'pip>=25' </dev/null
python3 -m pip install -q -e '.[dev]' </dev/null
python3 -m ruff check .
wait "$slurm"  # a cluster that did not start ends the run here, before pytest
MEMBUDGET_REQUIRE_SLURM=1 python3 -m pytest "$@"
