"""`python train.py` end to end, as a user runs it: metrics.jsonl, summary.json and an offline W&B run."""

import json

import pytest

from tests.conftest import FAST_COMPILE, read_metrics, run_train
from tests.wandb_offline import find_offline_runs, read_offline_run

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "activation_bytes",
               "peak_memory_bytes", "mfu"}
SMALL = ["train.steps=4", "train.seq_len=64", "train.global_batch_size=4"]


@pytest.mark.parametrize("ac", [["ac=none"], ["ac=full"], ["ac=selective"], ["ac=selective", "ac.selective_option=2"],
                                ["ac=memory_budget", FAST_COMPILE]])
def test_train_writes_metrics_summary_and_wandb(tmp_path, ac):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *ac, *SMALL, "train.micro_batch_size=2")
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(METRIC_KEYS <= set(r) for r in rows)
    assert all(r["activation_bytes"] > 0 and r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0 for r in rows)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["num_params"] > 0 and summary["final_loss"] == rows[-1]["loss"]
    assert summary["activation_bytes"] == rows[-1]["activation_bytes"]
    assert summary["config"]["ac"]["mode"] == ac[0].split("=")[1]
    assert {"median_tokens_per_s", "peak_memory_bytes", "mfu"} <= set(summary)

    (wandb_dir,) = find_offline_runs(run_dir)
    run = read_offline_run(wandb_dir)
    assert run["id"] == summary["wandb"]["id"] and run["exit_code"] == 0
    assert [h["loss"] for h in run["history"] if "loss" in h] == pytest.approx([r["loss"] for r in rows])
    assert run["config"]["ac"]["mode"] == summary["ac_mode"]
    assert f"ac:{summary['ac_mode']}" in run["tags"] and summary["ac_mode"] in run["name"]


def test_readme_command_runs_as_typed_with_inductor(tmp_path):
    """`python train.py ac=memory_budget ac.memory_budget=0.4`: compile turns on, inductor honours the budget."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "ac=memory_budget", "ac.memory_budget=0.4", "logger=none", *SMALL, "train.steps=2",
                     timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["compile"] is True and summary["memory_budget"] == 0.4
    assert summary["config"]["compile"]["backend"] == "inductor"


def test_default_run_learns(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "logger=none", "train.steps=30", "train.seq_len=128")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    assert "step 30 | loss" in (run_dir / "train.log").read_text()  # plain lines when not on a terminal


def test_non_finite_loss_stops_with_a_clear_message(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "logger=none", *SMALL, "train.steps=20", "optimizer.lr=1e20",
                     "lr_schedule.warmup_steps=0", "train.max_grad_norm=1e20")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    error = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert len(error) == 1 and "loss=" in error[0] and "optimizer.lr" in error[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "LossNotFinite" in summary["error"]


def test_auto_budget_is_planned_logged_and_used(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, "ac=memory_budget", "ac.memory_budget=auto", "ac.target_memory_gib=0.05", FAST_COMPILE,
                     "logger=none", *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    chosen = summary["memory_budget"]
    assert isinstance(chosen, float) and 0.0 <= chosen <= 1.0
    assert f"ac.memory_budget=auto -> {chosen:g}" in (run_dir / "train.log").read_text()

    nothing_fits = run_train(tmp_path / "tiny", "ac=memory_budget", "ac.memory_budget=auto",
                             "ac.target_memory_gib=0.001", FAST_COMPILE, "logger=none", *SMALL)
    assert nothing_fits.returncode == 2
    errors = [line for line in (nothing_fits.stdout + nothing_fits.stderr).splitlines() if "error:" in line]
    assert len(errors) == 1 and "ac.memory_budget=auto: no budget fits" in errors[0] and "ac=full" in errors[0]
