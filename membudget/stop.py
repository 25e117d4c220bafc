"""Stop signals (SIGTERM, Ctrl-C, SLURM's SIGUSR2): noted at once, acted on where every rank agrees to stop (the
trainer's step boundary), or at once while this rank plans auto's AC setting; and the Stopped a run ends with."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Optional

import torch.distributed as dist

from membudget.errors import Stopped
from membudget.launch import launcher_gone

log = logging.getLogger("membudget")


class StopPlanning(BaseException):
    """Raised by StopSignals while auto plans (StopSignals.at_once): a BaseException, so that it passes through
    the compiler's own error handling (which wraps an Exception raised inside a compile)."""


class StopSignals:
    """Signals noted at once and acted on at the next step boundary, where all ranks agree to stop:
    - SIGUSR2, SLURM's warning before the time limit (the launcher presets ask for it; submitit also uses it
      for preemption): checkpoint, then submitit's own handler requeues the job (status "preempted");
    - SIGTERM and SIGINT (Ctrl-C): checkpoint and end with status "interrupted"; a second Ctrl-C stops at once.
    One received during set-up ends the run before its first step, with nothing to save (stop_before_training);
    one received while this rank plans auto's setting ends the planning at once (`at_once`).
    """

    SIGNALS = {signal.SIGUSR2: "preempted", signal.SIGTERM: "interrupted", signal.SIGINT: "interrupted"}

    def __init__(self):
        self.received: Optional[int] = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._note)

    def _note(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received is not None:
            raise KeyboardInterrupt  # the second Ctrl-C
        gone = launcher_gone() if signum == signal.SIGTERM else None
        # several ranks: said at the step boundary, once every rank agreed to stop (torchrun's SIGTERM after
        # another rank failed is followed by no agreement and no checkpoint, only the line naming that rank)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            log.warning("received %s: %s", signal.Signals(signum).name,
                        "stopping the planning" if self.planning else "stopping at the next step boundary")
        self.received = signum
        self.why = gone
        if self.planning:
            raise StopPlanning

    planning = False  # this rank is planning auto's setting: a signal ends it at once (nothing else to lose)

    @contextlib.contextmanager
    def at_once(self):
        """While this rank plans: the first signal stops the planning where it is (the plan is all it would
        finish, minutes for a large grid, past SLURM's 30 s between SIGTERM and SIGKILL)."""
        self.planning = True
        try:
            yield
        finally:
            self.planning = False

    received_by: Optional[int] = None  # the lowest rank that received a signal, agreed at the step's sync
    reached: Optional[str] = None  # "rank 1", "ranks 0, 2", "every rank"
    agreed: Optional[int] = None  # that rank's signal
    why: Optional[str] = None

    @property
    def status(self) -> str:
        return self.SIGNALS.get(self.received, "interrupted")

    def restore(self) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        self.previous = {}


def stopped_by(signum: Optional[int], how: str) -> Stopped:
    """The Stopped that `signum` (None: not known) ends the run with: "stopped by SIGTERM<how>"."""
    name = signal.Signals(signum).name if signum else "a signal"
    return Stopped(StopSignals.SIGNALS.get(signum, "interrupted"), name, f"stopped by {name}{how}")


def planning_stopped(signum: int, when: str) -> Stopped:
    return stopped_by(signum, f" {when}, before anything was written")
