"""What the debug presets record around the training loop, into the run dir:

    python train.py debug=memory_snapshot ...   the CUDA caching allocator's history of the first steps:
                                                memory_snapshot.pickle, for https://pytorch.org/memory_viz
    python train.py debug=profile ...           a torch.profiler trace of a few steps after warm-up: profile/
                                                (tensorboard --logdir <run dir>/profile, or ui.perfetto.dev)

A snapshot needs a GPU: on a CPU, debug=memory_snapshot says so in one line and records a profiler trace with
memory of the first steps instead (profile/: each allocation and free, and the total allocated; TensorBoard's
memory view). A run that fails (an OOM) still writes what was recorded: that is when it is wanted most. Rank
N > 0 writes its snapshot as memory_snapshot_rankN.pickle and its traces as rankN.*.pt.trace.json.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Optional

import torch

from membudget.internals import cuda_memory_history, dump_cuda_memory_snapshot

log = logging.getLogger("membudget")
HISTORY_ENTRIES = 100_000  # allocator events kept (the oldest are dropped): enough for a few steps of a big model


class Diagnostics:
    """Started before the first step; `on_step_end` after each step, `close` once the loop ended, however."""

    def __init__(self, cfg, run_dir: Path, device: torch.device, rank: int = 0, steps: Optional[int] = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.suffix = f"_rank{rank}" if rank else ""
        self.worker = f"rank{rank}"
        self.steps_done = 0
        self.snapshot: Optional[Path] = None
        self.profiler: Optional[torch.profiler.profile] = None
        self.traced = False
        memory_instead = cfg.memory_snapshot and device.type != "cuda"
        if cfg.memory_snapshot and device.type == "cuda":
            self.snapshot = self.run_dir / f"memory_snapshot{self.suffix}.pickle"
            cuda_memory_history(True, HISTORY_ENTRIES)
            log.info("debug=memory_snapshot: recording the CUDA allocator's history for %d steps, then %s",
                     cfg.snapshot_steps, self.snapshot)
        if memory_instead:
            log.warning("debug=memory_snapshot: a CUDA memory snapshot needs a GPU (this run is on %s); recording a "
                        "torch.profiler trace with memory of the first %d steps into %s instead", device.type,
                        cfg.snapshot_steps, self.run_dir / "profile")
        if not (cfg.profile or memory_instead):
            return
        # a requested profile keeps its window (after compilation); the CPU stand-in for a snapshot, the first steps
        wait, warmup, active = ((cfg.profile_wait, cfg.profile_warmup, cfg.profile_active) if cfg.profile
                                else (0, 0, cfg.snapshot_steps))
        self.window = (wait + warmup + 1, wait + warmup + active)
        if steps is not None and steps < self.window[0]:
            log.warning("diagnostics: the trace starts at step %d of this run, which has %d steps to go: no trace; "
                        "raise train.steps or lower diagnostics.profile_wait/profile_warmup", self.window[0], steps)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # tracing from the first step, with no warm-up, is the point there
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                on_trace_ready=self._write_trace,
                record_shapes=True,
                profile_memory=True,
            )
        self.profiler.start()

    def _write_trace(self, prof: torch.profiler.profile) -> None:
        out = self.run_dir / "profile"
        torch.profiler.tensorboard_trace_handler(str(out), worker_name=self.worker)(prof)
        self.traced = True
        log.info("diagnostics: profiler trace of steps %d-%d in %s", *self.window, out)

    def on_step_end(self, step: int) -> None:
        self.steps_done += 1
        if self.profiler is not None:
            self.profiler.step()
        if self.snapshot is not None and self.steps_done >= self.cfg.snapshot_steps:
            self._dump_snapshot()

    def _dump_snapshot(self) -> None:
        dump_cuda_memory_snapshot(self.snapshot)
        cuda_memory_history(False)
        log.info("debug=memory_snapshot: %d steps of allocator history in %s (drag it onto "
                 "https://pytorch.org/memory_viz)", self.steps_done, self.snapshot)
        self.snapshot = None

    def close(self) -> None:
        if self.snapshot is not None:  # the run ended (or failed) within the first snapshot_steps
            self._dump_snapshot()
        if self.profiler is not None:
            self.profiler.stop()  # writes the trace of a window the run ended inside
            self.profiler = None
            if not self.traced:
                log.warning("diagnostics: the run ended after %d steps, before the traced steps %d-%d: no trace",
                            self.steps_done, *self.window)
