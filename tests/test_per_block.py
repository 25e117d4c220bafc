"""Per-block AC policies and activation offloading (ac=per_block, ac=offload): the spelling users type, the one-line
errors, a mixed plan trained on CPU with exactly the planned activation bytes per block and the loss of ac=none,
offloaded tensors copied out and back bit-identically through an interrupted and resumed run, the planner's
pricing of offloading on a GPU, and ac.blocks=auto."""

import dataclasses
import json

import pytest
import torch

from membudget.checkpoint import Checkpointer
from membudget.devices import GPUS
from membudget.errors import UserError
from membudget.offload import Offloader, find_offloader
from membudget.plan import Planner, plan_setting, plan_sweep
from membudget.plan.blocks import compatible, cost, fits, per_target, targets_between
from membudget.plan.timing import step_time
from membudget.rules import validate
from membudget.schema import BlockPolicy, ac_label, block_policies, compact_policies, parse_block_policies
from membudget.units import GiB
from tests.checkpoint_driver import SMALL, Run, scope
from tests.conftest import FAST_COMPILE, compose_cfg, read_metrics, read_summary, train_here

RUN = ["logger=none", "train.device=cpu", "train.seq_len=128", "train.global_batch_size=4", "train.steps=2",
       "train.progress=lines", "data.prefetch=0", "checkpoint.enabled=false"]
MIXED = "full+offload:selective+selective+offload"


def test_policies_spell_parse_and_name_every_mode():
    policies = parse_block_policies("full*2+budget:0.3+offload:selective+offload+none*3")
    assert [str(p) for p in policies] == ["full", "full", "budget:0.3", "offload:selective", "offload", "none",
                                          "none", "none"]
    assert policies[2] == BlockPolicy("budget", 0.3) and policies[3] == BlockPolicy("selective", None, True)
    assert compact_policies(policies) == "full*2+budget:0.3+offload:selective+offload+none*3"
    assert parse_block_policies(compact_policies(policies)) == policies
    # every mode has a policy per block: the planner and the report see them alike
    for overrides, spelled, label in (
            (["ac=none"], "none*4", "none"),
            (["ac=selective", "ac.selective_option=2"], "none+full+none+full", "selective every 2"),
            (["ac=memory_budget", "ac.memory_budget='0.3*2+0.6*2'"], "budget:0.3*2+budget:0.6*2",
             "memory_budget 0.3*2+0.6*2"),
            (["ac=offload", "ac.offload_with=full"], "offload:full*4", "offload full"),
            (["ac=per_block", f"ac.blocks='{MIXED}'"], MIXED, f"per_block {MIXED}")):
        cfg = compose_cfg("logger=none", *overrides)
        validate(cfg, 1)
        assert compact_policies(block_policies(cfg.ac, 4)) == spelled and ac_label(cfg.ac) == label


@pytest.mark.parametrize("blocks, says", [
    ("full*3", "gives 3 policies but model.n_layers=4"),
    ("full*2+bogus*2", "give policy*count terms of none, full, selective, budget:<b>, offload"),
    ("budget:1.5*4", "budgets are numbers in [0, 1]"),
    ("offload:budget:0.3*4", "give policy*count terms"),
    ("offload:none*4", "give policy*count terms"),
])
def test_a_bad_blocks_value_is_one_line_naming_the_key_the_value_and_the_fix(blocks, says):
    with pytest.raises(UserError) as e:
        validate(compose_cfg("logger=none", "ac=per_block", f"ac.blocks='{blocks}'"), 1)
    message = str(e.value)
    assert message.startswith(f"ac.blocks='{blocks}': ") and says in message and "\n" not in message
    assert "e.g. ac.blocks=" in message  # the fix, as an override that composes
    validate(compose_cfg("logger=none", "ac=per_block", message.split("e.g. ")[1]), 1)


def test_offload_with_is_read_only_by_ac_offload():
    with pytest.raises(UserError, match=r"^ac.offload_with='full': only ac=offload reads it"):
        validate(compose_cfg("logger=none", "ac=full", "ac.offload_with=full"), 1)


def _per_block_bytes(plan) -> list[int]:
    return [b.activation_bytes for b in sorted(plan.blocks, key=lambda b: b.block)]


@pytest.mark.parametrize("blocks, compiled", [(MIXED, False),
                                               pytest.param("budget:0.0+full+budget:0.5+none", True,
                                                            marks=pytest.mark.slow)])
def test_a_mixed_plan_trains_with_the_planned_bytes_per_block_and_the_loss_of_none(tmp_path, blocks, compiled):
    overrides = [*RUN, FAST_COMPILE, "ac=per_block", f"ac.blocks='{blocks}'"]
    mixed = train_here(tmp_path / "mixed", *overrides)
    none = train_here(tmp_path / "none", *RUN, "ac=none")
    plan = plan_setting(compose_cfg(*overrides))
    assert parse_block_policies(plan.policies) == parse_block_policies(blocks) and len(plan.blocks) == 4  # four kinds of block: all four probed
    assert mixed["activation_bytes_per_block"] == _per_block_bytes(plan)  # the planner is exact on CPU
    assert mixed["activation_bytes"] == plan.activations
    kept = mixed["activation_bytes_per_block"]
    if compiled:
        assert len(set(kept)) == 4  # each policy keeps its own amount
    else:  # on a CPU offloading saves nothing: offload:selective keeps what selective keeps, offload what none does
        assert kept[0] < kept[1] == kept[2] < kept[3] == none["activation_bytes_per_block"][3]
    assert mixed["ac_policies"] == plan.policies and mixed["compile"] is compiled
    losses = [r["loss"] for r in read_metrics(tmp_path / "mixed")]
    reference = [r["loss"] for r in read_metrics(tmp_path / "none")]
    if compiled:  # the compiled blocks' decompositions round differently
        assert losses == pytest.approx(reference, abs=1e-5)
    else:  # recompute and offloading are exact: bitwise
        assert losses == reference
    assert none["activation_bytes"] > mixed["activation_bytes"]


def test_wandb_and_the_summary_name_the_policies_and_hold_the_bytes_per_block(tmp_path):
    from tests.wandb_offline import find_offline_runs, read_offline_run

    summary = train_here(tmp_path / "run", *RUN, "logger=wandb", "ac=per_block", f"ac.blocks='{MIXED}'")
    (wandb_dir,) = find_offline_runs(tmp_path / "run")
    run = read_offline_run(wandb_dir)
    assert run["name"] == f"llama3_debug-per_block-{MIXED}" and run["config"]["ac"]["blocks"] == MIXED
    assert "ac:per_block" in run["tags"]
    last = [h for h in run["history"] if "loss" in h][-1]  # bytes per block: one series each, bottom block 0
    assert [last[f"activation_bytes_per_block/{i}"] for i in range(4)] == summary["activation_bytes_per_block"]
    assert summary["ac_label"] == f"per_block {MIXED}" and summary["ac_policies"] == MIXED
    assert summary["offload_host_bytes"] == 0  # a CPU run copies nothing


@pytest.fixture
def copies_on_cpu(monkeypatch):
    """Offloading that copies on a CPU too (into separate host buffers), so its copies are exercised here."""
    init = Offloader.__init__
    monkeypatch.setattr(Offloader, "__init__", lambda self, target=None, **kw: init(self, target or "cpu", **kw))


def test_offloaded_tensors_come_back_bitwise_and_an_interrupted_offloaded_step_resumes_exactly(
        tmp_path, monkeypatch, copies_on_cpu):
    cfg = compose_cfg(*SMALL, "ac=offload", "ac.offload_with=selective")
    reference_cfg = compose_cfg(*SMALL, "ac=selective")
    with scope(reference_cfg):
        reference = Run.build(reference_cfg).train(6)
    checkpointer = Checkpointer(tmp_path, cfg.checkpoint)
    with scope(cfg):
        run = Run.build(cfg)
        first = run.train(3)
        offloader = find_offloader(run.model)
        assert offloader.target == "cpu" and sum(offloader.host_bytes.values()) > 0  # copies were made
        assert offloader.held_host_bytes == 0  # and all released after each backward
        run.save(checkpointer, 3)
        uninterrupted = first + run.train(3)
        assert uninterrupted == reference  # every tensor came back as it left: the losses are bitwise

        interrupted = Run.build(cfg)
        interrupted.load(checkpointer)
        fetch = Offloader._fetch

        def killed_in_backward(self, index):
            if index == 1:
                raise KeyboardInterrupt("killed while block 1's activations were in host memory")
            fetch(self, index)

        monkeypatch.setattr(Offloader, "_fetch", killed_in_backward)
        with pytest.raises(KeyboardInterrupt):
            interrupted.train(1)
        monkeypatch.setattr(Offloader, "_fetch", fetch)

        restarted = Run.build(cfg)  # the same command again, in a new process
        restarted.load(checkpointer)
        assert first + restarted.train(3) == uninterrupted


def test_the_planner_moves_offloaded_activations_to_the_host_and_prices_the_copies():
    """On a GPU target the probe's offloading blocks keep nothing on the device, the host holds what they saved,
    and the copies cost time only where the host link is slower than the blocks' compute."""
    cfg = compose_cfg("logger=none", "train.seq_len=1024", "train.global_batch_size=4", "model.dim=512",
                      "model.n_heads=8", "model.n_kv_heads=4")
    with Planner(cfg, device="cuda") as planner:
        none, offload, offload_full, full = (planner.plan(planner.point(m, **kw), recompute=False) for m, kw in (
            ("none", {}), ("offload", {}), ("offload", {"offload_with": "full"}), ("full", {})))
    assert all(b.activation_bytes == 0 and b.host_bytes > 0 for b in offload.blocks)
    # what a block saves goes to the host, but for storages under MIN_OFFLOAD_BYTES and the shared RoPE table
    for kept, moved in zip(none.blocks, offload.blocks):
        assert 0.95 * kept.activation_bytes <= moved.host_bytes <= kept.activation_bytes
    assert offload.host_bytes == sum(b.host_bytes for b in offload.blocks)
    assert offload.peak < none.peak and offload_full.peak <= full.peak
    # a whole block's activations over PCIe take longer than its compute at this size: exposed; full AC's inputs
    # are small: hidden behind compute, but for the top block's own copies out and back, which nothing overlaps
    assert offload.time.offload_waits > 0 and offload.time.bound == "exposed offload traffic"
    device = offload_full.device
    top = offload_full.blocks[-1].host_bytes / (device.host_link_bandwidth * device.efficiency.host_link)
    assert offload_full.time.offload_waits == pytest.approx(2 * top, rel=1e-6)
    assert offload_full.time.offload_transfers > 0


def test_under_tp_full_blocks_are_never_mixed_with_compiled_ones():
    from tests.test_plan_blocks import _budget, _uniform

    plans = [_uniform("full", GiB, 1.4, 36 * GiB), _uniform("offload:full", 0, 1.5, 35 * GiB),
             _uniform("none", 4 * GiB, 1.0, 60 * GiB), _budget(0.3, GiB, 1.1, 40 * GiB)]
    assert compatible(plans, tp=1) == [plans]
    groups = [{p.policies for p in g} for g in compatible(plans, tp=2)]
    assert groups == [{"none*4", "budget:0.3*4"}, {"full*4", "offload:full*4", "none*4"}]
    # the rule the groups follow: such a mix is refused by the config's rules
    with pytest.raises(UserError, match="cannot compile fully checkpointed blocks under TP"):
        validate(compose_cfg("logger=none", "parallelism=tp", "ac=per_block", "ac.blocks='full*2+budget:0.3*2'"), 2)


def test_host_link_model_overlaps_copies_with_compute():
    """Two blocks of 10 ms forward and backward each; copies of 5 ms are hidden, copies of 25 ms wait."""
    from membudget.plan.replay import Phase
    from membudget.plan.trace import Op

    device = dataclasses.replace(GPUS["H100"], host_link_bandwidth=1e9)
    rate = device.host_link_bandwidth * device.efficiency.host_link

    def phases(ms: float) -> list:
        flops = ms * 1e-3 * device.peak_flops * device.compute_scale * device.efficiency.gemm
        gemm = Op("aten.mm", int(flops), 0, True, None, "gemm", (1, 8192, 8192, 8192))
        return [Phase(f"{k} {j}", 2, 0, k, ops=[gemm], block=j)
                for k, j in (("forward", 0), ("forward", 1), ("backward", 1), ("backward", 0))]

    base = step_time(phases(10), device, {"dp_shard": 1, "tp": 1})
    hidden = step_time(phases(10), device, {"dp_shard": 1, "tp": 1}, {0: int(5e-3 * rate), 1: int(5e-3 * rate)})
    exposed = step_time(phases(10), device, {"dp_shard": 1, "tp": 1}, {0: int(25e-3 * rate), 1: int(25e-3 * rate)})
    # hidden: only the top block's own copies out and back, which nothing overlaps
    assert hidden.offload_waits == pytest.approx(2 * 5e-3, rel=0.01)
    assert hidden.seconds == pytest.approx(base.seconds + 2 * 5e-3, rel=0.01)
    assert exposed.offload_waits > 4 * 15e-3 and exposed.bound == "exposed offload traffic"
    assert exposed.offload_transfers == pytest.approx(4 * 25e-3, rel=0.01)


@pytest.mark.slow
def test_auto_chooses_policies_per_block_that_fit_and_train_as_planned(tmp_path):
    """Between the peaks of the single settings, a mix of policies planned as a whole that fits and beats every
    single setting that fits (on a CPU: less recompute); ac.blocks=auto there trains with the planned bytes."""
    # three budgets beside none, full and selective: the point is the mix, not the grid (that is test_plan_cli's)
    large = ["logger=none", "train.device=cpu", FAST_COMPILE, "train.seq_len=256", "train.global_batch_size=8",
             "model.n_layers=2", "plan.budgets=[0.0,0.5,1.0]"]
    cfg = compose_cfg(*large, "ac=per_block", "ac.blocks=auto")
    with Planner(cfg) as planner:  # one for the sweep and the mixes, as the trainer's choice plans them
        plans = plan_sweep(cfg, planner=planner)
        choices = per_target(planner, plans, targets_between(plans, max(p.judged_bytes for p in plans)))
    mixed = [c for c in choices if c.per_block is not None]
    assert mixed, [(c.target, c.single and c.single.label) for c in choices]
    for c in mixed:
        assert fits(c.per_block, c.target) and cost(c.per_block) < cost(c.single)
        assert len(set(parse_block_policies(c.per_block.policies))) > 1
    choice = mixed[0]
    target_gib = choice.target / GiB
    trained = train_here(tmp_path / "auto", *large, "train.steps=2", "train.progress=lines", "data.prefetch=0",
                         "ac=per_block", "ac.blocks=auto", f"ac.target_memory_gib={target_gib}")
    assert trained["ac_policies"] == choice.per_block.policies
    assert trained["activation_bytes"] == choice.per_block.activations
    written = json.loads((tmp_path / "auto" / "plan.json").read_text())  # the plan the run chose, in its dir
    assert (written["policies"], written["activations"]) == (choice.per_block.policies, choice.per_block.activations)
    assert torch.isfinite(torch.tensor(trained["final_loss"]))


@pytest.mark.slow
@pytest.mark.dist
def test_a_mixed_plan_gives_the_single_process_losses_under_fsdp_and_tp(tmp_path):
    """torchrun over two gloo ranks, a policy per block: the losses of one process with the same global batch."""
    from tests.test_distributed import SMALL as DIST, torchrun

    mixed = ["ac=per_block", f"ac.blocks='{MIXED}'", "train.micro_batch_size=1"]
    sweep = tmp_path / "sweep"
    proc = torchrun(sweep, 2, "parallelism=fsdp,tp", *mixed, *DIST)
    assert proc.returncode == 0, proc.why()
    train_here(tmp_path / "single", *DIST, *mixed)
    reference = [r["loss"] for r in read_metrics(tmp_path / "single")]
    jobs = sorted(d for d in sweep.iterdir() if d.is_dir() and d.name.isdigit())
    assert len(jobs) == 2
    for job in jobs:
        assert [r["loss"] for r in read_metrics(job)] == pytest.approx(reference, rel=1e-4), job
        assert read_summary(job)["ac_policies"] == MIXED
