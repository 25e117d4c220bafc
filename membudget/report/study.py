"""A search's study beside the report: every trial (failed ones with their error, repeated proposals counted,
trials still running), and whether the study's Pareto front (or its best trial) agrees with the report's own
tie-aware front.

The study's front is strict Pareto dominance on the values the search minimised (step time and, on a GPU, the
CUDA peak; on a CPU activation bytes); the report's front treats near-equal runs as ties and uses activation
memory everywhere. So they may differ by ties, and on a GPU by what memory means: the verdict names each
difference with the report's reason.
"""

from __future__ import annotations

from typing import Any

from membudget.units import fmt_bytes, fmt_time
from membudget.report.jobs import Sweep


def _name(sweep: Sweep, job: int) -> str:
    label = next((j.label for j in sweep.jobs if j.num == job and j.label), None)
    trial = next((t for t in sweep.trials if t.get("job") == job), {})
    return f"job {job} ({label or trial.get('setting') or ' '.join(trial.get('overrides') or []) or '?'})"


def _values(t: dict) -> str:
    values = t.get("values") or []
    if len(values) == 2:
        return f"{fmt_time(values[0])}, {fmt_bytes(values[1])}"
    return fmt_time(values[0]) if values and values[0] != float("inf") else "does not fit"


def study_verdict(sweep: Sweep, rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the study's front (or best) against the report's."""
    if sweep.study_error:
        return [f"\nStudy: {sweep.study_error}; the study's front is not compared."]
    if not sweep.trials:
        return []
    study = {int(t["job"]) for t in sweep.trials if t["best"] and "job" in t}
    by_job = {r["job"]: r for r in rows}
    if sweep.study == "best":
        if not study:
            return ["\nStudy (fastest that fits ac.target_memory_gib): no completed trial fits."]
        (job,) = study
        where = by_job[job]["pareto"] if job in by_job else "not in the table (not completed)"
        return [f"\nStudy's best trial (fastest that fits ac.target_memory_gib): {_name(sweep, job)}; on the "
                f"report's front: {'yes' if where == 'front' else f'no, {where}'}."]
    report = {r["job"] for r in rows if r["pareto"] == "front"}
    if study == report:
        return [f"\nStudy's Pareto front agrees with the report's: {len(study)} run{'s' * (len(study) != 1)} "
                f"({', '.join(_name(sweep, j) for j in sorted(study))})."]
    lines = ["\nStudy's Pareto front differs from the report's (the study ranks on exact values, the report "
             "counts near-equal runs as ties):", ""]
    for job in sorted(study - report):
        why = by_job[job]["pareto"] if job in by_job else None
        lines.append(f"- {_name(sweep, job)}: on the study's front; the report: {why or 'not ranked (not measured)'}")
    for job in sorted(report - study):
        lines.append(f"- {_name(sweep, job)}: on the report's front; the study's front leaves it out (a trial beats "
                     "it on exact values)" if any(t.get("job") == job for t in sweep.trials)
                     else f"- {_name(sweep, job)}: on the report's front; not a trial of the study")
    return lines


def trial_lines(sweep: Sweep) -> list[str]:
    """report.md's "Trials" section: one line per trial that ran a job, one for the repeated proposals."""
    if not sweep.trials:
        return []
    mark = {"front": "on the study's Pareto front", "best": "the study's best"}[sweep.study or "front"]
    lines = ["", "## Trials", ""]
    repeated = [t for t in sweep.trials if "job" not in t]
    for t in sweep.trials:
        if "job" not in t:
            continue
        line = f"- trial {t['number']}, {_name(sweep, int(t['job']))}: {t['state']}"
        if t["state"] == "COMPLETE":
            line += f", {_values(t)}" + (f"; {mark}" if t["best"] else "")
        elif t["state"] == "FAIL":
            job = next((j for j in sweep.jobs if j.num == t["job"]), None)
            line += f": {t.get('error') or (job.detail if job else '') or 'no error recorded'}"
        elif t["state"] == "RUNNING":
            line += ": not returned yet"
        lines.append(line)
    if repeated:
        lines.append(f"- {len(repeated)} proposal{'s' * (len(repeated) != 1)} repeated a setting already run "
                     "(pruned, not run again)")
    return lines
