"""The debug presets on CPU: each composes with any run and leaves what it promises in the run dir."""

from __future__ import annotations

import json
import logging

from tests.conftest import TINY, compose_cfg, read_summary, train_here

QUICK = (*TINY, "checkpoint.enabled=false", "model.n_layers=1")


def _trace(run_dir) -> dict:
    (path,) = (run_dir / "profile").glob("rank0.*.pt.trace.json")
    return json.loads(path.read_text())


def _steps(trace: dict) -> list[str]:
    return sorted({e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")})


def test_debug_profile_traces_the_steps_after_warmup(tmp_path):
    # the default window: skip 1 step (compilation), warm up 1, trace 2
    train_here(tmp_path, *QUICK, "train.steps=4", "debug=profile")
    trace = _trace(tmp_path)
    assert _steps(trace) == ["ProfilerStep#2", "ProfilerStep#3"]
    # the model's work is in it (TensorBoard's and Perfetto's format: Chrome trace events), with memory
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and "[memory]" in names


def test_debug_memory_snapshot_on_cpu_says_it_needs_a_gpu_and_traces_memory_instead(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="membudget"):
        train_here(tmp_path, *QUICK, "debug=memory_snapshot", "diagnostics.snapshot_steps=2")
    needs = [r.getMessage() for r in caplog.records if "needs a GPU" in r.getMessage()]
    assert len(needs) == 1 and "debug=memory_snapshot" in needs[0] and "on cpu" in needs[0]
    assert not list(tmp_path.glob("memory_snapshot*.pickle"))
    trace = _trace(tmp_path)
    assert _steps(trace) == ["ProfilerStep#0", "ProfilerStep#1"]  # the first steps, from the start
    allocations = [e for e in trace["traceEvents"] if e.get("name") == "[memory]"]
    assert allocations and max(e["args"]["Total Allocated"] for e in allocations) > 0


def test_debug_fast_is_a_few_quick_steps_without_checkpoints_or_wandb(tmp_path):
    cfg = compose_cfg("debug=fast", "ac=full")  # composes with any run; its own overrides still win
    assert cfg.train.steps == 3 and not cfg.checkpoint.enabled and cfg.logger.name == "none"
    assert cfg.ac.mode == "full" and compose_cfg("debug=fast", "train.steps=5").train.steps == 5
    train_here(tmp_path, "debug=fast", "model.n_layers=1", "train.seq_len=32")
    assert read_summary(tmp_path)["steps"] == 3
    assert not list(tmp_path.glob("checkpoint*")) and not (tmp_path / "wandb").exists()

