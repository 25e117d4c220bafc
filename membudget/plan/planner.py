"""Plan AC settings of one run: measure a probe, replay the whole model's first two steps, price them in memory
(allocated and, through the caching-allocator model, reserved) and in time, and judge them against the device."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Optional

from membudget.ac import compiler_scope
from membudget.errors import UserError
from membudget.rules import SECTIONS, check_parallelism, check_train, compile_enabled, mesh_degrees, validate
from membudget.schema import (
    CompileBackend,
    OffloadWith,
    RuntimeEstimator,
    ac_label,
    block_policies,
    budget_of,
    compact_budgets,
    compact_policies,
    parse_block_budgets,
)
from membudget.step import Numerics, StepShape
from membudget.units import GiB, fmt_bytes, gib

from .allocator import CachingAllocator
from .blocks import best_single, choose_mix, single_budgets
from .devices import CUDA_CONTEXT, NCCL_PER_COMMUNICATOR, assumed_device, expandable_segments
from .measure import fake_world, probe_shape, run_optimizer, run_probe
from .replay import Layout, Memory, consistent, simulate, two_steps
from .result import DOES_NOT_FIT, FITS, NO_LIMIT, TIGHT, UNCERTAINTY, BlockCost, Plan, Setting, fits_within
from .timing import cost, step_time
from .trace import GRADIENTS, OptimizerRun

log = logging.getLogger("membudget")


def resolve_world_size(cfg, world_size: Optional[int]) -> int:
    if world_size is None:
        world_size = cfg.plan.world_size
    if world_size is None:
        p = cfg.parallelism
        if -1 in (p.dp_replicate, p.dp_shard, p.tp):
            raise UserError(f"parallelism={p.name} infers a degree from the world size: set plan.world_size=N")
        world_size = p.dp_replicate * p.dp_shard * p.tp
    return world_size


class Planner:
    """Plans the AC settings of one run (model, parallelism, shapes); a fake process group while open."""

    def __init__(self, cfg, world_size: Optional[int] = None, device: Optional[str] = None):
        """`device`: "cuda" or "cpu", the device the run trains on; None: train.device, where auto plans for a GPU
        (a plan is often made where the run's GPUs are not)."""
        self.cfg = cfg
        self.world_size = resolve_world_size(cfg, world_size)
        self.degrees = mesh_degrees(cfg.parallelism, self.world_size)
        self.shape = StepShape.from_config(cfg, self.world_size)
        target = device or ("cpu" if cfg.train.device == "cpu" else "cuda")
        self.device = assumed_device(cfg.plan, target, local_ranks=self.world_size)  # CPU ranks share one host
        self.numerics = Numerics.for_target(cfg, target, self.device.capability)
        self.expandable = expandable_segments(cfg.plan)
        self._optimizer_runs: dict = {}  # this rank's shards and the optimizer settings -> OptimizerRun
        self._references: dict = {}  # the run without AC -> its forward and backward FLOPs per step
        target_gib = cfg.ac.target_memory_gib
        if target_gib is not None:
            self.limit: Optional[int] = int(target_gib * GiB)
            self.limit_source = f"ac.target_memory_gib={target_gib:g}"
        else:
            margin = cfg.plan.margin_gib
            self.limit = self.device.memory - int(margin * GiB) if self.device.memory else None
            self.limit_source = f"the device's {fmt_bytes(self.device.memory)} less plan.margin_gib={margin:g}"

    def __enter__(self) -> "Planner":
        self._world = fake_world(self.cfg.parallelism, self.world_size)
        self.mesh, self.groups = self._world.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._world.__exit__(*exc)

    def point(self, mode: str, budget=None, **ac):
        """The run's config with another AC mode or budget (or other `ac` fields), as the planner runs it."""
        cfg = copy.deepcopy(self.cfg)
        cfg.ac.mode = mode
        if str(mode) != "offload":  # read by ac=offload only
            cfg.ac.offload_with = OffloadWith.none
        if budget is not None:
            cfg.ac.memory_budget = budget
        for key, value in ac.items():
            setattr(cfg.ac, key, value)
        if dataclasses.is_dataclass(cfg):  # built without Hydra (scripts/gpu_check.py): the rules OmegaConf needs not
            for check in SECTIONS:
                check(cfg)
            check_parallelism(cfg, self.world_size)
            check_train(cfg, self.world_size)
        else:
            validate(cfg, self.world_size)
        cfg.ac.visualize_pareto = False
        cfg.ac.runtime_estimator = RuntimeEstimator.flops  # "profile" times kernels, which fake tensors cannot run
        return cfg

    # --- measurement ---------------------------------------------------------------------------------------
    def _probe(self, cfg):
        n = cfg.model.n_layers
        depth, period = probe_shape(cfg, n)
        probe = run_probe(cfg, self.mesh, self.groups, self.numerics, self.shape.micro_batch, depth, period,
                          self.shape.n_micro)
        layout = Layout(n, depth, period)
        if depth < n and not all(consistent(r, layout) for r in probe.runs):
            log.warning("plan: the probe's middle blocks allocate differently; probing all %d blocks", n)
            probe = run_probe(cfg, self.mesh, self.groups, self.numerics, self.shape.micro_batch, n, 1,
                              self.shape.n_micro)
            layout = Layout(n, n, 1)
        return probe, layout

    def _optimizer(self, cfg, probe) -> OptimizerRun:
        n = cfg.model.n_layers
        shards = probe.shards["outside"][:1] + probe.shards["block"] * n + probe.shards["outside"][1:]
        key = (tuple(shards), self.numerics.target, repr(cfg.optimizer), cfg.train.max_grad_norm)
        if key not in self._optimizer_runs:
            self._optimizer_runs[key] = run_optimizer(cfg, shards, self.numerics)
        return self._optimizer_runs[key]

    def reference(self) -> dict[str, float]:
        """The step's FLOPs without AC and without compile: what recompute is counted against."""
        key = (repr(self.cfg.model), repr(self.cfg.train), self.world_size, repr(self.degrees), self.numerics)
        if key not in self._references:
            cfg = self.point("none")
            cfg.compile.enabled = False
            with compiler_scope(cfg.ac):
                probe, layout = self._probe(cfg)
            flops = {"forward": 0, "backward": 0}
            for kind, j in layout.order():
                segment = probe.first.segments.get(layout.segment_name(kind, j))
                if segment is not None:
                    flops["backward" if kind in ("output backward", "backward") else "forward"] += segment.flops
            self._references[key] = {k: self.shape.n_micro * v for k, v in flops.items()}
        return self._references[key]

    # --- one plan ------------------------------------------------------------------------------------------
    def plan(self, cfg, label: Optional[str] = None, recompute: bool = True) -> Plan:
        """Plan one point (from `point`); `recompute`: also count its recompute FLOPs against ac=none (one more
        probe, once per Planner's run)."""
        start = time.perf_counter()
        n = cfg.model.n_layers
        with compiler_scope(cfg.ac, n_layers=n):
            probe, layout = self._probe(cfg)
        optimizer = self._optimizer(cfg, probe)
        transient = 0
        if probe.sharded and self.numerics.target == "cpu":  # model.init_: one parameter at a time at full size
            transient = max(probe.full_sizes)
        phases = two_steps(probe, optimizer, n, self.shape.n_micro, transient)
        allocated = simulate(phases)
        reserved = reserved_other = None
        max_allocated = allocated.allocated.nbytes
        overheads = {}
        if self.device.is_gpu:
            reserved = simulate(phases, CachingAllocator(expandable=self.expandable))
            reserved_other = simulate(phases, CachingAllocator(expandable=not self.expandable)).reserved
            max_allocated = reserved.allocator_allocated
            overheads = self._overheads()
        verdict, reason, judged = self._verdict(phases, allocated, reserved, overheads)
        step2 = [p for p in phases if p.step == 2]
        offloaded = {j: probe.first.host_per_block.get(layout.rep(j), 0) for j in range(n)}
        timing = step_time(step2, self.device, self.degrees, offloaded)
        reference = self.reference() if recompute else None
        backward = sum(op.flops for p in step2 if p.kind == "backward" for op in p.ops)
        activations = probe.first.activations
        if layout.depth < n:  # each storage is counted in the block whose forward kept it
            per_block = probe.first.per_block
            activations = per_block.get(None, 0) + sum(per_block.get(layout.rep(j), 0) for j in range(n))
        return Plan(
            label=label or ac_label(cfg.ac),
            ac_mode=str(cfg.ac.mode),
            memory_budget=_budget_value(cfg.ac),
            setting=self._setting(cfg),
            device=self.device,
            parameters=sum(probe.parameters) + n * sum(probe.block_parameters),
            buffers=sum(probe.buffers),
            gradients=_gradients(phases),
            optimizer_states=optimizer.state_bytes,
            activations=activations,
            init_transient=transient,
            allocated=allocated.allocated,
            per_step=allocated.per_step,
            reserved=None if reserved is None else reserved.reserved,
            reserved_other=reserved_other,
            max_allocated=max_allocated,
            overheads=overheads,
            limit=self.limit,
            limit_source=self.limit_source,
            verdict=verdict,
            verdict_reason=reason,
            judged_bytes=judged,
            time=timing,
            tokens_per_step=self.shape.tokens_per_step,
            forward_flops=reference["forward"] if reference else None,
            recompute_flops=max(0.0, backward - reference["backward"]) if reference else None,
            blocks=self._blocks(cfg, probe, layout),
            seconds=time.perf_counter() - start,
            policies=compact_policies(block_policies(cfg.ac, n)),
            host_bytes=sum(probe.first.host_per_block.get(layout.rep(j), 0) for j in range(n)),
        )

    def _overheads(self) -> dict[str, int]:
        communicators = sum(1 for d in self.degrees.values() if d > 1)
        terms = {"CUDA context": CUDA_CONTEXT}
        if communicators:
            terms["NCCL buffers"] = communicators * NCCL_PER_COMMUNICATOR
        return terms

    def _verdict(self, phases, allocated: Memory, reserved: Optional[Memory],
                 overheads: dict) -> tuple[str, str, int]:
        """(verdict, why, the bytes judged against the limit)."""
        # A device's memory holds the CUDA context and NCCL's buffers too; ac.target_memory_gib bounds what
        # PyTorch's allocator reserves (what max_memory_reserved shows)
        extra = sum(overheads.values()) if self.cfg.ac.target_memory_gib is None else 0
        need = (reserved.reserved.nbytes if reserved is not None else allocated.allocated.nbytes) + extra
        if not self.limit:
            return NO_LIMIT, "no memory limit known: set ac.target_memory_gib", need
        limit = self.limit
        needs = f"needs {fmt_bytes(need)} of {fmt_bytes(limit)}"
        if fits_within(need, limit):
            return FITS, needs, need
        if reserved is None:
            if need <= limit:
                return TIGHT, f"{needs}: within the plan's {UNCERTAINTY:.0%} uncertainty of the limit", need
            return DOES_NOT_FIT, needs, need
        capped = simulate(phases, CachingAllocator(expandable=self.expandable, capacity=limit - extra))
        if capped.ooms:
            return (DOES_NOT_FIT, f"{needs}; even releasing the allocator's cache, {capped.ooms} allocation(s) fail",
                    need)
        if need <= limit:
            return TIGHT, f"{needs}: within the plan's {UNCERTAINTY:.0%} uncertainty of the limit", need
        return TIGHT, (f"{needs} with a full cache; fits only by releasing cached memory ({capped.retries} "
                       f"cudaMalloc retries in two steps: slower)"), need

    def _blocks(self, cfg, probe, layout) -> list[BlockCost]:
        """Per probe block: what it keeps and costs, for choosing policies block by block."""
        policies = block_policies(cfg.ac, layout.n)
        costs = []
        segments = probe.first.segments
        for b in range(layout.depth):
            fwd, bwd = segments.get(f"forward {b}"), segments.get(f"backward {b}")
            if fwd is None or bwd is None:
                continue
            seconds = (lambda s: cost(s.ops, self.device, self.degrees).gpu) if self.device.is_gpu else (lambda s: None)
            costs.append(BlockCost(b, str(policies[layout.layers_of(b)[0]]),
                                   probe.first.per_block.get(b, 0), probe.first.host_per_block.get(b, 0),
                                   fwd.flops, bwd.flops, seconds(fwd), seconds(bwd)))
        return costs

    def _setting(self, cfg) -> Setting:
        compiled = compile_enabled(cfg)
        return Setting(
            model=cfg.model.name, world_size=self.world_size, seq_len=cfg.train.seq_len, **self.degrees,
            micro_batch=self.shape.micro_batch, grad_accumulation=self.shape.n_micro,
            dtype="bf16 autocast" if self.numerics.bf16 else "fp32", attention=self.numerics.attention,
            compile=compiled, configured_backend=str(self.cfg.compile.backend),
            planned_backend=str(CompileBackend.aot_eager_decomp_partition) if compiled else None,
            allocator="expandable segments" if self.expandable else "default",
            runtime_estimator=str(self.cfg.ac.runtime_estimator))


def _budget_value(ac):
    """A scalar budget as a float, per-block budgets in their compact spelling ("0.3*8+0.6*24"); None without."""
    budget = budget_of(ac)
    if budget is None:
        return None
    try:
        return float(budget)
    except ValueError:
        return compact_budgets(parse_block_budgets(budget))


def _gradients(phases) -> int:
    """Gradient bytes alive at the end of step 1's backward (before the optimizer step)."""
    live = {}
    for phase in phases:
        if phase.kind == "optimizer":
            break
        for event in phase.events:
            if event[0] == "a" and event[4] == GRADIENTS:
                live[event[1]] = event[2]
            elif event[0] == "f":
                live.pop(event[1], None)
    return sum(live.values())


# --- entry points ----------------------------------------------------------------------------------------

SWEEP_BUDGETS = tuple(round(0.1 * i, 1) for i in range(11))
OFFLOADS = ("none", "selective", "full")  # what an offloading block also does (ac.offload_with)


def _label(cfg, mode: str, budget=None, **ac) -> str:
    return ac_label({"mode": mode, "memory_budget": budget, "selective_option": str(cfg.ac.selective_option), **ac})


def is_auto(cfg) -> bool:
    """Whether the run leaves its AC setting to the planner (ac.memory_budget=auto or ac.blocks=auto)."""
    return (str(cfg.ac.mode) == "memory_budget" and cfg.ac.memory_budget == "auto") or (
        str(cfg.ac.mode) == "per_block" and cfg.ac.blocks == "auto")


def plan_setting(cfg, world_size: Optional[int] = None, device: Optional[str] = None) -> Plan:
    """The plan of `cfg`'s own AC setting; for auto, of the setting it chooses."""
    if is_auto(cfg):
        return choose_setting(cfg, world_size, device)[1]
    budget = cfg.ac.memory_budget if str(cfg.ac.mode) == "memory_budget" else None
    with Planner(cfg, world_size, device) as planner:
        return planner.plan(planner.point(cfg.ac.mode, budget))


def plan_sweep(cfg, world_size: Optional[int] = None, references: bool = True,
               device: Optional[str] = None, offload: bool = False) -> list[Plan]:
    """none, full, selective (as configured) and memory budgets 0.0, 0.1, ..., 1.0; `offload`: also every block
    offloading (with none, selective op and full AC), where that saves device memory (a GPU)."""
    with Planner(cfg, world_size, device) as planner:
        points = [(m, None, {}) for m in ("none", "full", "selective")] if references else []
        points += [("memory_budget", b, {}) for b in SWEEP_BUDGETS]
        if offload and planner.device.is_gpu:
            points += [("offload", None, {"offload_with": w, "selective_option": "op"}) for w in OFFLOADS]
        return [planner.plan(planner.point(m, b, **ac), _label(cfg, m, b, **ac)) for m, b, ac in points]


def choose(plans: list[Plan]) -> Optional[Plan]:
    """The fastest single budget whose planned peak fits (without a time model: the least recompute), ties to
    the lower peak, then the higher budget; None when none fits or no limit is known."""
    limit = plans[0].limit if plans else None
    return best_single(single_budgets(plans), limit) if limit else None


def choose_setting(cfg, world_size: Optional[int] = None, device: Optional[str] = None) -> tuple[object, Plan]:
    """For auto: the fastest setting whose reserved peak fits ac.target_memory_gib (default: the device's memory
    less plan.margin_gib); `device`: the one the run trains on (see Planner). ac.memory_budget=auto chooses among
    budgets, one or one per block; ac.blocks=auto a policy per block. UserError when none fits."""
    policies = str(cfg.ac.mode) == "per_block"
    plans = plan_sweep(cfg, world_size, references=policies, device=device, offload=policies)
    return choose_or_explain(plans, cfg, world_size, device)


def choose_or_explain(plans: list[Plan], cfg, world_size: Optional[int],
                      device: Optional[str] = None) -> tuple[object, Plan]:
    """(the choice: a budget, per-block budgets as "0.3*8+0.6*24", or under ac=per_block the blocks' policies as
    "full*4+none*28"; its plan) from a sweep's plans."""
    key = "ac.blocks" if str(cfg.ac.mode) == "per_block" else "ac.memory_budget"
    if plans[0].verdict == NO_LIMIT:
        raise UserError(f"{key}=auto: no memory limit known for this device: set ac.target_memory_gib=N (GiB)")
    candidates = plans if key == "ac.blocks" else single_budgets(plans)
    best = best_single(candidates, plans[0].limit)
    with Planner(cfg, world_size, device) as planner:
        mixed = choose_mix(planner, candidates, plans[0].limit, best)
    chosen = mixed or best
    if chosen is not None:
        return (chosen.policies if key == "ac.blocks" else chosen.memory_budget), chosen
    lowest = min(plans, key=lambda p: p.reserved_peak)
    full = next((p for p in plans if p.ac_mode == "full"), None)
    if full is None:
        with Planner(cfg, world_size, device) as planner:
            full = planner.plan(planner.point("full"), "full")
    raise UserError(
        f"{key}=auto: no setting fits {gib(lowest.limit)} GiB per rank on {lowest.device.name} "
        f"(lowest planned reserved peak {gib(lowest.reserved_peak)} GiB, {lowest.label}: {lowest.verdict}); "
        f"ac=full plans {gib(full.reserved_peak)} GiB ({full.verdict}); or lower train.micro_batch_size / "
        f"train.seq_len, or shard over more ranks (parallelism=fsdp with a larger plan.world_size)")
