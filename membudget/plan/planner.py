"""Plan AC settings of one run: a Planner holds the run (its fake process group, device, numerics, step shape and
memory limit), makes the config of each AC setting (`point`), and assembles its plan (`plan`): the probes
(probes.py) replayed as the whole model's first two steps, priced in memory (allocated and, through the
caching-allocator model, reserved) and in time, and judged against the device (verdict.py)."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Optional

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

from .allocator import CachingAllocator
from .devices import assumed_device, expandable_segments
from .measure import fake_world
from .probes import Probes
from .replay import simulate, two_steps
from .result import BlockCost, Plan, Setting
from .timing import cost, step_time
from .trace import GRADIENTS
from .verdict import Limit, judge
from .verdict import overheads as gpu_overheads


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

    def __init__(self, cfg, world_size: Optional[int] = None, device: Optional[str] = None,
                 optimizer_runs: Optional[dict] = None):
        """`device`: "cuda" or "cpu", the device the run trains on; None: train.device, where auto plans for a GPU
        (a plan is often made where the run's GPUs are not). `optimizer_runs`: a store of recorded optimizer steps
        that the caller shares between Planners (rows of one model and mesh record it once; Probes.optimizer);
        None: this Planner's own."""
        self.cfg = cfg
        self._optimizer_runs = optimizer_runs
        self.world_size = resolve_world_size(cfg, world_size)
        self.degrees = mesh_degrees(cfg.parallelism, self.world_size)
        self.shape = StepShape.from_config(cfg, self.world_size)
        target = device or ("cpu" if cfg.train.device == "cpu" else "cuda")
        self.device = assumed_device(cfg.plan, target, local_ranks=self.world_size)  # CPU ranks share one host
        self.numerics = Numerics.for_target(cfg, target, self.device.capability)
        self.expandable = expandable_segments(cfg.plan)
        self.limit = Limit.of(cfg, self.device)

    def __enter__(self) -> "Planner":
        self._world = fake_world(self.cfg.parallelism, self.world_size)
        mesh, groups = self._world.__enter__()
        self.probes = Probes(mesh, groups, self.numerics, self.shape, self._optimizer_runs)
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

    def reference(self) -> dict[str, float]:
        """The step's FLOPs without AC and without compile: what recompute is counted against."""
        none = self.point("none")
        none.compile.enabled = False
        return self.probes.reference(none)

    # --- one plan ------------------------------------------------------------------------------------------
    def plan(self, cfg, label: Optional[str] = None, recompute: bool = True) -> Plan:
        """Plan one point (from `point`); `recompute`: also count its recompute FLOPs against ac=none (one more
        probe, once per Planner's run)."""
        start = time.perf_counter()
        n = cfg.model.n_layers
        probe, layout = self.probes.probe(cfg)
        optimizer = self.probes.optimizer(cfg, probe)
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
            overheads = gpu_overheads(self.degrees)
        verdict, reason, judged = judge(phases, allocated, reserved, overheads, self.limit, self.expandable)
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
            limit=self.limit.nbytes,
            limit_source=self.limit.source,
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
            runtime_estimator=str(self.cfg.ac.runtime_estimator),
            reshard_after_forward=str(cfg.parallelism.reshard_after_forward))


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
