"""Checkpoints with torch.distributed.checkpoint (DCP): sharded on disk, the same code for a plain model and
for FSDP2 / DTensor models, written so that a save killed half-way never costs the last good checkpoint.

Layout under `<run dir>/checkpoints/`:

    step_0000100/           a complete checkpoint; only a finished save is ever renamed to this name
        .metadata           DCP's index of every tensor chunk (written last by DCP's coordinator)
        __0_0.distcp ...    DCP data, one file per rank: model and optimizer, each rank its own shards
        train_state.json    step, LR scheduler state and the trainer's `extra` (rank 0's)
        rng_rank0.pt ...    each rank's torch RNG states (CPU, and CUDA when present)
    .tmp_step_0000150/      a save in progress, or one that was killed: ignored, removed by the next save
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from membudget.config import CheckpointConfig, UserError

log = logging.getLogger("membudget")

TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"step_(\d+)")
_TMP = ".tmp_"  # prefix of everything in flight: saves being written, checkpoints being deleted


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


def _is_complete(path: Path) -> bool:
    """Whether `path` holds a finished checkpoint: DCP's index and the train state are both there."""
    return (path / ".metadata").is_file() and (path / TRAIN_STATE).is_file()


def read_train_state(path: Path) -> tuple[int, dict[str, Any]]:
    """(step, extra) of a checkpoint, without loading its tensors: e.g. the W&B run id, before W&B starts."""
    state = json.loads((Path(path) / TRAIN_STATE).read_text())
    return state["step"], state["extra"]


class Checkpointer:
    """Saves and restores model, optimizer, LR scheduler, RNG states and the trainer's `extra` dict.

    `save` and `load` are collective: every rank calls them. Only rank 0 renames and deletes.
    """

    def __init__(self, run_dir: Path, cfg: CheckpointConfig):
        self.dir = Path(run_dir) / "checkpoints"
        self.cfg = cfg
        if cfg.enabled:
            for key in ("every_steps", "keep"):
                if getattr(cfg, key) < 1:
                    raise UserError(f"checkpoint.{key}={getattr(cfg, key)!r}: must be at least 1; "
                                    "use checkpoint.enabled=false to save no checkpoints")

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

    def complete(self) -> list[Path]:
        """The complete checkpoints, oldest first."""
        if not self.dir.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.dir.iterdir()
                 if (m := _STEP_DIR.fullmatch(p.name)) and _is_complete(p)]
        return [p for _, p in sorted(found)]

    def latest(self) -> Optional[Path]:
        complete = self.complete()
        return complete[-1] if complete else None

    def resume_path(self) -> Optional[Path]:
        """The checkpoint to resume from per `checkpoint.resume`: auto (latest here, if any), never, or a path."""
        if self.cfg.resume == "never":
            return None
        if self.cfg.resume == "auto":
            return self.latest()
        path = Path(self.cfg.resume)
        if not _is_complete(path):
            raise UserError(f"checkpoint.resume={self.cfg.resume!r}: not a complete checkpoint (a step_NNNNNNN dir "
                            f"with .metadata and {TRAIN_STATE}); point it at one, or use auto or never")
        return path

    def due(self, step: int, last_step: int) -> bool:
        return self.cfg.enabled and (step % self.cfg.every_steps == 0 or step == last_step)

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
             extra: dict[str, Any]) -> Path:
        """Write checkpoint `step`; `extra` must be JSON-able and the same on every rank (rank 0's is kept)."""
        final = self.dir / f"step_{step:07d}"
        tmp = self.dir / f"{_TMP}{final.name}"
        rank = _rank()
        if rank == 0:
            self._remove_stale()
            tmp.mkdir(parents=True)
        _barrier()  # the temporary dir is fresh before anyone writes into it

        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=tmp)
        _write_durably(tmp / f"rng_rank{rank}.pt", _to_bytes(_rng_state()))
        if rank == 0:
            train_state = {"step": step, "scheduler": scheduler.state_dict(), "extra": extra}
            _write_durably(tmp / TRAIN_STATE, json.dumps(train_state, indent=1).encode())
        _barrier()  # every rank's files are on disk before the rename publishes them

        if rank == 0:
            _fsync_dir(tmp)
            if final.exists():  # the same step saved again, after resuming from an older checkpoint
                self._discard(final)
            tmp.rename(final)  # the commit point: atomic on POSIX file systems
            _fsync_dir(self.dir)
            for old in self.complete()[:-self.cfg.keep]:
                self._discard(old)
            log.info("saved checkpoint %s", final)
        _barrier()  # no rank goes on (or reads `latest()`) before the checkpoint is in place
        return final

    def load(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: Any) -> tuple[int, dict[str, Any]]:
        """Restore everything `save` wrote (DCP reshards to this run's layout); returns (step, extra)."""
        path = Path(path)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(json.loads((path / TRAIN_STATE).read_text())["scheduler"])
        rng_file = path / f"rng_rank{_rank()}.pt"
        if rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=True))
        else:
            log.warning("%s has no RNG state for rank %d (saved by fewer ranks): this rank keeps its seeded RNG",
                        path, _rank())
        step, extra = read_train_state(path)
        log.info("resumed from %s at step %d", path, step)
        return step, extra

    def _remove_stale(self) -> None:
        for stale in self.dir.glob(f"{_TMP}*"):
            log.info("removing %s, left by an interrupted save", stale)
            shutil.rmtree(stale)

    def _discard(self, path: Path) -> None:
        # Renamed first so that a deletion cut short leaves a stale temporary dir, never a half checkpoint.
        trash = path.with_name(f"{_TMP}deleted_{path.name}")
        path.rename(trash)
        shutil.rmtree(trash)
