"""The planner's prediction beside each run: `membudget.plan.plan_setting` of the job's own composed config,
so a sweep (grid or search) shows how far the plan is from what was measured. An auto run's job
(ac.memory_budget=auto, ac.blocks=auto) shows the plan it chose, from its plan.json.

The job's `.hydra/config.yaml` is merged onto the schema and planned for the device it trained on (train.device,
else the search's memory key, else the first line of its train.log) with its world size. Equal configs are
planned once. A job that cannot be planned gets empty cells and a note; the report never fails on it. Planning
the debug model takes about a second a job on a CPU.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from membudget.errors import one_line
from membudget.report.jobs import Job, Sweep

PLAN_COLUMNS = ("planned_activation_bytes", "activation_vs_planned", "planned_peak_memory_bytes")
_TRAINED_ON = re.compile(r" on (cpu|cuda)\b")


def device_of(job: Job, run_dir: Path) -> Optional[str]:
    """"cpu" or "cuda": where the job trained; None when nothing says."""
    device = str(job.config.get("train", {}).get("device", "auto"))
    if device in ("cpu", "cuda"):
        return device
    key = job.trial.get("memory_key")  # the search minimised CUDA peak on a GPU, activation bytes on a CPU
    if key in ("peak_memory_bytes", "activation_bytes"):
        return "cuda" if key == "peak_memory_bytes" else "cpu"
    log = run_dir / "train.log"
    if log.exists():
        with open(log, errors="replace") as f:
            match = _TRAINED_ON.search(f.readline())
        if match:
            return match.group(1)
    return None


def job_cfg(job: Job):
    """The job's composed config on the schema (enums, defaults of keys an older config lacks)."""
    from membudget.schema import RunConfig

    return OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(job.config))


def add_plans(sweep: Sweep, rows: list[dict[str, Any]]) -> list[str]:
    """Fill PLAN_COLUMNS of each row from the plan of its job's config; notes on the jobs not planned."""
    from membudget.plan import plan_setting

    jobs = {j.num: j for j in sweep.jobs}
    cache: dict[str, Any] = {}  # setting -> Plan, or the error planning it raised
    unknown, failed = [], []
    for row in rows:
        row.update(dict.fromkeys(PLAN_COLUMNS))
        job = jobs[row["job"]]
        plan = _chosen_plan(sweep.dir / str(job.num))
        if plan is not None:  # an auto run's own choice: what it trained, not planned again
            _fill(row, *plan)
            continue
        device = device_of(job, sweep.dir / str(job.num))
        if device is None:
            unknown.append(job.num)
            continue
        world_size = job.summary.get("world_size")
        key = json.dumps([{k: v for k, v in job.config.items() if k not in ("logger", "checkpoint")}, device,
                          world_size], sort_keys=True, default=str)
        if key not in cache:
            try:
                quiet = logging.getLogger("membudget")
                level, quiet.level = quiet.level, max(quiet.level, logging.WARNING)
                try:
                    cache[key] = plan_setting(job_cfg(job), world_size=world_size, device=device)
                finally:
                    quiet.level = level
            except Exception as e:  # a config the planner cannot take: an empty cell, never a failed report
                cache[key] = one_line(e)
        plan = cache[key]
        if isinstance(plan, str):
            failed.append(f"job {job.num} ({job.label}): {plan}")
            continue
        _fill(row, plan.activations, plan.peak)
    notes = []
    if unknown:
        notes.append(f"Not planned: job{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))}: the device "
                     "it trained on is unknown (train.device=auto and no train.log).")
    notes += [f"Planning failed for {f}." for f in failed]
    return notes


def _chosen_plan(run_dir: Path) -> Optional[tuple[int, int]]:
    """(activations, peak) of the plan an auto run chose and wrote (plan.json, auto.write_plan); None without
    one, or where it cannot be read (planned again then)."""
    try:
        plan = json.loads((run_dir / "plan.json").read_text())
        return int(plan["activations"]), int(plan["peak"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _fill(row: dict[str, Any], activations: int, peak: int) -> None:
    row["planned_activation_bytes"] = activations
    row["planned_peak_memory_bytes"] = peak
    if row.get("activation_bytes") is not None and activations:
        row["activation_vs_planned"] = row["activation_bytes"] / activations
