"""Bad input thrown at the real `python train.py`: every case must fail fast, cleanly and without side effects.

Each case is one command line (plus, for the parallelism cases, torchrun's RANK/WORLD_SIZE in the environment:
validation runs before any rendezvous, so no second process is needed). Every case must

- exit non-zero (Hydra's composition errors: 1; the run's own UserError: 2) well within CASE_LIMIT_S, no hang;
- name the offending key: in the single "error: <key>=..." line for a UserError, in the first line of Hydra's
  message for a composition error (unknown key, wrong type, unknown group option);
- print no Python traceback;
- leave nothing but Hydra's own files in the run dir (.hydra/, train.log): no metrics.jsonl, summary.json,
  checkpoints or W&B run, and nothing in the working directory.

The cases run as subprocesses in a small thread pool (each start costs seconds of CPU); one test collects every
failure and reports them together. The number of cases tried is printed in pytest's terminal summary.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from tests.conftest import ROOT

CASE_LIMIT_S = 30  # each case must end within this (it fails in validation: a few seconds of imports)
HARD_TIMEOUT_S = 60  # a case still running then is killed and reported as a hang
WORKERS = max(2, min(4, os.cpu_count() or 2))
# What a run dir may hold after a rejected run: Hydra's own files, nothing the run writes.
ALLOWED_IN_RUN_DIR = re.compile(r"\.hydra|train(_rank\d+)?\.log")
# Launcher variables of an enclosing torchrun/SLURM job would change every case's world size: never inherited.
LAUNCH_VARS = re.compile(r"RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|"
                         r"TORCHELASTIC_.*|SLURM_.*|HYDRA_FULL_ERROR")


@dataclass(frozen=True)
class Case:
    id: str
    key: str  # must be named in the error line
    overrides: tuple[str, ...]
    stage: str  # "hydra": composition error, exit 1 | "run": UserError from train.py, exit 2
    env: tuple[tuple[str, str], ...] = ()


def hydra(id: str, key: str, *overrides: str) -> Case:
    return Case(id, key, overrides, "hydra")


def run(id: str, key: str, *overrides: str, world: Optional[int] = None, rank: int = 0,
        **env: str) -> Case:
    if world is not None:
        env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    return Case(id, key, overrides, "run", tuple(sorted(env.items())))


MB = "ac=memory_budget"
CASES = [
    # ---- Hydra composition: unknown keys, wrong types, unknown group options (Hydra's own message, exit 1)
    hydra("unknown-key", "ac.memroy_budget", "ac.memroy_budget=0.3"),
    hydra("unknown-train-key", "train.sequence_length", "train.sequence_length=8"),
    hydra("unknown-section", "optimiser", "optimiser.lr=1e-3"),
    hydra("steps-not-int", "train.steps", "train.steps=abc"),
    hydra("dim-float", "model.dim", "model.dim=1.5"),
    hydra("seq-len-float", "train.seq_len", "train.seq_len=1e9"),
    hydra("steps-null", "train.steps", "train.steps=null"),
    hydra("batch-empty", "train.global_batch_size", "train.global_batch_size="),
    hydra("compile-enabled-not-bool", "compile.enabled", "compile.enabled=maybe"),
    hydra("force-recompute-not-list", "ac.force_recompute_modules", "ac.force_recompute_modules=w2"),
    hydra("target-gib-string", "ac.target_memory_gib", MB, "ac.memory_budget=auto", "ac.target_memory_gib=abc"),
    hydra("section-as-scalar", "train", "train=fast"),
    hydra("unknown-ac-option", "ac/nonsense", "ac=nonsense"),
    hydra("unknown-parallelism", "parallelism/tp2", "parallelism=tp2"),
    hydra("unknown-model", "model/llama3_9b", "model=llama3_9b"),
    hydra("unknown-data", "data/hf", "data=hf"),
    hydra("unknown-tokenizer", "tokenizer/sentencepiece", "tokenizer=sentencepiece"),
    hydra("unknown-logger", "logger/tensorboard", "logger=tensorboard"),
    hydra("unknown-experiment", "experiment/nope", "experiment=nope"),
    hydra("unknown-ac-point", "ac_point/mb11", "+ac_point=mb11"),
    # ---- AC and compile (validate, exit 2)
    run("budget-without-compile", "compile.enabled", MB, "compile.enabled=false"),
    run("budget-aot-eager", "compile.backend", MB, "compile.backend=aot_eager"),
    run("budget-above-1", "ac.memory_budget", MB, "ac.memory_budget=1.5"),
    run("budget-nan", "ac.memory_budget", MB, "ac.memory_budget=nan"),
    run("budget-string", "ac.memory_budget", MB, "ac.memory_budget=abc"),
    run("budget-sweep", "ac.memory_budget", MB, "ac.memory_budget=sweep"),
    run("unknown-solver", "ac.solver", MB, "ac.solver=magic"),
    run("selective-word", "ac.selective_option", "ac=selective", "ac.selective_option=sometimes"),
    # ---- parallelism: degrees vs the world size of a (pretended) torchrun launch; validation precedes rendezvous
    run("tp-not-dividing-seq", "parallelism.tp", "parallelism=tp", MB, "train.seq_len=255", world=2),
    run("tp-not-dividing-heads", "parallelism.tp", "parallelism=tp", world=3),
    run("fsdp-tp-odd-world", "parallelism.dp_shard", "parallelism=fsdp_tp", world=3),
    run("single-on-two-ranks", "parallelism", "parallelism=single", world=2),
    run("two-inferred-degrees", "parallelism.dp_shard", "parallelism=ddp", "parallelism.dp_shard=-1", world=4),
    run("batch-not-divisible", "train.global_batch_size", "parallelism=fsdp", world=3),
    # ---- train
    run("steps-negative", "train.steps", "train.steps=-1"),
    run("batch-zero", "train.global_batch_size", "train.global_batch_size=0"),
    run("seq-len-beyond-max", "train.seq_len", "train.seq_len=4096"),
    run("micro-batch-not-divisor", "train.micro_batch_size", "train.micro_batch_size=3"),
    run("grad-norm-negative", "train.max_grad_norm", "train.max_grad_norm=-1"),
    run("seed-negative", "train.seed", "data=synthetic", "train.seed=-1"),
    # ---- optimizer and LR schedule
    run("lr-nan", "optimizer.lr", "optimizer.lr=nan"),
    run("beta1-above-1", "optimizer.beta1", "optimizer.beta1=1.5"),
    run("min-lr-ratio-above-1", "lr_schedule.min_lr_ratio", "lr_schedule.min_lr_ratio=2"),
    # ---- model
    run("kv-heads-not-dividing", "model.n_kv_heads", "model.n_kv_heads=3"),
    run("heads-zero", "model.n_heads", "model.n_heads=0"),
    run("schema-as-model", "model.name", "model=model_schema"),
    # ---- keys the schema lacks, appended with +; interpolations that do not resolve
    run("appended-key", "train.foo", "+train.foo=1"),
    run("bad-interpolation", "train.steps", "train.steps=${nope}"),
    # ---- logger
    run("unknown-wandb-mode", "logger.mode", "logger.mode=bogus"),
    # ---- checkpoints
    run("checkpoint-every-zero", "checkpoint.every_steps", "checkpoint.every_steps=0"),
    run("resume-missing", "checkpoint.resume", "checkpoint.resume=/nonexistent/step_0000010"),
    # ---- data and tokenizer files ({tmp}: a folder of prepared bad files)
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


@dataclass
class Result:
    returncode: Optional[int]  # None: killed after HARD_TIMEOUT_S
    output: str  # stdout then stderr
    stderr: str
    elapsed: float
    leftovers: list[str]  # what the case left that it should not have


def _bad_files(folder: Path) -> Path:
    (folder / "empty.txt").write_text("")
    (folder / "bad.jsonl").write_text('{"text": oops\n')
    (folder / "nofield.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    (folder / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    # a valid tiktoken BPE with the 256 bytes: 256 ranks + 256 specials = 512 ids, more than the debug model's 258
    (folder / "bytes.model").write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return folder


def _env(case: Case) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARS.fullmatch(k)}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    env.update(case.env)
    return env


def _run_case(case: Case, base: Path, data: Path) -> Result:
    """`python train.py` in its own working dir; the run dir is <that dir>/run."""
    cwd = base / case.id
    cwd.mkdir()
    overrides = [o.replace("{tmp}", str(data)) for o in case.overrides]
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={cwd / 'run'}", *overrides]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=_env(case), capture_output=True, text=True, timeout=HARD_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        returncode = None
        stdout, stderr = (s.decode(errors="replace") if isinstance(s, bytes) else s or "" for s in (e.stdout, e.stderr))
    elapsed = time.monotonic() - start
    leftovers = [p.name for p in cwd.iterdir() if p.name != "run"]
    if (cwd / "run").is_dir():
        leftovers += [f"run/{p.name}" for p in (cwd / "run").iterdir() if not ALLOWED_IN_RUN_DIR.fullmatch(p.name)]
    return Result(returncode, stdout + stderr, stderr, elapsed, sorted(leftovers))


def problems(case: Case, r: Result) -> list[str]:
    """What is wrong with how train.py rejected the case; empty when it failed cleanly."""
    found = []
    if r.returncode is None:
        return [f"hung: still running after {HARD_TIMEOUT_S} s, killed"]
    expected = 1 if case.stage == "hydra" else 2
    if r.returncode != expected:
        found.append(f"exit code {r.returncode}, expected {expected}")
    if r.elapsed >= CASE_LIMIT_S:
        found.append(f"took {r.elapsed:.1f} s (limit {CASE_LIMIT_S} s)")
    if "Traceback" in r.output:
        found.append("printed a traceback")
    if case.stage == "run":
        errors = [line for line in r.output.splitlines() if "error: " in line]
        if len(errors) != 1:
            found.append(f"{len(errors)} 'error:' lines, expected exactly 1")
        elif not errors[0].split("error: ", 1)[1].startswith(case.key):
            found.append(f"the error line does not start with the key {case.key!r}: {errors[0]!r}")
    else:
        first = next((line for line in r.stderr.splitlines() if line.strip()), "")
        if case.key not in first:
            found.append(f"the first line of Hydra's message does not name {case.key!r}: {first!r}")
    if r.leftovers:
        found.append(f"left run artefacts: {', '.join(r.leftovers)}")
    return found


def _report(case: Case, r: Result, found: list[str]) -> str:
    tail = "\n".join("      " + line for line in r.output.strip().splitlines()[-6:])
    return (f"- {case.id} [{' '.join(case.overrides)}{''.join(f' {k}={v}' for k, v in case.env)}] "
            f"({r.elapsed:.1f} s): {'; '.join(found)}\n{tail}")


class _CountInSummary:
    """A plugin registered at run time: puts the number of cases tried into pytest's terminal summary."""

    def __init__(self, results: dict[str, Result]):
        self.results = results

    def pytest_terminal_summary(self, terminalreporter):
        if self.results:
            slowest = max(r.elapsed for r in self.results.values())
            terminalreporter.write_sep("-", f"bad-input cases tried: {len(self.results)} "
                                            f"(train.py runs, {WORKERS} at a time; slowest {slowest:.1f} s)")


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, Result]:
    """Every case run once, a few at a time: {case id: Result}."""
    data = _bad_files(tmp_path_factory.mktemp("bad_input_files"))
    base = tmp_path_factory.mktemp("bad_input_runs")
    out: dict[str, Result] = {}
    request.config.pluginmanager.register(_CountInSummary(out), "bad-input-count")
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for case, result in zip(CASES, pool.map(lambda c: _run_case(c, base, data), CASES)):
            out[case.id] = result
    return out


def test_case_table_is_well_formed():
    assert len(CASES) >= 40
    assert len({c.id for c in CASES}) == len(CASES), "case ids must be unique"
    assert all(c.stage in ("hydra", "run") and c.key for c in CASES)


def test_bad_input_fails_fast_in_one_line_without_leftovers(results):
    failures = []
    for case in CASES:
        found = problems(case, results[case.id])
        if found:
            failures.append(_report(case, results[case.id], found))
    assert not failures, f"{len(failures)} of {len(CASES)} bad inputs were not rejected cleanly:\n" + "\n".join(
        failures)
