"""Shared test helpers: compose the real Hydra config, run the real train.py as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from membudget.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# Fast CPU settings: the same min-cut partitioner as inductor, without code generation.
FAST_COMPILE = "compile.backend=aot_eager_decomp_partition"


def compose_cfg(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def run_train(run_dir: Path, *overrides: str, timeout: float = 300, multirun: bool = False):
    """`python train.py <overrides>` with its outputs in run_dir; W&B offline, nothing on the network."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    cmd = [sys.executable, str(ROOT / "train.py"), *(["-m"] if multirun else []), where, *overrides]
    env = subprocess_env()
    return subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child `train.py`: W&B offline and quiet, with a W&B service of its own."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    return {**env, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1", **extra}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    # an in-process wandb.init leaves WANDB_SERVICE pointing at this process's W&B service: subprocesses
    # started later would share it, and a run killed in a test would keep its id "in use" there
    os.environ.pop("WANDB_SERVICE", None)
