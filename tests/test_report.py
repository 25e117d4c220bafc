"""The sweep report (membudget.report), the experiment presets, and the offline W&B reader it is tested with.

Most tests build synthetic multirun dirs in the trainer's formats (`_write_job`) and analyse them in this
process; one runs a real, tiny `python train.py -m` sweep end to end (slow).
"""

import csv
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from membudget import report
from membudget.internals import basic_sweeper_jobs
from membudget.report import plots
from membudget.report.pareto import Ties, dominates, pareto_front, tied
from membudget.units import MiB, fmt_bytes, fmt_time
from membudget.schema import PlanConfig, ac_label
from tests.conftest import FAST_COMPILE, ROOT, compose_cfg, multirun_here
from tests.wandb_offline import find_offline_runs, read_offline_run, read_offline_runs, read_table


def _write_job(sweep: Path, num: int, ac: dict, *, steps=6, loss_shift=0.0, step_time=0.1, act=100 * MiB,
               status="completed", summary=True, wandb=None, overrides=None, compiled=True, nonfinite_at=None,
               data_wait=0.0):
    """A job dir as Hydra and the trainer write it: .hydra/{config,overrides}.yaml, metrics.jsonl (a
    non-finite loss is null and named under `nonfinite`, that step `skipped`), summary.json."""
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    ac = {"mode": "none", "memory_budget": 0.5, "selective_option": "op", **ac}
    config = {"model": {"name": "llama3_debug", "n_layers": 4}, "ac": ac, "compile": {"enabled": compiled},
              "train": {"seed": 0, "steps": steps}, "logger": {"name": "wandb" if wandb else "none"}}
    OmegaConf.save(config, job / ".hydra" / "config.yaml")
    OmegaConf.save(overrides or [f"ac={ac['mode']}"], job / ".hydra" / "overrides.yaml")
    losses = [5.0 - 0.3 * s + loss_shift for s in range(1, steps + 1)]
    per_block = [int(act) // 5] * 4
    with open(job / "metrics.jsonl", "w") as f:
        for s, loss in enumerate(losses, 1):
            row = {"step": s, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000 / step_time,
                   "step_time_s": step_time, "activation_bytes": int(act), "activation_bytes_per_block": per_block,
                   "peak_memory_bytes": int(2 * act), "mfu": None, "skipped": s == nonfinite_at}
            if s == nonfinite_at:
                row.update(loss=None, grad_norm=None, nonfinite=["loss", "grad_norm"])
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 99, "loss": 1.')  # a line cut short by a killed job: ignored
    if summary:
        budget = ac["memory_budget"] if ac["mode"] == "memory_budget" else None
        (job / "summary.json").write_text(json.dumps({
            "status": status, **({"error": "RuntimeError: boom"} if status == "failed" else {}),
            "num_params": 1000, "steps": steps, "final_loss": losses[-1], "median_tokens_per_s": 1000 / step_time,
            "median_step_time_s": step_time, "median_data_wait_s": data_wait, "peak_memory_bytes": int(2 * act),
            "steady_peak_memory_bytes": int(1.5 * act), "activation_bytes": int(act),
            "activation_bytes_per_block": per_block, "mfu": None, "skipped_steps": int(nonfinite_at is not None),
            "compile_s": 2.0 if compiled else None, "world_size": 1, "ac_mode": ac["mode"], "ac_label": ac_label(ac),
            "memory_budget": budget, "selective_option": ac["selective_option"] if ac["mode"] == "selective" else None,
            "compile": compiled, "wandb": wandb, "config": config,
        }))


def _ac_modes_sweep(tmp_path, **shifts) -> Path:
    """A finished `experiment=ac_modes` sweep; shifts={"full": 0.5} moves that run's loss curve."""
    sweep = tmp_path / "sweep"
    for num, (mode, time, mib) in enumerate([("none", 0.10, 400), ("full", 0.14, 40), ("selective", 0.12, 150),
                                             ("memory_budget", 0.11, 200)]):
        _write_job(sweep, num, {"mode": mode}, step_time=time, act=mib * MiB, loss_shift=shifts.get(mode, 0.0))
    return sweep


def _analyse(sweep: Path, **kwargs) -> report.Analysis:
    return report.analyse(report.load_sweep(sweep), **kwargs)


def _by_run(a: report.Analysis) -> dict[str, dict]:
    return {r["run"]: r for r in a.rows}


def _read_csv(sweep: Path) -> dict[str, dict[str, str]]:
    with open(sweep / "report.csv") as f:
        return {row["run"]: row for row in csv.DictReader(f)}


def _assert_image(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = imread(path).shape[:2]
    assert width == plots.WIDTH * plots.DPI and height > 300
    assert b"<svg" in path.with_suffix(".svg").read_bytes()[:1000]


# --- the command: every output, on a budget sweep with every kind of run ---------------------------------

def test_report_writes_table_plots_and_verdict(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "none"}, step_time=0.10, act=400 * MiB)
    _write_job(sweep, 1, {"mode": "full"}, step_time=0.14, act=40 * MiB)
    _write_job(sweep, 2, {"mode": "selective"}, step_time=0.13, act=150 * MiB)
    for num, budget in enumerate([0.0, 0.5, 1.0], start=3):
        _write_job(sweep, num, {"mode": "memory_budget", "memory_budget": budget}, step_time=0.14 - 0.04 * budget,
                   act=(40 + 360 * budget) * MiB)
    _write_job(sweep, 6, {"mode": "memory_budget", "memory_budget": "0.3*2+0.6*2"}, step_time=0.125, act=190 * MiB)
    assert report.main([str(sweep), "--no-wandb", "--strict"]) == 0

    rows = _read_csv(sweep)
    assert list(rows) == ["none", "full", "selective op", "memory_budget 0.0", "memory_budget 0.5",
                          "memory_budget 1.0", "memory_budget 0.3*2+0.6*2"]
    assert rows["memory_budget 0.5"]["memory_budget"] == "0.5" and rows["full"]["memory_budget"] == ""
    assert rows["memory_budget 0.3*2+0.6*2"]["memory_budget"] == "0.3*2+0.6*2"
    assert rows["selective op"]["selective_option"] == "op" and rows["none"]["selective_option"] == ""
    assert float(rows["full"]["step_time_vs_none"]) == pytest.approx(1.4)
    assert json.loads(rows["full"]["activation_bytes_per_block"]) == [8 * MiB] * 4
    assert rows["full"]["mfu"] == ""  # null MFU stays blank
    assert all(float(r["max_abs_loss_diff"]) == 0 and r["loss_flagged"] == "False" for r in rows.values())
    for name in ("loss", "memory_vs_time", "budget"):
        _assert_image(sweep / f"{name}.png")

    md = (sweep / "report.md").read_text()
    assert "FLAGGED" not in md and "Not finished" not in md and "| MFU |" not in md  # empty columns left out
    front = md.split("Pareto front")[1].split("\n\n")[1]
    # 0.0 ties with full and 1.0 with none (same memory, same time): the first in job order is named
    assert [line.split(":")[0] for line in front.splitlines()] == [
        "- full", "- selective op", "- memory_budget 0.5", "- none"]
    assert "tied with memory_budget 0.0 (40.0 MiB, 140 ms): the same memory and step time" in front
    assert "tied with memory_budget 1.0 (400 MiB, 100 ms)" in front
    assert "Compiled `none` is `memory_budget 1.0`" in md and "400 MiB (job 0) and 400 MiB (job 5)" in md
    assert "| dominated by selective op |" in md  # the per-block budget: more memory, no faster
    assert "Pareto front" in capsys.readouterr().out


def test_shifted_loss_is_flagged_and_strict_fails(tmp_path):
    sweep = _ac_modes_sweep(tmp_path, selective=0.2)  # 0.2 > 0.01 * (1 + loss ~ 3..5)
    a = _analyse(sweep)
    rows = _by_run(a)
    assert rows["selective op"]["loss_flagged"] is True and rows["full"]["loss_flagged"] is False
    assert rows["selective op"]["max_abs_loss_diff"] == pytest.approx(0.2)
    assert rows["selective op"]["pareto"] == "loss flagged"
    assert "selective op" not in [p.best["run"] for p in a.front]
    assert any("**Loss changed**" in line and "selective op" in line for line in a.verdict)
    # A looser tolerance accepts it: 0.2 <= 0.1 * (1 + 3.2)
    assert _by_run(_analyse(sweep, tolerance=0.1))["selective op"]["loss_flagged"] is False
    # --strict fails on a flagged loss, and where correctness is not shown; passes a clean sweep
    flagged = _analyse(_ac_modes_sweep(tmp_path / "a", full=0.5))
    assert (flagged.exit_status(strict=False), flagged.exit_status(strict=True)) == (0, 1)
    uncompared = tmp_path / "b"
    _write_job(uncompared, 0, {"mode": "full"})
    assert _analyse(uncompared).exit_status(strict=True) == 1  # correctness not shown
    assert _analyse(_ac_modes_sweep(tmp_path / "c")).exit_status(strict=True) == 0


def test_nonfinite_loss_is_flagged_and_skipped_steps_are_named(tmp_path):
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "none"})
    _write_job(sweep, 1, {"mode": "full"}, nonfinite_at=3)
    job = report.load_sweep(sweep).jobs[1]
    assert math.isnan(job.losses[3]) and job.skipped == [3] and 99 not in job.losses
    a = report.analyse(report.load_sweep(sweep))
    assert _by_run(a)["full"]["loss_flagged"] is True and _by_run(a)["full"]["skipped_steps"] == 1
    assert any("1 steps skipped" in line for line in a.verdict)


def test_a_job_whose_steps_waited_for_data_is_named(tmp_path):
    """A job's step time that is partly its data path's (median data wait above rules.DATA_WAIT_SHARE of a step)
    is said under the table, since it is not its AC setting's; report.csv has the wait of every job."""
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "none"}, data_wait=0.001)
    _write_job(sweep, 1, {"mode": "full"}, step_time=0.2, data_wait=0.05)
    a = report.analyse(report.load_sweep(sweep))
    assert [r["median_data_wait_s"] for r in a.rows] == [0.001, 0.05]
    [line] = [line for line in a.verdict if "waited" in line]
    assert line.startswith("- Job 1 (full): the steps waited 0.05 s each for their batches, 25% of a step")


def test_without_none_run_comparison_is_skipped(tmp_path):
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "full"})
    _write_job(sweep, 1, {"mode": "selective"})
    a = _analyse(sweep)
    assert "No completed ac=none run" in "\n".join(a.verdict) and not a.compared
    assert all(r["max_abs_loss_diff"] is None and r["step_time_vs_none"] is None for r in a.rows)


def test_baseline_prefers_the_same_compile_setting(tmp_path):
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "none"}, compiled=False, step_time=0.2, act=500 * MiB)
    _write_job(sweep, 1, {"mode": "none"}, compiled=True, step_time=0.1, act=400 * MiB)
    _write_job(sweep, 2, {"mode": "full"}, compiled=True, step_time=0.15, act=40 * MiB)
    _write_job(sweep, 3, {"mode": "full"}, compiled=False, step_time=0.3, act=40 * MiB)
    a = _analyse(sweep)
    assert {j: b.num for j, b in a.baselines.items()} == {0: 0, 1: 1, 2: 1, 3: 0}
    assert [r["step_time_vs_none"] for r in a.rows] == pytest.approx([1.0, 1.0, 1.5, 1.5])
    text = "\n".join(a.verdict)
    assert "Eager `none` (job 0) saves 500 MiB, compiled `none` 400 MiB (1.25x)" in text
    assert "recomputes cheap elementwise results" in text


def test_unfinished_jobs_are_listed(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    # multirun.yaml as Hydra's basic sweeper writes it: 8 jobs, of which 5 never started.
    OmegaConf.save({"hydra": {"sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                                          "params": {"ac": "none,full,selective,memory_budget"}},
                              "overrides": {"task": ["train.seed=0,1"]}}}, sweep / "multirun.yaml")
    _write_job(sweep, 0, {"mode": "none"}, overrides=["ac=none", "train.seed=0"])
    _write_job(sweep, 1, {"mode": "none"}, overrides=["ac=none", "train.seed=1"], status="failed")
    _write_job(sweep, 2, {"mode": "full"}, overrides=["ac=full", "train.seed=0"], summary=False)
    loaded = report.load_sweep(sweep)
    assert loaded.sweeper == "BasicSweeper" and len(loaded.jobs) == 8
    a = report.analyse(loaded)
    md = report.write.write_markdown(loaded, a.rows, a.verdict, {}).read_text()
    not_finished = md.split("## Not finished")[1].split("##")[0]
    assert "job 1 (ac=none train.seed=1): failed: RuntimeError: boom" in not_finished
    assert "job 2 (ac=full train.seed=0): running or stopped: last logged step 6 of 6" in not_finished
    assert "job 3 (ac=full train.seed=1): not started" in not_finished
    assert "job 7 (ac=memory_budget train.seed=1): not started" in not_finished
    assert [r["run"] for r in a.rows] == ["none (job 0)"]  # job 1 shares the label "none"


def test_labels_come_from_the_schema(tmp_path):
    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "memory_budget", "memory_budget": "0.3*2+0.6*2"})
    _write_job(sweep, 1, {"mode": "selective", "selective_option": "2"})
    _write_job(sweep, 2, {"mode": "memory_budget", "memory_budget": 0.3}, summary=False)  # no ac_label yet
    assert [j.label for j in report.load_jobs(sweep)] == [
        "memory_budget 0.3*2+0.6*2", "selective every 2", "memory_budget 0.3"]


# --- the Pareto front and its ties ----------------------------------------------------------------------

def _row(run, act, time, job=0, flagged=False):
    return {"job": job, "run": run, "activation_bytes": act, "median_step_time_s": time, "loss_flagged": flagged,
            "step_time_vs_none": None}


def test_pareto_front_drops_dominated_and_flagged():
    rows = [_row("a", 10 * MiB, 3, 0), _row("b", 20 * MiB, 2, 1), _row("dominated", 25 * MiB, 2.5, 2),
            _row("wrong", 5 * MiB, 1, 3, flagged=True)]
    assert [p.best["run"] for p in pareto_front(rows)] == ["a", "b"]
    assert [r["pareto"] for r in rows] == ["front", "front", "dominated by b", "loss flagged"]


def test_pareto_ties_name_the_better_run():
    # The CPU sweep's 9.1 MiB pair: 20 KB (0.2 %) apart in memory, 2 % apart in step time.
    full = _row("full", 9.1 * MiB, 0.1854, 1)
    zero = _row("memory_budget 0.0", 9.1 * MiB + 20_000, 0.1818, 3)
    [point] = pareto_front([full, zero])
    assert point.best is zero and point.tied == [full]
    assert point.reasons == ["memory_budget 0.0 is 1.9% faster for 0.21% (19.5 KiB) more memory "
                             "(0.21 of the memory tolerance against 0.38 of the time tolerance)"]
    assert (full["pareto"], zero["pareto"]) == ("tied with memory_budget 0.0", "front")
    # Beyond a tolerance the difference counts: a 1 % time tie makes full slower, a 0 memory tie full smaller.
    [point] = pareto_front([full, zero], Ties(time=0.01))
    assert point.best is zero and not point.tied and full["pareto"] == "dominated by memory_budget 0.0"
    [point] = pareto_front([full, zero], Ties(memory=0.0))
    assert point.best is full and zero["pareto"] == "dominated by full"
    # Equal memory: the faster is named; the slower one is listed with it, not as another front point.
    a, b = _row("0.8", 49 * MiB, 0.147, 11), _row("0.9", 49 * MiB, 0.1461, 12)
    [point] = pareto_front([a, b])
    assert point.best is b and point.reasons == ["the same memory, and 0.9 is 0.61% faster"]
    # A chain of ties (a ~ b ~ c, a and c apart): the best (a) takes b; c, tied only with b, stays on its own.
    a, b, c = _row("a", 10.0 * MiB, 1.0, 0), _row("b", 10.09 * MiB, 0.97, 1), _row("c", 10.18 * MiB, 0.925, 2)
    front = pareto_front([a, b, c])
    assert [(p.best["run"], [t["run"] for t in p.tied]) for p in front] == [("a", ["b"]), ("c", [])]


def test_pareto_front_never_contradicts_itself():
    """On random sweeps: no two named front runs tie or dominate each other, each is shown apart from its
    neighbours at the report's precision, and every tied or dominated run names a run that beats it."""
    rng = random.Random(0)
    ties = Ties()
    for _ in range(200):
        rows = [_row(f"r{i}", rng.choice([9.1, 9.12, 15, 27, 49.2, 69.2]) * MiB * rng.uniform(0.995, 1.005),
                     rng.uniform(0.14, 0.24), i) for i in range(rng.randint(1, 14))]
        front = pareto_front(rows, ties)
        bests = [p.best for p in front]
        assert bests and all(a["activation_bytes"] < b["activation_bytes"] for a, b in zip(bests, bests[1:]))
        for a in bests:
            assert not any(dominates(o, a, ties) for o in rows)
            assert not any(tied(a, b, ties) for b in bests if b is not a)
        shown = [(fmt_bytes(r["activation_bytes"]), fmt_time(r["median_step_time_s"])) for r in bests]
        assert len(set(shown)) == len(shown)
        names = {r["run"]: r for r in rows}
        for r in rows:
            kind, _, other = r["pareto"].partition(" by " if "dominated" in r["pareto"] else " with ")
            assert kind in ("front", "tied", "dominated")
            if kind == "dominated":  # by a run on the front: no run is lost to a chain of dominance
                assert dominates(names[other], r, ties) and names[other]["pareto"] != "dominated"
            if kind == "tied":
                assert tied(names[other], r, ties) and names[other]["pareto"] == "front"


def test_display_precision_separates_one_percent():
    assert fmt_bytes(9.1 * MiB) == "9.10 MiB" and fmt_bytes(9.2 * MiB) == "9.20 MiB"
    assert fmt_bytes(69.24 * MiB) == "69.2 MiB" and fmt_bytes(1.5 * 2**30) == "1.50 GiB"
    assert fmt_bytes(20_000) == "19.5 KiB" and fmt_time(0.1818) == "182 ms" and fmt_time(12.34) == "12.3 s"


# --- plots: styles and labels ----------------------------------------------------------------------------

def _budget_rows(n_budgets=11):
    rows = [dict(_row(m, 9.1 * MiB, 0.18, i), memory_budget=None) for i, m in enumerate(["none", "full", "selective"])]
    rows += [dict(_row(f"memory_budget {b / 10}", 9.1 * MiB, 0.18, 3 + b), memory_budget=b / 10)
             for b in range(n_budgets)]
    return rows


def test_every_series_has_its_own_style():
    for n in (11, 30):
        style = plots.styles(_budget_rows(n))
        assert len(set(style.values())) == len(style) == n + 3


def test_labels_do_not_overlap_and_coinciding_points_share_one(tmp_path):
    # the README sweep's crowded corners: 0.8 and 0.9 at the same memory and nearly the same time
    points = {"none": (69.2, 179.5), "full": (9.1, 185.4), "selective op": (31.2, 155.6), "0.0": (9.1, 181.8),
              "0.1": (15.1, 164.2), "0.2": (21.1, 183.3), "0.3": (27.1, 163.9), "0.4": (33.1, 209.4),
              "0.5": (41.1, 166.7), "0.6": (45.1, 172.8), "0.7": (49.2, 231.4), "0.8": (49.2, 147.0),
              "0.9": (49.2, 146.1), "1.0": (69.2, 150.1)}
    rows = [dict(_row(name, x * MiB, y / 1e3, i), memory_budget=None if "." not in name else float(name),
                 pareto=None) for i, (name, (x, y)) in enumerate(points.items())]
    fig = plots.memory_time_figure(rows, pareto_front(rows), plots.styles(rows))
    fig.draw_without_rendering()
    [ax] = fig.axes
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.texts]
    assert sorted(t.get_text() for t in labels) == sorted(
        ["none", "full", "selective op", "0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8, 0.9", "1.0"])
    boxes = [t.get_window_extent(renderer) for t in labels]
    inside = ax.get_window_extent(renderer)
    for i, a in enumerate(boxes):
        assert inside.contains(a.x0, a.y0) and inside.contains(a.x1, a.y1), labels[i].get_text()
        for b in boxes[i + 1:]:
            assert not a.overlaps(b)


def test_no_budget_plot_without_a_budget_sweep():
    rows = _budget_rows(1)
    assert plots.budget_figure(rows, plots.styles(rows)) is None


# --- presets -------------------------------------------------------------------------------------------------

def _sweep_overrides(experiment: str) -> list[list[str]]:
    """Each job's overrides of `python train.py -m experiment=<experiment>`, as Hydra's basic sweeper expands them."""
    params = compose_cfg(f"experiment={experiment}", hydra=True).hydra.sweeper.params
    return basic_sweeper_jobs(params, [f"experiment={experiment}"])


def _sweep_jobs(experiment: str) -> list[dict]:
    """The composed config of every job of `python train.py -m experiment=<experiment>`."""
    return [compose_cfg(*job) for job in _sweep_overrides(experiment)]


# The presets set compile.enabled: true; it only holds if conf/config.yaml merges `experiment` after `_self_`.
COMPILED = "compile.enabled of the preset was overridden: conf/config.yaml must list `experiment: null` after `_self_`"


def test_ac_modes_preset():
    jobs = _sweep_overrides("ac_modes")
    assert [job[0] for job in jobs] == ["ac=none", "ac=full", "ac=selective", "ac=memory_budget"]
    # the modes are plain group options; what the preset must keep is one compiled setting for all
    first, last = compose_cfg(*jobs[0]), compose_cfg(*jobs[-1])
    assert (first.ac.mode, last.ac.mode) == ("none", "memory_budget")
    assert first.compile.enabled is True and last.compile.enabled is True, COMPILED
    assert first.compile.backend == last.compile.backend == "inductor"
    assert (first.train, first.data, first.model) == (last.train, last.data, last.model)


@pytest.mark.slow
def test_budget_sweep_preset():
    """The sweep measures the budgets the planner plans (plan.budgets' default, what auto chooses among): its
    points are written out in conf/ac_point/, and the report and the search proof compare the two grids."""
    jobs = _sweep_jobs("budget_sweep")
    points = [(c.ac.mode, c.ac.memory_budget if c.ac.mode == "memory_budget" else None) for c in jobs]
    assert points == [("none", None), ("full", None), ("selective", None)] + [
        ("memory_budget", b) for b in PlanConfig().budgets]
    assert 0.3 in PlanConfig().budgets  # exactly 0.3, not 0.30000000000000004
    assert all(c.compile.enabled is True for c in jobs), COMPILED
    assert all(c.compile.backend == "inductor" for c in jobs)


# --- W&B ------------------------------------------------------------------------------------------------------

def _offline_run(tmp_path, **kwargs):
    import wandb

    run = wandb.init(mode="offline", dir=tmp_path, project="proj", group="grp", job_type="train",
                     tags=["t1", "t2"], config={"lr": 0.1, "model": {"dim": 64}}, **kwargs)
    for step in range(1, 4):
        run.log({"loss": 3.0 / step, "step": step, "nested": {"x": step}, "note": None})
    run.log({"big": "x" * 100_000})  # one record over several 32 KiB blocks
    run.log({"table": wandb.Table(columns=["a", "b"], data=[[1, "x"], [2, None]])})
    run.summary["final"] = "done"
    run.finish()
    return find_offline_runs(tmp_path)


@pytest.mark.slow
def test_wandb_summary_run_and_offline_reader(tmp_path, monkeypatch):
    """The report logs its table and plots as a `report` run into the sweep's W&B group (read back from the
    offline run files); the offline reader handles nested rows, records across blocks, tables, a killed
    run and a corrupt file."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the report's default: offline
    sweep = tmp_path / "sweep"
    info = {"project": "proj", "group": "sweep-group", "id": "abc", "dir": "unused"}
    _write_job(sweep, 0, {"mode": "none"}, wandb=info)
    _write_job(sweep, 1, {"mode": "full"}, wandb=info, act=40 * MiB, step_time=0.14)
    # a per-block budget's string shares the table's budget column with numbers: W&B wants one type
    _write_job(sweep, 2, {"mode": "memory_budget", "memory_budget": "0.3*2+0.6*2"}, wandb=info, act=60 * MiB,
               step_time=0.12)
    _write_job(sweep, 3, {"mode": "memory_budget", "memory_budget": 0.5}, wandb=info, act=60 * MiB, step_time=0.3)
    assert report.main([str(sweep)]) == 0
    [run] = read_offline_runs(sweep)
    assert (run["project"], run["group"], run["job_type"]) == ("proj", "sweep-group", "report")
    table = read_table(run["media"]["report"][0])
    assert table["columns"] == report.COLUMNS
    column = {c: [row[i] for row in table["data"]] for i, c in enumerate(table["columns"])}
    assert column["run"] == ["none", "full", "memory_budget 0.3*2+0.6*2", "memory_budget 0.5"]
    assert column["memory_budget"] == [None, None, "0.3*2+0.6*2", "0.5"]
    assert {"loss", "memory_vs_time", "budget"} <= set(run["media"])
    assert run["summary"]["pareto_front"] == ["full", "memory_budget 0.3*2+0.6*2", "none"]

    [path] = _offline_run(tmp_path / "reader")
    run = read_offline_run(path)
    assert (run["project"], run["group"], run["job_type"], run["tags"]) == ("proj", "grp", "train", ["t1", "t2"])
    assert run["config"] == {"lr": 0.1, "model": {"dim": 64}}
    losses = [row for row in run["history"] if "loss" in row]
    assert [(r["step"], r["loss"], r["nested"], r["note"], r["_step"]) for r in losses] == [
        (1, 3.0, {"x": 1}, None, 0), (2, 1.5, {"x": 2}, None, 1), (3, 1.0, {"x": 3}, None, 2)]
    assert run["history"][3]["big"] == "x" * 100_000
    assert run["summary"]["final"] == "done" and run["summary"]["loss"] == 1.0
    assert run["exit_code"] == 0 and run["id"] in path
    [table_path] = run["media"]["table"]
    assert any(table_path.endswith(f) for f in run["files"])
    assert read_table(table_path) == {"columns": ["a", "b"], "data": [[1, "x"], [2, None]]}
    assert read_offline_run(os.path.dirname(path))["id"] == run["id"]  # the run dir works too
    # killed mid-run: cut inside the big record; then one flipped byte
    data = Path(path).read_bytes()
    cut = Path(path).with_name("run-cut.wandb")
    cut.write_bytes(data[:40_000])
    run = read_offline_run(cut, timeout=0)
    assert run["exit_code"] is None and len(run["history"]) == 3
    corrupt = bytearray(data)
    corrupt[200] ^= 0xFF
    cut.write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="corrupt"):
        read_offline_run(cut, timeout=0)


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only: it compiles three runs on a shared CPU
def test_sweep_end_to_end(tmp_path):
    """A real CPU sweep of the debug model, 2 of its blocks (compiled none, full, budget 1.0; each block is compiled
    on its own): the report keeps the loss, finds compiled none equal to budget 1.0, and catches tampering."""
    sweep = tmp_path / "sweep"
    multirun_here(sweep, "ac=none,full,memory_budget", "ac.memory_budget=1.0", "compile.enabled=true",
                  FAST_COMPILE, "train.steps=2", "train.seq_len=16", "train.global_batch_size=1",
                  "train.progress=off", "checkpoint.enabled=false", "data.prefetch=0", "logger=none",
                  "model.n_layers=2")
    assert report.main([str(sweep), "--strict", "--no-wandb"]) == 0

    rows = _read_csv(sweep)
    assert list(rows) == ["none", "full", "memory_budget 1.0"]
    assert rows["full"]["loss_flagged"] == "False" and float(rows["full"]["max_abs_loss_diff"]) < report.TOLERANCE
    assert rows["memory_budget 1.0"]["activation_bytes"] == rows["none"]["activation_bytes"]
    assert int(rows["full"]["activation_bytes"]) < int(rows["none"]["activation_bytes"])
    assert "Compiled `none` is `memory_budget 1.0`" in (sweep / "report.md").read_text()
    for name in ("loss", "memory_vs_time"):
        _assert_image(sweep / f"{name}.png")

    # Tamper with one run's losses: the report must flag it and --strict must fail.
    metrics = sweep / "1" / "metrics.jsonl"
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**row, "loss": row["loss"] + 0.5}) + "\n" for row in lines))
    tampered = _analyse(sweep, plan=False)  # flags compare losses: the plans beside the runs play no part
    assert tampered.flagged == {1} and tampered.exit_status(strict=True) == 1


def test_workspace_script_explains_what_is_missing():
    if importlib.util.find_spec("wandb_workspaces"):
        pytest.skip("wandb-workspaces is installed: the script would go online")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "wandb_workspace.py"), "--group", "g"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "pip install wandb-workspaces" in done.stderr
