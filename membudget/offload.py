"""Activation offloading: what a block saves for backward waits in host memory between its forward and its backward.

`OffloadedBlock` runs a block (plain, checkpointed, selective or compiled) under saved_tensors_hooks whose pack
copies each saved activation's storage to host memory and whose unpack hands back a device copy. `Offloader`, one
per model, owns the copies, the side streams and the statistics, and prefetches: when block i's backward starts
(the gradient of its output arrives), block i-1's storages start coming back on a side stream, overlapping block
i's backward; the top block fetches its own at its start.

On CUDA each storage is copied into pinned host memory on a D2H stream (after the compute stream's event), and the
device original is held until its copy completes: at the end of the next block's forward the compute stream waits
for the copy's event and the original is dropped (the top block drops its own at its end). A stream wait, no host
sync, and no record_stream: the caching allocator would reuse a recorded block only once it polls the side
stream's event, which makes the device peak depend on timing. Prefetched copies are allocated in the compute
stream's order and waited for there before use.

On a CPU activations already live in host memory: nothing is copied, and the saved tensors stay as they are (an
ActivationCounter counts them), unless a `target` is given: "cpu" copies into separate host buffers (the CUDA
path's timeline without streams, for tests), "plan" copies nothing and keeps only the sizes (a planner probe on fake
tensors sees the device memory freed and, at the backward, allocated again; no values survive: fake tensors only).

Saved tensors that stay on the device: parameters (also FSDP2's unsharded ones and their views), storages shared
with a block input that does not require grad (the RoPE table: every block holds it anyway), storages below
MIN_OFFLOAD_BYTES, tensors not on the block's device, DTensors (TP's activations: their storage is not their
data) and non-strided, conjugate or negative views. Hooks stack, they do not chain: inside an offloading block,
saved tensors reach this module's hooks only, not an enclosing ActivationCounter's.

Compile the block that OffloadedBlock wraps, not the wrapper: a compiled block's saved tensors reach the hooks at
run time (AOTAutograd saves them in its autograd.Function), but Dynamo cannot trace the hooks themselves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from membudget.errors import UserError
from membudget.internals import BlockWrapper, storage_key, tree_leaves, view_base
from membudget.units import fmt_bytes

log = logging.getLogger("membudget")

# Storages smaller than this stay on the device: each copy has a fixed cost (a launch, a stream wait, an event, a
# pinned block: microseconds, more than moving 64 KiB over PCIe takes) for memory negligible next to a block's
# activations (scalars, per-token norm statistics at short sequences).
MIN_OFFLOAD_BYTES = 64 * 1024


@functools.cache
def _note_cpu() -> None:
    log.info("ac offload: on CPU activations already live in host memory; offloading saves nothing")


def _new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _new_storage(nbytes: int, device: torch.device, pin: bool = False) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin).untyped_storage()


class _Stored:
    """One device storage's copy in host memory, and its way back: what the saved tensors of a block point to
    (autograd owns it through them: it dies, freeing both copies, when their graph is released)."""

    __slots__ = ("offloader", "host", "device", "nbytes", "copied", "fetched", "ready", "__weakref__")

    def __init__(self, offloader: Offloader, host: Optional[torch.UntypedStorage], device: torch.device,
                 nbytes: int):
        self.offloader, self.host, self.device, self.nbytes = offloader, host, device, nbytes
        self.copied: Optional[torch.cuda.Event] = None  # the D2H copy's end (CUDA)
        self.fetched: Optional[torch.Tensor] = None  # the device copy (bytes), once fetched
        self.ready: Optional[torch.cuda.Event] = None  # the H2D copy's end (CUDA prefetch)
        offloader._hold(self.nbytes)

    def __del__(self):
        self.offloader.held_host_bytes -= self.nbytes


class _Forward:
    """One offloading forward of one block: its copies so far, and the device originals held until copied."""

    def __init__(self, index: int, device: torch.device, fixed: set[int]):
        self.index, self.device, self.fixed = index, device, fixed
        self.stored: dict[int, _Stored] = {}  # by device storage key: valid while `originals` hold the storages
        self.originals: list[torch.UntypedStorage] = []
        self.caches: list[Any] = []
        self.copied: Optional[torch.cuda.Event] = None


class Offloader:
    """A model's activation offloading: blocks register in order (bottom first); their forwards copy saved
    storages out, their backwards fetch them back one block ahead.

    `target`: None (pinned host memory for CUDA activations; nothing on a CPU), "cpu" (host copies from any
    device, pinned from CUDA) or "plan" (sizes only, no copies: planner probes on fake tensors). `min_bytes`:
    smaller storages stay on the device.

    Statistics: `host_bytes[index]`, the bytes block `index` offloaded in its last forward; `held_host_bytes`, the
    host bytes held now; `peak_host_bytes`, their peak (assign it `held_host_bytes` to start a new interval).
    """

    def __init__(self, target: Optional[str] = None, min_bytes: int = MIN_OFFLOAD_BYTES):
        if target not in (None, "cpu", "plan"):
            raise ValueError(f"Offloader target {target!r}: one of None, 'cpu', 'plan'")
        self.target, self.min_bytes = target, min_bytes
        self.blocks: list[int] = []
        self.host_bytes: dict[int, int] = {}
        self.held_host_bytes = self.peak_host_bytes = 0
        self._current: Optional[_Forward] = None
        self._pending: list[_Forward] = []  # forwards whose device originals are still held
        self._saved: dict[int, list[weakref.ref]] = {}  # per block: its copies not yet fetched
        self._cached: dict[int, list[weakref.ref]] = {}  # per block: selective-AC cache entries offloaded
        self._ready: dict[int, tuple[torch.device, torch.cuda.Event]] = {}  # per block: its prefetch's end (CUDA)
        self._streams: Optional[tuple[torch.cuda.Stream, torch.cuda.Stream]] = None  # (D2H, H2D)

    @property
    def offloading(self) -> bool:
        """Whether an offloading forward is running (what it saves leaves the device)."""
        return self._current is not None

    def register(self, index: int) -> None:
        self.blocks = sorted({*self.blocks, index})

    def _hold(self, nbytes: int) -> None:
        self.held_host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.held_host_bytes)

    def copies(self, args: tuple) -> bool:
        """Whether a forward on `args` offloads: with grad, on CUDA or with a target (on a CPU without one it
        logs once per process that offloading saves nothing)."""
        device = next((a.device for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.is_grad_enabled():
            return False
        if self.target is None and device.type != "cuda":
            _note_cpu()
            return False
        return True

    # --- forward -----------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def block_forward(self, index: int, args: tuple) -> Iterator[None]:
        """Block `index`'s forward on `args`: what it saves goes out through the pack hook."""
        tensors = [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
        fixed = {storage_key(a.untyped_storage()) for a in tensors if not a.requires_grad}
        self._current = _Forward(index, tensors[0].device, fixed)
        self.host_bytes[index] = 0
        self._saved[index] = [r for r in self._saved.get(index, []) if r() is not None]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._end_forward()

    def _offloads(self, t: torch.Tensor) -> bool:
        if isinstance(t, DTensor):
            return False  # its storage is not its data (TP's activations stay on the device)
        if isinstance(t, nn.Parameter) or isinstance(view_base(t), nn.Parameter):
            return False  # weights (FSDP2's unsharded ones too) are not activations
        if t.layout != torch.strided or t.is_conj() or t.is_neg() or t.device != self._current.device:
            return False
        storage = t.untyped_storage()
        return storage.nbytes() >= self.min_bytes and storage_key(storage) not in self._current.fixed

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._offloads(t):
            # detached: a saved output kept as itself would reference its own grad_fn (a cycle only gc frees)
            return t.detach()
        storage = t.untyped_storage()
        key = storage_key(storage)
        stored = self._current.stored.get(key)
        if stored is None:
            stored = self._current.stored[key] = self._copy_out(storage)
        return stored, t.dtype, t.storage_offset(), t.size(), t.stride()

    def _copy_out(self, storage: torch.UntypedStorage) -> _Stored:
        cur = self._current
        if self.target == "plan":
            host = None  # nothing to copy on fake tensors; a planner's recorder sees no host allocation
        elif cur.device.type == "cuda":
            d2h, _ = self._side_streams(cur.device)
            host = _new_storage(storage.nbytes(), torch.device("cpu"), pin=True)
            d2h.wait_stream(torch.cuda.current_stream(cur.device))  # the op that wrote it comes first
            with torch.cuda.stream(d2h):
                host.copy_(storage, non_blocking=True)
        else:
            host = _new_storage(storage.nbytes(), torch.device("cpu"))
            host.copy_(storage)
        cur.originals.append(storage)
        stored = _Stored(self, host, cur.device, storage.nbytes())
        self._saved[cur.index].append(weakref.ref(stored))
        self.host_bytes[cur.index] += stored.nbytes
        return stored

    def offload_cache(self, cache: Any) -> None:
        """Also offload, at the end of the current block's forward, the op outputs that selective AC caches
        (`internals.selective_cache(forward_ctx)`, handed over as the checkpoint's context_fn makes it): they
        bypass autograd's saved tensors. A no-op outside an offloading forward and while compiling."""
        if self._current is not None and not torch.compiler.is_compiling():
            self._current.caches.append(cache)

    def _offload_caches(self) -> None:
        # A cache entry (_VersionWrapper) holds its tensor as `val` and the version it had as `version`; selective
        # AC reads `val` in the recompute, so the entry holds the packed copy until the block's backward starts.
        cached = self._cached.setdefault(self._current.index, [])
        for cache in self._current.caches:
            for entry in tree_leaves(cache, is_leaf=lambda x: hasattr(x, "val")):
                if isinstance(getattr(entry, "val", None), torch.Tensor) and self._offloads(entry.val):
                    entry.val, entry.version = self._pack(entry.val), None
                    cached.append(weakref.ref(entry))

    def _end_forward(self) -> None:
        self._offload_caches()
        cur, self._current = self._current, None
        if cur.device.type == "cuda" and self.target != "plan" and cur.originals:
            cur.copied = self._side_streams(cur.device)[0].record_event()
            for stored in cur.stored.values():
                stored.copied = cur.copied
        # earlier blocks' originals have had this block's compute to be copied; the top block's go at once
        top = cur.index == self.blocks[-1]
        self._release(self._pending + [cur] if top else self._pending)
        self._pending = [] if top else [cur]

    def _release(self, forwards: list[_Forward]) -> None:
        for f in forwards:
            if f.copied is not None:
                torch.cuda.current_stream(f.device).wait_event(f.copied)
            f.originals.clear()
            f.stored.clear()

    # --- backward ----------------------------------------------------------------------------------------

    def watch_backward(self, index: int, out: Any) -> None:
        """Start block `index`'s backward work when the gradient of its output (`out`) arrives."""
        t = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if t is not None:
            t.register_hook(lambda grad: self._backward_starts(index))

    def _backward_starts(self, index: int) -> None:
        self._release(self._pending)  # a forward that ended without its successor's
        self._pending = []
        self._fetch(index)  # the top block's own; a no-op where prefetched
        if index in self._ready:  # the compute stream, which frees the buffers, waits even for any never unpacked
            device, ready = self._ready.pop(index)
            torch.cuda.current_stream(device).wait_event(ready)
        below = [i for i in self.blocks if i < index]
        if below:
            self._fetch(below[-1])
        self._restore_caches(index)

    def _fetch(self, index: int) -> None:
        """Start bringing block `index`'s copies back (on CUDA: on the H2D stream, in parallel with compute)."""
        stored = [s for s in (r() for r in self._saved.pop(index, [])) if s is not None and s.fetched is None]
        if not stored:
            return
        device = stored[0].device
        if device.type != "cuda" or self.target == "plan":
            for s in stored:
                self._fetch_now(s)
            return
        _, h2d = self._side_streams(device)
        compute = torch.cuda.current_stream(device)
        # allocated in the compute stream's order: it alone uses and frees them, after waiting for `ready`
        buffers = [_new_buffer(s.nbytes, device) for s in stored]
        h2d.wait_stream(compute)
        with torch.cuda.stream(h2d):
            for event in {id(s.copied): s.copied for s in stored if s.copied is not None}.values():
                h2d.wait_event(event)  # a D2H copy still running (the top block's)
            for s, buffer in zip(stored, buffers):
                buffer.untyped_storage().copy_(s.host, non_blocking=True)
            ready = h2d.record_event()
        for s, buffer in zip(stored, buffers):
            s.fetched, s.ready = buffer, ready
        self._ready[index] = device, ready

    def _fetch_now(self, s: _Stored) -> None:
        """Copy `s` back on the current stream (no prefetch reached it)."""
        buffer = _new_buffer(s.nbytes, s.device)
        if self.target != "plan":
            if s.copied is not None:
                torch.cuda.current_stream(s.device).wait_event(s.copied)
            buffer.untyped_storage().copy_(s.host, non_blocking=s.device.type == "cuda")
        s.fetched = buffer

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        stored, dtype, offset, size, stride = packed
        if stored.fetched is None:
            self._fetch_now(stored)
        elif stored.ready is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.ready)
        # a view of the fetched bytes (not Tensor.set_: under a fake mode set_ keeps the storage alive, and a
        # planner would see the buffer never freed)
        return stored.fetched.view(dtype).as_strided(size, stride, offset)

    def _restore_caches(self, index: int) -> None:
        for entry in (r() for r in self._cached.pop(index, [])):
            if entry is not None and isinstance(entry.val, tuple):
                entry.val = self._unpack(entry.val)
                entry.version = entry.val._version

    def _side_streams(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if self._streams is None:
            self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams


class OffloadedBlock(BlockWrapper):
    """`block` (plain, checkpointed or compiled) with its saved activations offloaded by `offloader`, as block
    `index` of the model (the order prefetching follows)."""

    def __init__(self, block: nn.Module, offloader: Offloader, index: int):
        super().__init__(block)
        self.offloader, self.index = offloader, index
        offloader.register(index)

    def forward(self, *args, **kwargs):
        if not self.offloader.copies(args):
            return self.block(*args, **kwargs)
        with self.offloader.block_forward(self.index, args):
            out = self.block(*args, **kwargs)
        self.offloader.watch_backward(self.index, out)
        return out


def find_offloader(model: nn.Module) -> Optional[Offloader]:
    """The model's offloader (its statistics; set its `target` before the first forward), or None."""
    return next((m.offloader for m in model.modules() if isinstance(m, OffloadedBlock)), None)


# --- host memory ---------------------------------------------------------------------------------------------

def host_bytes_needed(storage_bytes: Iterable[int], min_bytes: int = MIN_OFFLOAD_BYTES) -> int:
    """The pinned host memory that holding offloaded storages of these sizes at once takes, at least: CUDA's
    caching host allocator rounds each block up to a power of two; storages below `min_bytes` stay on the device."""
    return sum(1 << (n - 1).bit_length() for n in storage_bytes if n >= max(min_bytes, 1))


def check_pinned_memory(nbytes: int, key: str = "ac.mode", value: str = "offload") -> None:
    """Raise UserError (naming `key`=`value`) when `nbytes` of pinned host memory cannot be had; tried once, and
    released. Nothing to check without CUDA (a CPU run copies nothing)."""
    if nbytes <= 0 or not torch.cuda.is_available():
        return
    try:
        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{key}={value}: offloading activations needs {fmt_bytes(nbytes)} of pinned host memory, "
                        f"which this host cannot pin ({reason}); use ac.mode=full, offload fewer blocks "
                        "(ac.mode=per_block), use a smaller train.micro_batch_size, or free host memory") from None
    # the trial block would stay in the host allocator's cache, whole: it never splits blocks
    torch.accelerator.empty_host_cache()
