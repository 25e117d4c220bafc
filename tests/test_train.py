"""Training end to end, as a user runs it: metrics.jsonl, summary.json and an offline W&B run; what the console
and train.log say while a run goes; the default run learns; the README's inductor command runs as typed."""

import gc
import json
import logging
import math
import statistics

import pytest

from membudget.schema import parse_block_budgets
from membudget.units import GiB
from tests.conftest import FAST_COMPILE, TINY, read_metrics, read_summary, run_train, train_here
from tests.wandb_offline import find_offline_runs, read_offline_run

METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "activation_bytes",
               "activation_bytes_per_block", "peak_memory_bytes", "mfu", "skipped"}


@pytest.mark.parametrize("ac", [
    ["ac=none"], ["ac=full"], ["ac=selective"], ["ac=selective", "ac.selective_option=2"],
    pytest.param(["ac=memory_budget", FAST_COMPILE], marks=pytest.mark.slow),
    pytest.param(["ac=memory_budget", FAST_COMPILE, "ac.memory_budget=0.0*2+1.0*2"], marks=pytest.mark.slow),
])
def test_train_writes_metrics_and_summary(tmp_path, ac):
    summary = train_here(tmp_path / "run", *TINY, *ac, "train.global_batch_size=4", "train.micro_batch_size=2")
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(METRIC_KEYS <= set(r) for r in rows)
    assert all(r["activation_bytes"] > 0 and r["peak_memory_bytes"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(sum(r["activation_bytes_per_block"]) < r["activation_bytes"] for r in rows)  # + embedding, loss
    assert read_summary(tmp_path / "run") == json.loads(json.dumps(summary))
    assert summary["status"] == "completed" and summary["final_loss"] == rows[-1]["loss"]
    assert summary["num_params"] > 0 and summary["activation_bytes"] == rows[-1]["activation_bytes"]
    assert summary["config"]["ac"]["mode"] == ac[0].split("=")[1]
    assert {"median_tokens_per_s", "peak_memory_bytes", "steady_peak_memory_bytes", "mfu"} <= set(summary)
    assert summary["median_steps"] == [1, 3]  # fewer than four logged steps: the medians leave none out


def test_wandb_offline_run_holds_the_metrics(tmp_path):
    summary = train_here(tmp_path / "run", *TINY, "logger=wandb", "ac=selective")
    rows = read_metrics(tmp_path / "run")
    (wandb_dir,) = find_offline_runs(tmp_path / "run")
    run = read_offline_run(wandb_dir)
    assert run["id"] == summary["wandb"]["id"] and run["exit_code"] == 0
    assert [h["loss"] for h in run["history"] if "loss" in h] == pytest.approx([r["loss"] for r in rows])
    assert run["config"]["ac"]["mode"] == "selective"
    assert "ac:selective" in run["tags"] and run["name"] == "llama3_debug-selective-op"


@pytest.mark.slow
def test_the_console_and_train_log_show_what_the_run_does(tmp_path):
    """On a terminal the bar shows the AC setting; train.log always holds every logged step, the start line
    names the whole setting, compilation is announced and timed, and DCP's single-process warning is gone."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, *TINY, "ac=memory_budget", FAST_COMPILE, "train.progress=bar", "train.steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    setting = "ac=memory_budget 0.5 (solver dp, estimator flops), compile aot_eager_decomp_partition"
    assert setting in log.splitlines()[0] or any(setting in line and "model llama3_debug" in line
                                                 for line in log.splitlines())
    assert all(f"step {s} | loss" in log for s in range(1, 5))
    assert "compiling 4 blocks" in log and "saved activations per block" in log
    assert f"done: {setting}" in log
    # the medians leave out the first quarter of the logged steps (the compiling one here), and say so
    assert read_summary(run_dir)["median_steps"] == [2, 4] and " tok/s over steps 2-4, " in log
    assert setting in proc.stderr  # the bar's description
    assert "step 2 | loss" not in proc.stderr  # the bar shows the step: its line goes to the file only
    assert "assuming the intent" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    train_here(tmp_path / "run", "logger=none", "train.steps=30", "train.seq_len=128", "data.prefetch=2")
    rows = read_metrics(tmp_path / "run")
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]


@pytest.mark.slow
def test_readme_command_runs_as_typed_with_inductor(tmp_path, monkeypatch):
    """`python train.py ac=memory_budget ac.memory_budget=0.4`: compile turns on, and inductor honours the budget:
    the activations saved lie 0.4 of the way from full AC's (everything recomputed) to budget 1.0's (compiled,
    nothing recomputed). Budget 1.0 is compiled without code generation (aot_eager_decomp_partition: inductor's
    decompositions and partitioner, which decide what is saved; both backends save the same bytes at 0.4 and 1.0),
    so that a new machine compiles one run with inductor, not two."""
    summary = train_here(tmp_path / "run", *TINY, "ac=memory_budget", "ac.memory_budget=0.4", "train.steps=2")
    assert summary["compile"] is True and summary["memory_budget"] == 0.4
    assert summary["config"]["compile"]["backend"] == "inductor"
    saved = {"full": train_here(tmp_path / "full", *TINY, "ac=full", "train.steps=2")["activation_bytes"],
             "1.0": train_here(tmp_path / "1.0", *TINY, "ac=memory_budget", "ac.memory_budget=1.0",
                               "train.steps=2", FAST_COMPILE)["activation_bytes"]}
    assert saved["full"] < summary["activation_bytes"] < saved["1.0"], (summary["activation_bytes"], saved)
    share = (summary["activation_bytes"] - saved["full"]) / (saved["1.0"] - saved["full"])  # 0.3998 on torch 2.13
    assert share == pytest.approx(0.4, abs=0.05), share

    # a later start of the run where its inductor cache is not (a requeue on another node) compiles from the code
    # the first start kept in the run dir: inductor's graphs are cache hits only (AOTAutograd's own cache passes
    # over graphs with saved-tensor hooks, as the activation counter's, so it traces again)
    from membudget.internals import compile_counters

    assert (tmp_path / "run" / "compile_cache.bin").is_file()
    # the process's next run compiled nothing inductor keeps (aot_eager), so it kept no earlier run's code either
    assert not (tmp_path / "1.0" / "compile_cache.bin").exists()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "another_node"))
    compile_counters.clear()
    resumed = train_here(tmp_path / "run", *TINY, "ac=memory_budget", "ac.memory_budget=0.4", "train.steps=3")
    assert resumed["activation_bytes"] == summary["activation_bytes"]
    hits, misses = (compile_counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss"))
    assert hits >= 1 and not misses, dict(compile_counters)


def test_what_a_step_waits_for_its_data_is_measured_and_a_slow_data_path_named(tmp_path):
    """data_wait_s: how long each step waited for its batch (the slowest rank's, per logged interval), here with
    the data read in the loop (data.prefetch=0); its median over the steady steps is in the summary. A median
    above DATA_WAIT_SHARE of the step is named at the end, with what to raise."""
    from membudget.rules import DATA_WAIT_SHARE, data_wait_line

    summary = train_here(tmp_path / "run", *TINY, "data.prefetch=0", "train.steps=4", "checkpoint.enabled=false")
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4 and all(0 < r["data_wait_s"] < r["step_time_s"] for r in rows), rows
    assert summary["median_data_wait_s"] == statistics.median(r["data_wait_s"] for r in rows[1:])
    line = data_wait_line({"median_data_wait_s": 0.06, "median_step_time_s": 1.0})
    assert line.startswith("the steps waited 0.06 s each for their batches, 6% of a step") and \
        "data.tokenize_threads" in line and "data.prefetch" in line and "python -m membudget.pretokenize" in line
    # a token file is not tokenized: its reads are what to speed up
    line = data_wait_line({"median_data_wait_s": 0.06, "median_step_time_s": 1.0,
                           "config": {"data": {"name": "tokens"}}})
    assert "copy the token file to faster storage" in line and "tokenize" not in line.replace("token file", "")
    for quiet in ({"median_data_wait_s": DATA_WAIT_SHARE, "median_step_time_s": 1.0},
                  {"median_data_wait_s": None, "median_step_time_s": None}):
        assert data_wait_line(quiet) is None


def test_a_compile_cache_torch_cannot_read_is_one_warning(tmp_path, caplog, capfd):
    """A damaged compile_cache.bin in a resumed run's dir: one line says so and that the run compiles, in place of
    torch's traceback."""
    from membudget import compile_cache

    path = tmp_path / "compile_cache.bin"
    path.write_bytes(b"not what torch.compiler.save_cache_artifacts writes")
    with caplog.at_level(logging.INFO, logger="membudget"):
        compile_cache.load(tmp_path)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", f"{path}: could not load it (torch cannot read it: damaged); compiling")]
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("every", [2, None])
def test_the_garbage_collector_runs_on_the_step_schedule_and_is_back_on_afterwards(tmp_path, every):
    """train.gc_every_steps=2 over 5 steps: Python's automatic collection is off through the steps, and the young
    generations are collected after step 1 (compilation's garbage), 2 and 4; null: the collector's own thresholds. The
    collector is on again after the run (gc.callbacks sees every collection and whether it was automatic)."""
    seen = []  # (generation, automatic collection possible) of every collection

    def note(phase, info):
        if phase == "start":
            seen.append((info["generation"], gc.isenabled()))

    thresholds = gc.get_threshold()
    gc.set_threshold(100)  # automatic collections, wherever the collector is on
    gc.callbacks.append(note)
    try:
        train_here(tmp_path / "run", *TINY, "train.steps=5", f"train.gc_every_steps={every or 'null'}",
                   "checkpoint.enabled=false")
    finally:
        gc.callbacks.remove(note)
        gc.set_threshold(*thresholds)
    assert gc.isenabled()
    scheduled = [g for g, automatic in seen if not automatic]
    if every is None:
        assert not scheduled and len(seen) > 10  # the automatic collector ran throughout
    else:
        assert scheduled == [1, 1, 1], seen


AUTO = ("ac=memory_budget", "ac.memory_budget=auto", FAST_COMPILE, "model.n_layers=2",
        "plan.budgets=[0.0,0.5,1.0]")  # a short sweep: the whole one is test_plan_cli's


@pytest.mark.slow
def test_auto_budget_is_planned_logged_and_used(tmp_path, caplog):
    with caplog.at_level("INFO", logger="membudget"):
        summary = train_here(tmp_path / "run", *TINY, *AUTO, "ac.target_memory_gib=0.05")
    chosen = summary["memory_budget"]
    assert chosen is not None and summary["ac_label"].startswith("memory_budget")
    # one of the three, or a mix of them per block: auto chooses among plan.budgets only
    assert set(parse_block_budgets(chosen) if isinstance(chosen, str) else [chosen]) <= {0.0, 0.5, 1.0}, chosen
    assert any(f"ac.memory_budget=auto -> {chosen}" in r.getMessage() for r in caplog.records)
    # the plan it chose is in the run dir, as `python -m membudget.plan` writes one: what the run ran
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["memory_budget"] == chosen and plan["activations"] == summary["activation_bytes"]
    # and in the summary (and so W&B's), beside what was measured
    assert summary["planned"]["activation_bytes"] == summary["activation_bytes"] == plan["activations"]
    assert summary["planned"]["peak_memory_bytes"] == plan["peak"] and summary["planned"]["verdict"] == "fits"
    assert plan["limit"] == int(0.05 * GiB) and plan["fits"]
    assert (tmp_path / "run" / "plan.md").read_text().startswith(f"# Plan: llama3_debug, {plan['label']}")

    # resumed (a requeued job, a longer run): the first start's choice and plan are kept, nothing is planned
    def start(*overrides):
        caplog.clear()
        with caplog.at_level("INFO", logger="membudget"):
            summary = train_here(tmp_path / "run", *TINY, *AUTO, *overrides)
        return summary, [r.getMessage() for r in caplog.records if "ac.memory_budget=auto" in r.getMessage()]

    resumed, said = start("ac.target_memory_gib=0.05", "train.steps=5")
    assert said[0].startswith(f"ac.memory_budget=auto: keeping {chosen}, the choice of this run's first start")
    assert not [line for line in said if "planning the budgets" in line]
    assert resumed["memory_budget"] == chosen and resumed["planned"] == summary["planned"]
    kept = json.loads((tmp_path / "run" / "plan.json").read_text())
    varies = ("seconds", "device")  # planning time, and a CPU's memory: what the host has free just then
    assert {k: v for k, v in kept.items() if k not in varies} == {k: v for k, v in plan.items() if k not in varies}
    # what auto chooses from changed: it says what, and chooses again
    _, said = start("ac.target_memory_gib=0.06", "train.steps=6")
    assert said[0].startswith("ac.memory_budget=auto: choosing again: what it chooses from changed since this "
                              "run's earlier start (ac.target_memory_gib: 0.05 -> 0.06; limit_bytes: "), said
    assert "planning the budgets [0,0.5,1]" in said[1], said
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["auto_inputs"] != plan["auto_inputs"]


def test_what_auto_chooses_from_is_the_planning_config_the_device_and_torch():
    """auto_inputs, which a resumed run compares to keep its choice: the run's length, logging, checkpoints and
    data leave it alone; what a plan reads changes it."""
    from membudget.plan import auto_inputs
    from tests.conftest import compose_cfg

    base = ("ac=memory_budget", "ac.memory_budget=auto", "ac.target_memory_gib=1", "parallelism=fsdp")
    inputs = auto_inputs(compose_cfg(*base), 1, "cpu")
    same = ("train.steps=99", "train.log_every=7", "logger=wandb", "checkpoint.every_steps=3", "data=synthetic",
            "train.progress=off", "parallelism.timeout_s=60")
    assert auto_inputs(compose_cfg(*base, *same), 1, "cpu") == inputs
    for other in (["ac.target_memory_gib=2"], ["train.seq_len=128"], ["plan.budgets=[0.0,1.0]"],
                  ["compile.backend=aot_eager_decomp_partition"], ["train.max_grad_norm=0.5"]):
        assert auto_inputs(compose_cfg(*base, *other), 1, "cpu") != inputs, other
    assert auto_inputs(compose_cfg(*base), 2, "cpu") != inputs  # the world size
    assert auto_inputs(compose_cfg(*base), 1, "cuda") != inputs  # the device planned for


def test_mfu_excludes_the_embedding_lookup():
    """flops_per_token (the MFU numerator, torchtitan's convention: 6 FLOPs per matmul parameter, the embedding a
    lookup, plus full attention) agrees with torch's FlopCounterMode on one real step of the debug model, tied and
    untied. Attention runs on the math backend so its matmuls are counted; the counter skips only the RMSNorm
    weights, which the convention counts as 6 FLOPs per parameter."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from membudget.metrics import ActivationCounter, flops_per_token
    from membudget.step import build_model, forward_backward
    from tests.conftest import compose_cfg

    batch, seq_len = 2, 64
    for tie in (False, True):
        cfg = compose_cfg("logger=none", f"model.tie_embeddings={str(tie).lower()}")
        torch.manual_seed(0)
        model = build_model(cfg, torch.device("cpu"))
        tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq_len + 1))
        with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
            forward_backward(model, tokens[:, :-1], tokens[:, 1:], ActivationCounter(model))
        norm_params = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
        counted = counter.get_total_flops() / (batch * seq_len) + 6 * norm_params
        assert counted == flops_per_token(model, seq_len), tie
        assert math.isfinite(counted)
