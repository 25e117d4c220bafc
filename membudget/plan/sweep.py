"""The planner's entry points: the plan of a run's own AC setting, a sweep over settings, and the choice for
ac.memory_budget=auto and ac.blocks=auto (one setting, or a policy per block), explained when none fits."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import signal
import subprocess
import sys
from typing import Iterator, Optional

import torch

from membudget.errors import UserError
from membudget.schema import Reshard, ac_label, auto_key, budget_list, flat_keys, is_auto, resolved
from membudget.units import fmt_bytes

from .blocks import best_single, choose_mix, single_budgets
from .planner import Planner
from .result import NO_LIMIT, Plan


OFFLOADS = ("none", "selective", "full")  # what an offloading block also does (ac.offload_with)


def _label(cfg, mode: str, budget=None, **ac) -> str:
    return ac_label({"mode": mode, "memory_budget": budget, "selective_option": str(cfg.ac.selective_option), **ac})


def plan_setting(cfg, world_size: Optional[int] = None, device: Optional[str] = None) -> Plan:
    """The plan of `cfg`'s own AC setting; for auto, of the setting it chooses."""
    return _own_setting(cfg, world_size, device, None)[1]


def _own_setting(cfg, world_size: Optional[int], device: Optional[str], planner: Optional[Planner]) -> tuple:
    """(the config planned, its plan): `cfg`'s own AC setting, or for auto the one it chooses."""
    with _planning(cfg, world_size, device, planner) as planner:
        if is_auto(cfg.ac):
            choice, plan = choose_setting(cfg, planner=planner)
            return chosen_point(planner, cfg, choice), plan
        point = planner.point(cfg.ac.mode, cfg.ac.memory_budget if str(cfg.ac.mode) == "memory_budget" else None)
        return point, planner.plan(point)


def chosen_point(planner: Planner, cfg, choice):
    """The config of auto's `choice` (a budget, per-block budgets, or under ac=per_block the blocks' policies)."""
    return planner.point(cfg.ac.mode, **{auto_key(cfg.ac.mode): choice})


def plan_with_reshard_policies(cfg, world_size: Optional[int] = None,
                               device: Optional[str] = None) -> tuple[Plan, list[Plan]]:
    """The plan of `cfg`'s own setting (plan_setting) and its reshard_policies."""
    with Planner(cfg, world_size, device) as planner:
        point, plan = _own_setting(cfg, world_size, device, planner)
        return plan, reshard_policies(planner, point, plan)


def reshard_policies(planner: Planner, point, plan: Plan) -> list[Plan]:
    """Where FSDP shards its groups (dp_shard > 1), `point` (planned as `plan`) under FSDP2's other reshard
    policies (parallelism.reshard_after_forward): what keeping the gathered parameters from forward to backward
    costs in memory and buys in time, and what freeing the last block's saves. [] where nothing is sharded."""
    if plan.setting.dp_shard == 1:
        return []
    others = []
    for policy in Reshard:
        if str(policy) != plan.setting.reshard_after_forward:
            other = copy.deepcopy(point)
            other.parallelism.reshard_after_forward = policy
            others.append(planner.plan(other, f"{plan.label}, parallelism.reshard_after_forward={policy}"))
    return others


@contextlib.contextmanager
def _planning(cfg, world_size: Optional[int], device: Optional[str], planner: Optional[Planner]) -> Iterator[Planner]:
    """`planner` when one is given (open, and left open), else a Planner of `cfg` open for the block."""
    if planner is not None:
        yield planner
        return
    with Planner(cfg, world_size, device) as opened:
        yield opened


def plan_sweep(cfg, world_size: Optional[int] = None, references: bool = True,
               device: Optional[str] = None, offload: bool = False, planner: Optional[Planner] = None) -> list[Plan]:
    """none, full, selective (as configured) and the memory budgets of plan.budgets; `offload`: also every block
    offloading (with none, selective op and full AC), where that saves device memory (a GPU). `planner`: an open
    Planner of `cfg` to plan with (what a Planner measures once, all its plans share); None: one of its own."""
    with _planning(cfg, world_size, device, planner) as planner:
        points = [(m, None, {}) for m in ("none", "full", "selective")] if references else []
        points += [("memory_budget", b, {}) for b in cfg.plan.budgets]
        if offload and planner.device.is_gpu:
            points += [("offload", None, {"offload_with": w, "selective_option": "op"}) for w in OFFLOADS]
        return [planner.plan(planner.point(m, b, **ac), _label(cfg, m, b, **ac)) for m, b, ac in points]


def choose(plans: list[Plan]) -> Optional[Plan]:
    """The fastest single budget whose planned peak fits (without a time model: the least recompute), ties to
    the lower peak, then the higher budget; None when none fits or no limit is known."""
    limit = plans[0].limit if plans else None
    return best_single(single_budgets(plans), limit) if limit else None


def choose_setting(cfg, world_size: Optional[int] = None, device: Optional[str] = None,
                   planner: Optional[Planner] = None) -> tuple[object, Plan]:
    """For auto: the fastest setting whose reserved peak fits ac.target_memory_gib (default: the device's memory
    less plan.margin_gib); `device`: the one the run trains on (see Planner). ac.memory_budget=auto chooses among
    budgets, one or one per block; ac.blocks=auto a policy per block. UserError when none fits. The sweep and
    the mixes are planned by one Planner (`planner`, as plan_sweep's)."""
    policies = str(cfg.ac.mode) == "per_block"
    with _planning(cfg, world_size, device, planner) as planner:
        plans = plan_sweep(cfg, references=policies, offload=policies, planner=planner)
        return choose_or_explain(plans, cfg, world_size, planner=planner)


# What no plan reads: the run's length and logging, checkpoints, the data (the probe's tokens are random), the
# collectives' timeout
NOT_PLANNED = ("logger", "checkpoint", "diagnostics", "data", "tokenizer", "train.steps", "train.log_every",
               "train.progress", "parallelism.timeout_s")


def auto_inputs(cfg, world_size: Optional[int] = None, device: Optional[str] = None) -> dict:
    """Everything auto's choice depends on, as plain data: the config but NOT_PLANNED, the world size, the device
    and the memory limit it is planned for (a CPU's: its available memory, unless ac.target_memory_gib), the
    allocator, and torch's version. Equal inputs choose alike; a resumed run whose inputs are its first start's
    keeps that start's choice (trainer)."""
    planner = Planner(cfg, world_size, device)
    config = resolved(cfg)
    for key in NOT_PLANNED:
        section, _, name = key.partition(".")
        (config.get(section, {}) if name else config).pop(name or section, None)
    inputs = {"config": config, "world_size": planner.world_size, "device": planner.device.name,
              "device_memory_bytes": planner.device.memory if planner.device.is_gpu else None,
              "limit_bytes": planner.limit.nbytes, "expandable_segments": planner.expandable,
              "torch": torch.__version__}
    return json.loads(json.dumps(inputs, default=str))  # as plan.json holds them


def changed_inputs(before: dict, now: dict) -> list[str]:
    """What differs between two auto_inputs, as "key: before -> now" (the config's keys dotted, as overrides)."""
    old, new = ({**flat_keys(i.get("config", {})), **{k: v for k, v in i.items() if k != "config"}}
                for i in (before, now))
    return [f"{key}: {old.get(key)} -> {new.get(key)}" for key in sorted(old.keys() | new.keys())
            if old.get(key) != new.get(key)]


def choose_setting_apart(cfg, world_size: Optional[int] = None, device: Optional[str] = None) -> tuple[object, Plan]:
    """choose_setting in a fresh interpreter (its torch import: about 3 s), for a process that has joined a real
    process group, beside which the planner's fake one cannot be made (rank 0 of a run over several ranks, which
    plans for all of them: auto.choose_for_run). Its warnings reach this process's stderr; its UserError is
    raised here."""
    # Ctrl-C ends the child as SIGTERM does, without a KeyboardInterrupt traceback: its parent says what stopped
    child = subprocess.run([sys.executable, "-c", "import signal; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                            "from membudget.plan.sweep import _choose_for_parent; _choose_for_parent()"],
                           input=pickle.dumps((cfg, world_size, device)), stdout=subprocess.PIPE)
    if child.returncode != 0:
        how = (f"was ended by {_signal_name(-child.returncode)}" if child.returncode < 0
               else f"failed (exit status {child.returncode}, its error above)")
        raise UserError(f"ac.{auto_key(cfg.ac.mode)}=auto: the planner's process {how}; plan the run with "
                        "python -m membudget.plan")
    outcome, value = pickle.loads(child.stdout)
    if outcome == "error":
        raise UserError(value)
    return value


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _choose_for_parent() -> None:
    """choose_setting_apart's child: (cfg, world_size, device) pickled on stdin, ("ok", (choice, plan)) or
    ("error", its UserError's line) pickled on stdout."""
    cfg, world_size, device = pickle.load(sys.stdin.buffer)
    result = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever else writes to stdout (print, a C library) goes to stderr, not into the pickle
    sys.stdout = sys.stderr
    try:
        outcome = ("ok", choose_setting(cfg, world_size, device))
    except UserError as e:
        outcome = ("error", str(e))
    with result:
        result.write(pickle.dumps(outcome))


def choose_or_explain(plans: list[Plan], cfg, world_size: Optional[int], device: Optional[str] = None,
                      planner: Optional[Planner] = None) -> tuple[object, Plan]:
    """(the choice: a budget, per-block budgets as "0.3*8+0.6*24", or under ac=per_block the blocks' policies as
    "full*4+none*28"; its plan) from a sweep's plans; the mixes planned by `planner` (as plan_sweep's)."""
    key = f"ac.{auto_key(cfg.ac.mode)}"
    if plans[0].verdict == NO_LIMIT:
        raise UserError(f"{key}=auto: no memory limit known for this device: set ac.target_memory_gib=N (GiB)")
    candidates = plans if key == "ac.blocks" else single_budgets(plans)
    best = best_single(candidates, plans[0].limit)
    with _planning(cfg, world_size, device, planner) as planner:
        mixed = choose_mix(planner, candidates, plans[0].limit, best)
        chosen = mixed or best
        if chosen is not None:
            return (chosen.policies if key == "ac.blocks" else chosen.memory_budget), chosen
        lowest = min(candidates, key=lambda p: p.judged_bytes)  # of what auto may choose: the others are fixes
        full = next((p for p in plans if p.ac_mode == "full"), None)
        if full is None:
            full = planner.plan(planner.point("full"), "full")
    grid = sorted(cfg.plan.budgets)
    lower = "" if grid[0] == 0.0 else f"let auto try budget 0.0 (plan.budgets={budget_list([0.0, *grid])}), "
    raise UserError(
        f"{key}=auto: no {'setting' if key == 'ac.blocks' else 'budget'} fits {fmt_bytes(lowest.limit)} per rank on "
        f"{lowest.device.name} "
        f"(lowest planned {lowest.judged}, {lowest.label}: {lowest.verdict}); "
        f"ac=full plans {full.judged} ({full.verdict}); or {lower}lower train.micro_batch_size / "
        f"train.seq_len, or shard over more ranks (parallelism=fsdp with a larger plan.world_size)")
