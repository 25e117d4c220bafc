"""Shared test helpers: compose the real Hydra config, train in this process, run ranks under torchrun's own
launcher from this process (run_ranks), or run the real train.py as a subprocess where the process is the point
(signals, exit codes, torchrun's command line, SLURM)."""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import gc
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser

from membudget.collector import collect_rarely
from membudget.launch import compose_config
from membudget.options import CONF_DIR

# One intra-op thread, as the subprocesses get (OMP_NUM_THREADS in _CHILD_SETTINGS): the models here are tiny,
# and on a machine whose cores are busy (pytest-xdist's other worker, a torchrun job's ranks, another user) a
# second thread makes every op wait for a descheduled one: 10x slower steps were measured on 2 shared cores.
THREADS = 1

ROOT = Path(__file__).resolve().parents[1]
# Fast CPU settings: the same min-cut partitioner as inductor, without code generation.
FAST_COMPILE = "compile.backend=aot_eager_decomp_partition"
# A tiny run: the debug model, a few short steps, nothing but the run dir on disk.
TINY = ("logger=none", "train.steps=3", "train.seq_len=32", "train.global_batch_size=2", "train.progress=lines",
        "data.prefetch=0")


def compose_cfg(*overrides: str, hydra: bool = False):
    """The config train.py would run with these overrides (and Hydra's own node with hydra=True): a fresh copy
    each call. Hydra composes in two stages: the config groups the overrides select (the defaults list, the
    files it reads and merges: ~0.1 s), then the other overrides, applied to that one by one. The first stage is
    composed once per session for each choice of groups (the suite's compositions share a third as many), the
    second is Hydra's own code run on a copy: the same config (tests/test_config.py checks it against compose)."""
    if hydra:  # Hydra's node records every override
        return copy.deepcopy(_compose(overrides, True))
    groups = tuple(o for o in overrides if _is_group(o))
    values = OverridesParser.create().parse_overrides([o for o in overrides if o not in groups])
    # a hydra key is Hydra's node's; a sweep's values are refused by the first stage, not the second
    if any(o.key_or_group.startswith("hydra") or o.is_sweep_override() for o in values):
        return copy.deepcopy(_compose(overrides, False))
    cfg = copy.deepcopy(_compose(groups, False))
    # Hydra's second stage (in ConfigLoaderImpl._load_configuration_impl), a private API of Hydra's
    ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    return cfg


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~").split("@", 1)[0]


def _is_group(override: str) -> bool:
    """An override that selects a config group's option (ac=full, +ac_point=budget_0.5): conf/ has its dir."""
    return (CONF_DIR / _key(override)).is_dir()


@functools.lru_cache(maxsize=None)
def _compose(overrides: tuple[str, ...], hydra: bool):
    return compose_config(overrides, hydra=hydra)  # Hydra's compose of the whole command line


def train_here(run_dir: Path, *overrides: str) -> dict:
    """Train in this process, as `python train.py hydra.run.dir=<run_dir> <overrides>` would: the summary."""
    from membudget.trainer import train

    return train(compose_cfg(*overrides), Path(run_dir))


def run_train(run_dir: Path, *overrides: str, timeout: float = 300, multirun: bool = False, env=None):
    """`python train.py <overrides>` with its outputs in run_dir; W&B offline, nothing on the network."""
    where = f"hydra.sweep.dir={run_dir}" if multirun else f"hydra.run.dir={run_dir}"
    cmd = [sys.executable, str(ROOT / "train.py"), *(["-m"] if multirun else []), where, *overrides]
    Path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(cmd, cwd=Path(run_dir).parent, capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(**(env or {})), stdin=subprocess.DEVNULL)


def hydra_main_here(main, argv: list[str]) -> None:
    """The Hydra entry point `main` (train.py's, membudget.plan's) run in this process as the command line `argv`
    runs it: its dirs are the real ones, without a second interpreter importing torch. Hydra's logging set-up and
    global state are undone afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", argv)
            main()
    finally:
        GlobalHydra.instance().clear()
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:], root.level = handlers, level


def train_py_here(*args: str) -> None:
    """`python train.py <args>` run in this process, through train.py's Hydra entry point (its validation, run
    dir and logger): a failed run raises (SystemExit, or the sweep's error)."""
    import train

    hydra_main_here(train.main, ["train.py", *args])


def multirun_here(sweep: Path, *overrides: str) -> None:
    """`python train.py -m hydra.sweep.dir=<sweep> <overrides>` run in this process (Hydra's basic launcher runs
    the jobs in its own process anyway)."""
    train_py_here("-m", f"hydra.sweep.dir={sweep}", *overrides)


@dataclass
class Ranks:
    """What a run_ranks launch left: its exit status (0, or 1 if a rank failed), each rank's return value, and
    what each rank wrote on its stdout (where Hydra's console log goes) and stderr."""

    returncode: int
    returns: dict[int, object]
    failure: str  # torchrun's report of the failed ranks
    outputs: list[tuple[str, str]]  # (stdout, stderr) by rank

    @property
    def stdout(self) -> str:
        """Rank 0's."""
        return self.outputs[0][0]

    @property
    def console(self) -> str:
        """What torchrun's console would show: every rank's output, rank by rank."""
        return "".join(out + err for out, err in self.outputs)

    @property
    def log(self) -> str:
        """Everything: torchrun's report of the failed ranks, then every rank's output."""
        return self.failure + self.console

    def why(self, tail: int = 2000) -> str:
        """What to read when it failed, for an assertion's message: torchrun's report, then each rank's last `tail`
        characters of stdout and of stderr, where a rank that died of a native fault has its threads' stacks
        (faulthandler's "Fatal Python error", which train.py enables) kept whole."""
        parts = [self.failure]
        for rank, (out, err) in enumerate(self.outputs):
            fatal = err.find("Fatal Python error")
            parts.append(f"--- rank {rank}: stdout ---\n{out[-tail:]}\n--- rank {rank}: stderr ---\n"
                         f"{err[fatal:] if fatal >= 0 else err[-tail:]}")
        return "\n".join(parts)


# Forked by every run_ranks rank: what the ranks import is imported once, by the fork server. Dynamo and the
# compiler's front end too, which a rank would import at its first compiled call (1.5 CPU-s a rank).
_RANK_IMPORTS = ["torch", "torch._dynamo", "torch._inductor.compile_fx", "membudget.trainer", "train", "tests.conftest",
                 "tests.checkpoint_driver", "tests.plan_real_step"]


# A rank of run_ranks that has not returned by then prints its threads' stacks and exits: its launch fails with
# them in its log, where a hung collective would otherwise wait out pytest's timeout and end the whole worker.
RANK_TIMEOUT_S = 300


def run_ranks(nproc: int, entry, *args, cwd: Path, timeout_s: float = RANK_TIMEOUT_S) -> Ranks:
    """`torchrun --standalone --nproc-per-node N` of `entry(*args)` (a module-level function) in the dir `cwd`:
    torchrun's own launcher (`elastic_launch`: rendezvous, agent, a process per rank, a failed rank named), run
    from this process. Each rank is forked from multiprocessing's fork server, which imports torch and the
    trainer once per test worker, where a new interpreter per rank imports them again (2.7 CPU-s a rank, and
    1.5 s for torchrun's own process). For the tests whose point is the ranks, not torchrun's command line."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    multiprocessing.set_forkserver_preload(_RANK_IMPORTS)  # read when the server starts, the first launch
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=logs.name, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.05,
                          start_method="forkserver", logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.ALL))
    # the agent sets its own handlers from the main thread (only), which would outlive it in this process
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        returns, returncode, failure = elastic_launch(config, _in_rank)(entry, Path(cwd), timeout_s, *args), 0, ""
    except ChildFailedError as e:
        returns, returncode, failure = {}, 1, e.format_msg()
    finally:
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler)

    def output(rank: int, stream: str) -> str:
        return "".join(f.read_text(errors="replace") for f in logs.glob(f"**/attempt_0/{rank}/{stream}.log"))

    ranks = Ranks(returncode, returns, failure, [(output(rank, "stdout"), output(rank, "stderr"))
                                                 for rank in range(nproc)])
    shutil.rmtree(logs, ignore_errors=True)
    return ranks


def _in_rank(entry, cwd: Path, timeout_s: float, *args):
    """A rank of run_ranks: in `cwd`, with subprocess_env's settings (its launcher's variables are its own), its
    stacks dumped (into its stderr log) and its process ended after `timeout_s`."""
    import torch

    faulthandler.dump_traceback_later(timeout_s, exit=True)
    for key in [k for k in os.environ if _test_only(k)]:
        del os.environ[key]
    os.environ.update(_CHILD_SETTINGS)
    torch.set_num_threads(THREADS)
    os.chdir(cwd)
    try:
        return entry(*args)
    finally:  # into this rank's log files, which torchrun's launcher unhooks before Python's exit would flush
        faulthandler.cancel_dump_traceback_later()
        sys.stdout.flush()
        sys.stderr.flush()


def train_py_ranks(nproc: int, cwd: Path, *args: str) -> Ranks:
    """`torchrun --standalone --nproc-per-node N train.py <args>` in `cwd` (see run_ranks)."""
    return run_ranks(nproc, train_py_here, *args, cwd=cwd)


# What a child `train.py` (a subprocess or a run_ranks rank) runs with: W&B offline and quiet, THREADS threads.
_CHILD_SETTINGS = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1",
                   "OMP_NUM_THREADS": str(THREADS)}


def _test_only(key: str) -> bool:
    """A variable of this process's environment that no child may inherit: this process's W&B service (a child
    gets its own), an enclosing SLURM job's."""
    return key == "WANDB_SERVICE" or key.startswith("SLURM_")


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child `train.py`: _CHILD_SETTINGS, and no variables of this process's W&B service
    or of an enclosing torchrun or SLURM job."""
    env = {k: v for k, v in os.environ.items()
           if not _test_only(k) and not k.startswith("TORCHELASTIC_")
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, **_CHILD_SETTINGS, **extra}


def wait_until(condition, timeout_s: float = 60.0, what: str = "the condition") -> None:
    """Poll `condition` until it holds; generous by default: a busy machine can stall a thread or a process for
    seconds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not come within {timeout_s:g} s"
        time.sleep(0.005)


@contextlib.contextmanager
def membudget_log(handler: logging.Handler):
    """`handler` on the membudget logger, at INFO, while the block runs; the logger as it was afterwards."""
    logger = logging.getLogger("membudget")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


@contextlib.contextmanager
def small_tmpfs(tmp_path: Path, size: str):
    """A tmpfs of `size` (mount's spelling: 48k, 6m) in tmp_path, for full-disk tests; skips where not root."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def pytest_collection_finish(session):
    """Python's cyclic collector in a worker: the objects of its imports and collection are frozen out of it (never
    garbage: torch, Hydra, the test modules) and its youngest generation is collected rarely, as the planner's
    CLI does (membudget/collector.py). The planner's fake-tensor runs and torch.compile allocate millions of
    short-lived objects, and with the defaults the collector took 12 % of a planning test's CPU
    (tests/test_plan_cli.py, measured with gc.callbacks). Reference counting still frees everything that is not
    in a cycle at once."""
    gc.freeze()
    collect_rarely()


def pytest_configure(config):
    """torch at THREADS threads in each process that runs tests. pytest-xdist's controller runs none: it does not
    import torch (1.9 CPU-s before the workers start)."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    import torch

    torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _torch_threads():
    """A test that changes torch's thread count gets it back afterwards: it does not leak into later tests."""
    import torch

    yield
    if torch.get_num_threads() != THREADS:
        torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    # an in-process wandb.init leaves WANDB_SERVICE pointing at this process's W&B service: subprocesses
    # started later would share it, and a run killed in a test would keep its id "in use" there
    os.environ.pop("WANDB_SERVICE", None)


# --- pytest-xdist (`-n auto --dist loadgroup` in pyproject.toml): what may run side by side, in which order ---

SLURM = "slurm"  # the tests that submit jobs to the local SLURM cluster
# a rough cost of a test, in seconds on 2 CPUs: the order only balances the workers, it checks nothing
_COST = {"dist": 25.0, "slow": 10.0, "fast": 0.3}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    """xdist sends each group to one worker, its tests in the collection's order:

    - the SLURM tests: the local cluster is one node of 2 CPUs, whose jobs from two workers would queue behind
      each other past the tests' deadlines;
    - the tests of a module that use a fixture it shares between them (module scope): built once, not once
      per worker.

    Under xdist the groups and the other tests are then ordered by a rough cost, the largest first, so that no
    long test starts last and leaves one worker waiting for the other. A serial run keeps the collection order."""
    groups: dict[int, str] = {}
    for item in items:
        if item.get_closest_marker("slurm"):
            groups[id(item)] = SLURM
        elif _module_fixture(item):
            groups[id(item)] = item.module.__name__
    for item in items:
        if id(item) in groups:
            item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    if not (hasattr(config, "workerinput") or config.getoption("dist", "no") != "no"):
        return
    cost: dict[str, float] = {}
    for item in items:
        unit = groups.get(id(item), item.nodeid)
        kind = next((m for m in ("dist", "slow") if item.get_closest_marker(m)), "fast")
        cost[unit] = cost.get(unit, 0.0) + _COST[kind]
    order = {unit: i for i, unit in enumerate(sorted(cost, key=lambda unit: -cost[unit]))}
    items.sort(key=lambda item: order[groups.get(id(item), item.nodeid)])  # stable: a group keeps its order


def _module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture of this repository's tests shared by a module (or wider)."""
    return any(d.scope != "function" and d.baseid.startswith("tests")
               for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs)
