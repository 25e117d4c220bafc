"""scripts/gpu_check.py's CPU path: real steps of the debug model against the plan, for every AC setting it checks
on a GPU. On the CPU the plan is exact: activation, parameter, gradient and optimizer bytes, and the peak over the
first two steps as torch's MemTracker sees it."""

import importlib.util
import sys

import pytest

from tests.conftest import ROOT


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_cpu_path_runs_each_setting_and_the_plan_matches_it_exactly(capsys):
    check = gpu_check()
    rows = check.check(check.SETTINGS, device="cpu", model="llama3_debug", layers=6, seq=32, batch=2, steps=2)
    # six blocks planned from a probe of three; two kinds of block (full AC on every second one) from eight
    rows += check.check(["selective:2"], device="cpu", model="llama3_debug", layers=8, seq=32, batch=2, steps=2)
    assert [r.plan.label for r in rows] == ["none", "full", "selective op", "memory_budget 0.0", "memory_budget 0.5",
                                            "memory_budget 1.0", "selective every 2"]
    for row in rows:
        plan, real = row.plan, row.measured
        assert real is not None, row.skipped
        for key in ("activations", "parameters", "gradients", "optimizer_states"):
            assert getattr(plan, key) == getattr(real, key), (row.setting, key)
        assert plan.max_allocated == pytest.approx(real.max_allocated, abs=1024), row.setting
        assert plan.reserved is None and plan.time is None and real.tokens_per_s > 0
    table = check.table(rows)
    assert table.count("\n") == len(rows) + 1 and "(+0.0%)" in table
