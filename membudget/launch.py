"""This process's place in the job: how it was launched (one process, torchrun, an srun step), the run's
name that every rank of the job agrees on, the rendezvous address, the device, joining the process group,
and how early SLURM must warn before a time limit.

Launchers, in order of trust:
- torchrun sets RANK/WORLD_SIZE/LOCAL_RANK, MASTER_ADDR/MASTER_PORT, and TORCHELASTIC_RUN_ID (its
  `--rdzv-id`, the same on every node; a fresh uuid for a single-node launch without an endpoint);
- an `srun` step (also how submitit runs a job's tasks) sets SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID
  and SLURM_STEP_ID. Only a step's variables are trusted: an `salloc` shell or an `sbatch` script carries
  SLURM_NTASKS (a batch script even SLURM_PROCID=0), but a plain `python train.py` started there is one
  process, which says so in one line.
RANK/WORLD_SIZE with MASTER_ADDR/MASTER_PORT set by hand (or by another launcher) are a launch too, named
after that endpoint.

submitit's TorchDistributedEnvironment is not used for the rendezvous: it takes the job's node list rather
than the step's, keeps a MASTER_PORT leaked from the submitting shell, and draws ports inside Linux's
ephemeral range (32768-60999), where a port can already be in use by an outgoing connection.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import itertools
import logging
import math
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from membudget.errors import UserError
from membudget.units import GB

log = logging.getLogger("membudget")

# Rendezvous ports derived from the SLURM job and step ids: below Linux's default ephemeral range
# (32768-60999), above the registered services most hosts run.
PORT_BASE, PORT_SPAN = 20000, 12000


@dataclass(frozen=True)
class Launch:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "single"  # single | torchrun | env (RANK/WORLD_SIZE set by hand) | srun
    job_key: Optional[str] = None  # the run's name, from what every rank of the job shares; None: one process

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def in_srun_step(env: Mapping[str, str] = os.environ) -> bool:
    """Inside an `srun` step (SLURM_STEP_ID is set there, not in the allocation's shell or batch script)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env


def launch_from_env(env: Mapping[str, str] = os.environ) -> Launch:
    """torchrun's variables, else an srun step's, else one process."""
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = [k for k in ("RANK", "WORLD_SIZE") if k not in env]
        if missing:
            other = "RANK" if missing[0] == "WORLD_SIZE" else "WORLD_SIZE"
            raise UserError(f"{missing[0]} is not set but {other} is: launch with torchrun (it sets both), or "
                            "unset it for one process")
        world_size = int(env["WORLD_SIZE"])
        if world_size > 1 and not env.get("MASTER_ADDR"):
            raise UserError(f"WORLD_SIZE={world_size} is set but MASTER_ADDR is not: launch with torchrun "
                            "(or set MASTER_ADDR/MASTER_PORT), or unset RANK/WORLD_SIZE for one process")
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        # RANK=0 WORLD_SIZE=1 by hand is one process: two such runs must not share one dir
        key = _rendezvous_key(env) if launcher == "torchrun" or world_size > 1 else None
        return Launch(int(env["RANK"]), world_size, int(env.get("LOCAL_RANK", 0)), launcher, key)
    if in_srun_step(env):
        ntasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")))
        # a one-task step is one process (`srun --pty bash`, then several `python train.py`): no shared name
        key = f"slurm-{env.get('SLURM_JOB_ID', '0')}.{env['SLURM_STEP_ID']}" if ntasks > 1 else None
        return Launch(int(env["SLURM_PROCID"]), ntasks, int(env.get("SLURM_LOCALID", 0)), "srun", key)
    return Launch()


def warn_if_unused_allocation(env: Mapping[str, str] = os.environ) -> None:
    """One line when a plain run starts inside a SLURM allocation of several tasks, which it does not use."""
    if int(env.get("SLURM_NTASKS", "1")) > 1 and not in_srun_step(env) and "RANK" not in env:
        log.warning("this shell is SLURM job %s with %s tasks, but not an srun step: training as one process; "
                    "launch with `srun python train.py ...` to use all tasks",
                    env.get("SLURM_JOB_ID", "?"), env["SLURM_NTASKS"])


def _rendezvous_key(env: Mapping[str, str]) -> str:
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is None:  # RANK/WORLD_SIZE by hand (or another launcher): the rendezvous endpoint is shared
        return f"env-{env.get('MASTER_ADDR', 'local')}-{env.get('MASTER_PORT', '0')}"
    if run_id != "none":
        return f"torchrun-{run_id}"
    # No --rdzv-id: torchrun's static rendezvous with a --master-port (or c10d with an endpoint). A c10d
    # MASTER_PORT is drawn anew by each launch, and nodes share nothing else that names this launch.
    nodes = int(env.get("GROUP_WORLD_SIZE", "1"))
    if nodes > 1:
        raise UserError(f"torchrun on {nodes} nodes without --rdzv-id: the nodes cannot agree on one run dir; "
                        "pass --rdzv-id=<the job's id> to every node (rerun with the same id to resume)")
    # one node: its ranks share their parent, torchrun's agent
    import psutil

    agent = psutil.Process(os.getppid())
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(agent.create_time())) + f"-{agent.pid}"


def run_name(env: Mapping[str, str] = os.environ) -> str:
    """The run's name under outputs/ or multirun/, the same in every rank of one launch and different for two
    launches: `<date>/<time>-<pid>` for one process (two runs started in the same second differ), the job's
    key for torchrun (`torchrun-<rendezvous id>`) and srun (`slurm-<job id>.<step id>`), which every node of
    a multi-node job shares (a node's clock or its launcher's start time would not be). Rerunning a torchrun
    launch with the same --rdzv-id, or a requeued SLURM job's same step, resumes in the same dir."""
    try:
        key = launch_from_env(env).job_key
    except UserError:
        key = None  # train.py reports the launch's error in one line; Hydra only needs some dir meanwhile
    return key or time.strftime("%Y-%m-%d/%H-%M-%S") + f"-{os.getpid()}"


def _rank_suffix() -> str:
    try:
        rank = launch_from_env().rank
    except UserError:
        rank = 0
    return f"_rank{rank}" if rank else ""


# --- the rendezvous ---------------------------------------------------------------------------------------

def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compact host list ("gpu[01-03,07],login1", "rack[1-2]-n[01-02]") as host names, in order
    (what `scontrol show hostnames` prints, for the lists it accepts)."""
    hosts = []
    for pattern in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        # literal text and bracket groups alternate: the product of the groups, the leftmost varying slowest
        pieces = re.split(r"\[([^\]]*)\]", pattern)
        choices = [[text] if i % 2 == 0 else _expand_ranges(text) for i, text in enumerate(pieces)]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _expand_ranges(ranges: str) -> list[str]:
    """"01-03,07" -> 01 02 03 07: each range keeps the zero padding of its first number."""
    out = []
    for item in ranges.split(","):
        first, _, last = item.partition("-")
        out.extend(f"{i:0{len(first)}d}" for i in range(int(first), int(last or first) + 1))
    return out


def first_host(nodelist: str, path: Optional[str] = None) -> str:
    """The first host of a SLURM node list: `scontrol show hostnames` where it is on PATH and accepts the
    list, else this module's parser (containers without SLURM's client tools)."""
    scontrol = shutil.which("scontrol", path=path)
    if scontrol:
        proc = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.split():
            return proc.stdout.split()[0]
    return expand_hostlist(nodelist)[0]


def srun_rendezvous(env: Mapping[str, str] = os.environ) -> tuple[str, int]:
    """MASTER_ADDR/MASTER_PORT of an srun step: the step's first node, and the step's reserved port (srun
    --resv-ports) or one from the job and step ids, the same on every task and outside the ephemeral range.
    Whatever MASTER_ADDR/MASTER_PORT the submitting shell exported is ignored."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError("SLURM_STEP_NODELIST is not set in this srun step: cannot find the first node; "
                        "set MASTER_ADDR/MASTER_PORT and launch with torchrun instead")
    return first_host(nodelist, env.get("PATH")), srun_port(env)


def srun_port(env: Mapping[str, str] = os.environ) -> int:
    """The step's first reserved port (srun --resv-ports), else one from the job and step ids: consecutive
    jobs and a job's steps on one node get different ports."""
    reserved = env.get("SLURM_STEP_RESV_PORTS")
    if reserved:
        return int(re.split(r"[-,]", reserved)[0])
    return PORT_BASE + (int(env.get("SLURM_JOB_ID", "0")) * 16 + int(env.get("SLURM_STEP_ID", "0"))) % PORT_SPAN


# --- the device and the process group ----------------------------------------------------------------------

def pick_device(name: str, launch: Launch):
    """The device this rank trains on: CUDA when asked for (or auto and present), else the CPU. With one GPU
    visible per task (SLURM's --gpus-per-task, --gpu-bind) it is cuda:0 whatever the local rank."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name != "cuda":
        return torch.device(name)
    if not torch.cuda.is_available():
        raise UserError("train.device='cuda': no CUDA device is visible; use train.device=auto or cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if launch.local_rank >= count:
        raise UserError(f"train.device='cuda': local rank {launch.local_rank} but only {count} GPUs are visible "
                        f"to this process; launch one process per GPU (e.g. --ntasks-per-node {count}) or bind "
                        "one GPU per task (--gpus-per-task=1)")
    return torch.device("cuda", launch.local_rank)


def init_distributed(launch: Launch, device, timeout_s: float = 600) -> None:
    """Join the process group when launched with several processes: NCCL on CUDA (bound to this rank's device
    up front), gloo on the CPU. A peer that never comes, or an unreachable master, is one line."""
    import torch
    import torch.distributed as dist

    if launch.world_size == 1 or dist.is_initialized():
        return
    if launch.launcher == "srun":
        addr, port = srun_rendezvous()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if launch.launcher == "torchrun":
        die_with_launcher()
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    try:
        # torch's store client ignores its timeout while a port that accepts but never answers holds it (it
        # waits minutes): a deadline of our own, a little past the setting
        within_deadline(lambda: dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        ), timeout_s + JOIN_SLACK_S, f"parallelism.timeout_s={timeout_s}: rank {launch.rank} of "
           f"{launch.world_size} could not join the process group at {where} within {timeout_s + JOIN_SLACK_S:g} s "
           "(nothing answered there); check that MASTER_ADDR:MASTER_PORT is rank 0's host and a free port, and "
           f"that all {launch.world_size} processes were launched")
        atexit.register(_leave_process_group)
        Heartbeat.start(launch)
    except (RuntimeError, ValueError) as e:  # DistStoreError, DistNetworkError are RuntimeErrors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"parallelism.timeout_s={timeout_s}: rank {launch.rank} of {launch.world_size} could not "
                        f"join the process group at {where} ({type(e).__name__}: {first}); check that all "
                        f"{launch.world_size} processes were launched and can reach rank 0's host") from None


JOIN_SLACK_S = 5  # past parallelism.timeout_s: torch's own timeout, when it works, speaks first


def _leave_process_group() -> None:
    """At exit, before the interpreter finalizes: destroy the process group, then let gloo's workers release
    what the last collectives held (else the process can abort after its work is done; see
    internals.wait_for_idle_gloo_workers)."""
    import torch.distributed as dist

    from membudget.internals import wait_for_idle_gloo_workers

    if dist.is_initialized():
        dist.destroy_process_group()
    wait_for_idle_gloo_workers()


_STRANDED: list = []  # within_deadline's threads whose call outlived its deadline (see exit_without_stranded_calls)


def within_deadline(fn, seconds: float, message: str):
    """fn() in a helper thread, raising UserError(message) when it has not returned after `seconds` (the
    thread is left blocked; the process exits soon after, through exit_without_stranded_calls). Its exceptions
    are raised here."""
    import threading

    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="membudget-join", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        _STRANDED.append(thread)
        raise UserError(message)
    if "error" in box:
        raise box["error"]
    return box.get("value")


@contextlib.contextmanager
def exit_without_stranded_calls():
    """The process's exit (train.py's entry point). A call that outlived within_deadline's deadline (a store
    that never answers) may return while the interpreter finalizes; its thread is then ended inside torch's C++
    and the process aborts with SIGABRT ("terminate called without an active exception") instead of exiting
    with its own code. While such a call is still running at exit, the exit handlers run here (W&B's, the
    logs', the process group's), then the process ends with its code without finalizing."""
    import sys
    import threading

    try:
        yield
        code = 0
    except SystemExit as e:
        code = e.code
        if not any(t.is_alive() for t in _STRANDED):
            raise
    if not any(t.is_alive() for t in _STRANDED):
        return
    if code is not None and not isinstance(code, int):  # as Python's own exit: the message, then 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():  # as the interpreter's exit: its other threads first, daemons aside
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()
    from membudget.internals import run_exit_handlers  # torch is loaded: a process group was being joined

    run_exit_handlers()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


# --- a launcher that goes away, a peer that stops answering ---------------------------------------------------

LAUNCHER_PID: Optional[int] = None  # torchrun's agent, when this worker asked to be told of its death


def die_with_launcher() -> None:
    """A torchrun worker gets SIGTERM when its agent dies (Linux's PR_SET_PDEATHSIG): the trainer turns it into a
    stop at the next step boundary, with a checkpoint. Workers run in sessions of their own, so a SIGKILL to the
    agent's process group would otherwise leave them training without a launcher."""
    global LAUNCHER_PID
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGTERM), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    LAUNCHER_PID = parent
    if parent == 1 or os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_gone() -> Optional[str]:
    """'torchrun's agent (pid N) exited' when this worker's launcher is gone, else None."""
    if LAUNCHER_PID is not None and os.getppid() != LAUNCHER_PID:
        return f"the launcher, torchrun's agent pid {LAUNCHER_PID}, exited"
    return None


_START_TIME = 22 - 3  # proc(5): /proc/<pid>/stat's field 22, counted from the state (field 3)


def process_identity() -> str:
    """This process as another process of the same machine can find it again: the kernel's boot id, this PID
    namespace, the pid and its start time (a pid the kernel hands out again has another start time)."""
    return f"{_boot_id()} {_pid_namespace()} {os.getpid()} {_start_time(os.getpid())}"


def process_state(identity: str) -> Optional[str]:
    """What became of the process `identity` (process_identity's) names: "exited" (gone, a zombie, or its pid
    reused), "suspended" (SIGSTOP, a debugger), "running"; None where this process cannot see it (another node,
    another container's PID namespace, no /proc)."""
    try:
        boot, namespace, pid, started = identity.split()
    except ValueError:
        return None
    if (boot, namespace) != (_boot_id(), _pid_namespace()):  # (None here never equals what another wrote)
        return None
    stat = _stat(int(pid))
    if stat is None or stat[_START_TIME] != started:
        return "exited"
    return {"Z": "exited", "X": "exited", "T": "suspended", "t": "suspended"}.get(stat[0], "running")


def _stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/<pid>/stat after the command name (the state first); None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces and parentheses


def _start_time(pid: int) -> Optional[str]:
    stat = _stat(pid)
    return stat[_START_TIME] if stat else None


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class Heartbeat:
    """Each rank of a multi-rank job bumps a counter of its own in the rendezvous store every second, from a
    thread of its own (it runs while the rank waits in a collective, and stops when the process is killed or
    stopped), and leaves its process_identity there. When a collective fails, `stopped_ranks` names the ranks
    whose counters stand still, and what became of each one's process where this rank can see it."""

    PERIOD_S = 1.0
    STORE_TIMEOUT_S = 30.0  # the thread's store calls' (a job's start can keep the store busy); at exit, its wait
    instance: "Optional[Heartbeat]" = None

    def __init__(self, launch: Launch):
        import threading

        self.launch = launch
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted worker group counts anew
        self.prefix = f"membudget/heartbeat/{launch.job_key or 'job'}/{restart}/"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="membudget-heartbeat", daemon=True)

    @classmethod
    def start(cls, launch: Launch) -> None:
        if launch.world_size > 1 and cls.instance is None and os.environ.get("MASTER_PORT"):
            cls.instance = cls(launch)
            cls.instance.thread.start()
            atexit.register(cls.instance.stop)

    def stop(self) -> None:
        """At exit: stop beating, and wait (at most STORE_TIMEOUT_S) for the thread to come back from the store. A
        daemon thread still inside one of torch's C++ calls while the interpreter finalizes is ended there, and the
        process aborts ("terminate called without an active exception", SIGABRT) after its work is done: a run
        that stopped early with a one-line error (another node's config) died so under load."""
        self.done.set()
        self.thread.join(self.STORE_TIMEOUT_S)

    def _client(self, timeout_s: float):
        import torch.distributed as dist

        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                             timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    def _beat(self) -> None:
        try:
            store = self._client(self.STORE_TIMEOUT_S)
            store.set(f"{self.prefix}process/{self.launch.rank}", process_identity())
            while not self.done.is_set():
                store.add(f"{self.prefix}{self.launch.rank}", 1)
                self.done.wait(self.PERIOD_S)
        except Exception:  # noqa: BLE001 - the store is gone (the launcher or rank 0 exited): nothing to beat to
            pass

    def counts(self, store) -> list[int]:
        return [store.add(f"{self.prefix}{r}", 0) for r in range(self.launch.world_size)]

    def _state(self, store, rank: int) -> Optional[str]:
        """process_state of `rank`'s process; None where this rank cannot see it or it left no identity."""
        key = f"{self.prefix}process/{rank}"
        if not store.check([key]):
            return None
        return process_state(store.get(key).decode())

    @classmethod
    def stopped_ranks(cls) -> Optional[dict[int, Optional[str]]]:
        """The other ranks whose heartbeat does not advance over 3 periods, each with its process_state; None when
        the store cannot say (it was rank 0's, and it is gone)."""
        self = cls.instance
        if self is None:
            return None

        def look():
            store = self._client(5)
            before = self.counts(store)
            time.sleep(3 * self.PERIOD_S + 0.5)
            after = self.counts(store)
            return {r: self._state(store, r) for r in range(self.launch.world_size)
                    if r != self.launch.rank and after[r] == before[r]}

        try:
            return within_deadline(look, 15, "the rendezvous store did not answer")
        except Exception:  # noqa: BLE001 - no store to ask
            return None


def config_fingerprint(config: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def check_same_run(config: dict, data: dict, launch: Launch) -> None:
    """Every rank's resolved config and data (data.data_fingerprint) must be rank 0's: two nodes launched with
    different overrides, or reading different copies of the data, would train silently apart or abort deep in a
    collective. One all-gather of a hash, before any model is built; on a difference, the configs and the
    fingerprints themselves, and one line naming each differing key with both values, each differing file, and
    the node and rank."""
    import socket

    import torch.distributed as dist

    from membudget.data import data_changes
    from membudget.schema import flat_keys

    if launch.world_size == 1 or not dist.is_initialized():
        return
    node = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", "?"))
    mine = (config_fingerprint(config), config_fingerprint(data), node, socket.gethostname())
    everyone = [None] * launch.world_size
    dist.all_gather_object(everyone, mine)
    odd = [r for r, theirs in enumerate(everyone) if theirs[:2] != everyone[0][:2]]
    if not odd:
        return
    both = [None] * launch.world_size
    dist.all_gather_object(both, (flat_keys(config), data))
    first = odd[0]
    (ref, ref_data), (other, other_data) = both[0], both[first]
    keys = sorted(k for k in ref.keys() | other.keys() if ref.get(k) != other.get(k))
    shown = [f"{k}={ref.get(k)!r} on rank 0, {other.get(k)!r} on rank {first}" for k in keys[:6]]
    if len(keys) > 6:
        shown.append(f"and {len(keys) - 6} more keys")
    files = data_changes(ref_data, other_data, then="on rank 0", now=f"on rank {first}")
    if files:
        shown.append(f"the data differs: {', '.join(files)}")
    _, _, node1, host1 = everyone[first]
    ranks = f"rank {first}" + (f" and {len(odd) - 1} other ranks" if len(odd) > 1 else "")
    fix = [*(["launch every node with the same command and overrides"] if keys else []),
           *(["give every node the same copy of the data"] if files else [])]
    if not fix:  # hashes that differ where the comparison sees nothing (values that print alike)
        shown, fix = ["their configs print alike but hash differently"], ["launch every node with the same command"]
    raise UserError(f"{ranks} (node {node1}, host {host1}) would train another run than rank 0 (node "
                    f"{everyone[0][2]}, host {everyone[0][3]}): {'; '.join(shown)}; {' and '.join(fix)}")


# --- how early SLURM warns before a time limit ---------------------------------------------------------------

# The step in flight, the ranks' agreement to stop, submitit's requeue: before and after the save itself.
SIGNAL_SLACK_S = 60


def checkpoint_write_s(cfg: Any, world_size: int) -> float:
    """Seconds for the slowest rank to write its part of a checkpoint: fp32 weights and AdamW's two moments
    (fit.CHECKPOINT_BYTES_PER_PARAMETER) over the shards (dp_shard x tp; replicas write one copy), at checkpoint.write_gbps
    per rank. A layout that does not fit the world size (a sweep's own layouts are not in the config the
    launcher sees) counts as unsharded, the most any layout writes on one rank."""
    from omegaconf import OmegaConf

    from membudget.fit import CHECKPOINT_BYTES_PER_PARAMETER, parameter_count
    from membudget.rules import mesh_degrees

    try:
        degrees = mesh_degrees(cfg.parallelism, world_size)
        shards = degrees["dp_shard"] * degrees["tp"]
    except UserError:
        shards = 1
    per_rank = CHECKPOINT_BYTES_PER_PARAMETER * parameter_count(cfg.model) / shards
    gbps = OmegaConf.select(cfg, "checkpoint.write_gbps")  # the schema's default: a shared filesystem, 2 GB/s a node
    return per_rank / (gbps * GB)


def signal_delay_s(cfg: Any) -> int:
    """The SLURM launcher's signal_delay_s: time for the step in flight and the save, before the time limit;
    at most half the job's time (a longer lead would signal right at the start). Read from the composed
    config (the model, the parallelism and the launcher's nodes x tasks_per_node), so swept values of those
    are not seen: set hydra.launcher.signal_delay_s when sweeping model sizes."""
    launcher = cfg.hydra.launcher
    lead = SIGNAL_SLACK_S
    if cfg.checkpoint.enabled:
        lead += checkpoint_write_s(cfg, int(launcher.nodes) * int(launcher.tasks_per_node))
    return int(min(math.ceil(lead), 60 * launcher.timeout_min // 2))


@functools.cache
def register_configs() -> None:
    """Register the schema (membudget.schema.RunConfig) as the base of conf/config.yaml (its first default), and
    the resolvers below. The schema is not stored under any option group, so it can never be picked as an option
    (`ac=ac_schema`). Once per process: Hydra's ConfigStore and OmegaConf's resolvers live as long as it, and each
    store converts the whole schema again (16 ms, an eighth of a compose)."""
    from hydra.core.config_store import ConfigStore

    from membudget.schema import RunConfig

    ConfigStore.instance().store(name="run_schema", node=RunConfig)
    register_resolvers()


def compose_config(overrides, hydra: bool = False):
    """The config of `python train.py <overrides>`, composed outside a Hydra entry point (scripts, the evidence
    table, tests) from conf/ (membudget.options.CONF_DIR); `hydra`: with Hydra's own node, as a job sees it."""
    from hydra import compose, initialize_config_dir

    from membudget.options import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def register_resolvers() -> None:
    """`${run_name:}` for Hydra's run/sweep dirs, `${rank_suffix:}` for each rank's own log file, and
    `${signal_delay_s:}` for the SLURM launcher preset."""
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("run_name", run_name, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("rank_suffix", _rank_suffix, replace=True)
    OmegaConf.register_new_resolver("signal_delay_s", lambda *, _root_: signal_delay_s(_root_), replace=True)
