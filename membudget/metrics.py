"""What a run measures (activation bytes, peak memory, throughput, MFU) and where it goes (metrics.jsonl,
W&B, the console's progress bar or log lines).

`activation_bytes` is the one definition the trainer, the planner and the report share: the bytes of the
tensors kept for backward during one micro-batch's forward, deduplicated by storage, without the storages of
parameters and buffers (a saved reference to a weight costs no memory of its own). Three places keep them:
- autograd's saved tensors, eager and compiled alike: seen by `saved_tensors_hooks`;
- the inputs of a checkpointed block, which non-reentrant checkpoint holds for its recompute;
- the op outputs that selective AC caches (MUST_SAVE), which a selective wrapper hands to its sink.
Each storage is attributed to the block whose forward first kept it (`per_block`; the rest: embedding,
final norm, output and loss).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from membudget.devices import GPUS, by_cuda_name
from membudget.internals import CheckpointWrapper, storage_key, tqdm_logging_handlers, tree_leaves, view_base
from membudget.offload import find_offloader
from membudget.units import GiB, MiB

log = logging.getLogger("membudget")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor: a DTensor's own storage has the global size."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class ActivationCounter:
    """Counts activation bytes of the forward passes run inside `count()`, in total and per block.

    Checkpoint wrappers report their inputs through a forward pre-hook, selective AC its cache through the
    wrapper's `selective_cache_sink`, so every mode is measured the same way.
    """

    def __init__(self, model: nn.Module):
        self._excluded = {storage_key(local_tensor(t).untyped_storage())
                          for t in list(model.parameters()) + list(model.buffers())}
        self._storages: dict[int, tuple[torch.UntypedStorage, Optional[int]]] = {}
        self._caches: list[tuple[Any, Optional[int]]] = []
        self._counting = False
        self._block: Optional[int] = None
        self.last_per_block: dict[Optional[int], int] = {}
        self._sinks = []
        self._offloader = find_offloader(model)  # an offloading block's checkpointed inputs leave the device
        layers = getattr(model, "layers", {})
        for index, block in enumerate(layers.values() if hasattr(layers, "values") else ()):
            block.register_forward_pre_hook(lambda m, a, i=index: self._enter(i))
            block.register_forward_hook(lambda m, a, o: self._enter(None))
        for module in model.modules():
            if isinstance(module, CheckpointWrapper):
                module.register_forward_pre_hook(self._on_checkpoint_input)
            sink = getattr(module, "selective_cache_sink", None)
            if sink is not None:
                self._sinks.append(sink)

    def _enter(self, block: Optional[int]) -> None:
        if not torch.compiler.is_compiling():
            self._block = block

    def _add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storage = local_tensor(t).untyped_storage()
            key = storage_key(storage)
            if key not in self._excluded and key not in self._storages:
                self._storages[key] = (storage, self._block)

    def _on_checkpoint_input(self, module, args) -> None:
        # A compiled checkpointed block saves its input through autograd (seen by the pack hook), and
        # Dynamo must not trace this hook: is_compiling() folds it away there.
        if torch.compiler.is_compiling():
            return
        if self._counting and torch.is_grad_enabled() and not (self._offloader and self._offloader.offloading):
            for a in tree_leaves(args):
                self._add(a)

    def _collect(self, cache: Any) -> None:
        self._caches.append((cache, self._block))

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # FSDP's unsharded parameters exist only during forward/backward: seen as a Parameter or a view of one
        if not isinstance(t, nn.Parameter) and not isinstance(view_base(t), nn.Parameter):
            self._add(t)
        # detached: keeping a saved output itself would tie it to its own grad_fn in a reference cycle,
        # freed only by the garbage collector
        return t.detach()

    @contextlib.contextmanager
    def count(self) -> Iterator[None]:
        """Count one forward pass; read the total from `nbytes` (and `per_block`) afterwards."""
        self._storages.clear()
        self._caches.clear()
        self._counting, self._block = True, None
        for sink in self._sinks:
            sink.target = self._collect
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._counting, self._block = False, None
            for sink in self._sinks:
                sink.target = None
        for cache, block in self._caches:
            self._block = block
            for leaf in tree_leaves(cache, is_leaf=lambda x: hasattr(x, "val")):
                self._add(getattr(leaf, "val", leaf))
        self._block = None
        self._caches.clear()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s, _ in self._storages.values())

    @property
    def per_block(self) -> dict[Optional[int], int]:
        """Bytes by block index (None: outside the blocks)."""
        out: dict[Optional[int], int] = {}
        for storage, block in self._storages.values():
            out[block] = out.get(block, 0) + storage.nbytes()
        return out

    def release(self) -> None:
        """Drop the references kept for deduplication so the step's memory can be freed (the per-block
        breakdown of the forward just counted stays readable as `last_per_block`)."""
        self.last_per_block = self.per_block
        self._storages.clear()


# --- memory ------------------------------------------------------------------------------------------------

def reset_peak_memory(device: torch.device) -> None:
    """Start a new interval for `peak_memory`: CUDA's peak counters, or the process's RSS high-water mark
    (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory since the last `reset_peak_memory`: CUDA max allocated/reserved on GPU, the process's peak
    RSS on CPU."""
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        return {
            "peak_memory_bytes": allocated,
            "cuda_max_allocated_bytes": allocated,
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return {"peak_memory_bytes": int(line.split()[1]) * 1024}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_memory_bytes": rss if sys.platform == "darwin" else rss * 1024}


# --- throughput ---------------------------------------------------------------------------------------------

def device_peak_flops(device: torch.device, bf16: bool, configured: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s of this device in the run's dtype, for MFU: train.peak_flops, else the data sheet's
    (membudget/devices.py) by exact device name; None when unknown (MFU is then not reported rather than guessed)."""
    if configured:
        return configured
    if device.type != "cuda":
        return None
    key = by_cuda_name(torch.cuda.get_device_name(device))
    if key is None:
        log.warning("no peak FLOP/s known for %r: MFU is not reported; set train.peak_flops",
                    torch.cuda.get_device_name(device))
        return None
    return GPUS[key].peak_flops if bf16 else GPUS[key].peak_flops_fp32


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward, without recompute (torchtitan's convention): 6 per
    parameter that a matmul uses (the embedding is a lookup: excluded, unless tied to the output projection),
    plus the attention scores, 12 * layers * heads * head_dim * seq_len."""
    args = model.args
    params = {id(p): p.numel() for p in model.parameters()}
    lookup = 0 if args.tie_embeddings else args.vocab_size * args.dim
    matmul_params = sum(params.values()) - lookup
    return 6 * matmul_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


# --- where rows go ------------------------------------------------------------------------------------------

def finite_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row that JSON can hold: non-finite floats become null and are named under `nonfinite`."""
    bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return row
    return {**{k: (None if k in bad else v) for k, v in row.items()}, "nonfinite": bad}


def write_json(path: Path, data: Any) -> None:
    """Write a JSON file atomically (write_text)."""
    write_text(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write a text file atomically (write_bytes), UTF-8."""
    write_bytes(path, text.encode())


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file atomically (a temporary file renamed over it): a crash or a full disk leaves the old file or
    the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def append_line(path: Path, line: str) -> None:
    """Append one line whole or not at all: an append that fails (a full disk) truncates the file back to its
    size before it, so it never ends in half a line."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def wandb_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row as W&B charts it: a list (bytes per block) as one series per entry, `key/0`, `key/1`, ...
    (block 0 at the bottom); nothing for a value the run does not have."""
    out = {}
    for key, value in row.items():
        if key == "step" or value is None:
            continue
        if isinstance(value, list):
            out.update({f"{key}/{i}": v for i, v in enumerate(value)})
        else:
            out[key] = value
    return out


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and forwards it to W&B."""

    def __init__(self, run_dir: Path, wandb_run=None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = wandb_run

    def write(self, row: dict[str, Any]) -> None:
        row = finite_row(row)
        append_line(self.path, json.dumps(row, allow_nan=False))
        if self.wandb_run is not None:
            self.wandb_run.log(wandb_row(row), step=row["step"])


def init_wandb(cfg, run_dir: Path, group: Optional[str], resume_id: Optional[str] = None):
    """An offline W&B run unless the user configured online; None with logger=none."""
    if cfg.logger.name != "wandb":
        return None
    import wandb

    from membudget.errors import UserError
    from membudget.schema import ac_label, budget_of, resolved

    ac = cfg.ac
    tags = list(cfg.logger.tags) + [f"ac:{ac.mode}"]
    if budget_of(ac) is not None:
        tags.append(f"budget:{budget_of(ac)}")
    mode = str(cfg.logger.mode or os.environ.get("WANDB_MODE", "offline"))
    try:
        return wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            group=cfg.logger.group or group,
            job_type=f"ac-{ac.mode}",
            tags=tags,
            name=cfg.logger.run_name or f"{cfg.model.name}-{ac_label(ac).replace(' ', '-')}",
            config=resolved(cfg),
            dir=str(run_dir),
            mode=mode,
            id=resume_id,
            resume="allow" if resume_id else None,
        )
    except (wandb.errors.UsageError, wandb.errors.CommError, wandb.errors.AuthenticationError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"logger.mode={mode!r}: W&B could not start ({first}); log in with `wandb login` or set "
                        "WANDB_API_KEY, or use logger.mode=offline (and `wandb sync` later) or logger=none") from None


# --- the console ----------------------------------------------------------------------------------------------

class _HideStepLines(logging.Filter):
    """On the console while the bar is drawn, the bar shows the step: its log line goes to the file only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "step_line", False)


def _console_handlers() -> list[logging.Handler]:
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) in (sys.stdout, sys.stderr)]


def quiet_console(is_main: bool) -> None:
    """Rank 0 alone speaks on the console; the other ranks keep everything in their own log file."""
    if not is_main:
        for handler in _console_handlers():
            handler.setLevel(logging.ERROR)


class Progress:
    """A tqdm bar on a terminal (other log lines print above it), plain log lines otherwise (SLURM logs,
    pipes). Every logged step also goes to the log file as a line, bar or not."""

    def __init__(self, mode: str, total: int, done: int, label: str):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self.bar = None
        self._stack = contextlib.ExitStack()
        self._filter = _HideStepLines()
        self._handlers: list[logging.Handler] = []
        if mode == "bar":
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._stack.enter_context(logging_redirect_tqdm())
            self.bar = tqdm(total=total, initial=done, desc=label, unit="step", dynamic_ncols=True)
        if mode in ("bar", "off"):
            self._handlers = _console_handlers() + tqdm_logging_handlers(logging.getLogger())
            for handler in self._handlers:
                handler.addFilter(self._filter)

    def update(self, row: dict[str, Any]) -> None:
        mem = (row["peak_memory_bytes"] or 0) / GiB
        log.info("step %d | loss %s | lr %.2e | %.0f tok/s | %.3f s/step | peak mem %.2f GiB | act %.1f MiB%s",
                 row["step"], _num(row["loss"], ".4f"), row["lr"], row["tokens_per_s"], row["step_time_s"], mem,
                 row["activation_bytes"] / MiB, " | SKIPPED (non-finite)" if row.get("skipped") else "",
                 extra={"step_line": True})
        if self.bar is not None:
            self.bar.set_postfix(loss=_num(row["loss"], ".4f"), tok_s=f"{row['tokens_per_s']:.0f}",
                                 mem=f"{mem:.2f}GiB", refresh=False)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        for handler in self._handlers:
            handler.removeFilter(self._filter)
        self._stack.close()


def _num(value: Optional[float], spec: str) -> str:
    return "nan" if value is None else format(value, spec)
