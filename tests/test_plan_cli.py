"""`python -m membudget.plan`: a sweep of every budget next to the AC modes, auto's choice among them, plan.json,
plan.md and the plots, in its Hydra dir; and the errors a user can make."""

import json

import pytest

from membudget.errors import UserError
from membudget.plan import Plan, choose, choose_or_explain, plan_setting
from membudget.rules import validate
from membudget.units import GiB, MiB, fmt_bytes
from tests.conftest import FAST_COMPILE, compose_cfg, hydra_main_here
from tests.test_plan_model import plan

SMALL = ["logger=none", "train.device=cpu", FAST_COMPILE, "train.seq_len=64", "train.global_batch_size=2",
         "model.n_layers=2"]


@pytest.mark.slow
def test_the_cli_sweeps_chooses_and_writes_its_plans(tmp_path):
    from membudget.plan.cli import main

    run_dir = tmp_path / "plan"
    # `python -m membudget.plan ...` in this process (the command is cli.main): a failure exits non-zero
    hydra_main_here(main, ["membudget.plan", f"hydra.run.dir={run_dir}", *SMALL, "ac=memory_budget",
                           "ac.memory_budget=auto", "ac.target_memory_gib=0.00838"])
    result = json.loads((run_dir / "plan.json").read_text())
    plans = result["plans"]
    assert [p["label"] for p in plans[:3]] == ["none", "full", "selective op"]
    assert [p["memory_budget"] for p in plans[3:]] == [i / 10 for i in range(11)]  # plan.budgets' default
    budgets = {p["memory_budget"]: p for p in plans[3:]}
    none, full = plans[0], plans[1]
    assert budgets[0.0]["activations"] < budgets[1.0]["activations"] <= none["activations"]
    assert full["activations"] < budgets[0.5]["activations"] < none["activations"]
    assert budgets[0.0]["recompute_flops"] > budgets[1.0]["recompute_flops"] == 0
    assert none["recompute_flops"] == 0 < budgets[0.5]["recompute_flops"] < full["recompute_flops"]
    for p in plans:  # the peak holds at least what every step keeps
        assert p["peak"] > p["parameters"] + p["optimizer_states"] + p["activations"], p["label"]
    chosen = result["chosen"]  # a CPU has no time model: the least recompute that fits
    assert chosen["fits"] and chosen["limit"] == int(0.00838 * GiB)
    assert all(p["recompute_flops"] >= chosen["recompute_flops"] for p in plans[3:] if p["fits"])
    assert any(not p["fits"] for p in plans[3:])
    assert result["reshard_policies"] == []  # one process: FSDP shards nothing
    text = (run_dir / "plan.md").read_text()
    assert "**chosen**" in text and "a CPU run: its memory is this host's available memory" in text
    assert (run_dir / "sweep.png").stat().st_size > 1000
    assert (run_dir / "sweep.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


@pytest.mark.slow
def test_one_setting_is_written_as_plan_json_and_md(tmp_path):
    from membudget.plan.cli import run

    result = run(compose_cfg(*SMALL, "ac=full", "train.device=cuda", "plan.gpu=A100-40GB", "plan.margin_gib=1"),
                 tmp_path)
    assert result["label"] == "full" and result["limit"] == int((39.4 - 1) * GiB) and result["verdict"] == "fits"
    assert result["reserved_peak"] >= result["max_allocated"] >= result["peak"] > 0
    assert result["device"]["reason"] == "plan.gpu=A100-40GB" and result["setting"]["attention"] == "flash"
    text = (tmp_path / "plan.md").read_text()
    assert "reserved peak (default allocator)" in text and "tokens/s per device" in text
    # plan.json reads back as the plan it was (what a resumed auto run keeps: auto.kept_choice), and one of
    # another version (a field missing) is refused

    written = json.loads((tmp_path / "plan.json").read_text())
    kept = Plan.from_dict(written)
    again = json.loads(json.dumps(kept.to_dict()))
    assert again == {k: written[k] for k in again}  # (the CLI adds its own keys beside the plan's)
    assert kept.summary_line().startswith(f"planned {kept.judged} of {fmt_bytes(result['limit'])} ")
    with pytest.raises(TypeError):
        Plan.from_dict({k: v for k, v in written.items() if k != "setting"})


@pytest.mark.slow
def test_a_plan_of_a_run_with_the_profile_estimator_says_it_assumed_flops(tmp_path):
    from membudget.plan.cli import run
    from membudget.plan.report import plan_markdown

    result = run(compose_cfg(*SMALL, "ac=memory_budget", "ac.memory_budget=0.5", "ac.runtime_estimator=profile",
                             "train.device=cuda"), tmp_path)
    assert result["setting"]["runtime_estimator"] == "profile"
    said = "Recompute chosen as with ac.runtime_estimator=flops: the run's profile times each op on the GPU"
    text = (tmp_path / "plan.md").read_text()
    assert said in text
    # what every rank must tokenize: the whole global batch, at the job's planned tokens/s in all
    tokens_per_s = Plan.from_dict(result).tokens_per_s
    assert f"Every rank that tokenizes reads the whole global batch: {tokens_per_s / 1e6:.3g} M tokens/s" in text
    assert "ac.runtime_estimator" not in plan_markdown(plan())  # a flops run's plan: nothing to say


@pytest.mark.slow
def test_a_sharded_plan_shows_its_setting_under_each_reshard_policy(tmp_path):
    """A plan of a run that FSDP shards (here never resharded, on a GPU with a time model) names its policy and
    plans the same setting under the two others, each as its own plan would be; one process shards nothing and
    gets no table. (Which policy holds more depends on the size: here a block's gathered parameters weigh less
    than the backward's all-gather buffers that never saves; on an 8B model never holds 12.6 GiB more, as
    test_plan_evidence checks against PR #822's runs.)"""
    from membudget.plan.cli import run

    sharded = [*SMALL, "parallelism=fsdp", "plan.world_size=2", "train.device=cuda", "plan.gpu=A100-40GB"]
    result = run(compose_cfg(*sharded, "parallelism.reshard_after_forward=never"), tmp_path / "never")
    assert result["setting"]["reshard_after_forward"] == "never"
    others = {p["setting"]["reshard_after_forward"]: p for p in result["reshard_policies"]}
    assert set(others) == {"default", "always"}
    for policy, other in others.items():
        alone = plan_setting(compose_cfg(*sharded, f"parallelism.reshard_after_forward={policy}"))
        assert other["label"] == f"{result['label']}, parallelism.reshard_after_forward={policy}"
        assert (other["peak"], other["reserved_peak"], other["step_seconds"]) == (
            alone.peak, alone.reserved_peak, alone.step_seconds), policy
    assert len({p["peak"] for p in (result, *others.values())}) > 1  # the policies change what the plan holds
    text = (tmp_path / "never" / "plan.md").read_text()
    assert "parallelism.reshard_after_forward=never" in text  # the plan's own setting, in its words
    table = text.split("## FSDP's reshard policies")[1]
    assert table.count("(this plan)") == 1 and "| never (this plan) |" in table
    assert all(f"| {policy} |" in table for policy in others) and "tokens/s per device" in table
    # each row's verdict beside what it judged: the reserved peak and the CUDA context against the A100's memory
    assert "| policy | reserved peak | against the limit | verdict |" in table
    assert (f"| never (this plan) | {fmt_bytes(result['reserved_peak'])} | {fmt_bytes(result['judged_bytes'])} | "
            f"{result['verdict']} |") in table and result["judged_bytes"] > result["reserved_peak"]

    alone = run(compose_cfg(*SMALL), tmp_path / "one")  # one process: nothing is sharded
    assert alone["reshard_policies"] == []
    assert "reshard" not in (tmp_path / "one" / "plan.md").read_text()


def test_auto_says_what_would_fit_when_no_budget_does():
    plans = [plan(f"memory_budget {b}", b, verdict="does not fit") for b in (0.0, 0.5, 1.0)]
    plans.append(plan("full", None, verdict="does not fit"))
    assert choose(plans) is None
    with pytest.raises(UserError) as info:
        choose_or_explain(plans, compose_cfg(), None)
    message = str(info.value)
    assert "\n" not in message and "ac=full" in message and "micro_batch_size" in message and "fsdp" in message
    assert "plan.budgets" not in message  # the grid already holds budget 0.0
    # a grid without 0.0 (plan.budgets): the fix says to try it, as an override that composes
    with pytest.raises(UserError) as info:
        choose_or_explain(plans, compose_cfg("plan.budgets=[0.7,0.5]"), None)
    fix = "plan.budgets=[0,0.5,0.7]"
    assert fix in str(info.value) and compose_cfg(fix).plan.budgets == [0.0, 0.5, 0.7]


def test_when_no_budget_fits_the_line_names_the_lowest_budget_and_what_else_would():
    """A sweep that also plans the modes (python -m membudget.plan): auto chooses among the budgets only, so the
    line names the lowest budget's peak, and ac=full, which fits, as the fix (it read "no setting fits ... lowest
    planned reserved peak 45.29 GiB, offload: fits" for 8B on 8 ranks with plan.budgets=[0.3,0.5,0.7]). Against
    the device's memory the line shows what the verdict held against it: the reserved peak and the CUDA context
    (it read "no budget fits 75.0 GiB ... lowest planned reserved peak 74.7 GiB ...: does not fit")."""
    budgets = [plan(f"memory_budget {b}", b, reserved=int((74.7 + 10 * (b - 0.3)) * GiB), verdict="does not fit")
               for b in (0.3, 0.5)]
    full = plan("full", None, reserved=50 * GiB)
    with pytest.raises(UserError) as info:
        choose_or_explain([full, *budgets], compose_cfg("plan.budgets=[0.3,0.5]"), None)
    message = str(info.value)
    assert "no budget fits 75.0 GiB per rank" in message, message
    assert ("lowest planned reserved peak 74.7 GiB + 512 MiB outside the allocator, memory_budget 0.3: does not fit"
            in message), message
    assert "ac=full plans reserved peak 50.0 GiB + 512 MiB outside the allocator (fits)" in message, message


def test_a_small_target_that_nothing_fits_reads_in_its_own_unit():
    """A CPU run's target of a few MiB: the line said "no budget fits 0.00 GiB per rank ... peak 0.01 GiB"."""
    budgets = [plan(f"memory_budget {b}", b, reserved=int((8 + b) * MiB), verdict="does not fit", limit=4 * MiB)
               for b in (0.3, 0.5)]
    full = plan("full", None, reserved=6 * MiB, verdict="does not fit", limit=4 * MiB)
    with pytest.raises(UserError) as info:
        choose_or_explain([full, *budgets], compose_cfg("plan.budgets=[0.3,0.5]"), None)
    message = str(info.value)
    assert "no budget fits 4.00 MiB per rank" in message and "peak 8.30 MiB + 512 MiB" in message, message
    assert "ac=full plans reserved peak 6.00 MiB + 512 MiB outside the allocator (does not fit)" in message, message


def test_budget_auto_and_sweep_in_config():
    validate(compose_cfg("ac=memory_budget", "ac.memory_budget=auto", "ac.target_memory_gib=70"))
    with pytest.raises(UserError, match="set plan.world_size"):
        plan_setting(compose_cfg("parallelism=fsdp"))
