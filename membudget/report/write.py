"""What the report writes: report.md (verdict, table, plots), report.csv, and the W&B summary run."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from membudget.report.compare import COLUMNS
from membudget.units import fmt_bytes, fmt_time
from membudget.report.jobs import Sweep
from membudget.report.pareto import FrontPoint, Ties, front_runs
from membudget.report.study import trial_lines

# report.md's table: (header, column); report.csv keeps every column, raw
TABLE = [("job", "job"), ("trial", "trial"), ("run", "run"), ("activation", "activation_bytes"),
         ("planned act.", "planned_activation_bytes"), ("act./planned", "activation_vs_planned"),
         ("peak memory", "peak_memory_bytes"), ("planned peak", "planned_peak_memory_bytes"),
         ("steady peak", "steady_peak_memory_bytes"), ("step time", "median_step_time_s"),
         ("vs none", "step_time_vs_none"), ("tokens/s", "median_tokens_per_s"), ("MFU", "mfu"),
         ("compile", "compile_s"), ("skipped", "skipped_steps"), ("final loss", "final_loss"),
         ("max loss diff", "max_abs_loss_diff"), ("loss", "loss_flagged"), ("Pareto", "pareto"),
         ("study", "study")]
_FORMATS = {
    "activation_bytes": fmt_bytes, "peak_memory_bytes": fmt_bytes, "planned_activation_bytes": fmt_bytes,
    "planned_peak_memory_bytes": fmt_bytes, "activation_vs_planned": lambda v: f"{v:.3f}",
    "steady_peak_memory_bytes": fmt_bytes,
    "median_step_time_s": fmt_time, "compile_s": lambda v: f"{v:.1f} s", "step_time_vs_none": lambda v: f"{v:.2f}x",
    "median_tokens_per_s": lambda v: f"{v:,.0f}", "mfu": lambda v: f"{v:.1%}", "final_loss": lambda v: f"{v:.4f}",
    "max_abs_loss_diff": lambda v: f"{v:.2e}", "loss_flagged": lambda v: "**FLAGGED**" if v else "ok",
    "skipped_steps": lambda v: str(v) if v else "",
}


def fmt(column: str, value: Any) -> str:
    return "" if value is None else _FORMATS.get(column, str)(value)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _point(r: dict[str, Any]) -> str:
    return f"{fmt_bytes(r['activation_bytes'])}, {fmt_time(r['median_step_time_s'])}"


def verdict(rows, front: list[FrontPoint], ties: Ties, notes: list[str], none_notes: list[str],
            tolerance: float, study: list[str] = ()) -> list[str]:
    """The report's conclusion as markdown lines; `study`: a search's study against the front (report.study)."""
    lines = []
    if front:
        lines += [f"Pareto front: the fastest run at each activation memory, less memory first. Runs with "
                  f"{ties.describe()} of each other are tied (--memory-tie, --time-tie); of tied runs the one "
                  "ahead by more, each difference counted in units of its tolerance, is named.", ""]
        for p in front:
            r = p.best
            line = f"- {r['run']}: {_point(r)} per step"
            if r["step_time_vs_none"]:
                line += f" ({fmt('step_time_vs_none', r['step_time_vs_none'])} none)"
            for other, why in zip(p.tied, p.reasons):
                line += f"; tied with {other['run']} ({_point(other)}): {why}"
            lines.append(line)
    lines += list(study)
    flagged = [r["run"] for r in rows if r["loss_flagged"]]
    compared = [r for r in rows if r["loss_flagged"] is not None]
    if flagged:
        lines.append(f"\n**Loss changed** beyond tolerance {tolerance:g} in: {', '.join(flagged)}.")
    elif compared:
        lines.append(f"\nLoss: all {len(compared)} compared runs match ac=none within tolerance {tolerance:g} "
                     "(|diff| <= tolerance * (1 + |loss|) at every common step).")
    if none_notes:
        lines += ["", "Activation memory of `none`:", ""] + [f"- {n}" for n in none_notes]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return lines


def write_markdown(sweep: Sweep, rows, verdict_lines: list[str], plots: dict[str, list[Path]]) -> Path:
    table = [(h, c) for h, c in TABLE if any(fmt(c, r[c]) for r in rows)]  # no column that is empty throughout
    lines = [f"# AC sweep report: {sweep.dir.name}", "", f"Sweep: `{sweep.dir}`", "", "## Verdict", ""]
    lines += verdict_lines
    lines += ["", "## Runs", "", "| " + " | ".join(h for h, _ in table) + " |", "|" + "---|" * len(table)]
    lines += ["| " + " | ".join(fmt(c, r[c]) for _, c in table) + " |" for r in rows]
    lines += trial_lines(sweep)
    unfinished = [j for j in sweep.jobs if j.status != "completed" and not j.trial]  # a trial's: under Trials
    if unfinished:
        lines += ["", "## Not finished", ""]
        lines += [f"- job {j.num} ({' '.join(j.overrides) or j.label}): {j.status}"
                  + (f": {j.detail}" if j.detail else "") for j in unfinished]
    lines += ["", "## Plots", ""] + [f"![{name}]({paths[0].name})" for name, paths in plots.items()]
    path = sweep.dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _table_value(column: list[Any]) -> list[Any]:
    """A W&B table column holds one type: a column of numbers and strings (scalar and per-block budgets)
    becomes strings."""
    kinds = {type(v) for v in column if v is not None} - {bool}
    if len(kinds) > 1 and str in kinds:
        return [None if v is None else str(v) for v in column]
    return column


def log_to_wandb(sweep: Sweep, rows, front: list[FrontPoint], plots, tolerance: float) -> None:
    """Log the table and plots as one run (job_type="report") into the training runs' W&B group."""
    logged = [j for j in sweep.jobs if j.summary.get("wandb")]
    if not logged:
        print("No training run of this sweep logged to W&B (logger=none?): no W&B summary run.")
        return
    import wandb

    info = logged[0].summary["wandb"]
    run = wandb.init(
        project=info["project"], group=info["group"], entity=logged[0].config.get("logger", {}).get("entity"),
        job_type="report", name=f"report-{sweep.dir.name}", dir=sweep.dir,
        mode=os.environ.get("WANDB_MODE", "offline"), config={"sweep_dir": str(sweep.dir), "tolerance": tolerance},
    )
    columns = [_table_value([r[c] for r in rows]) for c in COLUMNS]
    table = wandb.Table(columns=COLUMNS, data=[list(values) for values in zip(*columns)] if rows else [])
    run.log({"report": table, **{name: wandb.Image(str(paths[0])) for name, paths in plots.items()}})
    run.summary.update({
        "flagged_runs": [r["run"] for r in rows if r["loss_flagged"]],
        "pareto_front": front_runs(front),
        "not_finished": [j.num for j in sweep.jobs if j.status != "completed"],
    })
    run.finish()
