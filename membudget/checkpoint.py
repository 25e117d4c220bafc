"""Checkpoints with torch.distributed.checkpoint (DCP): sharded on disk, the same code for a plain model and
for FSDP2 / DTensor models, and written so that no fault leaves a checkpoint that resumes wrongly.

Layout under `<run dir>/checkpoints/`:

    step_0000100/           a complete checkpoint; only a finished, verified save is ever renamed to this name
        .metadata           DCP's index of every tensor chunk
        __0_0.distcp ...    DCP data, one file per rank: model and optimizer, each rank its own shards
        train_state.json    step, LR scheduler state, the trainer's `extra` and the run's resolved config
        rng_rank0.pt ...    each rank's torch RNG states (CPU, and CUDA when present)
        manifest.json       every file's size and CRC32, written last: a checkpoint without it, or whose
                            files do not match it, is damaged and skipped
    .tmp_step_0000150/      a save in progress, or one that was killed: ignored, removed by the next save

What is guaranteed: a save killed at any point, or one that fails (disk full), leaves the previous complete
checkpoints as they were; a model or optimizer state with a NaN or inf is never saved; resuming takes the
newest checkpoint that verifies and loads (a warning names each one skipped), and fails in one line when none
does; rank 0 decides which checkpoint every rank loads.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from membudget.errors import UserError
from membudget.schema import flat_keys
from membudget.metrics import local_tensor
from membudget.units import GB, MiB

log = logging.getLogger("membudget")

TRAIN_STATE = "train_state.json"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP = ".tmp_"  # prefix of everything in flight: saves being written, checkpoints being deleted
_CHUNK = 16 * MiB


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (created or renamed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@contextlib.contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process, which is what we ask for
    (no_dist=True): that warning says nothing to a user."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _cause(e: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (a BaseException holding each rank's (error, traceback))."""
    if isinstance(e, CheckpointException):
        return next((exc for exc, _ in e.failures.values()), e)
    return e


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _rng_state() -> dict[str, torch.Tensor]:
    # Only torch's generators: nothing in membudget draws from python's `random` or numpy's global RNG
    # (synthetic data seeds its own generator per step).
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def read_train_state(path: Path) -> dict[str, Any]:
    """A checkpoint's train_state.json (step, scheduler, extra, config), without loading its tensors."""
    return json.loads((Path(path) / TRAIN_STATE).read_text())


class _Unreadable(Exception):
    """A manifest that cannot be read or is not the shape save() writes (a flipped bit can leave valid JSON)."""


def _manifest(path: Path) -> dict[str, tuple[int, int]]:
    """{file name: (bytes, crc32)} from the checkpoint's manifest; FileNotFoundError when there is none,
    _Unreadable when it is damaged."""
    try:
        files = json.loads((Path(path) / MANIFEST).read_text())["files"]
        entries = {name: (entry["bytes"], entry["crc32"]) for name, entry in files.items()}
    except FileNotFoundError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise _Unreadable(type(e).__name__) from e
    if not all(type(n) is int and type(crc) is int for n, crc in entries.values()):  # JSON's keys are strings
        raise _Unreadable("an entry is not (bytes, crc32)")
    return entries


def verify(path: Path, files: Optional[list[str]] = None) -> Optional[str]:
    """None when the checkpoint's files (all, or those named) match its manifest, else what is wrong."""
    path = Path(path)
    if not path.is_dir():
        return "no such directory"
    try:
        manifest = _manifest(path)
    except FileNotFoundError:
        return "no manifest.json (not a complete save)"
    except _Unreadable as e:
        return f"unreadable manifest.json ({e})"
    for name in files if files is not None else manifest:
        expected = manifest.get(name)
        file = path / name
        if expected is None:
            return f"{name} is not in the manifest"
        if not file.is_file():
            return f"{name} is missing"
        nbytes, crc = expected
        if file.stat().st_size != nbytes:
            return f"{name} has {file.stat().st_size} bytes, {nbytes} were written"
        if _crc32(file) != crc:
            return f"{name} does not match its checksum"
    return None


def save_seconds(state_bytes: int, write_gbps: float) -> float:
    """How long one rank's save of `state_bytes` may take at `write_gbps`, with room for a slow rank: twice the
    write time plus two minutes, at least ten minutes (a barrier that waits shorter fails a healthy save)."""
    return max(600.0, 2 * state_bytes / (write_gbps * GB) + 120)


def all_finite(tensors) -> bool:
    """Whether every tensor is finite (this rank's shards), in one reduction."""
    locals_ = [local_tensor(t) for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not locals_:
        return True
    return bool(torch.stack([torch.isfinite(t).all() for t in locals_]).all())


def _checkpoints(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def saved_checkpoints(run_dir: Path) -> list[Path]:
    """A run dir's checkpoint dirs (renamed into place, so not in flight), oldest first; not yet verified."""
    where = _checkpoints(run_dir)
    if not where.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in where.iterdir() if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


class Checkpointer:
    """Saves and restores model, optimizer, LR scheduler, RNG states and the trainer's `extra` dict.

    `save` and `restore` are collective: every rank calls them; rank 0 decides, renames and deletes. Their
    barriers run on a process group of their own whose timeout is `timeout_s` (a large save to slow storage
    must not trip the training collectives' timeout).
    """

    def __init__(self, run_dir: Path, cfg, timeout_s: Optional[float] = None):
        self.dir = _checkpoints(run_dir)
        self.cfg = cfg
        self.timeout_s = timeout_s or 1800  # the save's collectives (a stalled peer is named after it)
        self._group = None
        if dist.is_initialized() and _world() > 1:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)

    def _any(self, flag: bool) -> bool:
        """Whether any rank's flag is set (one small collective on the checkpoint group)."""
        if self._group is None:
            return flag
        t = torch.tensor([float(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def _from_rank0(self, obj):
        if self._group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def check_writable(self) -> None:
        """Fail before training, not at the first save, when checkpoints cannot be written."""
        if not self.cfg.enabled:
            return
        # probe the run dir until the first save has made checkpoints/: a run that fails on later input
        # leaves no empty checkpoints/ behind, and ranks probing at once do not race on creating it
        probe = self.dir if self.dir.is_dir() else self.dir.parent
        try:
            probe.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=probe):
                pass
        except OSError as e:
            raise UserError(f"checkpoint dir {str(self.dir)!r} is not writable ({e.strerror or e}): "
                            "choose a writable hydra.run.dir, or set checkpoint.enabled=false") from None

    def saved(self) -> list[Path]:
        return saved_checkpoints(self.dir.parent)

    def latest(self) -> Optional[Path]:
        """The newest checkpoint whose files match their manifest (read whole: for tests and tools)."""
        return next((p for p in reversed(self.saved()) if verify(p) is None), None)

    def _verify_together(self, path: Path) -> Optional[str]:
        """`verify` with the files split over the ranks (each checksums its share); rank 0 decides."""
        try:
            names = sorted(_manifest(path))
        except (FileNotFoundError, _Unreadable):
            names = None  # verify() names the problem
        mine = verify(path, None if names is None else names[_rank()::_world()])
        if self._group is not None:
            found = [None] * _world()
            dist.all_gather_object(found, mine, group=self._group)
            mine = next((p for p in found if p is not None), None)
        return self._from_rank0(mine)

    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every_steps == 0 or step == last_step)

    # --- save ---------------------------------------------------------------------------------------------

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             extra: dict[str, Any], config: Optional[dict] = None) -> Path:
        """Write checkpoint `step`; `extra` must be JSON-able and the same on every rank (rank 0's is kept).
        UserError (nothing written) when the state is not finite; UserError naming the path when the disk
        is full or unwritable (the previous checkpoints stay)."""
        model_state, optim_state = get_state_dict(model, optimizer)
        if self._any(not all_finite(list(model_state.values()) + _leaves(optim_state))):
            raise UserError(f"checkpoint step {step}: the model or optimizer state holds NaN or inf, so it is not "
                            "saved; the run diverged: lower optimizer.lr or train.max_grad_norm")
        final = self.dir / f"step_{step:07d}"
        tmp = self.dir / f"{_TMP}{final.name}"
        rank = _rank()
        failure = None
        try:
            if rank == 0:
                self._remove_stale()
                tmp.mkdir(parents=True)
            self._barrier()  # the temporary dir is fresh before anyone writes into it
            with _dcp_quiet():
                dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp,
                         process_group=self._group, no_dist=self._group is None)
            _write_durably(tmp / f"rng_rank{rank}.pt", _to_bytes(_rng_state()))
            if rank == 0:
                state = {"step": step, "scheduler": scheduler.state_dict(), "extra": extra, "config": config}
                _write_durably(tmp / TRAIN_STATE, json.dumps(state, indent=1).encode())
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a failed write: abandon the save
            failure = _cause(e)
        if self._any(failure is not None):
            self._abandon(tmp, step, failure)
        # each rank checksums the files it wrote (its .distcp and RNG state; rank 0 also the shared ones)
        mine = {p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)} for p in sorted(tmp.iterdir())
                if _written_by(p.name, rank)}
        files = mine
        if self._group is not None:
            gathered = [None] * _world()
            dist.all_gather_object(gathered, mine, group=self._group)
            files = {name: meta for part in gathered for name, meta in part.items()}
        try:
            if rank == 0:  # nothing verify() does not check: a flipped bit in an unread field would pass
                _write_durably(tmp / MANIFEST, json.dumps({"files": files}, indent=1).encode())
                _fsync_dir(tmp)
                if final.exists():  # the same step saved again, after resuming from an older checkpoint
                    self._discard(final)
                tmp.rename(final)  # the commit point: atomic on POSIX file systems
                _fsync_dir(self.dir)
                for old in self.saved()[:-self.cfg.keep]:
                    self._discard(old)
                log.info("saved checkpoint %s", final)
        except OSError as e:
            failure = e
        if self._any(failure is not None):
            self._abandon(tmp, step, failure)
        self._barrier()  # no rank goes on before the checkpoint is in place
        return final

    def _abandon(self, tmp: Path, step: int, error: Optional[BaseException]) -> None:
        """A save that failed on some rank: its partial files go, the earlier checkpoints stay, one line. A full
        disk often shows only as torch.save's "unexpected pos": the free space says what happened."""
        free = shutil.disk_usage(self.dir).free if self.dir.is_dir() else None
        self._barrier()
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        latest = next((p for p in reversed(self.saved()) if (p / MANIFEST).is_file()), None)
        if isinstance(error, OSError) and error.strerror:
            why = error.strerror
        elif free is not None and free < 64 * MiB:
            why = f"No space left on device: {free / MiB:.1f} MiB free"
        elif error is not None:
            text = str(error).strip().splitlines()
            why = f"{type(error).__name__}: {text[0] if text else ''}"
        else:
            why = "it failed on another rank"
        where = getattr(error, "filename", None) or tmp
        disk = isinstance(error, OSError) or (free is not None and free < 64 * MiB)
        fix = ("free space, then rerun the same command to resume" if disk or error is None else
               "rerun the same command to resume; not a disk error: report it with this run's train.log")
        raise UserError(f"checkpoint step {step}: could not write {where} ({why}); the earlier checkpoints are "
                        f"intact{f' (latest {latest})' if latest else ''}: {fix}") from None

    # --- resume ---------------------------------------------------------------------------------------------

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                path: Optional[Path] = None, accept: Optional[Callable[[dict], None]] = None,
                ) -> Optional[tuple[Path, dict[str, Any]]]:
        """Load the newest intact checkpoint (or `path`) into model, optimizer, scheduler and RNG; returns
        (its path, its train state), or None when there is none to resume. Each damaged one is skipped with a
        warning; UserError when checkpoints exist but none verifies and loads. `accept` sees a verified
        checkpoint's train state before it loads, and raises UserError to refuse it (another model, say)."""
        candidates = [Path(path)] if path is not None else list(reversed(self.saved()))
        skipped: list[str] = []
        for candidate in candidates:
            # rank 0 decides: every rank then loads the same checkpoint (NFS caches can make them disagree)
            problem = self._verify_together(candidate)
            if problem is None and accept is not None:
                accept(read_train_state(candidate))
            if problem is None:
                try:
                    state = self._load(candidate, model, optimizer, scheduler)
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - any failure: try the older one
                    cause = _cause(e)
                    text = str(cause).strip().splitlines()
                    problem = f"{type(cause).__name__}: {text[0] if text else ''}"
                if self._any(problem is not None):
                    problem = problem or "failed to load on another rank"
            if problem is None:
                if skipped:
                    log.warning("resuming from %s; skipped: %s", candidate, "; ".join(skipped))
                log.info("resumed from %s at step %d", candidate, state["step"])
                return candidate, state
            if path is None:  # a named checkpoint has nothing to skip to: its error below says it once
                log.warning("checkpoint %s is damaged (%s): skipping it", candidate, problem)
            skipped.append(f"{candidate.name} ({problem})")
        if path is not None:
            raise UserError(f"checkpoint.resume={str(path)!r}: cannot resume from it ({problem}); point it at an "
                            "intact step_NNNNNNN dir, or use checkpoint.resume=auto")
        if skipped:
            raise UserError(f"checkpoint.resume='auto': no intact checkpoint in {self.dir} ({'; '.join(skipped)}); "
                            "start fresh with checkpoint.resume=never checkpoint.archive_old_run=true")
        return None

    def _load(self, path: Path, model, optimizer, scheduler) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        with _dcp_quiet():
            dcp.load(state, checkpoint_id=path, process_group=self._group, no_dist=self._group is None)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        train_state = read_train_state(path)
        scheduler.load_state_dict(train_state["scheduler"])
        rng_file = path / f"rng_rank{_rank()}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            log.warning("%s has no RNG state for rank %d (saved by fewer ranks): this rank keeps its seeded RNG",
                        path, _rank())
        return train_state

    def _remove_stale(self) -> None:
        for stale in self.dir.glob(f"{_TMP}*"):
            log.info("removing %s, left by an interrupted save", stale)
            shutil.rmtree(stale, ignore_errors=True)

    def _discard(self, path: Path) -> None:
        # Renamed first so that a deletion cut short leaves a stale temporary dir, never a half checkpoint.
        trash = path.with_name(f"{_TMP}deleted_{path.name}")
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)


def _written_by(name: str, rank: int) -> bool:
    """Which rank checksums a file of the checkpoint: its writer (DCP's __<rank>_<n>.distcp, rng_rank<r>.pt),
    rank 0 for the shared ones (.metadata, train_state.json)."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp|rng_rank(\d+)\.pt", name)
    owner = int(next(g for g in match.groups() if g is not None)) if match else 0
    return owner == rank


def _leaves(state: Any) -> list:
    from membudget.internals import tree_leaves

    return tree_leaves(state)


# --- what a resume may change ------------------------------------------------------------------------------

# Settings that change the model or the data stream: a resumed run with other values would be another run.
_FIXED = ("model.", "data.name", "data.path", "data.text_field", "data.hf_", "data.split", "tokenizer.",
          "train.seq_len", "train.global_batch_size", "train.seed", "train.dtype")
# Settings a resume applies (logged): the optimizer, the schedule and how long to train.
_APPLIED = ("optimizer.", "lr_schedule.", "train.steps", "train.max_grad_norm", "train.on_nonfinite",
            "train.max_skipped_steps")


def config_changes(saved: Optional[dict], now: dict, same_stream: bool = False
                   ) -> tuple[list[str], list[str], list[str]]:
    """What differs between the checkpoint's config and this run's, as (refused, applied, allowed) lists of
    `key: old -> new`. Refused: the model and the data stream; applied: optimizer, schedule, steps; allowed:
    how the math is run (AC, compile, parallelism layout), logging, checkpointing, planning.
    `same_stream`: this run reads a token file of what the checkpoint read (data.switch_to_token_file), so the
    data settings change but not the stream: allowed."""
    if saved is None:
        return [], [], []
    old, new = flat_keys(saved), flat_keys(now)
    refused, applied, allowed = [], [], []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key):
            continue
        change = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        if key.startswith(_FIXED) and not (same_stream and key.startswith("data.")):
            refused.append(change)
        elif key.startswith(_APPLIED):
            applied.append(change)
        else:
            allowed.append(change)
    return refused, applied, allowed
