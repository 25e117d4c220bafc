"""Tests against a real SLURM cluster: the local one of scripts/slurm/start.sh.

They submit real jobs with submitit (and one Hydra sweep through
hydra-submitit-launcher with conf/hydra/launcher/slurm_local.yaml) to the
partition "debug", and are skipped only when `sinfo` is not on PATH or the
SLURM controller does not answer. Start the cluster (as root) with

    bash scripts/slurm/start.sh     # and afterwards: bash scripts/slurm/stop.sh

The job functions are defined inside the tests on purpose: cloudpickle then
sends them by value. A module-level function of this test module would be
pickled by reference, and the job's python cannot import the test module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTITION = "debug"
JOB_DEADLINE_S = 120  # a job of a few seconds must be done (or failed) by then


def _cluster_down_reason() -> str | None:
    """Why the tests cannot run here, or None when the controller answers."""
    if shutil.which("sinfo") is None:
        return "SLURM is not installed (`sinfo` not on PATH); start it with scripts/slurm/start.sh"
    try:
        # `scontrol ping` answers at once; `sinfo` retries for ~10 s when slurmctld is down.
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        if "is UP" not in ping.stdout:
            first = (ping.stdout or ping.stderr).strip().splitlines()
            return f"SLURM cluster is not up (`scontrol ping`: {first[0] if first else ping.returncode}); run scripts/slurm/start.sh"
        proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"SLURM controller does not answer ({exc}); run scripts/slurm/start.sh"
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        return f"SLURM cluster is not up (`sinfo`: {msg[-1] if msg else proc.returncode}); run scripts/slurm/start.sh"
    return None


_DOWN = _cluster_down_reason()

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(_DOWN is not None, reason=_DOWN or ""),
    pytest.mark.timeout(300),  # hard backstop (pytest-timeout); the tests bound their own waits
]

submitit = pytest.importorskip("submitit")
from submitit.core.utils import UncompletedJobError  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def debug_partition_usable():
    """The controller answers: the partition must exist with a usable node (else fail, not skip)."""
    proc = subprocess.run(
        ["sinfo", "-h", "-p", PARTITION, "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    states = proc.stdout.split()
    usable = {"idle", "mixed", "allocated", "completing"}
    assert proc.returncode == 0 and usable & set(states), (
        f"partition {PARTITION!r} has no usable node (sinfo states: {states or proc.stderr.strip()}); "
        "see /var/log/slurm/ and rerun scripts/slurm/start.sh"
    )


def _executor(folder: Path, **params) -> "submitit.AutoExecutor":
    ex = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    ex.update_parameters(
        slurm_partition=PARTITION,
        nodes=1,
        cpus_per_task=1,
        timeout_min=5,
        slurm_signal_delay_s=30,
        **params,
    )
    return ex


def _wait_done(job, deadline_s: float = JOB_DEADLINE_S) -> float:
    """Poll until submitit considers the job done; cancel and fail after deadline_s."""
    t0 = time.monotonic()
    while not job.done():
        if time.monotonic() - t0 > deadline_s:
            state = job.state
            job.cancel(check=False)
            pytest.fail(
                f"SLURM job {job.job_id} not done after {deadline_s:.0f} s (state {state}); "
                f"stderr:\n{job.stderr() or ''}"
            )
        time.sleep(1)
    return time.monotonic() - t0


def _sacct(job_id: str, want: str, deadline_s: float = 30) -> str:
    """`State|ExitCode` of the job's allocation in accounting, once its state is `want`
    (records reach slurmdbd a moment after the job ends)."""
    row = ""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        proc = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", str(job_id)],
            capture_output=True, text=True, timeout=30,
        )
        row = proc.stdout.strip()
        if proc.returncode == 0 and row.startswith(want + "|"):
            return row
        time.sleep(0.5)
    pytest.fail(f"sacct: job {job_id} is {row or 'not recorded'!r}, expected {want} (is slurmdbd up?)")


def test_two_tasks_per_node_return_results_from_both_ranks(tmp_path):
    def rank_info(tag):
        import os
        import socket

        import submitit

        env = submitit.JobEnvironment()
        return {
            "tag": tag,
            "procid": int(os.environ["SLURM_PROCID"]),
            "ntasks": int(os.environ["SLURM_NTASKS"]),
            "partition": os.environ.get("SLURM_JOB_PARTITION"),
            "job_id": os.environ["SLURM_JOB_ID"],
            "global_rank": env.global_rank,
            "world_size": env.num_tasks,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    job = _executor(tmp_path, tasks_per_node=2).submit(rank_info, "hello")
    _wait_done(job)
    results = job.results()  # one per task

    assert len(results) == 2, results
    assert sorted(r["procid"] for r in results) == [0, 1]
    assert [r["global_rank"] for r in results] == [r["procid"] for r in results]
    for r in results:
        assert r["tag"] == "hello"
        assert r["ntasks"] == 2 and r["world_size"] == 2
        assert r["partition"] == PARTITION
        assert r["job_id"] == str(job.job_id)
    assert results[0]["host"] == results[1]["host"]  # one node
    assert results[0]["pid"] != results[1]["pid"]  # one process per task
    assert _sacct(job.job_id, "COMPLETED") == "COMPLETED|0:0"


def test_hard_crash_raises_instead_of_hanging(tmp_path):
    def crash():
        import os

        os._exit(3)  # no exception handling, no result pickle

    job = _executor(tmp_path, tasks_per_node=1).submit(crash)
    # Without accounting (sacct) submitit cannot tell a dead job from a running
    # one and would wait forever here; with slurmdbd it sees FAILED.
    _wait_done(job)

    t0 = time.monotonic()
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        job.result()
    assert time.monotonic() - t0 < JOB_DEADLINE_S
    assert job.state == "FAILED"  # what submitit read from sacct
    assert _sacct(job.job_id, "FAILED") == "FAILED|3:0"


_HYDRA_APP = '''
import json, os, socket
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg):
    out = Path(HydraConfig.get().runtime.output_dir)
    rank = int(os.environ["SLURM_PROCID"])
    (out / f"rank{rank}.json").write_text(json.dumps({
        "x": cfg.x,
        "ntasks": int(os.environ["SLURM_NTASKS"]),
        "partition": os.environ.get("SLURM_JOB_PARTITION"),
        "host": socket.gethostname(),
    }))
    return cfg.x * 10


if __name__ == "__main__":
    main()
'''


def test_hydra_sweep_with_slurm_local_preset(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("x: 0\n")
    (tmp_path / "app.py").write_text(_HYDRA_APP)
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        str(tmp_path / "app.py"),
        "-m",
        "hydra/launcher=slurm_local",
        f"hydra.searchpath=[file://{REPO / 'conf'}]",
        f"hydra.sweep.dir={sweep}",
        "x=1,2",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=2 * JOB_DEADLINE_S,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"sweep failed:\n{proc.stdout}\n{proc.stderr}"

    for num, x in enumerate((1, 2)):
        ranks = {}
        for rank in (0, 1):
            f = sweep / str(num) / f"rank{rank}.json"
            assert f.is_file(), f"missing {f}; sweep output:\n{proc.stdout}\n{proc.stderr}"
            ranks[rank] = json.loads(f.read_text())
        for info in ranks.values():
            assert info["x"] == x
            assert info["ntasks"] == 2
            assert info["partition"] == PARTITION
