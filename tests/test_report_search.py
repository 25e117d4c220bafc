"""The report of an AC search (experiment=budget_search): a real, tiny search through train.py (run in this
process), read back by `python -m membudget.report` as a grid is, plus its trials, the study's front and the
planner's prediction."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from membudget import report, search
from membudget.units import MiB
from tests.conftest import multirun_here, read_summary
from tests.test_search import EAGER

pytest.importorskip("optuna", reason="the search extra: pip install -e '.[search]'")


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> Path:
    """A finished search: none, full and both selective options complete; with compile off every memory_budget
    trial fails its config check (a real failed job), and the sampler's next proposal repeats a budget."""
    sweep = tmp_path_factory.mktemp("report_search") / "search"
    multirun_here(sweep, "experiment=budget_search", *EAGER, "compile.enabled=false",  # a failed search raises
                  "ac=choice(none,full,selective,memory_budget)", "hydra.sweeper.n_trials=8",
                  "hydra.sweeper.max_failure_rate=1.0")
    assert report.main([str(sweep), "--no-wandb"]) == 0
    return sweep


def _rows(sweep: Path) -> list[dict]:
    with open(sweep / "report.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_search_reports_its_trials_and_the_studys_front(searched):
    trials = search.trials(searched)
    rows = {int(r["job"]): r for r in _rows(searched)}
    complete = {t["job"]: t for t in trials if t["state"] == "COMPLETE"}
    assert set(rows) == set(complete) and len(rows) == 4
    for job, t in complete.items():  # each row is its trial's job, marked where the study's front has it
        assert int(rows[job]["trial"]) == t["number"]
        assert rows[job]["study"] == ("front" if t["best"] else "")
        assert int(rows[job]["activation_bytes"]) == read_summary(searched / str(job))["activation_bytes"]
    assert any(t["best"] for t in complete.values())

    md = (searched / "report.md").read_text()
    study_front = {t["job"] for t in complete.values() if t["best"]}
    report_front = {j for j, r in rows.items() if r["pareto"] == "front"}
    agree = "Study's Pareto front agrees with the report's" in md
    assert agree == (study_front == report_front)
    for job in study_front ^ report_front:
        assert f"- job {job} (" in md.split("## Runs")[0]  # each difference named in the verdict
    # the table has the study column, and every trial is listed: the failed ones with the job's error
    header = next(line for line in md.splitlines() if line.startswith("| job |"))
    assert "| study |" in header and "| planned act. |" in header
    failed = [t for t in trials if t["state"] == "FAIL"]
    assert failed and all("compile.enabled=False" in t["error"] for t in failed)
    for t in failed:
        assert f"- trial {t['number']}, job {t['job']} (memory_budget " in md and t["error"] in md
    repeated = [t for t in trials if t["state"] == "PRUNED"]
    assert repeated and f"- {len(repeated)} proposal" in md and "repeated a setting already run" in md


@pytest.mark.slow
def test_the_planned_activations_are_the_measured_ones_on_cpu(searched):
    rows = _rows(searched)
    assert rows and all(r["planned_activation_bytes"] for r in rows)
    assert [int(r["planned_activation_bytes"]) for r in rows] == [int(r["activation_bytes"]) for r in rows]
    assert all(float(r["activation_vs_planned"]) == 1.0 for r in rows)
    assert all(int(r["planned_peak_memory_bytes"]) > int(r["planned_activation_bytes"]) for r in rows)


@pytest.mark.slow
def test_no_plan_leaves_the_planned_columns_empty(searched):
    assert report.main([str(searched), "--no-wandb", "--no-plan"]) == 0
    rows = _rows(searched)
    assert rows and not any(r["planned_activation_bytes"] or r["activation_vs_planned"] for r in rows)
    assert "planned act." not in (searched / "report.md").read_text()


def test_a_job_the_planner_cannot_take_gets_empty_cells_and_a_note(tmp_path):
    from omegaconf import OmegaConf

    from tests.test_report import _write_job

    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "none"})
    _write_job(sweep, 1, {"mode": "full"}, act=40 * MiB)
    config = OmegaConf.load(sweep / "0" / ".hydra" / "config.yaml")
    config.model.n_heads = 3  # the debug model's dim 128 is not a multiple of it: the planner refuses
    OmegaConf.save(config, sweep / "0" / ".hydra" / "config.yaml")
    (sweep / "0" / "train.log").write_text("[...] - model llama3_debug: ..., parallelism=single on cpu, rank 0/1\n")
    assert report.main([str(sweep), "--no-wandb"]) == 0  # job 1: no train.log, its device is unknown
    assert not any(r["planned_activation_bytes"] for r in _rows(sweep))
    md = (sweep / "report.md").read_text()
    assert "Planning failed for job 0 (none): " in md
    assert "Not planned: job 1: the device it trained on is unknown" in md


def test_an_auto_jobs_planned_columns_are_the_plan_it_chose(tmp_path):
    """An auto run's dir holds the plan it chose (plan.json): the report shows that plan beside the job, without
    planning the auto setting again (here it could not: the device it trained on is unknown); a plan.json that
    cannot be read is planned again, as any other job."""
    from tests.test_report import _write_job

    sweep = tmp_path / "sweep"
    _write_job(sweep, 0, {"mode": "memory_budget", "memory_budget": "auto"}, act=40 * MiB)
    _write_job(sweep, 1, {"mode": "memory_budget", "memory_budget": "auto"}, act=40 * MiB)
    (sweep / "0" / "plan.json").write_text(json.dumps({"activations": 32 * MiB, "peak": 90 * MiB, "label": "x"}))
    (sweep / "1" / "plan.json").write_text('{"activations": 32')  # cut short
    assert report.main([str(sweep), "--no-wandb"]) == 0
    chosen, damaged = _rows(sweep)
    assert int(chosen["planned_activation_bytes"]) == 32 * MiB and int(chosen["planned_peak_memory_bytes"]) == 90 * MiB
    assert float(chosen["activation_vs_planned"]) == pytest.approx(40 / 32)
    assert not damaged["planned_activation_bytes"]
    assert "Not planned: job 1: the device it trained on is unknown" in (sweep / "report.md").read_text()
