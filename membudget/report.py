"""Turn a Hydra multirun of AC settings into a verdict: which setting is fastest at which memory, and
did any change the loss.

    python -m membudget.report <sweep dir> [--tolerance X] [--strict] [--no-wandb]

Reads each job's `.hydra/config.yaml`, `metrics.jsonl` and `summary.json` (see the trainer) and writes
into the sweep dir: `report.md`, `report.csv` (one row per finished run) and plots as PNG and SVG
(`loss`, `memory_vs_time`, and for budget sweeps `budget`). Unless --no-wandb, it also logs a summary
run (`job_type="report"`) into the W&B group of the sweep's training runs.

Each run's loss is compared step by step with the ac=none run of the same settings (all config keys but
`ac`, `compile` and `logger` equal); a run is flagged when the loss differs anywhere by more than
tolerance * (1 + |baseline loss|). With --strict the command exits 1 when a run is flagged or no run
could be compared.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from omegaconf import OmegaConf

# Relative and absolute at once: |loss - loss_none| <= TOLERANCE * (1 + |loss_none|). AC only changes
# what is saved or recomputed, so the math is the same and runs differ by rounding: bit-identical or
# ~1e-6 in fp32 on CPU, and in bf16 with other kernels (compiled vs eager, recompute vs saved) they
# drift apart by well under 1% over a sweep's length. AC bugs (a wrong tensor recomputed, a lost
# gradient) move the loss by far more within a few steps. The absolute part keeps a loss near zero
# from being judged on noise. Raise it for very long bf16 runs, whose trajectories diverge slowly.
TOLERANCE = 0.01

# Columns of report.csv and the W&B table, in order.
COLUMNS = [
    "job", "run", "ac_mode", "memory_budget", "selective_option", "activation_bytes", "peak_memory_bytes",
    "median_tokens_per_s", "median_step_time_s", "step_time_vs_none", "mfu", "final_loss",
    "max_abs_loss_diff", "loss_flagged",
]
PLOT_FORMATS = ("png", "svg")
MiB = 2**20


@dataclass
class Job:
    num: int
    overrides: list[str]
    status: str  # completed | failed | running or stopped | not started
    detail: str = ""
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)  # step -> loss, from metrics.jsonl
    label: str = ""


def _sweep_overrides(sweep_dir: Path) -> list[list[str]] | None:
    """Each job's overrides as Hydra's basic sweeper expands them from multirun.yaml, or None
    (no multirun.yaml, another sweeper); this is how jobs that never started are found."""
    path = sweep_dir / "multirun.yaml"
    if not path.exists():
        return None
    hydra_cfg = OmegaConf.load(path).hydra
    if not hydra_cfg.sweeper._target_.endswith(".BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    args = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.params or {}).items()] + list(hydra_cfg.overrides.task)
    try:
        overrides = OverridesParser.create().parse_overrides(args)
    except HydraException:  # e.g. glob() sweeps, which need the config loader
        return None
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def _read_losses(path: Path) -> dict[int, float]:
    losses = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a job still writing or killed
                continue
            if row.get("loss") is not None:
                losses[int(row["step"])] = float(row["loss"])
    return losses


def _label(config: dict) -> str:
    ac = config.get("ac", {})
    mode = ac.get("mode", "?")
    if mode == "memory_budget":
        return f"memory_budget {ac.get('memory_budget')}"
    if mode == "selective":
        option = str(ac.get("selective_option", "op"))
        return "selective op" if option == "op" else f"selective every {option}"
    return mode


def load_jobs(sweep_dir: Path) -> list[Job]:
    """Every job of the sweep, started or not (job dirs are Hydra's default `<sweep dir>/<job num>`)."""
    expected = _sweep_overrides(sweep_dir) or []
    nums = {int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()}
    jobs = []
    for num in sorted(nums | set(range(len(expected)))):
        job_dir = sweep_dir / str(num)
        overrides = expected[num] if num < len(expected) else []
        if not (job_dir / ".hydra" / "config.yaml").exists():
            jobs.append(Job(num, overrides, "not started"))
            continue
        config = OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "config.yaml"))
        if (job_dir / ".hydra" / "overrides.yaml").exists():
            overrides = list(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
        summary_path = job_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        losses = _read_losses(job_dir / "metrics.jsonl")
        if summary.get("status") == "completed":
            status, detail = "completed", ""
        elif summary:
            status, detail = "failed", str(summary.get("error", ""))
        else:
            last = max(losses, default=0)
            status = "running or stopped"
            detail = f"last logged step {last} of {config.get('train', {}).get('steps', '?')}, no summary.json"
        jobs.append(Job(num, overrides, status, detail, config, summary, losses))
    labels = [_label(j.config) for j in jobs]
    for job, label in zip(jobs, labels):
        job.label = label if labels.count(label) == 1 else f"{label} (job {job.num})"
    return jobs


def _settings_key(config: dict) -> str:
    """What must match for a run to be compared with an ac=none run: everything but the AC setting."""
    return json.dumps({k: v for k, v in config.items() if k not in ("ac", "compile", "logger")}, sort_keys=True)


def _loss_diff(losses: dict[int, float], baseline: dict[int, float], tolerance: float):
    """(largest |loss - baseline| at common steps, its step, flagged) or None without common steps."""
    steps = sorted(losses.keys() & baseline.keys())
    if not steps:
        return None
    # NaN counts as an infinite difference and `not <=` fails on NaN: a diverged run is flagged, never passed.
    diffs = {s: abs(losses[s] - baseline[s]) for s in steps}
    diffs = {s: math.inf if math.isnan(d) else d for s, d in diffs.items()}
    worst = max(steps, key=diffs.get)
    flagged = any(not diffs[s] <= tolerance * (1 + abs(baseline[s])) for s in steps)
    return diffs[worst], worst, flagged


def match_baselines(jobs: list[Job]) -> dict[int, Job]:
    """For each completed run, the first completed ac=none run with the same settings (itself for one)."""
    done = [j for j in jobs if j.status == "completed"]
    baselines: dict[str, Job] = {}
    for job in done:
        if job.config.get("ac", {}).get("mode") == "none":
            baselines.setdefault(_settings_key(job.config), job)
    return {j.num: baselines[k] for j in done if (k := _settings_key(j.config)) in baselines}


def build_rows(jobs: list[Job], tolerance: float) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per completed run (COLUMNS) and notes on what could not be compared."""
    baselines = match_baselines(jobs)
    notes = []
    if not baselines:
        notes.append("No completed ac=none run: the loss comparison and relative step times are skipped.")
    rows = []
    for job in (j for j in jobs if j.status == "completed"):
        s, ac = job.summary, job.config.get("ac", {})
        base = baselines.get(job.num)
        row = {
            "job": job.num, "run": job.label, "ac_mode": ac.get("mode"),
            "memory_budget": ac.get("memory_budget") if ac.get("mode") == "memory_budget" else None,
            "selective_option": ac.get("selective_option") if ac.get("mode") == "selective" else None,
            "activation_bytes": s.get("activation_bytes"), "peak_memory_bytes": s.get("peak_memory_bytes"),
            "median_tokens_per_s": s.get("median_tokens_per_s"), "median_step_time_s": s.get("median_step_time_s"),
            "step_time_vs_none": None, "mfu": s.get("mfu"), "final_loss": s.get("final_loss"),
            "max_abs_loss_diff": None, "loss_flagged": None,
        }
        if base is None:
            if baselines:
                notes.append(f"Job {job.num} ({job.label}): no ac=none run with the same settings; not compared.")
        else:
            if s.get("median_step_time_s") and base.summary.get("median_step_time_s"):
                row["step_time_vs_none"] = s["median_step_time_s"] / base.summary["median_step_time_s"]
            diff = _loss_diff(job.losses, base.losses, tolerance)
            if diff is None:
                notes.append(f"Job {job.num} ({job.label}): no step logged by both it and ac=none; not compared.")
            else:
                row["max_abs_loss_diff"], _, row["loss_flagged"] = diff
                if row["loss_flagged"]:
                    notes.append(f"Job {job.num} ({job.label}): loss departs from ac=none (job {base.num}) by "
                                 f"{diff[0]:.3g} at step {diff[1]}, beyond the tolerance.")
        rows.append(row)
    return rows, notes


def pareto_front(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs no other run beats on both activation memory and step time, by memory; flagged runs excluded."""
    points = [r for r in rows if r["activation_bytes"] is not None and r["median_step_time_s"] is not None
              and not r["loss_flagged"]]

    def beats(a, b):
        return (a["activation_bytes"] <= b["activation_bytes"] and a["median_step_time_s"] <= b["median_step_time_s"]
                and (a["activation_bytes"], a["median_step_time_s"]) != (b["activation_bytes"], b["median_step_time_s"]))

    front = [r for r in points if not any(beats(o, r) for o in points)]
    return sorted(front, key=lambda r: r["activation_bytes"])


def _save(fig: Figure, sweep_dir: Path, name: str) -> list[Path]:
    paths = [sweep_dir / f"{name}.{fmt}" for fmt in PLOT_FORMATS]
    for path in paths:
        fig.savefig(path, dpi=120)
    return paths


def plot(jobs: list[Job], rows: list[dict[str, Any]], sweep_dir: Path) -> dict[str, list[Path]]:
    """Write the plots (PNG and SVG); return {plot name: paths}. Figure objects render with Agg, no GUI."""
    baselines = match_baselines(jobs)
    plots = {}

    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax_loss, ax_diff = fig.subplots(1, 2)
    for i, job in enumerate(j for j in jobs if j.status == "completed"):
        color = f"C{i % 10}"  # the same run has the same color in both panels
        steps = sorted(job.losses)
        ax_loss.plot(steps, [job.losses[s] for s in steps], color=color, label=job.label)
        base = baselines.get(job.num)
        if base is not None and base is not job:
            common = sorted(job.losses.keys() & base.losses.keys())
            ax_diff.plot(common, [job.losses[s] - base.losses[s] for s in common], color=color)
    ax_loss.set(xlabel="step", ylabel="loss", title="Loss")
    ax_diff.set(xlabel="step", ylabel="loss - loss(ac=none)", title="Difference from ac=none")
    ax_loss.legend(fontsize="small")
    plots["loss"] = _save(fig, sweep_dir, "loss")

    points = [r for r in rows if r["activation_bytes"] is not None and r["median_step_time_s"] is not None]
    if points:
        fig = Figure(figsize=(7, 5), layout="constrained")
        ax = fig.subplots()
        for r in points:
            ax.scatter(r["activation_bytes"] / MiB, r["median_step_time_s"], color="red" if r["loss_flagged"] else "C0")
            ax.annotate(r["run"], (r["activation_bytes"] / MiB, r["median_step_time_s"]), fontsize="small",
                        xytext=(4, 4), textcoords="offset points")
        front = pareto_front(rows)
        ax.step([r["activation_bytes"] / MiB for r in front], [r["median_step_time_s"] for r in front],
                where="post", color="C1", marker="o", label="Pareto front (fastest at each memory)")
        ax.set(xlabel="activation memory (MiB)", ylabel="median step time (s)", title="Activation memory vs step time")
        ax.legend(fontsize="small")
        plots["memory_vs_time"] = _save(fig, sweep_dir, "memory_vs_time")

    budget_rows = sorted((r for r in rows if r["memory_budget"] is not None), key=lambda r: r["memory_budget"])
    if len({r["memory_budget"] for r in budget_rows}) > 1:  # a budget sweep
        fig = Figure(figsize=(10, 4.5), layout="constrained")
        axes = fig.subplots(1, 2)
        for ax, key, scale, ylabel in ((axes[0], "activation_bytes", MiB, "activation memory (MiB)"),
                                       (axes[1], "median_step_time_s", 1, "median step time (s)")):
            xy = [(r["memory_budget"], r[key] / scale) for r in budget_rows if r[key] is not None]
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label="memory_budget")
            # The other modes as horizontal references: where the budget curve crosses them.
            for i, r in enumerate(r for r in rows if r["memory_budget"] is None and r[key] is not None):
                ax.axhline(r[key] / scale, linestyle="--", color=f"C{i + 1}", label=r["run"])
            ax.set(xlabel="activation_memory_budget", ylabel=ylabel)
            ax.legend(fontsize="small")
        fig.suptitle("Memory budget sweep")
        plots["budget"] = _save(fig, sweep_dir, "budget")
    return plots


# how report.md shows each column (report.csv keeps the raw values)
_FORMATS = {
    "activation_bytes": lambda v: f"{v / MiB:,.1f} MiB",
    "peak_memory_bytes": lambda v: f"{v / MiB:,.1f} MiB",
    "median_tokens_per_s": lambda v: f"{v:,.0f}",
    "median_step_time_s": lambda v: f"{v:.4g} s",
    "step_time_vs_none": lambda v: f"{v:.2f}x",
    "mfu": lambda v: f"{v:.1%}",
    "final_loss": lambda v: f"{v:.4f}",
    "max_abs_loss_diff": lambda v: f"{v:.2e}",
    "loss_flagged": lambda v: "**FLAGGED**" if v else "ok",
}


def _fmt(column: str, value: Any) -> str:
    if value is None:
        return ""
    return _FORMATS.get(column, str)(value)


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def verdict(rows: list[dict[str, Any]], notes: list[str], tolerance: float) -> list[str]:
    """The report's conclusion as markdown lines."""
    lines = []
    front = pareto_front(rows)
    if front:
        lines.append("Fastest at each activation memory (Pareto front; less memory first):")
        lines += [f"- {r['run']}: {_fmt('activation_bytes', r['activation_bytes'])}, "
                  f"{_fmt('median_step_time_s', r['median_step_time_s'])} per step"
                  + (f" ({_fmt('step_time_vs_none', r['step_time_vs_none'])} ac=none)" if r["step_time_vs_none"] else "")
                  for r in front]
    flagged = [r["run"] for r in rows if r["loss_flagged"]]
    compared = [r for r in rows if r["loss_flagged"] is not None]
    if flagged:
        lines.append(f"\n**Loss changed** beyond tolerance {tolerance:g} in: {', '.join(flagged)}.")
    elif compared:
        lines.append(f"\nLoss: all {len(compared)} compared runs match ac=none within tolerance {tolerance:g} "
                     "(|diff| <= tolerance * (1 + |loss|) at every common step).")
    lines += [f"- {n}" for n in notes]
    return lines


def write_markdown(sweep_dir: Path, jobs, rows, notes, plots, tolerance: float) -> Path:
    headers = ["job", "run", "AC mode", "budget", "selective", "activation", "peak memory", "tokens/s",
               "step time", "vs none", "MFU", "final loss", "max abs loss diff", "loss"]
    lines = [f"# AC sweep report: {sweep_dir.name}", "", f"Sweep: `{sweep_dir}`", "", "## Verdict", ""]
    lines += verdict(rows, notes, tolerance)
    lines += ["", "## Runs", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(c, r[c]) for c in COLUMNS) + " |" for r in rows]
    unfinished = [j for j in jobs if j.status != "completed"]
    if unfinished:
        lines += ["", "## Not finished", ""]
        lines += [f"- job {j.num} ({' '.join(j.overrides) or j.label}): {j.status}"
                  + (f": {j.detail}" if j.detail else "") for j in unfinished]
    lines += ["", "## Plots", ""] + [f"![{name}]({paths[0].name})" for name, paths in plots.items()]
    path = sweep_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def log_to_wandb(sweep_dir: Path, jobs: list[Job], rows, plots, tolerance: float) -> None:
    """Log the table and plots as one run (job_type="report") into the training runs' W&B group."""
    logged = [j for j in jobs if j.summary.get("wandb")]
    if not logged:
        print("No training run of this sweep logged to W&B (logger=none?): no W&B summary run.")
        return
    import wandb

    info = logged[0].summary["wandb"]
    run = wandb.init(
        project=info["project"], group=info["group"], entity=logged[0].config.get("logger", {}).get("entity"),
        job_type="report", name=f"report-{sweep_dir.name}", dir=sweep_dir,
        mode=os.environ.get("WANDB_MODE", "offline"), config={"sweep_dir": str(sweep_dir), "tolerance": tolerance},
    )
    table = wandb.Table(columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in rows])
    run.log({"report": table, **{name: wandb.Image(str(paths[0])) for name, paths in plots.items()}})
    run.summary.update({
        "flagged_runs": [r["run"] for r in rows if r["loss_flagged"]],
        "pareto_front": [r["run"] for r in pareto_front(rows)],
        "not_finished": [j.num for j in jobs if j.status != "completed"],
    })
    run.finish()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m membudget.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", type=Path, help="the multirun dir (hydra.sweep.dir) holding the job dirs")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"flag runs whose loss differs from ac=none by more than X*(1+|loss|) (default {TOLERANCE})")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if a run is flagged or no run could be compared with ac=none")
    parser.add_argument("--no-wandb", action="store_true", help="do not log the summary run to W&B")
    args = parser.parse_args(argv)
    sweep_dir = args.sweep_dir.resolve()
    if not sweep_dir.is_dir():
        parser.error(f"{sweep_dir} is not a directory")
    jobs = load_jobs(sweep_dir)
    if not jobs:
        parser.error(f"{sweep_dir} holds no job dirs (<sweep dir>/0, 1, ...) and no multirun.yaml")
    rows, notes = build_rows(jobs, args.tolerance)
    plots = plot(jobs, rows, sweep_dir)
    write_csv(rows, sweep_dir / "report.csv")
    report = write_markdown(sweep_dir, jobs, rows, notes, plots, args.tolerance)
    print("\n".join(verdict(rows, notes, args.tolerance)))
    unfinished = sum(j.status != "completed" for j in jobs)
    print(f"{len(rows)} runs, {unfinished} not finished. Report: {report}")
    if not args.no_wandb:
        log_to_wandb(sweep_dir, jobs, rows, plots, args.tolerance)
    compared = any(r["loss_flagged"] is not None for r in rows)
    if args.strict and (any(r["loss_flagged"] for r in rows) or not compared):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
