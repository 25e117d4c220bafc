"""A sweep dir read back: every job the sweeper planned, started or not, with what the trainer wrote.

A job dir is Hydra's `<sweep dir>/<job num>` holding `.hydra/{config,overrides}.yaml` (Hydra) and
`metrics.jsonl`, `summary.json` (the trainer). Which jobs a sweep planned depends on its sweeper, named in
`multirun.yaml`: EXPECTED_JOBS maps a sweeper to a function that lists its jobs' overrides. A sweeper that
picks its jobs as it goes (the AC search, membudget.search: a study in SQLite, `optimization_results.yaml`)
lists the jobs its trials ran, and its trials are kept in `Sweep.trials`; the job dirs read the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from membudget.errors import one_line
from membudget.rules import compile_enabled
from membudget.schema import ac_label, budget_of, parse_block_budgets


@dataclass
class Job:
    num: int
    overrides: list[str]
    status: str  # completed | failed | stopped | running or stopped | not started
    detail: str = ""  # why it is not completed
    config: dict = field(default_factory=dict)  # .hydra/config.yaml
    summary: dict = field(default_factory=dict)  # summary.json
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss (NaN where it was not finite)
    skipped: list[int] = field(default_factory=list)  # steps whose update was skipped (non-finite)
    label: str = ""  # the AC setting's label, with the job number where two jobs share one
    trial: dict = field(default_factory=dict)  # a search's trial that ran this job (membudget.search.trials)

    @property
    def ac(self) -> dict:
        return self.config.get("ac", {})

    @property
    def mode(self) -> str:
        return str(self.ac.get("mode", "?"))

    @property
    def budget(self):
        """The memory budget (float, or per block "0.3*2+0.6*2") of an ac=memory_budget job, else None."""
        return budget_of(self.ac)

    @property
    def compiled(self) -> bool:
        if "compile" in self.summary:
            return bool(self.summary["compile"])
        return compile_enabled(OmegaConf.create({"compile": {"enabled": None, **self.config.get("compile", {})},
                                                 "ac": {"mode": self.mode, "blocks": self.ac.get("blocks", "none")}}))


def mean_budget(budget) -> Optional[float]:
    """A budget as one number (per-block budgets: their mean), for ordering and colour scales."""
    if budget is None:
        return None
    if isinstance(budget, (int, float)):
        return float(budget)
    try:
        blocks = parse_block_budgets(budget)
    except ValueError:
        return None
    return sum(blocks) / len(blocks)


@dataclass
class Sweep:
    dir: Path
    sweeper: str  # the sweeper's class name from multirun.yaml (BasicSweeper, ...); "" without one
    jobs: list[Job]
    trials: list[dict] = field(default_factory=list)  # a search's every trial (membudget.search.trials)
    study: str = ""  # a search: "front" (two objectives: its Pareto front) or "best" (one: the fastest that fits)
    study_error: str = ""  # a search whose study could not be read: why

    @property
    def completed(self) -> list[Job]:
        return [j for j in self.jobs if j.status == "completed"]


def _basic_sweeper_jobs(hydra_cfg, sweep_dir: Path) -> Optional[list[list[str]]]:
    from membudget.internals import basic_sweeper_jobs

    params = hydra_cfg.sweeper.get("params")
    return basic_sweeper_jobs(OmegaConf.to_container(params) if params else {}, list(hydra_cfg.overrides.task))


def read_trials(sweep_dir: Path) -> list[dict]:
    """A search's trials from its study.db, numbered order; [] without one."""
    if not (Path(sweep_dir) / "study.db").exists():
        return []
    from membudget.search import trials

    return sorted(trials(sweep_dir), key=lambda t: t["number"])


def _search_jobs(hydra_cfg, sweep_dir: Path) -> Optional[list[list[str]]]:
    """The jobs the search's trials launched (a trial's `job` is its subdir), each with its overrides."""
    ran = {int(t["job"]): list(t.get("overrides") or []) for t in read_trials(sweep_dir) if "job" in t}
    return [ran.get(num, []) for num in range(max(ran, default=-1) + 1)] or None


# sweeper class name -> the overrides of every job it planned (None: unknown, only job dirs count)
EXPECTED_JOBS: dict[str, Callable[..., Optional[list[list[str]]]]] = {
    "BasicSweeper": _basic_sweeper_jobs,
    "BudgetSearchSweeper": _search_jobs,  # conf/hydra/sweeper/budget_search.yaml (and budget_fit)
}
SEARCH_SWEEPERS = {"BudgetSearchSweeper"}


def _study_kind(hydra_cfg, sweep_dir: Path) -> str:
    """"front" for a two-objective search, "best" for the constrained one (hydra/sweeper=budget_fit)."""
    direction = hydra_cfg.sweeper.get("direction") if hydra_cfg is not None else None
    if direction is None and (sweep_dir / "optimization_results.yaml").exists():
        return "front" if "solutions" in OmegaConf.load(sweep_dir / "optimization_results.yaml") else "best"
    return "front" if OmegaConf.is_list(direction) and len(direction) == 2 else "best"


def _with_trial(job: Job, trial: dict) -> None:
    """What the study knows of a job its files do not say: the error of a failed trial, a trial still running."""
    job.trial = trial
    if trial["state"] == "FAIL" and job.status != "failed":
        why = trial.get("error") or ("its sweeper stopped before the job returned; a rerun runs the setting again"
                                     if trial.get("stale") else "no error recorded")
        job.status, job.detail = "failed", why
    elif trial["state"] == "FAIL" and not job.detail and trial.get("error"):
        job.detail = trial["error"]
    elif trial["state"] == "RUNNING" and job.status in ("not started", "running or stopped"):
        job.status = "running"
        job.detail = f"trial {trial['number']} has not returned yet" + (f"; {job.detail}" if job.detail else "")


def read_metrics(path: Path) -> tuple[dict[int, float], list[int]]:
    """(step -> loss, skipped steps) from metrics.jsonl. A loss that was not finite is null there and named
    under `nonfinite`: it reads back as NaN, so a diverged run is flagged, never passed."""
    losses, skipped = {}, []
    if not path.exists():
        return losses, skipped
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):  # a line cut short by a killed job
            continue
        if row.get("loss") is not None:
            losses[step] = float(row["loss"])
        elif "loss" in (row.get("nonfinite") or []):
            losses[step] = math.nan
        if row.get("skipped"):
            skipped.append(step)
    return losses, skipped


def read_job(job_dir: Path, num: int, overrides: list[str]) -> Job:
    if not (job_dir / ".hydra" / "config.yaml").exists():
        return Job(num, overrides, "not started")
    config = OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "config.yaml"))
    if (job_dir / ".hydra" / "overrides.yaml").exists():
        overrides = list(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        summary = {}
    losses, skipped = read_metrics(job_dir / "metrics.jsonl")
    status = summary.get("status")
    if status == "completed":
        detail = ""
    elif status in ("preempted", "interrupted"):
        status, detail = "stopped", f"{summary['status']}: {summary.get('stopped', '')}; rerun to resume"
    elif summary:
        status, detail = "failed", str(summary.get("error", ""))
    else:
        status = "running or stopped"
        detail = f"last logged step {max(losses, default=0)} of {config.get('train', {}).get('steps', '?')}, " \
                 "no summary.json"
    label = summary.get("ac_label") or ac_label(config.get("ac", {}))
    return Job(num, overrides, status, detail, config, summary, losses, skipped, label)


def load_sweep(sweep_dir: Path) -> Sweep:
    """Every job of the sweep, started or not."""
    sweep_dir = Path(sweep_dir)
    sweeper, expected, hydra_cfg = "", None, None
    trials, study, study_error = [], "", ""
    if (sweep_dir / "multirun.yaml").exists():
        hydra_cfg = OmegaConf.load(sweep_dir / "multirun.yaml").hydra
        sweeper = str(hydra_cfg.sweeper.get("_target_", "")).rsplit(".", 1)[-1]
    if sweeper in SEARCH_SWEEPERS or (not sweeper and (sweep_dir / "study.db").exists()):
        study = _study_kind(hydra_cfg, sweep_dir)
        try:
            trials = read_trials(sweep_dir)
        except Exception as e:  # no optuna here, another study's db: the job dirs still read
            study_error = f"{sweep_dir / 'study.db'} not read: {one_line(e)}"
    if sweeper in EXPECTED_JOBS and not study_error:
        expected = EXPECTED_JOBS[sweeper](hydra_cfg, sweep_dir)
    expected = expected or []
    nums = {int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}
    jobs = [read_job(sweep_dir / str(num), num, expected[num] if num < len(expected) else [])
            for num in sorted(nums | set(range(len(expected))))]
    by_job = {int(t["job"]): t for t in trials if "job" in t}  # each job is one trial's (a rerun: a new job)
    for job in jobs:
        if job.num in by_job:
            _with_trial(job, by_job[job.num])
        if not job.label:
            job.label = " ".join(job.overrides)
    labels = [j.label for j in jobs if j.status != "not started"]
    for job in jobs:
        if labels.count(job.label) > 1:
            job.label = f"{job.label} (job {job.num})"
    return Sweep(sweep_dir, sweeper, jobs, trials, study, study_error)


def load_jobs(sweep_dir: Path) -> list[Job]:
    return load_sweep(sweep_dir).jobs
