"""AC modes change memory, not math: same loss and gradients as ac=none, fewer saved activations."""

import pytest
import torch

import membudget.ac as ac_module
from membudget.ac import compiler_scope
from membudget.config import validate
from membudget.metrics import ActivationCounter
from membudget.trainer import build_model, forward_backward
from tests.conftest import FAST_COMPILE, compose_cfg


def one_step(*overrides, run_dir=None):
    """Loss, gradients and activation bytes of one forward/backward of the debug model in fp32 on CPU."""
    cfg = compose_cfg("logger=none", FAST_COMPILE, *overrides)
    validate(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=gen)
    with compiler_scope(cfg.ac, run_dir):
        torch.manual_seed(0)
        model = build_model(cfg, torch.device("cpu"))
        loss, nbytes = forward_backward(model, tokens[:, :-1], tokens[:, 1:], ActivationCounter(model))
    return loss, [p.grad.clone() for p in model.parameters()], nbytes


@pytest.fixture(scope="module")
def reference():
    return one_step("ac=none")


def _assert_same(result, reference, atol):
    loss, grads, _ = result
    ref_loss, ref_grads, _ = reference
    assert torch.allclose(loss, ref_loss, atol=atol, rtol=0)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    ["ac=full"],
    ["ac=selective", "ac.selective_option=op"],
    ["ac=selective", "ac.selective_option=2"],
    ["ac=selective", "ac.force_recompute_modules=[feed_forward.w2]"],
    ["ac=full", "compile.enabled=true"],
    ["ac=selective", "compile.enabled=true"],
])
def test_checkpointing_gives_the_same_loss_and_gradients(overrides, reference):
    _assert_same(one_step(*overrides), reference, atol=1e-6 if "compile.enabled=true" not in overrides else 1e-5)


@pytest.mark.parametrize("budget", [0.0, 0.5, 1.0])
def test_memory_budget_trains_like_none(budget, reference):
    _assert_same(one_step("ac=memory_budget", f"ac.memory_budget={budget}"), reference, atol=1e-5)


def test_activation_bytes_order():
    none, full = one_step("ac=none")[2], one_step("ac=full")[2]
    selective_op = one_step("ac=selective", "ac.selective_option=op")[2]
    selective_2 = one_step("ac=selective", "ac.selective_option=2")[2]
    forced = one_step("ac=selective", "ac.force_recompute_modules=[feed_forward.w2,attention.wo]")[2]
    assert none >= selective_op >= full > 0
    assert none >= selective_2 >= full
    assert forced < selective_op  # forcing matmuls to recompute saves less

    budgets = {b: one_step("ac=memory_budget", f"ac.memory_budget={b}")[2] for b in (1.0, 0.5, 0.0)}
    assert budgets[1.0] >= budgets[0.5] >= budgets[0.0]
    assert budgets[0.0] < budgets[1.0]
    # at 0.0 both keep little more than each block's input
    assert abs(budgets[0.0] - full) <= 0.05 * full


def test_budget_is_scoped_to_the_run():
    default = torch._functorch.config.activation_memory_budget
    cfg = compose_cfg("ac=memory_budget", "ac.memory_budget=0.3")
    with compiler_scope(cfg.ac):
        assert torch._functorch.config.activation_memory_budget == 0.3
    assert torch._functorch.config.activation_memory_budget == default
    # runs in one process do not reuse each other's compiled plans
    first = one_step("ac=memory_budget", "ac.memory_budget=0.0")[2]
    middle = one_step("ac=memory_budget", "ac.memory_budget=1.0")[2]
    again = one_step("ac=memory_budget", "ac.memory_budget=0.0")[2]
    assert first == again < middle


def test_pareto_svgs_land_in_the_run_dir(tmp_path):
    one_step("ac=memory_budget", "ac.visualize_pareto=true", run_dir=tmp_path)
    svgs = list((tmp_path / "memory_budget_pareto").glob("*.svg"))
    assert svgs and all(s.read_text().lstrip().startswith(("<?xml", "<svg")) for s in svgs)


def test_selective_policy_only_saves_compute_heavy_ops():
    assert torch.ops.aten.mm.default in ac_module._SAVE_OPS
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ac_module._SAVE_OPS
