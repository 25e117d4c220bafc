"""The sweep's runs as rows (one per completed job), each compared with its ac=none run: the loss step by
step, the step time as a ratio; and what the runs of `none` say about compilation."""

from __future__ import annotations

import json
import math
from typing import Any

from membudget.rules import data_wait_line
from membudget.units import fmt_bytes
from membudget.report.jobs import Job, Sweep

# Relative and absolute at once: |loss - loss_none| <= TOLERANCE * (1 + |loss_none|). AC only changes
# what is saved or recomputed, so the math is the same and runs differ by rounding: bit-identical or
# ~1e-6 in fp32 on CPU, and in bf16 with other kernels (compiled vs eager, recompute vs saved) they
# drift apart by well under 1% over a sweep's length. AC bugs (a wrong tensor recomputed, a lost
# gradient) move the loss by far more within a few steps. The absolute part keeps a loss near zero
# from being judged on noise. Raise it for very long bf16 runs, whose trajectories diverge slowly.
TOLERANCE = 0.01

# Columns of report.csv and the W&B table, in order. `trial` and `study` are a search's (membudget.search): the
# trial that ran the job, and "front" / "best" where it is on the study's Pareto front or is its best trial.
COLUMNS = [
    "job", "trial", "run", "ac_mode", "memory_budget", "selective_option", "policies", "compiled",
    "offload_host_bytes", "activation_bytes",
    "planned_activation_bytes", "activation_vs_planned", "activation_bytes_per_block", "peak_memory_bytes",
    "planned_peak_memory_bytes", "steady_peak_memory_bytes", "median_tokens_per_s", "median_step_time_s",
    "median_data_wait_s", "step_time_vs_none", "mfu", "compile_s", "skipped_steps", "final_loss", "max_abs_loss_diff",
    "loss_flagged", "pareto", "study",
]


def settings_key(config: dict) -> str:
    """What must match for a run to be compared with an ac=none run: everything but the AC setting (and
    compile, which only changes kernels, and the logger)."""
    return json.dumps({k: v for k, v in config.items() if k not in ("ac", "compile", "logger")}, sort_keys=True,
                      default=str)


def match_baselines(jobs: list[Job]) -> dict[int, Job]:
    """For each completed run, the ac=none run with the same settings: the first with the same compile
    setting, else the first at all (the loss is comparable across compile, memory and time are not)."""
    done = [j for j in jobs if j.status == "completed"]
    nones = [j for j in done if j.mode == "none"]
    baselines = {}
    for job in done:
        same = [n for n in nones if settings_key(n.config) == settings_key(job.config)]
        same.sort(key=lambda n: n.compiled != job.compiled)  # stable: job order within each
        if same:
            baselines[job.num] = job if job in same else same[0]
    return baselines


def loss_diff(losses: dict[int, float], baseline: dict[int, float], tolerance: float):
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


def build_rows(sweep: Sweep, tolerance: float) -> tuple[list[dict[str, Any]], list[str]]:
    """One row per completed run (COLUMNS; `pareto` is filled in by the Pareto front, the planned columns by
    report.planned) and notes on what could not be compared or deserves a look."""
    baselines = match_baselines(sweep.jobs)
    notes = []
    if not baselines:
        notes.append("No completed ac=none run: the loss comparison and relative step times are skipped.")
    rows = []
    for job in sweep.completed:
        s = job.summary
        per_block = s.get("activation_bytes_per_block")
        row = {
            "job": job.num, "trial": job.trial.get("number"), "run": job.label, "ac_mode": job.mode, "memory_budget": job.budget,
            "selective_option": job.ac.get("selective_option") if job.mode == "selective" else None,
            "policies": s.get("ac_policies"), "compiled": job.compiled,
            "offload_host_bytes": s.get("offload_host_bytes"), "activation_bytes": s.get("activation_bytes"),
            "planned_activation_bytes": None, "activation_vs_planned": None,
            "activation_bytes_per_block": json.dumps(per_block) if per_block else None,
            "peak_memory_bytes": s.get("peak_memory_bytes"), "planned_peak_memory_bytes": None,
            "steady_peak_memory_bytes": s.get("steady_peak_memory_bytes"),
            "median_tokens_per_s": s.get("median_tokens_per_s"), "median_step_time_s": s.get("median_step_time_s"),
            "median_data_wait_s": s.get("median_data_wait_s"),
            "step_time_vs_none": None, "mfu": s.get("mfu"), "compile_s": s.get("compile_s"),
            "skipped_steps": s.get("skipped_steps", len(job.skipped)), "final_loss": s.get("final_loss"),
            "max_abs_loss_diff": None, "loss_flagged": None, "pareto": None,
            "study": (sweep.study if job.trial.get("best") else "") if job.trial else None,
        }
        if row["skipped_steps"]:
            notes.append(f"Job {job.num} ({job.label}): {row['skipped_steps']} steps skipped (loss or gradient not "
                         "finite): its curve departs from ac=none from there on.")
        if waited := data_wait_line(s):  # the step time is partly the data path's, not the AC setting's
            notes.append(f"Job {job.num} ({job.label}): {waited}.")
        base = baselines.get(job.num)
        if base is None:
            if baselines:
                notes.append(f"Job {job.num} ({job.label}): no ac=none run with the same settings; not compared.")
            rows.append(row)
            continue
        if s.get("median_step_time_s") and base.summary.get("median_step_time_s") and base.compiled == job.compiled:
            row["step_time_vs_none"] = s["median_step_time_s"] / base.summary["median_step_time_s"]
        diff = loss_diff(job.losses, base.losses, tolerance)
        if diff is None:
            notes.append(f"Job {job.num} ({job.label}): no step logged by both it and ac=none; not compared.")
        else:
            row["max_abs_loss_diff"], _, row["loss_flagged"] = diff
            if row["loss_flagged"]:
                notes.append(f"Job {job.num} ({job.label}): loss departs from ac=none (job {base.num}) by "
                             f"{diff[0]:.3g} at step {diff[1]}, beyond the tolerance.")
        rows.append(row)
    return rows, notes


def none_notes(sweep: Sweep) -> list[str]:
    """Why ac=none has two activation figures: compiled `none` is budget 1.0, eager `none` saves more."""
    done = [j for j in sweep.completed if j.summary.get("activation_bytes") is not None]
    notes = []
    compiled_nones = [j for j in done if j.mode == "none" and j.compiled]
    for none in compiled_nones[:1]:
        key, act = settings_key(none.config), none.summary["activation_bytes"]
        ones = [j for j in done if j.budget is not None and not isinstance(j.budget, str) and float(j.budget) == 1.0
                and settings_key(j.config) == key]
        if ones:
            one = ones[0].summary["activation_bytes"]
            same = "the same activations" if one == act else "nearly the same activations"
            notes.append(f"Compiled `none` is `memory_budget 1.0`: 1.0 is the partitioner's default budget "
                         f"(torch._functorch.config.activation_memory_budget), so both runs save {same}: "
                         f"{fmt_bytes(act)} (job {none.num}) and {fmt_bytes(one)} (job {ones[0].num}).")
        eager = [j for j in done if j.mode == "none" and not j.compiled and settings_key(j.config) == key]
        why = ("eager autograd keeps every tensor a backward formula needs, while the min-cut partitioner of a "
               "compiled block recomputes cheap elementwise results in the backward instead, even at budget 1.0")
        if eager:
            e = eager[0].summary["activation_bytes"]
            notes.append(f"Eager `none` (job {eager[0].num}) saves {fmt_bytes(e)}, compiled `none` {fmt_bytes(act)} "
                         f"({e / act:.2f}x): {why}.")
        else:
            notes.append(f"An eager `none` run (compile.enabled=false, as in a plain `python train.py`) saves more "
                         f"activations than this compiled one: {why}. Compare activation memory only between runs "
                         "with the same compile setting.")
    return notes
