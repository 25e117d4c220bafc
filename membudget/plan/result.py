"""What a plan says about one AC setting, per rank: memory by part, the peaks of allocated and reserved memory
and when they happen, the verdict against the device, and the predicted step time."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from membudget.devices import Device
from membudget.units import fmt_bytes

from .replay import Moment
from .timing import StepTime

# How far the predicted reserved peak may be from the measured one: issue 14's target, above the worst error
# over the public measurements of programs the planner models (docs/planner/evidence.csv: 1.9 %;
# tests/test_plan_evidence.py holds every such row within it). A peak within this of the limit is "tight".
UNCERTAINTY = 0.05


def fits_within(need: int, limit: int) -> bool:
    """The verdict "fits": `need` at least the plan's uncertainty under `limit`."""
    return need <= usable(limit)


def usable(limit: float) -> float:
    """The most a plan may need and still fit `limit`."""
    return limit * (1 - UNCERTAINTY)


def limit_for(need: float) -> float:
    """The least limit that `need` fits."""
    return need / (1 - UNCERTAINTY)

FITS, TIGHT, DOES_NOT_FIT, NO_LIMIT = "fits", "tight", "does not fit", "no limit known"


@dataclass(frozen=True)
class Setting:
    """What was planned, beyond the AC setting."""

    model: str
    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    seq_len: int
    micro_batch: int
    grad_accumulation: int
    dtype: str
    attention: str
    compile: bool
    configured_backend: str
    planned_backend: Optional[str]
    allocator: str  # "default" | "expandable segments"
    # ac.runtime_estimator as configured; plans always price recompute by FLOPs ("profile" times kernels)
    runtime_estimator: str = "flops"
    reshard_after_forward: str = "default"  # parallelism.reshard_after_forward: which FSDP2 groups regather


@dataclass(frozen=True)
class BlockCost:
    """One probe block under the setting: what it keeps and what it costs (per micro-batch)."""

    block: int
    policy: str  # its AC policy (schema.BlockPolicy, spelled)
    activation_bytes: int  # kept on the device
    host_bytes: int  # waiting in host memory (offloading policies on a GPU)
    forward_flops: int
    backward_flops: int  # recompute included
    forward_seconds: Optional[float]
    backward_seconds: Optional[float]


@dataclass
class Plan:
    label: str
    ac_mode: str
    memory_budget: Union[float, str, None]  # a scalar, or per-block budgets spelled compactly
    setting: Setting
    device: Device
    parameters: int  # this rank's shards (FSDP2's padding included) and the RoPE buffer below
    buffers: int
    gradients: int
    optimizer_states: int
    activations: int  # training's activation_bytes (one micro-batch)
    init_transient: int  # what initialisation holds beyond the parameters (CPU meshes: the largest at full size)
    allocated: Moment  # the peak of allocated bytes over initialisation and the first two steps
    per_step: dict[int, Moment]
    reserved: Optional[Moment]  # the caching allocator's reserved peak, as configured (None: a CPU)
    reserved_other: Optional[Moment]  # the same under the other allocator setting
    max_allocated: int  # torch.cuda.max_memory_allocated (blocks as the allocator rounds them)
    overheads: dict[str, int]  # device memory outside the allocator
    limit: Optional[int]  # what the rank may use: ac.target_memory_gib, else device memory less plan.margin_gib
    limit_source: str
    verdict: str
    verdict_reason: str
    judged_bytes: int  # what the verdict held against the limit: the reserved (CPU: allocated) peak, plus the
    # CUDA context and NCCL's buffers when the limit is the device's memory
    time: Optional[StepTime]
    tokens_per_step: int
    forward_flops: Optional[float]  # the step's forward, ac=none (None: not counted)
    recompute_flops: Optional[float]  # extra forward FLOPs run in backward, against ac=none
    blocks: list[BlockCost] = field(default_factory=list)
    seconds: float = 0.0  # planning time
    policies: str = ""  # every block's policy, bottom first, spelled compactly ("full*4+budget:0.3*28")
    host_bytes: int = 0  # pinned host memory the offloading blocks take (one micro-batch's activations)

    @property
    def peak(self) -> int:
        """The allocated peak: what the CPU holds, and torch.cuda.memory_allocated before rounding."""
        return self.allocated.nbytes

    @property
    def reserved_peak(self) -> int:
        return self.reserved.nbytes if self.reserved is not None else self.allocated.nbytes

    @property
    def peak_name(self) -> str:
        """What reserved_peak is called: a CPU has no caching allocator, so its peak is the allocated one."""
        return "reserved peak" if self.reserved is not None else "peak"

    @property
    def judged(self) -> str:
        """What the verdict held against the limit (judged_bytes), in words: the reserved peak (a CPU's: the
        allocated one), and what the device holds outside the allocator where the limit is the device's memory."""
        peak = f"{self.peak_name} {fmt_bytes(self.reserved_peak)}"
        outside = self.judged_bytes - self.reserved_peak
        return f"{peak} + {fmt_bytes(outside)} outside the allocator" if outside > 0 else peak

    @property
    def needed(self) -> int:
        """What the device must hold at the peak: reserved memory and what lies outside the allocator."""
        return self.reserved_peak + sum(self.overheads.values())

    @property
    def fits(self) -> Optional[bool]:
        return None if self.verdict == NO_LIMIT else self.verdict == FITS

    @property
    def step_seconds(self) -> Optional[float]:
        return None if self.time is None else self.time.seconds

    @property
    def tokens_per_s(self) -> Optional[float]:
        return None if self.time is None else self.tokens_per_step / self.time.seconds

    @property
    def tokens_per_s_per_device(self) -> Optional[float]:
        return None if self.time is None else self.tokens_per_s / self.setting.world_size

    @property
    def recompute_ratio(self) -> float:
        return self.recompute_flops / self.forward_flops if self.forward_flops and self.recompute_flops else 0.0

    def summary_line(self) -> str:
        """One line for the trainer's log."""
        where = f"{self.device.name} ({self.device.reason})"
        limit = "" if self.limit is None else f" of {fmt_bytes(self.limit)} ({self.limit_source})"
        speed = "" if self.time is None else (f", predicted {self.tokens_per_s_per_device:,.0f} tokens/s per device "
                                              f"(bound by {self.time.bound})")
        return f"planned {self.judged}{limit} per rank: {self.verdict}{speed}; {where}"

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data.update(peak=self.peak, reserved_peak=self.reserved_peak, needed=self.needed, fits=self.fits,
                    step_seconds=self.step_seconds, tokens_per_s=self.tokens_per_s,
                    tokens_per_s_per_device=self.tokens_per_s_per_device, recompute_ratio=self.recompute_ratio)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """The plan to_dict wrote (as JSON holds it: plan.json); its other keys are passed over. TypeError or
        ValueError where it does not hold a plan of this version."""
        return _from_plain(cls, data)


def _from_plain(kind: Any, value: Any) -> Any:
    """`value`, as dataclasses.asdict and JSON left it, as the type `kind` (a dataclass's field's): dataclasses,
    Optional, lists, tuples and dicts with int keys again."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise TypeError(f"{kind.__name__}: expected an object, got {type(value).__name__}")
        hints = typing.get_type_hints(kind)
        return kind(**{f.name: _from_plain(hints[f.name], value[f.name]) for f in dataclasses.fields(kind)
                       if f.init and f.name in value})
    if origin is Union:
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _from_plain(inner[0], value) if len(inner) == 1 else value
    if origin is list:
        return [_from_plain(args[0], v) for v in value]
    if origin is tuple:
        return tuple(value)
    if origin is dict:
        key, item = args
        return {(int(k) if key is int else k): _from_plain(item, v) for k, v in value.items()}
    return value
