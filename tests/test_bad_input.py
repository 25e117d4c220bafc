"""Bad input: every case fails fast, in one line that names the offending key, without side effects, and
every override a fix suggests actually composes.

Most cases run in this process, as train.py runs them: Hydra's composition (a bad key, type or choice fails
there, its first line naming the key) or the trainer's `train` (a UserError whose message starts with
`key=`), with torchrun's RANK/WORLD_SIZE in the environment for the parallelism cases (validation runs before
any rendezvous, so no second process is needed). A rejected run leaves nothing in its run dir but the lock
file (`.lock`, the run dir's lock, written only once the cheap checks have passed).

A few cases are about the process itself (exit codes, no traceback, Hydra creating the run dir, a peer that
never comes): those run the real `python train.py` (slow).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from hydra.errors import ConfigCompositionException

from membudget.console import composition_error_line
from membudget.errors import UserError
from membudget.options import group_options
from membudget.units import GiB
from tests.conftest import ROOT, compose_cfg, subprocess_env

HOST_GIB = 64  # this host's available memory as the fit check sees it: the same refusals on any machine
ALLOWED_IN_RUN_DIR = re.compile(r"\.hydra|train(_rank\d+)?\.log|\.lock")
GROUPS = ("model", "ac", "parallelism", "data", "tokenizer", "logger", "experiment", "ac_point", "debug")
SECTIONS = ("model", "ac", "compile", "parallelism", "tokenizer", "data", "optimizer", "lr_schedule", "train",
            "checkpoint", "logger", "plan", "diagnostics", "hydra")


@dataclass(frozen=True)
class Case:
    id: str
    key: str  # must be named in the error line
    overrides: tuple[str, ...]
    stage: str  # "hydra": composition error | "run": UserError from the trainer
    env: tuple[tuple[str, str], ...] = ()


def hydra(id: str, key: str, *overrides: str) -> Case:
    return Case(id, key, overrides, "hydra")


def run(id: str, key: str, *overrides: str, world: Optional[int] = None, rank: int = 0, **env: str) -> Case:
    if world is not None:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", **env, "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank)}
    return Case(id, key, overrides, "run", tuple(sorted(env.items())))


MB = "ac=memory_budget"
CASES = [
    # ---- Hydra composition: unknown keys, wrong types, unknown choices and group options
    hydra("unknown-key", "ac.memroy_budget", "ac.memroy_budget=0.3"),
    hydra("unknown-train-key", "train.sequence_length", "train.sequence_length=8"),
    hydra("unknown-section", "optimiser", "optimiser.lr=1e-3"),
    hydra("steps-not-int", "train.steps", "train.steps=abc"),
    hydra("dim-float", "model.dim", "model.dim=1.5"),
    hydra("seq-len-float", "train.seq_len", "train.seq_len=1e9"),
    hydra("seed-float", "train.seed", "train.seed=1e23"),
    hydra("steps-null", "train.steps", "train.steps=null"),
    hydra("batch-empty", "train.global_batch_size", "train.global_batch_size="),
    hydra("compile-enabled-not-bool", "compile.enabled", "compile.enabled=maybe"),
    hydra("force-recompute-not-list", "ac.force_recompute_modules", "ac.force_recompute_modules=w2"),
    hydra("target-gib-string", "ac.target_memory_gib", MB, "ac.memory_budget=auto", "ac.target_memory_gib=abc"),
    hydra("section-as-scalar", "train", "train=fast"),
    hydra("budget-list", "ac.memory_budget", "ac.memory_budget=[0.3,0.4]"),
    hydra("unknown-mode", "ac.mode", "ac.mode=bogus"),
    hydra("unknown-solver", "ac.solver", MB, "ac.solver=magic"),
    hydra("unknown-estimator", "ac.runtime_estimator", "ac.runtime_estimator=guess"),
    hydra("unknown-dtype", "train.dtype", "train.dtype=int8"),
    hydra("unknown-decay", "lr_schedule.decay", "lr_schedule.decay=step"),
    hydra("unknown-backend", "compile.backend", "compile.backend=tvm"),
    hydra("unknown-device", "train.device", "train.device=tpu"),
    hydra("unknown-wandb-mode", "logger.mode", "logger.mode=bogus"),
    hydra("unknown-ac-option", "ac/nonsense", "ac=nonsense"),
    hydra("schema-as-option", "ac/ac_schema", "ac=ac_schema"),
    hydra("unknown-parallelism", "parallelism/tp2", "parallelism=tp2"),
    hydra("unknown-model", "model/llama3_9b", "model=llama3_9b"),
    hydra("data-name-as-option", "data/hf", "data=hf"),  # data=c4 and data=fineweb_edu set name: hf
    hydra("tokenizer-name-as-option", "tokenizer/tiktoken", "tokenizer=tiktoken"),  # it is tokenizer=llama3
    hydra("unknown-logger", "logger/tensorboard", "logger=tensorboard"),
    hydra("unknown-experiment", "experiment/nope", "experiment=nope"),
    hydra("plan-budgets-words", "plan.budgets", "plan.budgets=[low,high]"),
    hydra("unknown-ac-point", "ac_point/budget_1.1", "+ac_point=budget_1.1"),
    # ---- AC and compile
    run("budget-without-compile", "compile.enabled", MB, "compile.enabled=false"),
    run("budget-aot-eager", "compile.backend", MB, "compile.backend=aot_eager"),
    run("budget-eager", "compile.backend", MB, "compile.backend=eager"),
    run("budget-above-1", "ac.memory_budget", MB, "ac.memory_budget=1.5"),
    run("budget-negative", "ac.memory_budget", MB, "ac.memory_budget=-0.1"),
    run("auto-budget-target-negative", "ac.target_memory_gib", MB, "ac.memory_budget=auto", "ac.target_memory_gib=-1"),
    run("auto-blocks-target-zero", "ac.target_memory_gib", "ac=per_block", "ac.blocks=auto", "ac.target_memory_gib=0"),
    run("auto-grid-above-1", "plan.budgets", MB, "ac.memory_budget=auto", "plan.budgets=[0.5,1.5]"),
    run("auto-grid-empty", "plan.budgets", MB, "ac.memory_budget=auto", "plan.budgets=[]"),
    run("auto-grid-twice", "plan.budgets", "ac=per_block", "ac.blocks=auto", "plan.budgets=[0.5,0.5]"),
    run("target-negative-without-auto", "ac.target_memory_gib", MB, "ac.target_memory_gib=-1"),
    run("plan-ranks-zero", "plan.world_size", "plan.world_size=0"),
    run("plan-device-memory-zero", "plan.device_gib", MB, "ac.memory_budget=auto", "plan.device_gib=0"),
    run("plan-margin-negative", "plan.margin_gib", MB, "ac.memory_budget=auto", "plan.margin_gib=-5"),
    run("profile-no-active-steps", "diagnostics.profile_active", "debug=profile", "diagnostics.profile_active=0"),
    run("profile-negative-wait", "diagnostics.profile_wait", "debug=profile", "diagnostics.profile_wait=-1"),
    run("snapshot-no-steps", "diagnostics.snapshot_steps", "debug=memory_snapshot", "diagnostics.snapshot_steps=0"),
    run("budget-nan", "ac.memory_budget", MB, "ac.memory_budget=nan"),
    run("budget-string", "ac.memory_budget", MB, "ac.memory_budget=abc"),
    run("budget-sweep", "ac.memory_budget", MB, "ac.memory_budget=sweep"),
    run("budget-per-block-too-few", "ac.memory_budget", MB, "ac.memory_budget=0.3*3"),
    run("budget-per-block-out-of-range", "ac.memory_budget", MB, "ac.memory_budget=0.3*2+1.2*2"),
    run("selective-word", "ac.selective_option", "ac=selective", "ac.selective_option=sometimes"),
    run("selective-zero", "ac.selective_option", "ac=selective", "ac.selective_option=0"),
    run("force-recompute-unread", "ac.force_recompute_modules", "ac.force_recompute_modules=[feed_forward.w2]"),
    run("force-recompute-no-match", "ac.force_recompute_modules", "ac=selective",
        "ac.force_recompute_modules=[no_such_module]"),
    # ---- parallelism: degrees vs the world size of a (pretended) torchrun launch; validation precedes rendezvous
    run("tp-not-dividing-seq", "parallelism.tp", "parallelism=tp", MB, "train.seq_len=255", world=2),
    run("tp-not-dividing-heads", "parallelism.tp", "parallelism=tp", world=3),
    run("tp-compiled-full-ac", "compile.enabled", "parallelism=tp", "ac=full", "compile.enabled=true", world=2),
    run("fsdp-tp-odd-world", "parallelism.dp_shard", "parallelism=fsdp_tp", world=3),
    run("single-on-two-ranks", "parallelism", "parallelism=single", world=2),
    run("two-inferred-degrees", "parallelism.dp_shard", "parallelism=ddp", "parallelism.dp_shard=-1", world=4),
    run("batch-not-divisible", "train.global_batch_size", "parallelism=fsdp", world=3),
    run("hsdp-group-beyond-world", "parallelism.dp_replicate", "parallelism=hsdp", world=2),
    run("degrees-beyond-world", "parallelism", "parallelism=fsdp", "parallelism.dp_shard=4", world=2),
    run("two-inferred-degrees-tp", "parallelism.tp", "parallelism=fsdp", "parallelism.tp=-1", world=2),
    run("degree-zero", "parallelism.dp_shard", "parallelism=fsdp", "parallelism.dp_shard=0", world=2),
    run("tp-beyond-kv-heads", "parallelism.tp", "parallelism=tp", "parallelism.tp=8", world=8),
    run("micro-batch-not-dividing-rank-batch", "train.micro_batch_size", "parallelism=fsdp",
        "train.micro_batch_size=3", world=2),
    run("rank-without-master", "WORLD_SIZE", "parallelism=fsdp", RANK="0", WORLD_SIZE="2"),
    run("rank-without-world-size", "WORLD_SIZE", RANK="1"),
    # ---- train
    run("steps-negative", "train.steps", "train.steps=-1"),
    run("batch-zero", "train.global_batch_size", "train.global_batch_size=0"),
    run("seq-len-beyond-max", "train.seq_len", "train.seq_len=4096"),
    run("seq-len-huge", "train.seq_len", "train.seq_len=1000000000"),
    run("micro-batch-not-divisor", "train.micro_batch_size", "train.micro_batch_size=3"),
    run("grad-norm-negative", "train.max_grad_norm", "train.max_grad_norm=-1"),
    run("seed-negative", "train.seed", "data=synthetic", "train.seed=-1"),
    run("max-skipped-zero", "train.max_skipped_steps", "train.max_skipped_steps=0"),
    run("gc-every-zero", "train.gc_every_steps", "train.gc_every_steps=0"),
    # ---- runs that cannot fit this host's memory: refused before anything is allocated
    run("batch-beyond-host", "train.global_batch_size", "train.global_batch_size=1000000"),
    run("8b-on-cpu", "model", "model=llama3_8b", "tokenizer=llama3", "tokenizer.path={tmp}/bytes.model"),
    run("70b-on-cpu", "model", "model=llama3_70b"),
    # ---- optimizer and LR schedule
    run("lr-nan", "optimizer.lr", "optimizer.lr=nan"),
    run("beta1-above-1", "optimizer.beta1", "optimizer.beta1=1.5"),
    run("min-lr-ratio-above-1", "lr_schedule.min_lr_ratio", "lr_schedule.min_lr_ratio=2"),
    # ---- model
    run("kv-heads-not-dividing", "model.n_kv_heads", "model.n_kv_heads=3"),
    run("heads-zero", "model.n_heads", "model.n_heads=0"),
    run("schema-as-model", "model.name", "model.name=???"),
    run("norm-eps-negative", "model.norm_eps", "model.norm_eps=-1"),
    run("rope-theta-zero", "model.rope_theta", "model.rope_theta=0"),
    run("rope-scaling-zero", "model.rope_scaling_factor", "model.rope_scaling_factor=0"),
    run("ffn-multiplier-negative", "model.ffn_dim_multiplier", "model.ffn_dim_multiplier=-1"),
    # ---- keys the schema lacks, appended with +; interpolations that do not resolve
    run("appended-key", "train.foo", "+train.foo=1"),
    run("bad-interpolation", "train.steps", "train.steps=${nope}"),
    # ---- logger
    run("online-without-api-key", "logger.mode", "logger=wandb", "logger.mode=online", WANDB_API_KEY=""),
    # ---- checkpoints
    run("checkpoint-every-zero", "checkpoint.every_steps", "checkpoint.every_steps=0"),
    run("checkpoint-keep-zero", "checkpoint.keep", "checkpoint.keep=0"),
    run("resume-missing", "checkpoint.resume", "checkpoint.resume=/nonexistent/step_0000010"),
    # ---- data and tokenizer files ({tmp}: a folder of prepared bad files)
    run("prefetch-negative", "data.prefetch", "data.prefetch=-1"),
    run("tokenize-threads-zero", "data.tokenize_threads", "data.tokenize_threads=0"),
    run("text-without-path", "data.path", "data=text"),
    run("text-missing-path", "data.path", "data=text", "data.path=/nonexistent"),
    run("text-empty-file", "data.path", "data=text", "data.path={tmp}/empty.txt"),
    run("jsonl-missing-file", "data.path", "data=jsonl", "data.path={tmp}/missing.jsonl"),
    run("jsonl-bad-json", "data.path", "data=jsonl", "data.path={tmp}/bad.jsonl"),
    run("jsonl-wrong-field", "data.text_field", "data=jsonl", "data.path={tmp}/nofield.jsonl"),
    run("jsonl-no-text", "data.path", "data=jsonl", "data.path={tmp}/blank.jsonl"),
    run("tokenizer-without-path", "tokenizer.path", "tokenizer=llama3"),
    run("tokenizer-missing-file", "tokenizer.path", "tokenizer=llama3", "tokenizer.path=/nonexistent/tokenizer.model"),
    run("tokenizer-beyond-vocab", "model.vocab_size", "tokenizer=llama3", "tokenizer.path={tmp}/bytes.model"),
]


def _bad_files(folder: Path) -> Path:
    (folder / "empty.txt").write_text("")
    (folder / "bad.jsonl").write_text('{"text": oops\n')
    (folder / "nofield.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    (folder / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    # a valid tiktoken BPE with the 256 bytes: 256 ranks + 256 specials = 512 ids, more than the debug model's 258
    (folder / "bytes.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return folder


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    return _bad_files(tmp_path_factory.mktemp("bad_input_files"))


def _overrides(case: Case, files: Path) -> list[str]:
    return ["logger=none", *(o.replace("{tmp}", str(files)) for o in case.overrides)]


def reject(case: Case, files: Path, run_dir: Path, monkeypatch) -> str:
    """The error a case gets in this process; raises AssertionError when it is not rejected cleanly."""
    for key, value in case.env:
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    if case.stage == "hydra":
        with pytest.raises(ConfigCompositionException) as err:
            compose_cfg(*_overrides(case, files))
        first = str(err.value).splitlines()[0]
        assert case.key in first, f"the first line of Hydra's message does not name {case.key!r}: {first!r}"
        # what train.py prints for it (membudget.console.one_line_hydra_errors): one line naming the key
        line = composition_error_line(err.value)
        assert "\n" not in line and case.key in line, f"train.py's line does not name {case.key!r}: {line!r}"
        return first
    from membudget.trainer import train

    with pytest.raises(UserError) as err:
        train(compose_cfg(*_overrides(case, files)), run_dir)
    message = str(err.value)
    assert message.startswith(case.key), f"the error does not start with the key {case.key!r}: {message!r}"
    assert "\n" not in message, f"not one line: {message!r}"
    key, _, value = case.overrides[-1].partition("=") if case.overrides else ("", "", "")
    if key == case.key:  # the value given is named too
        assert value.replace("{tmp}", str(files)).lower().strip("[]") in message.lower(), message
    return message


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_fast_in_one_line_without_leftovers(case, bad_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    import membudget.fit
    import membudget.trainer

    monkeypatch.setattr(membudget.fit, "available_bytes",
                        lambda device, local_ranks: (HOST_GIB * GiB, "this host's available memory"))
    steps = []  # fails fast: in validation or at the first batch, before any forward pass
    monkeypatch.setattr(membudget.trainer, "forward_backward", lambda *a, **k: steps.append(a) or 1 / 0)
    message = reject(case, bad_files, tmp_path / "run", monkeypatch)
    assert not steps, "a training step ran before the input was rejected"
    leftovers = [p.name for p in (tmp_path / "run").iterdir() if not ALLOWED_IN_RUN_DIR.fullmatch(p.name)] \
        if (tmp_path / "run").is_dir() else []
    assert not leftovers, f"left run artefacts: {leftovers}"
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["run"]), "wrote into the working dir"
    # every group=option or section.key=value the fix suggests composes
    for suggestion in suggested_overrides(message):
        compose_cfg(*_overrides(case, bad_files), suggestion)


def suggested_overrides(message: str) -> list[str]:
    """The overrides a message suggests (`tokenizer=llama3`, `ac.memory_budget=0.5*4`, `plan.budgets=[0.3,0.5]`),
    placeholders left out."""
    fix = message.split(": ", 1)[1] if ": " in message else ""
    found = []
    for key, value in re.findall(r"(?<![\w.])(\+?[a-z_]+(?:[./][a-z_]+)*)=(\[[^\]\s]*\]|[^\s,;()'\"`]+)", fix):
        value = value.rstrip(".")
        if key.lstrip("+").split(".")[0].split("/")[0] not in SECTIONS + GROUPS or "<" in value or value.isupper():
            continue
        if key in GROUPS and value not in group_options(key):
            raise AssertionError(f"the message suggests {key}={value}, which is not an option: {message!r}")
        found.append(f"{key}={value}")
    return found


def test_fsdp_on_one_process_says_so(tmp_path, caplog):
    from tests.conftest import TINY, train_here

    with caplog.at_level("WARNING", logger="membudget"):
        train_here(tmp_path / "run", *TINY, "parallelism=fsdp", "train.steps=1", "checkpoint.enabled=false")
    lines = [r.getMessage() for r in caplog.records if "parallelism=fsdp on one process" in r.getMessage()]
    assert len(lines) == 1 and "torchrun" in lines[0]


# --- the process itself --------------------------------------------------------------------------------------

def _train_py(cwd: Path, *args: str, env: Optional[dict] = None, timeout: float = 60):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=subprocess_env(**(env or {})), stdin=subprocess.DEVNULL)


def _one_error_line(proc) -> str:
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error: " in line or "Error" in line.split(" - ")[0]]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


@pytest.mark.slow
def test_train_py_exit_codes_and_one_line(tmp_path):
    """Composition errors exit 1 with Hydra's message; the run's own errors exit 2 with one `error:` line; no
    traceback; nothing written."""
    composed = _train_py(tmp_path, f"hydra.run.dir={tmp_path / 'a'}", "ac=nonsense")
    assert composed.returncode == 1 and "Traceback" not in composed.stderr
    assert "ac/nonsense" in composed.stderr.strip().splitlines()[0]
    rejected = _train_py(tmp_path, f"hydra.run.dir={tmp_path / 'b'}", MB, "compile.enabled=false", "logger=none")
    assert rejected.returncode == 2
    assert _one_error_line(rejected).split("error: ", 1)[1].startswith("compile.enabled=False")
    assert {p.name for p in (tmp_path / "b").iterdir()} <= {".hydra", "train.log"}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["file", "proc"])
def test_run_dir_that_cannot_be_made(tmp_path, where):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    run_dir = blocker / "run" if where == "file" else Path("/proc/membudget_run")
    proc = _train_py(tmp_path, f"hydra.run.dir={run_dir}", "logger=none")
    assert proc.returncode != 0
    line = _one_error_line(proc)
    assert "hydra.run.dir" in line and str(run_dir) in line


@pytest.mark.slow
def test_a_peer_that_never_comes_is_one_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # the 3 s rendezvous deadline ends it; the generous subprocess timeout only keeps a hang from stalling the suite
    proc = _train_py(tmp_path, f"hydra.run.dir={tmp_path / 'run'}", "parallelism=fsdp", "logger=none",
                     "parallelism.timeout_s=3", env=env, timeout=600)
    assert proc.returncode == 2
    line = _one_error_line(proc)
    assert "parallelism.timeout_s=3" in line and "rank 0 of 2" in line
