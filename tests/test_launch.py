"""The launch: which launcher started this process, the run's name every rank agrees on, the srun rendezvous,
the SLURM launcher's signal lead and the local launcher slot (in-process, on the environments each launcher
sets), and two torchrun agents as two nodes of one job (real torchrun, gloo).

The environments below are what these launchers set, checked on the local SLURM cluster: an `salloc` shell
has SLURM_JOB_ID/SLURM_NTASKS/SLURM_NODELIST, an `sbatch` script also SLURM_PROCID=0 and SLURM_LOCALID=0,
and only an `srun` step has SLURM_STEP_ID, SLURM_STEP_NODELIST and SLURM_STEP_NUM_TASKS.
tests/test_slurm_cluster.py runs train.py in a batch script and in an srun step for real.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from membudget.errors import UserError
from membudget.launch import (Launch, config_fingerprint, expand_hostlist, first_host, launch_from_env, run_name,
                              srun_port, srun_rendezvous, warn_if_unused_allocation)
from membudget.options import CONF_DIR
from membudget.schema import resolved
from tests.conftest import ROOT, TINY, compose_cfg, read_metrics, subprocess_env, wait_until

SALLOC = {"SLURM_JOB_ID": "4711", "SLURM_NTASKS": "16", "SLURM_NODELIST": "gpu[01-02]",
          "SLURM_JOB_NODELIST": "gpu[01-02]"}
SBATCH = {**SALLOC, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}


def srun_task(procid: int, job: int = 4711, step: int = 0, ntasks: int = 16, nodes: str = "gpu[01-02]",
              **extra: str) -> dict[str, str]:
    """The environment of task `procid` of an srun step of `ntasks` tasks, 8 per node."""
    return {**SALLOC, "SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step), "SLURM_PROCID": str(procid),
            "SLURM_LOCALID": str(procid % 8), "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks),
            "SLURM_STEP_NODELIST": nodes, **extra}


def torchrun_rank(rank: int, run_id: str = "job7", world: int = 16, nodes: int = 2, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % 8), "GROUP_WORLD_SIZE": str(nodes),
            "MASTER_ADDR": "gpu01", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": run_id, **extra}


# --- SLURM's host lists ----------------------------------------------------------------------------------

HOSTLISTS = {
    "gpu[01-03,07],login1": ["gpu01", "gpu02", "gpu03", "gpu07", "login1"],
    "a[1-2]-ib": ["a1-ib", "a2-ib"],
    "n[001-002]": ["n001", "n002"],
    "n[099-101]": ["n099", "n100", "n101"],
    "x[8-11]": ["x8", "x9", "x10", "x11"],
    "rack[1-2]-n[01-02]": ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    "a,b[1,3],c": ["a", "b1", "b3", "c"],
    "node7": ["node7"],
}


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_hostlist_expands_as_slurm_does(hostlist):
    assert expand_hostlist(hostlist) == HOSTLISTS[hostlist]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="SLURM's scontrol is not installed here")
def test_hostlist_parser_agrees_with_scontrol():
    """Every list that `scontrol show hostnames` accepts (it rejects a suffix after the brackets)."""
    for hostlist, hosts in HOSTLISTS.items():
        shown = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True).stdout
        assert shown.split() in ([], hosts), hostlist


def test_first_host_without_scontrol_on_path(tmp_path):
    """A container without SLURM's client tools: PATH without scontrol, and the Python parser answers."""
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep)
                           if not (Path(d) / "scontrol").exists()) or str(tmp_path)
    assert shutil.which("scontrol", path=path) is None
    assert first_host("gpu[07-08],login1", path) == "gpu07"
    assert srun_rendezvous(srun_task(3, nodes="a[3-4]-ib", PATH=path))[0] == "a3-ib"


# --- which launcher -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shell", [SALLOC, SBATCH], ids=["salloc", "sbatch"])
def test_allocation_shell_is_one_process_with_an_srun_hint(shell, caplog):
    """`python train.py` in an salloc shell or an sbatch script of 16 tasks: not a 16-rank job waiting for
    15 peers, one process, and one line saying to use srun."""
    assert launch_from_env(shell) == Launch()
    with caplog.at_level(logging.WARNING, logger="membudget"):
        warn_if_unused_allocation(shell)
        warn_if_unused_allocation({})  # a plain shell: nothing to say
    (line,) = caplog.messages
    assert "job 4711 with 16 tasks, but not an srun step" in line and "srun python train.py" in line


def test_srun_step_gives_rank_world_and_local_rank():
    # an 8-task step inside a 16-task job: the step's own size counts
    env = {**srun_task(11, ntasks=8), "SLURM_NTASKS": "16"}
    assert launch_from_env(env) == Launch(11, 8, 3, "srun", "slurm-4711.0")
    # one-task step (`srun --pty bash`, then python train.py): one process with a name of its own
    assert launch_from_env(srun_task(0, ntasks=1)) == Launch(0, 1, 0, "srun", None)


def test_rank_and_world_size_set_by_hand():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    assert launch_from_env(env) == Launch(1, 2, 0, "env", "env-10.0.0.1-29600")  # what both ranks share
    assert launch_from_env({"RANK": "0", "WORLD_SIZE": "1"}) == Launch(0, 1, 0, "env", None)  # one process


def test_torchrun_variables_win_over_the_srun_step_they_run_in():
    env = {**srun_task(1, ntasks=2), **torchrun_rank(9)}  # srun -N2 --ntasks-per-node 1 torchrun ...
    assert launch_from_env(env) == Launch(9, 16, 1, "torchrun", "torchrun-job7")


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but MASTER_ADDR is not"),
    (torchrun_rank(0, run_id="none"), "torchrun on 2 nodes without --rdzv-id"),
])
def test_incomplete_launch_is_one_line_error_and_the_run_still_gets_a_name(env, message):
    with pytest.raises(UserError, match=message) as err:
        launch_from_env(env)
    assert "\n" not in str(err.value)
    # Hydra resolves the run dir before train.py can report the error: the name must not raise
    assert re.fullmatch(r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\d+", run_name(env))


# --- every rank's config the same (tests/test_dist_faults.py launches two nodes that differ) -------------------

@pytest.mark.parametrize("override", ["optimizer.lr=0.0005", "model.n_layers=3", "train.seed=1", "ac=full"])
def test_a_config_that_differs_in_any_one_value_has_another_fingerprint(override):
    """What the ranks compare before a model is built: one value apart, a value that trains silently apart (the
    learning rate, the seed) or a shape that fails deep in a collective, is another fingerprint; the same
    overrides composed again are the same one."""
    def fingerprint(*overrides):
        return config_fingerprint(resolved(compose_cfg(*TINY, *overrides)))  # as the trainer hands it over

    assert fingerprint() == fingerprint()
    assert fingerprint(override) != fingerprint()


# --- the run's name -------------------------------------------------------------------------------------

def test_run_name_is_shared_by_every_rank_of_a_launch_and_differs_between_launches():
    srun = {run_name(srun_task(i)) for i in range(16)}
    assert srun == {"slurm-4711.0"}
    assert run_name(srun_task(0, step=1)) == "slurm-4711.1" and run_name(srun_task(0, job=4712)) == "slurm-4712.0"
    torchrun = {run_name(torchrun_rank(i)) for i in range(16)}
    assert torchrun == {"torchrun-job7"} and run_name(torchrun_rank(0, run_id="job8")) == "torchrun-job8"
    # torchrun on one node without --rdzv-id (a static --master-port): its ranks share the agent, their parent
    one_node = {run_name(torchrun_rank(i, run_id="none", world=2, nodes=1)) for i in range(2)}
    (name,) = one_node
    assert name.endswith(f"-{os.getppid()}")


def test_two_plain_runs_started_together_get_two_names(tmp_path):
    """Two `python train.py` in one shell, in the same second (they used to share the shell's start time)."""
    cmd = [sys.executable, "-c", "from membudget.launch import run_name; print(run_name())"]
    env = subprocess_env(**SALLOC)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    names = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert names[0] != names[1]
    for name, proc in zip(names, procs):
        assert re.fullmatch(rf"\d{{4}}-\d\d-\d\d/\d\d-\d\d-\d\d-{proc.pid}", name)


# --- the srun rendezvous ----------------------------------------------------------------------------------

def test_srun_rendezvous_is_the_steps_first_node_and_a_port_outside_the_ephemeral_range():
    # the step runs on the job's last two nodes; MASTER_ADDR/MASTER_PORT leaked from the submitting shell
    leaked = {"MASTER_ADDR": "login1", "MASTER_PORT": "29500", "SLURM_JOB_NODELIST": "gpu[01-04]",
              "SLURM_NODELIST": "gpu[01-04]"}
    tasks = [srun_task(i, nodes="gpu[03-04]", **leaked) for i in range(16)]
    assert {srun_rendezvous(env) for env in tasks} == {srun_rendezvous(tasks[0])}
    addr, port = srun_rendezvous(tasks[0])
    assert addr == "gpu03"
    ports = {srun_port(srun_task(0, job=job, step=step)) for job in range(0, 10**6, 997) for step in range(3)}
    assert all(1024 <= p < 32768 for p in ports) and len(ports) > 1000
    assert len({srun_port(srun_task(0, job=job, step=step)) for job in range(100, 110) for step in range(3)}) == 30
    # a step with ports reserved by SLURM (srun --resv-ports) uses them
    assert srun_port(srun_task(0, SLURM_STEP_RESV_PORTS="12001-12004")) == 12001


# --- the SLURM launcher presets -----------------------------------------------------------------------------

def test_slurm_signal_lead_is_sized_from_the_checkpoint():
    """12 bytes per parameter (fp32 weights, AdamW's moments) over the shards, at 0.25 GB/s per rank, plus 60 s."""
    from membudget.fit import parameter_count

    cfg = compose_cfg("hydra/launcher=slurm", "model=llama3_8b", "parallelism=fsdp", hydra=True)
    launcher = cfg.hydra.launcher
    per_rank = 12 * parameter_count(cfg.model) / 8  # FSDP over one node's 8 ranks
    assert launcher.signal_delay_s == pytest.approx(60 + per_rank / 0.25e9, abs=1)
    launcher.nodes = 2
    assert launcher.signal_delay_s == pytest.approx(60 + per_rank / 2 / 0.25e9, abs=1)
    # a layout the launcher's world does not fit (a sweep's layouts are not in its config): counted unsharded
    cfg.parallelism.dp_shard = 1
    assert launcher.signal_delay_s == pytest.approx(60 + 8 * per_rank / 0.25e9, abs=1)
    cfg.checkpoint.enabled = False  # nothing to save: the slack alone
    assert launcher.signal_delay_s == 60

    # a 70B save over 16 ranks takes longer than the 120 s the preset used to allow; at most half the job
    cfg = compose_cfg("hydra/launcher=slurm", "model=llama3_70b", "parallelism=fsdp_tp", "parallelism.tp=8",
                      "hydra.launcher.nodes=2", hydra=True)
    assert cfg.hydra.launcher.signal_delay_s > 240
    cfg.hydra.launcher.timeout_min = 8
    assert cfg.hydra.launcher.signal_delay_s == 240


def test_local_launcher_slot_is_git_ignored_and_composes(tmp_path):
    """A user's conf/hydra/launcher/local.yaml (from local.yaml.example): never committed, and composed as
    hydra/launcher=local over the slurm preset. Composed here from a copy on Hydra's search path, so a
    user's own file in the checkout is left alone."""
    slot = "conf/hydra/launcher/local.yaml"
    ignored = subprocess.run(["git", "check-ignore", slot, "conf/hydra/launcher/slurm_local.yaml"], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    assert ignored == [slot]
    (tmp_path / "hydra" / "launcher").mkdir(parents=True)
    example = (CONF_DIR / "hydra" / "launcher" / "local.yaml.example").read_text()
    (tmp_path / "hydra" / "launcher" / "local.yaml").write_text(example.replace("partition: gpu ", "partition: a100 "))
    cfg = compose_cfg("hydra/launcher=local", f"hydra.searchpath=[file://{tmp_path}]", "parallelism=fsdp",
                      hydra=True)
    launcher = cfg.hydra.launcher
    assert (launcher.partition, launcher.account, launcher.qos) == ("a100", "myproject", "normal")
    assert launcher.gpus_per_node == 8 and launcher.signal_delay_s >= 60  # the rest from the slurm preset
    assert launcher._target_.endswith("SlurmLauncher")


# --- two nodes, simulated: two torchrun agents on this host ---------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _two_agents(cwd: Path, delay_s: float, *overrides: str) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes 2 --node-rank N --rdzv-backend c10d ...` once per node, the second `delay_s` later."""
    endpoint = f"localhost:{_free_port()}"
    procs = []
    for node in range(2):
        if node:
            time.sleep(delay_s)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job7",
               str(ROOT / "train.py"), *TINY, "parallelism=fsdp", "checkpoint.every_steps=1", *overrides]
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=subprocess_env(), stdin=subprocess.DEVNULL))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _run_dirs(cwd: Path) -> list[Path]:
    """The dirs Hydra started a run in (each holds its .hydra/)."""
    return sorted(p.parent for p in (cwd / "outputs").rglob(".hydra"))


@pytest.mark.slow
@pytest.mark.dist
def test_two_nodes_write_one_run_dir_and_a_relaunch_resumes_it(tmp_path):
    """Two torchrun agents started 2 s apart (two nodes whose launchers started at different times, as on a
    cluster) train one FSDP job: one run dir holds both ranks' shards; the same launch again resumes it."""
    _two_agents(tmp_path, 2.0, "train.steps=1")
    run = tmp_path / "outputs" / "torchrun-job7"
    assert _run_dirs(tmp_path) == [run]  # one dir for the job, none per node
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["step_0000001"]  # no half-written .tmp dir left by a rank writing elsewhere
    shards = sorted(p.name for p in (run / "checkpoints" / "step_0000001").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    assert (run / "train_rank1.log").exists()

    _two_agents(tmp_path, 0.0, "train.steps=2")
    assert _run_dirs(tmp_path) == [run]
    assert "resumed from" in (run / "train.log").read_text()
    assert "resumed" in (run / "train_rank1.log").read_text()
    assert [row["step"] for row in read_metrics(run)] == [1, 2]


def test_at_exit_the_process_group_is_left_with_gloos_workers_idle():
    """The exit path of every distributed run (launch._leave_process_group): gloo's worker threads are found by the
    name torch gives them (if torch renames them, the wait would find none and guard nothing), and after the
    last collective the wait sees them asleep. Under load a worker that still held a collective's tensor when
    the interpreter finalized aborted the process (docs/measured.md: 7 of 36 exits against 0 of 36)."""
    import torch
    import torch.distributed as dist

    from membudget.internals import gloo_worker_threads, wait_for_idle_gloo_workers
    from membudget.launch import _leave_process_group

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(20):
            dist.all_reduce(torch.ones(4096))
        # a worker names itself when it starts, so one that ran these collectives has its name (before them, a
        # loaded host may not have started any yet)
        assert len(gloo_worker_threads()) >= 1
        assert wait_for_idle_gloo_workers(timeout_s=10)
    finally:
        _leave_process_group()
    assert not dist.is_initialized()


# A rank whose heartbeat is inside a store call as it exits: the call waits 0.5 s on a key no one sets, then
# bumps the counter (a store slow to answer, as at a loaded job's start)
_EXIT_WHILE_BEATING = """
import datetime, os, sys, threading
import torch.distributed as dist
from membudget.launch import Heartbeat, Launch

server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(server.port)
inside = threading.Event()

class SlowStore(dist.TCPStore):
    def add(self, key, amount):
        inside.set()
        try:
            self.wait(["membudget/never"], datetime.timedelta(seconds=0.5))
        except dist.DistError:
            pass
        return super().add(key, amount)

Heartbeat._client = lambda self, timeout_s: SlowStore("127.0.0.1", server.port, None, False,
                                                      timeout=datetime.timedelta(seconds=timeout_s))
Heartbeat.start(Launch(rank=1, world_size=2, launcher="torchrun", job_key="job"))
assert inside.wait(30)
print("exiting", flush=True)
sys.exit(3)
"""


def test_a_rank_that_exits_while_its_heartbeat_is_in_a_store_call_exits_with_its_own_code():
    """A rank that stops with an error right after joining (check_same_run: another node's config) exits while its
    heartbeat thread may be inside one of the store's C++ calls. Waited for at exit, the process ends with its own
    exit code; left running, the thread is ended inside C++ as the interpreter finalizes and the process aborts
    with SIGABRT ("terminate called without an active exception"), which a loaded suite once showed."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_BEATING], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert "exiting" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    assert "terminate called" not in done.stderr


# A rank whose join outlived its deadline: the store call returns 1.5 s later, while an object's teardown holds
# the interpreter's finalization open with the GIL released (as torch's own teardown can)
_EXIT_WHILE_A_CALL_IS_STRANDED = """
import datetime, sys, time
import torch.distributed as dist
from membudget.errors import UserError
from membudget.launch import exit_without_stranded_calls, within_deadline

server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=30))

class SlowTeardown:
    def __del__(self, sleep=time.sleep):
        sleep(4)

held = SlowTeardown()
with exit_without_stranded_calls():
    try:
        within_deadline(lambda: client.wait(["never"], datetime.timedelta(seconds=1.5)), 0.2, "no answer")
    except UserError as e:
        print("error:", e, flush=True)
        sys.exit(3)
"""


def test_a_rank_whose_call_outlived_its_deadline_exits_with_its_own_code():
    """within_deadline leaves a call that outlived its deadline running (a store that never answers, at joining or
    at naming a lost peer). If it returns while the interpreter finalizes, its thread is ended inside C++ and the
    process aborts (SIGABRT, "terminate called without an active exception"): three times in three without
    exit_without_stranded_calls, which train.py's entry point runs. With it, the exit handlers run and the
    process ends with its own code and its output."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WHILE_A_CALL_IS_STRANDED], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.stdout == "error: no answer\n", done.stderr[-3000:]
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    assert "terminate called" not in done.stderr


def test_a_lost_ranks_process_is_told_running_suspended_or_dead_where_this_machine_sees_it():
    """What the line for a rank whose heartbeat stopped says of its process (Heartbeat.stopped_ranks): the identity
    a real process leaves (process_identity), read back while it runs, stopped by SIGSTOP, killed (a zombie until
    its parent reaps it) and reaped. A reused pid is the old process gone; an identity from another machine or PID
    namespace is not judged."""
    from membudget.launch import process_state
    from membudget.peers import who_stopped

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; from membudget.launch import process_identity; "
                               "print(process_identity(), flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        identity = child.stdout.readline().strip()
        boot, namespace, pid, started = identity.split()
        assert int(pid) == child.pid
        assert process_state(identity) == "running"
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(identity) == "suspended", what="the stopped child's state")
        os.kill(child.pid, signal.SIGKILL)
        wait_until(lambda: process_state(identity) == "exited", what="the killed child's state")  # a zombie
    finally:
        child.kill()
        child.wait()
    assert process_state(identity) == "exited"  # reaped: no such pid
    # this process's pid with another start time (the kernel reused the pid); another boot; another namespace
    assert process_state(f"{boot} {namespace} {os.getpid()} {int(started) + 1}") == "exited"
    assert process_state(f"another-boot {namespace} {os.getpid()} {started}") is None
    assert process_state(f"{boot} pid:[1] {os.getpid()} {started}") is None
    assert who_stopped({3: None, 1: "exited", 2: None}) == \
        "rank 1 died (its process on this machine is gone) and ranks 2, 3 stopped answering"
    assert who_stopped({1: "suspended", 2: "suspended"}).startswith("ranks 1, 2 are suspended (their processes")

