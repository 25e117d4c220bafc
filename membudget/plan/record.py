"""The op-level recorder: every allocation and free of a step in program order, with the stream it is made on,
and every op's FLOPs and bytes, in segments between marks.

Why our own and not torch's tools: the caching-allocator model needs the ordered trace of allocations and frees
with each one's stream, which MemTracker (peaks per module and category) does not keep, and the time model needs
each op's FLOPs and bytes on this rank, where FlopCounterMode sums per module and counts a DTensor op at its global
shape. The FLOP formulas are torch's (`flop_registry`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from membudget.internals import (
    SCALED_MM,
    SDPA_CUDNN,
    SDPA_CUDNN_BACKWARD,
    SDPA_EFFICIENT,
    SDPA_EFFICIENT_BACKWARD,
    SDPA_FLASH,
    SDPA_FLASH_BACKWARD,
    SDPA_FLASH_CPU,
    SDPA_FLASH_CPU_BACKWARD,
    WAIT_TENSOR_OP,
    TorchDispatchMode,
    WeakIdKeyDictionary,
    flop_registry,
    op_packet,
    op_schema,
    storage_key,
    storage_resizes,
    tree_leaves,
)

from .trace import (ATTENTION, FALLBACK, GEMM, GRAPH_OUTPUTS, MEMORY, VIEW, Alloc, Collective, Event, Free,
                    FreeCarried, Op, Segment)

aten = torch.ops.aten
# torch's formulas, plus CPU's flash attention (same arguments first), so CPU plans count attention too
FLOPS = {
    **flop_registry,
    SDPA_FLASH_CPU: flop_registry[SDPA_FLASH],
    SDPA_FLASH_CPU_BACKWARD: flop_registry[SDPA_FLASH_BACKWARD],
}
# Ops that only make storage: no bytes move
_NO_DATA = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like}
_CAUSAL = {SDPA_FLASH, SDPA_FLASH_BACKWARD, SDPA_EFFICIENT, SDPA_EFFICIENT_BACKWARD, SDPA_FLASH_CPU,
           SDPA_FLASH_CPU_BACKWARD}
_GEMMS = {aten.mm: (0, 1), aten.addmm: (1, 2), aten.bmm: (0, 1), aten.baddbmm: (1, 2), SCALED_MM: (0, 1)}
_ATTENTION = _CAUSAL | {SDPA_CUDNN, SDPA_CUDNN_BACKWARD}
# Recorders inside `tracking()`: compiled graphs (`fused_graph`) report their calls to them
_TRACKING: list["Recorder"] = []
_COLLECTIVES = {  # op name (without namespace) -> kind
    "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce", "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "all_to_all_single": "all_to_all", "alltoall_base_": "all_to_all",
}


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class Recorder(TorchDispatchMode):
    """Records the ops that run while it is on and the storages they allocate (an output whose storage no input
    has, or a storage resized up: FSDP2 allocates and frees unsharded parameters that way) until each dies.
    Compiled graphs are recorded too: with `ignore_compile_internals` Dynamo keeps this mode off while it traces
    and on while the graph runs, and aot_eager graphs run op by op. A storage allocated before `start()` that is
    freed while recording is a `FreeCarried` of its size."""

    # Compiled graphs call higher-order ops (full AC's run_and_save_rng_state): seen here too, their outputs
    # counted, their inner op not priced
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, group_names: Optional[dict[str, tuple[str, int]]] = None):
        super().__init__()
        self.segments: list[Segment] = []
        self.recording = False
        self._group_names = group_names or {}  # process group name -> (mesh dimension, ranks)
        self._keys = WeakIdKeyDictionary()  # storage -> [key of its current allocation, bytes], kept by its finalizer
        self._next_key = 0
        # storages without an allocation of this recording (older, or of no bytes) -> a negative key of their own
        self._unrecorded = WeakIdKeyDictionary()
        self._next_unrecorded = -1
        self._streams = {id(torch.cpu.current_stream()): 0}  # the default stream is 0
        self.communication: set[int] = set()  # keys allocated by collectives, FSDP2's copies and its resizes
        self.region: Optional[int] = None  # the fused graph call running now
        self._regions = 0
        self.mark("before")

    # --- segments ------------------------------------------------------------------------------------------
    def mark(self, name: str) -> None:
        self.segments.append(Segment(name))

    def start(self) -> None:
        """Record from here: storages allocated so far are old (their frees are carried ones)."""
        for entry in self._keys.values():
            entry[2] = False
        self.recording = True
        self.segments = [Segment("start")]

    def stop(self) -> None:
        """Stop recording: frees after this (the probe's model dying) belong to no segment."""
        self.recording = False

    def _event(self, event: Event) -> None:
        if self.recording:
            self.segments[-1].events.append(event)

    # --- allocations ---------------------------------------------------------------------------------------
    def _stream(self) -> int:
        # FSDP2 runs its copy-in, all-gather and reduce-scatter under its own streams; on the CPU they are
        # torch.cpu.Stream objects made current by torch.cpu.stream(), which the planner reads back
        stream = torch.cpu.current_stream()
        return self._streams.setdefault(id(stream), len(self._streams))

    def _resize(self, storage: torch.UntypedStorage, nbytes: int, communication: bool = False) -> None:
        entry = self._keys.get(storage)
        if entry is None:
            entry = self._keys[storage] = [None, 0, self.recording]
            weakref.finalize(storage, self._died, entry)
        if entry[1]:
            self._free(entry)
        if nbytes:
            entry[0], entry[1], entry[2] = self._next_key, nbytes, self.recording
            self._next_key += 1
            self._event(Alloc(entry[0], nbytes, self._stream()))
            if communication:
                self.communication.add(entry[0])

    def _free(self, entry: list) -> None:
        if entry[2]:
            self._event(Free(entry[0]))
        else:
            self._event(FreeCarried(entry[1]))
        entry[1] = 0

    def _died(self, entry: list) -> None:
        if entry[1]:
            self._free(entry)

    def key_of(self, storage: torch.UntypedStorage) -> Optional[int]:
        """The key of a live storage's current allocation (None: not allocated while recording)."""
        entry = self._keys.get(storage)
        return entry[0] if entry is not None and entry[1] and entry[2] else None

    @contextmanager
    def tracking(self) -> Iterator["Recorder"]:
        """On for the ops, and for `UntypedStorage.resize_`, which no dispatch mode sees."""
        _TRACKING.append(self)
        try:
            with storage_resizes(lambda storage, nbytes: self._resize(storage, nbytes, communication=True)), self:
                yield self
        finally:
            _TRACKING.remove(self)

    # --- compiled graphs -----------------------------------------------------------------------------------
    def _ident(self, t: torch.Tensor) -> int:
        """An allocation's key while it lives; a storage without one (from before recording, or of no bytes, as
        SDPA's empty outputs) gets a negative key for its lifetime: not its address, which a later storage of
        the same compiled region can reuse, so that which ops share a tensor would depend on the heap's layout."""
        storage = t.untyped_storage()
        entry = self._keys.get(storage)
        if entry is not None and entry[1]:
            return entry[0]
        if storage not in self._unrecorded:
            self._unrecorded[storage] = self._next_unrecorded
            self._next_unrecorded -= 1
        return self._unrecorded[storage]

    def _enter_graph(self) -> None:
        self._regions += 1
        self.region = self._regions

    def _exit_graph(self, outputs) -> None:
        """A graph's outputs outlive its last kernel: a marker op that reads them closes the region."""
        if self.recording and self.region is not None:
            reads = tuple((self._ident(t), _size(t)) for t in _tensors(outputs))
            self.segments[-1].ops.append(Op(GRAPH_OUTPUTS, 0, 0, False, kind=VIEW, region=self.region, reads=reads))
        self.region = None

    # --- ops -----------------------------------------------------------------------------------------------
    def _collective(self, func, args, out) -> Optional[Collective]:
        kind = _COLLECTIVES.get(op_schema(func).name.split("::")[-1])
        if kind is None:
            return None
        nbytes = max((t.numel() * t.element_size() for t in _tensors((args, out))), default=0)
        leaves = tree_leaves(args)
        boxed = next((a for a in leaves if isinstance(a, torch.ScriptObject)), None)
        if boxed is not None:  # c10d ops take the process group
            group = dist.ProcessGroup.unbox(boxed)
            name, ranks = group.group_name, group.size()
        else:  # functional collectives take its name
            name = next((a for a in leaves if isinstance(a, str) and a in self._group_names), None)
            ranks = self._group_names[name][1] if name is not None else 1
        return Collective(kind, nbytes, ranks, self._group_names.get(name, (None,))[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # DTensor runs its local ops through this mode
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is WAIT_TENSOR_OP:
            # Eagerly the input itself; its fake kernel makes a new tensor. So the output keeps the input's
            # (counted) storage alive, as the alias would: else a waited collective's output goes uncounted.
            kept = args[0].untyped_storage()
            if storage_key(out.untyped_storage()) != storage_key(kept):
                weakref.finalize(out.untyped_storage(), lambda: kept)
            return out
        inputs = _tensors((args, kwargs))
        outputs = _tensors(out)
        input_storages = {storage_key(t.untyped_storage()) for t in inputs}
        new = []
        communication = getattr(func, "namespace", None) in ("fsdp", "c10d", "_c10d_functional")
        for t in outputs:
            storage = t.untyped_storage()
            if storage_key(storage) not in input_storages and storage not in self._keys:
                new.append(t)
                self._resize(storage, storage.nbytes(), communication)
        if self.recording:
            op, op_args, op_out = _rng_wrapped(func, args, out) or (func, args, out)
            if op is not func:  # priced as the op it runs; its outputs were counted above
                inputs = _tensors((op_args, kwargs))
            if op_schema(op) is not None:
                self._record_op(op, op_args, kwargs, op_out, inputs, new)
        return out

    def _record_op(self, func, args, kwargs, out, inputs, new) -> None:
        packet = op_packet(func)
        formula = FLOPS.get(packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        if packet in _CAUSAL and _causal(func, args, kwargs):
            flops //= 2  # the kernels skip the masked half of the scores; torch's formula counts the square
        outputs = _tensors(out)
        # what moves through HBM: the inputs and what is written (new outputs, or what a mutating op writes:
        # its mutated arguments, also when it returns nothing, as AdamW's _foreach_*_ and FSDP2's copy-outs do);
        # views, metadata ops and bare allocations move nothing
        mutated, out_args = _mutated(func, args, kwargs)
        written = new or mutated
        inputs = [t for t in inputs if id(t) not in out_args]  # out= arguments are written, not read
        nbytes = 0 if packet in _NO_DATA or not written else sum(_size(t) for t in inputs + written)
        low = bool(outputs) and outputs[0].dtype in (torch.bfloat16, torch.float16)
        kind, shape = _kind_and_shape(packet, func, args, kwargs)
        if not nbytes and kind == MEMORY:
            kind = VIEW
        elif kind == MEMORY and any(t.is_complex() for t in inputs + written):
            kind = FALLBACK
        region = reads = writes = None
        if self.region is not None:
            region = self.region
            reads = tuple((self._ident(t), _size(t)) for t in inputs)
            writes = tuple((self._ident(t), _size(t)) for t in written)
        self.segments[-1].ops.append(Op(str(packet), int(flops), int(nbytes), low, self._collective(func, args, out),
                                        kind, shape, region, reads or (), writes or ()))


def _size(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _mutated(func, args, kwargs) -> tuple[list[torch.Tensor], set[int]]:
    """The tensors an op writes in place (its arguments that its schema marks as written, `Tensor(a!)`), and the
    ids of those among them that are out= arguments, which it does not read."""
    schema = op_schema(func)
    if schema is None or not schema.is_mutable:
        return [], set()
    written, out_args = [], set()
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            tensors = _tensors(args[i] if i < len(args) else kwargs.get(argument.name))
            written += tensors
            if argument.is_out:
                out_args.update(id(t) for t in tensors)
    return written, out_args


def _rng_wrapped(func, args, out):
    """(op, its args, its output) of the op a compiled graph runs inside run_and_save_rng_state (a forward's
    random op under activation checkpointing: SDPA with its dropout) or run_with_rng_state (its recompute);
    None for any other op."""
    name = getattr(func, "__name__", "")
    if name == "run_and_save_rng_state":
        return args[0], args[1:], out[1]
    if name == "run_with_rng_state":
        return args[1], args[2:], out
    return None


def fused_graph(run):
    """Wraps a compiled graph (boxed: `run(args)`) that inductor would compile, so that the recorders on now
    record its ops as one region, whose pointwise ops the time model prices as fused kernels."""

    def call(args):
        for recorder in _TRACKING:
            recorder._enter_graph()
        out = None
        try:
            out = run(args)
        finally:
            for recorder in _TRACKING:
                recorder._exit_graph(out)
        return out

    return call


def _kind_and_shape(packet, func, args, kwargs) -> tuple[str, tuple]:
    if packet in _GEMMS:
        a, b = (args[i] for i in _GEMMS[packet])
        batch = a.shape[0] if a.dim() == 3 else 1
        return GEMM, (batch, a.shape[-2], b.shape[-1], a.shape[-1])
    if packet in _ATTENTION:
        backward = "backward" in str(packet)
        q = args[1 if backward else 0]
        return ATTENTION, (q.shape[0], q.shape[1], q.shape[2], q.shape[3], _causal(func, args, kwargs), backward)
    return MEMORY, ()


def _causal(func, args, kwargs) -> bool:
    schema = op_schema(func)
    names = [a.name for a in schema.arguments]
    if "is_causal" not in names:
        return False
    i = names.index("is_causal")
    return bool(kwargs.get("is_causal", args[i] if i < len(args) else False))
