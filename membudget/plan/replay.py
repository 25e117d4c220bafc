"""The first two optimizer steps of the whole model, replayed from a probe: its recorded segments laid out block by
block over the model's depth, micro-batch after micro-batch, then the optimizer step; and the memory they hold,
as allocated bytes and through the caching-allocator model as reserved bytes, with the moment of each peak.

Block j of the model replays the probe block of the same kind that stands for it: the bottom and the top blocks
and their neighbouring period as themselves, the middle ones as the probe's middle period, whose neighbours are
middle blocks too, so that what a block frees of its neighbours' (the residual stream, FSDP2's reduce-scatter
buffer) is freed at the same point of the step as in the probe.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .allocator import CachingAllocator
from .fusion import fused_intermediates
from .trace import (
    ACTIVATIONS,
    CATEGORIES,
    GRADIENTS,
    OPTIMIZER,
    PARAMETERS,
    TEMPORARIES,
    Alloc,
    Free,
    FreeCarried,
    Op,
    OptimizerRun,
    Probe,
    Run,
    Segment,
)


@dataclass
class Phase:
    """One replayed segment: a block's forward or backward, the loss, the optimizer step."""

    label: str
    step: int
    micro: int
    kind: str  # init | forward | backward | optimizer
    # ("a", key, nbytes, stream, category): allocate | ("f", key): free | ("c", nbytes): free a leftover of an
    # earlier micro-batch | ("g",): zero_grad frees the gradients
    events: list = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)
    block: Optional[int] = None


class Layout:
    """Which probe block stands for block j of an n-block model."""

    def __init__(self, n_layers: int, depth: int, period: int):
        self.n, self.depth, self.period = n_layers, depth, period

    def rep(self, j: int) -> int:
        n, depth, p = self.n, self.depth, self.period
        if depth == n or j <= p:
            return j
        if j >= n - 1 - p:
            return j - (n - depth)
        return p + 1 + (j - p - 1) % p

    def layers_of(self, b: int) -> list[int]:
        """The model's blocks that probe block `b` stands for."""
        return [j for j in range(self.n) if self.rep(j) == b]

    def order(self) -> list[tuple[str, Optional[int]]]:
        n = self.n
        return ([("start", None)] + [("forward", j) for j in range(n)] + [("loss", None), ("output backward", None)]
                + [("backward", j) for j in reversed(range(n))])

    def segment_name(self, kind: str, j: Optional[int]) -> str:
        return kind if j is None else f"{kind} {self.rep(j)}"


_LABELS = {"start": "embedding", "loss": "loss", "output backward": "output's backward"}


def _split(name: str) -> tuple[str, Optional[int]]:
    kind, _, block = name.rpartition(" ")
    return (kind, int(block)) if block.isdigit() and kind in ("forward", "backward") else (name, None)


def consistent(run: Run, layout: Layout) -> bool:
    """Whether the probe's middle blocks of one kind allocate alike (the replay's premise)."""
    p = layout.period
    for kind in ("forward", "backward"):
        for r in range(p):
            sizes = [run.segments[f"{kind} {b}"].alloc_sizes() for b in range(1, layout.depth - 1)
                     if b % p == r and f"{kind} {b}" in run.segments]
            if any(s != sizes[0] for s in sizes):
                return False
    return True


def _micro(run: Run, layout: Layout, step: int, micro: int, fused: set[int]) -> list[Phase]:
    """The phases of one micro-batch of the whole model from a recorded `run`; without the allocations in `fused`
    (fusion.fused_intermediates: values inductor's kernels keep in registers)."""
    def events(segment: Segment) -> list:
        return [e for e in segment.events if not (isinstance(e, (Alloc, Free)) and e.key in fused)]

    roles = {}
    for name, segment in run.segments.items():
        kind, b = _split(name)
        k = 0
        for event in events(segment):
            if isinstance(event, Alloc):
                roles[event.key] = (kind, b, k)
                k += 1
    phases = []
    for kind, j in layout.order():
        segment = run.segments.get(layout.segment_name(kind, j))
        label = _LABELS.get(kind) or f"{kind} of block {j}"
        phase = Phase(label, step, micro, "forward" if kind in ("start", "forward", "loss") else "backward",
                      block=j)
        phases.append(phase)
        if segment is None:
            continue
        b = None if j is None else layout.rep(j)
        phase.ops = segment.ops
        k = 0
        for event in events(segment):
            if isinstance(event, Alloc):
                category = run.categories.get(event.key, TEMPORARIES)
                phase.events.append(("a", (step, micro, kind, j, k), event.nbytes, event.stream, category))
                k += 1
            elif isinstance(event, Free):
                kind_a, b_a, k_a = roles[event.key]
                if b_a is None:
                    layers = [None]
                elif b is not None:  # a neighbour's, at the same distance
                    layers = [j + b_a - b]
                else:  # outside the blocks (the loss, a collection of garbage): each block it stands for frees there
                    layers = layout.layers_of(b_a)
                phase.events += [("f", (step, micro, kind_a, layer, k_a)) for layer in layers]
            elif isinstance(event, FreeCarried):
                phase.events.append(("c", event.nbytes))
    return phases


def _optimizer(opt: OptimizerRun, step: int) -> Phase:
    segment = opt.first if step == 1 else opt.steady
    phase = Phase("optimizer step" if step > 1 else "optimizer step (creates AdamW's states)", step, -1,
                  "optimizer", ops=segment.ops)
    for event in segment.events:
        if isinstance(event, Alloc):
            category = OPTIMIZER if step == 1 and event.key in opt.state_keys else TEMPORARIES
            phase.events.append(("a", (step, "optimizer", event.key), event.nbytes, event.stream, category))
        elif isinstance(event, Free):
            phase.events.append(("f", (step, "optimizer", event.key)))
    phase.events.append(("g",))  # zero_grad(set_to_none=True)
    return phase


def two_steps(probe: Probe, opt: OptimizerRun, n_layers: int, n_micro: int, init_transient: int) -> list[Phase]:
    """Initialisation, then steps 1 and 2 (step 1 has no optimizer states before its optimizer step)."""
    layout = Layout(n_layers, probe.depth, probe.period)
    init = Phase("initialisation", 0, -1, "init")
    sizes = probe.parameters + probe.block_parameters * n_layers + probe.buffers
    init.events = [("a", ("parameter", i), nbytes, 0, PARAMETERS) for i, nbytes in enumerate(sizes)]
    if init_transient:  # CPU meshes initialise one parameter at a time at full size, then keep this rank's shard
        init.events += [("a", ("init",), init_transient, 0, TEMPORARIES), ("f", ("init",))]
    phases = [init]
    fused = {id(run): fused_intermediates(run) for run in probe.runs}
    for step in (1, 2):
        for micro in range(n_micro):
            run = probe.run_of(micro, n_micro)
            phases += _micro(run, layout, step, micro, fused[id(run)])
        phases.append(_optimizer(opt, step))
    return phases


# --- memory over the replay --------------------------------------------------------------------------------

@dataclass
class Moment:
    """Memory at one moment of the replay: the total and what it is."""

    nbytes: int = 0
    phase: str = ""
    step: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.phase}, step {self.step}"


@dataclass
class Memory:
    allocated: Moment  # the peak of bytes in use (what the CPU's allocator holds)
    per_step: dict[int, Moment]  # the same, per step (0: initialisation)
    reserved: Optional[Moment] = None  # the caching allocator's peak reserved, with its slack in the breakdown
    allocator_allocated: int = 0  # the allocator's peak allocated (rounded block sizes): max_memory_allocated
    retries: int = 0
    ooms: int = 0


def carried(live: dict, nbytes: int, ordinal: int):
    """The leftover of an earlier micro-batch or step that a carried free releases: the oldest alive of its
    size (not a parameter, gradient, optimizer state or activation). The probe's FreeCarried names its size
    only, yet size suffices: (1) same-size leftovers are alike for every total and peak of allocated bytes;
    (2) for the allocator model, the oldest is the one the probe freed, since every micro-batch replays the
    same segments in the same order, so leftovers are made and freed in the same order (FSDP2's reduce
    outputs kept for the next micro-batch, block by block). Seen so far (HSDP, DDP), the candidates also
    share one stream and category, and choosing any other leaves every peak unchanged
    (tests/test_plan_allocator.py)."""
    return next((k for k, (n, c, when) in live.items() if n == nbytes and when < ordinal
                 and c not in (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS)), None)


def simulate(phases: list[Phase], allocator: Optional[CachingAllocator] = None) -> Memory:
    """Walk the replay's allocations and frees (through `allocator`, if given); the peaks and their moments."""
    live: dict = {}  # key -> (nbytes, category, when)
    totals = dict.fromkeys(CATEGORIES, 0)
    in_use = 0
    peak = Moment()
    growth: list[Moment] = []  # each time the allocator reserved more
    per_step: dict[int, Moment] = {}
    ordinal, current = 0, None  # which micro-batch (or optimizer step) of the replay a phase belongs to

    def release(key) -> None:
        nonlocal in_use
        nbytes, category, _ = live.pop(key)
        totals[category] -= nbytes
        in_use -= nbytes
        if allocator is not None:
            allocator.free(key)

    for phase in phases:
        if (phase.step, phase.micro) != current:
            ordinal, current = ordinal + 1, (phase.step, phase.micro)
        step_peak = per_step.setdefault(phase.step, Moment())
        for event in phase.events:
            tag = event[0]
            if tag == "a":
                _, key, nbytes, stream, category = event
                live[key] = (nbytes, category, ordinal)
                totals[category] += nbytes
                in_use += nbytes
                if allocator is not None:
                    before = allocator.peak_reserved
                    allocator.malloc(key, nbytes, stream)
                    if allocator.peak_reserved > before:
                        growth.append(Moment(allocator.reserved, phase.label, phase.step,
                                             {**totals, "allocator slack": allocator.reserved - in_use}))
                if in_use > step_peak.nbytes:
                    per_step[phase.step] = step_peak = Moment(in_use, phase.label, phase.step, dict(totals))
            elif tag == "f":  # of an allocation the probe recorded (Recorder._died): a KeyError is a replay bug
                release(event[1])
            elif tag == "c":
                key = carried(live, event[1], ordinal)
                if key is not None:
                    release(key)
            else:  # zero_grad(set_to_none=True)
                for key in [k for k, (_, c, _) in live.items() if c == GRADIENTS]:
                    release(key)
        if step_peak.nbytes > peak.nbytes:
            peak = step_peak
    memory = Memory(peak, per_step)
    if allocator is not None:
        # Reserved memory only grows (nothing releases it but memory pressure): its peak is placed where it came
        # within 1% of its final value (later growth is small segments), the slack counting what came later
        final = allocator.peak_reserved
        moment = next((m for m in growth if m.nbytes >= 0.99 * final), Moment())
        slack = moment.breakdown.get("allocator slack", 0) + final - moment.nbytes
        memory.reserved = Moment(final, moment.phase, moment.step, {**moment.breakdown, "allocator slack": slack})
        memory.allocator_allocated = allocator.peak_allocated
        memory.retries, memory.ooms = allocator.retries, allocator.ooms
    return memory
