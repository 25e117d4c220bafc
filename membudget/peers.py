"""A peer that died or stopped answering inside a collective: which rank (its heartbeat, launch.Heartbeat, and what
became of its process), where this rank was, the setting that timed out, and the checkpoint a rerun resumes from,
in one line (PeerLost)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from membudget.checkpoint import MANIFEST, saved_checkpoints
from membudget.errors import UserError
from membudget.launch import Heartbeat


class PeerLost(UserError):
    """Another rank died or stopped answering inside a collective: one line naming it, where, and what to rerun."""


_WHERE: dict[str, Any] = {"phase": "setup (joining, checking the config, resuming)", "step": None}


def at(phase: str, step: Optional[int]) -> None:
    """Where this rank is now (what it is doing, the step), for the line that names a peer which stopped answering."""
    _WHERE["phase"], _WHERE["step"] = phase, step


_PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Timed out waiting", "timed out",
                 "Connection refused", "Broken pipe", "gloo", "NCCL")


def is_peer_failure(e: BaseException) -> bool:
    """A collective that failed because a peer died or stalled (gloo's and NCCL's errors, c10d's DistError)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1) or isinstance(e, UserError):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_FAILURE)


def peer_lost_line(cfg, run_dir: Path, checkpoint_timeout_s: Optional[float], error: BaseException) -> Optional[str]:
    """The line for a collective that failed: the ranks whose heartbeat stopped, where (`at`), the setting (the
    run's checkpoint timeout during a save), and the checkpoint of `run_dir` a rerun resumes from; None when every
    rank is alive and it was no timeout (not a peer's fault)."""
    stopped = Heartbeat.stopped_ranks()
    phase, step = _WHERE["phase"], _WHERE["step"]
    saving = phase.startswith("the checkpoint save") and checkpoint_timeout_s is not None
    setting = (f"checkpoint.timeout_s={checkpoint_timeout_s:g}" if saving
               else f"parallelism.timeout_s={cfg.parallelism.timeout_s}")
    if stopped:
        who = who_stopped(stopped)
    elif stopped is None:
        who = "another rank (the rendezvous store, gone with it, could not say which) stopped answering"
    elif "timed out" in str(error).lower():
        who = f"every rank is alive, but one waited longer than {setting.split('=')[0]} for the others"
        setting += ": raise it if a step or save is that slow"
    else:
        return None
    if not cfg.checkpoint.enabled:
        resume = "checkpointing is off: rerunning the same command starts again from step 0"
    else:
        done = [p for p in saved_checkpoints(run_dir) if (p / MANIFEST).is_file()]  # complete saves, oldest first
        resume = (f"the last complete checkpoint is {done[-1].name}: rerun the same command to resume" if done
                  else "no checkpoint was completed yet: rerunning the same command starts again from step 0")
    when = f" at step {step}" if step is not None else ""
    return f"{who} during {phase}{when} ({setting}); {resume}"


# what a stopped rank's process_state says, singular and plural (its process is on this machine; None: elsewhere)
_FATES = {"exited": ("died (its process on this machine is gone)",) * 2,
          "suspended": ("is suspended (its process on this machine is stopped: SIGSTOP, or a debugger)",
                        "are suspended (their processes on this machine are stopped: SIGSTOP, or a debugger)"),
          "running": ("stopped answering (its process on this machine still runs: hung?)",
                      "stopped answering (their processes on this machine still run: hung?)"),
          None: ("stopped answering",) * 2}


def who_stopped(stopped: dict[int, Optional[str]]) -> str:
    """'rank 1 died (...)', 'ranks 2, 3 stopped answering and rank 1 died (...)': the ranks grouped by fate."""
    by_fate: dict[Optional[str], list[int]] = {}
    for rank, state in sorted(stopped.items()):
        by_fate.setdefault(state, []).append(rank)
    return " and ".join(("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) + " "
                        + _FATES[state][len(ranks) > 1] for state, ranks in by_fate.items())
