"""python -m membudget.report <sweep dir>: read a sweep's runs, compare each loss with ac=none's, and write which
AC setting is fastest at which memory (report.md, report.csv and plots, in the sweep dir)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from membudget.report import plots
from membudget.report.compare import TOLERANCE, build_rows, match_baselines, none_notes
from membudget.report.jobs import Job, Sweep, load_sweep
from membudget.report.pareto import FrontPoint, Ties, pareto_front
from membudget.report.planned import add_plans
from membudget.report.study import study_verdict
from membudget.report.write import log_to_wandb, verdict, write_csv, write_markdown


@dataclass
class Analysis:
    sweep: Sweep
    rows: list[dict[str, Any]]  # one per completed run, report.COLUMNS
    front: list[FrontPoint]
    baselines: dict[int, Job]  # job -> its ac=none run
    verdict: list[str]  # markdown lines
    tolerance: float

    @property
    def flagged(self) -> set[int]:
        return {r["job"] for r in self.rows if r["loss_flagged"]}

    @property
    def compared(self) -> bool:
        return any(r["loss_flagged"] is not None for r in self.rows)

    def exit_status(self, strict: bool) -> int:
        """--strict: 1 when a run is flagged or no run could be compared with ac=none."""
        return 1 if strict and (self.flagged or not self.compared) else 0


def analyse(sweep: Sweep, tolerance: float = TOLERANCE, ties: Ties = Ties(), plan: bool = True) -> Analysis:
    """Rows, front and verdict; plan: each run's plan beside it (report.planned; about a second a job)."""
    rows, notes = build_rows(sweep, tolerance)
    if plan:
        notes += add_plans(sweep, rows)
    front = pareto_front(rows, ties)
    lines = verdict(rows, front, ties, notes, none_notes(sweep), tolerance, study_verdict(sweep, rows))
    return Analysis(sweep, rows, front, match_baselines(sweep.jobs), lines, tolerance)


def draw(a: Analysis) -> dict[str, list[Path]]:
    """The plots into the sweep dir: {name: [png, svg]}."""
    style = plots.styles(a.rows)
    figures = {"loss": plots.loss_figure(a.sweep.jobs, a.baselines, style, a.tolerance, a.flagged),
               "memory_vs_time": plots.memory_time_figure(a.rows, a.front, style),
               "budget": plots.budget_figure(a.rows, style)}
    return {name: plots.save(fig, a.sweep.dir, name) for name, fig in figures.items() if fig is not None}


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give a fraction in [0, 1), e.g. 0.05 for 5 %")
    return value


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m membudget.report", description=__doc__.split(": ", 1)[1])
    parser.add_argument("sweep_dir", type=Path, help="the multirun dir (hydra.sweep.dir) holding the job dirs")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"flag runs whose loss differs from ac=none by more than X*(1+|loss|) (default {TOLERANCE})")
    parser.add_argument("--memory-tie", type=_fraction, default=Ties.memory, metavar="FRACTION",
                        help=f"activation memory within this fraction counts as equal (default {Ties.memory})")
    parser.add_argument("--time-tie", type=_fraction, default=Ties.time, metavar="FRACTION",
                        help=f"step times within this fraction count as equal (default {Ties.time})")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if a run is flagged or no run could be compared with ac=none")
    parser.add_argument("--no-wandb", action="store_true", help="do not log the summary run to W&B")
    parser.add_argument("--no-plan", action="store_true",
                        help="do not plan each run's config beside it (membudget.plan; about a second a job)")
    args = parser.parse_args(argv)
    sweep_dir = args.sweep_dir.resolve()
    if not sweep_dir.is_dir():
        parser.error(f"{sweep_dir} is not a directory")
    sweep = load_sweep(sweep_dir)
    if not sweep.jobs:
        parser.error(f"{sweep_dir} holds no job dirs (<sweep dir>/0, 1, ...) and no multirun.yaml")

    a = analyse(sweep, args.tolerance, Ties(args.memory_tie, args.time_tie), plan=not args.no_plan)
    made = draw(a)
    write_csv(a.rows, sweep_dir / "report.csv")
    path = write_markdown(sweep, a.rows, a.verdict, made)
    print("\n".join(a.verdict))
    print(f"{len(a.rows)} runs, {len(sweep.jobs) - len(a.rows)} not finished. Report: {path}")
    if not args.no_wandb:
        log_to_wandb(sweep, a.rows, a.front, made, args.tolerance)
    return a.exit_status(args.strict)
