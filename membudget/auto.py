"""ac.memory_budget=auto and ac.blocks=auto at a run's start: the setting planned for the run's device and world
size (rank 0 plans, every rank takes its answer), kept by a resumed run whose inputs are unchanged, and written into
the run dir as plan.md and plan.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from membudget.checkpoint import saved_checkpoints
from membudget.errors import UserError
from membudget.launch import Launch
from membudget.metrics import write_json, write_text
from membudget.parallel import broadcast_object
from membudget.schema import auto_key, budget_list
from membudget.stop import StopPlanning, StopSignals, planning_stopped

log = logging.getLogger("membudget")

PLAN_WAIT_S = 3 * 3600


def choose_for_run(cfg, launch: Launch, device: str, stop: StopSignals, run_dir: Path):
    """ac.memory_budget=auto or ac.blocks=auto: planned on fake tensors over a fake process group,
    for the kind of device this run trains on (train.device=auto on a machine without a GPU: the CPU's numerics).
    Several ranks: rank 0 plans, in a fresh interpreter (beside the joined process group the planner's fake one
    cannot be made), and every rank takes its answer, or its error; a planner process that a stop signal ended
    with rank 0 (torchrun's and SLURM's SIGTERM reach both) stops every rank. A run that resumes keeps the choice
    and plan its run dir's plan.json holds where what auto chooses from is unchanged (kept_choice), and plans
    nothing. (its plan, what auto chose from: plan.auto_inputs; rank 0's, else None)."""
    from membudget.plan import auto_inputs, choose_setting, choose_setting_apart

    key = auto_key(cfg.ac.mode)
    inputs = kept = None

    def start() -> None:  # rank 0's: what auto chooses from, and whether a resumed run keeps its choice
        nonlocal inputs, kept
        inputs = auto_inputs(cfg, launch.world_size, device)
        kept = kept_choice(cfg, run_dir, key, inputs)
        if kept is not None:
            log.info("ac.%s=auto: keeping %s, the choice of this run's first start, and its plan (%s, made from "
                     "the same config, device and torch)", key, kept[0], run_dir / "plan.json")
        else:
            log.info("ac.%s=auto: planning %s on fake tensors for %s", key,
                     "a policy per block" if key == "blocks" else f"the budgets {budget_list(cfg.plan.budgets)}",
                     "cuda" if device == "cuda" else "this CPU")

    if dist.is_initialized():
        outcome, failure = None, None
        if launch.rank != 0:
            log.info("ac.%s=auto: rank 0 plans; this rank waits for its answer", key)
        if launch.rank == 0:
            try:
                start()
                with stop.at_once():  # its planner process is ended with it
                    outcome = ("ok", kept or choose_setting_apart(cfg, launch.world_size, device))
            except StopPlanning:
                outcome = ("stopped", stop.received)
            except Exception as e:
                if stop.received:  # the signal (torchrun's, SLURM's) that ended the planner's process too
                    outcome = ("stopped", stop.received)
                elif isinstance(e, UserError):
                    outcome = ("error", str(e))
                else:  # a bug: the other ranks stop with a line, not at the end of their wait
                    outcome, failure = ("error", f"ac.{key}=auto: rank 0's planning failed ({type(e).__name__}: "
                                                 f"{e}); plan the run with python -m membudget.plan"), e
        outcome = broadcast_object(outcome, torch.device("cpu"), timeout_s=PLAN_WAIT_S)
        if failure is not None:
            raise failure
        if outcome[0] == "error":
            raise UserError(outcome[1])
        if outcome[0] == "stopped":
            raise planning_stopped(outcome[1], f"while rank 0 planned ac.{key}=auto")
        choice, plan = outcome[1]
    else:
        start()
        try:
            with stop.at_once():
                choice, plan = kept or choose_setting(cfg, launch.world_size, device)
        except StopPlanning:
            raise planning_stopped(stop.received, f"while planning ac.{key}=auto") from None
    setattr(cfg.ac, key, choice)
    log.info("ac.%s=auto -> %s: %s%s", key, choice, plan.summary_line(),
             "" if launch.rank == 0 else " (rank 0's plan)")
    return plan, inputs


def kept_choice(cfg, run_dir: Path, key: str, inputs: dict):
    """(the choice, its plan) of an earlier start of this run, which a resumed run keeps: from its plan.json,
    where that start chose from the same auto_inputs (`inputs`) and left a checkpoint to resume
    (checkpoint.resume=auto). A requeued job then neither plans again nor changes its AC setting midway. None
    otherwise; where the inputs changed, the log says which."""
    from membudget.plan import Plan, changed_inputs

    try:
        if cfg.checkpoint.resume != "auto" or not saved_checkpoints(run_dir):
            return None
        written = json.loads((run_dir / "plan.json").read_text())
    except (OSError, ValueError):  # none, one cut short, a dir it cannot read: choose again
        return None
    before = written.get("auto_inputs") if isinstance(written, dict) else None
    if not isinstance(before, dict):
        return None
    if before != inputs:
        changes = changed_inputs(before, inputs)
        log.info("ac.%s=auto: choosing again: what it chooses from changed since this run's earlier start (%s%s)",
                 key, "; ".join(changes[:4]), f"; {len(changes) - 4} more" if len(changes) > 4 else "")
        return None
    try:
        plan = Plan.from_dict(written)
    except (TypeError, ValueError, KeyError) as e:  # a plan.json of another version: choose again
        log.info("ac.%s=auto: choosing again: %s does not hold a plan this version reads (%s: %s)", key,
                 run_dir / "plan.json", type(e).__name__, e)
        return None
    return (plan.policies if key == "blocks" else plan.memory_budget), plan


def write_plan(run_dir: Path, plan, inputs: Optional[dict]) -> None:
    """The plan auto chose, as `python -m membudget.plan` writes it (plan.md, plan.json, with what
    it chose from, `inputs`, for a resumed run to keep it: kept_choice): what the run's measurements can be read
    against. None (a run not set to auto): an earlier start's plan, resumed here with another AC setting, is
    removed, as it no longer says what runs."""
    from membudget.plan.report import plan_markdown

    if plan is None:
        for name in ("plan.md", "plan.json"):
            (run_dir / name).unlink(missing_ok=True)
        return
    for path, write, content in ((run_dir / "plan.md", write_text, plan_markdown(plan)),
                                 (run_dir / "plan.json", write_json, {**plan.to_dict(), "auto_inputs": inputs})):
        try:
            write(path, content)
        except OSError as e:
            raise UserError(f"ac.{auto_key(plan.ac_mode)}=auto: could not write {path} ({e.strerror or e}); free "
                            "space, then rerun the same command") from None
