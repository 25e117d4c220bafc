"""AC modes change memory, not math: the same loss and gradients as ac=none, fewer saved activations; the
budget is scoped to its run; per-block budgets give each block the bytes of its own budget."""

import pytest
import torch

from membudget.ac import SAVE_OPS, compiler_scope
from membudget.internals import tree_leaves
from membudget.metrics import ActivationCounter
from membudget.rules import validate
from membudget.step import build_model, forward_backward
from tests.conftest import FAST_COMPILE, compose_cfg


def one_step(*overrides, run_dir=None):
    """Loss, gradients and activation bytes of one forward/backward of the debug model in fp32 on CPU."""
    cfg = compose_cfg("logger=none", FAST_COMPILE, *overrides)
    validate(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 65), generator=gen)
    with compiler_scope(cfg.ac, run_dir, cfg.model.n_layers):
        torch.manual_seed(0)
        model = build_model(cfg, torch.device("cpu"))
        counter = ActivationCounter(model)
        loss, nbytes = forward_backward(model, tokens[:, :-1], tokens[:, 1:], counter)
    return loss, [p.grad.clone() for p in model.parameters()], nbytes, counter.last_per_block


class _Steps(dict):
    """`one_step` of each tuple of overrides, computed when first asked for and then shared by the module's
    tests (the results are only read)."""

    def __missing__(self, overrides: tuple[str, ...]):
        self[overrides] = one_step(*overrides)
        return self[overrides]


@pytest.fixture(scope="module")
def steps():
    return _Steps()


@pytest.fixture(scope="module")
def reference(steps):
    return steps["ac=none",]


def _assert_same(result, reference, atol):
    loss, grads, *_ = result
    ref_loss, ref_grads, *_ = reference
    assert torch.allclose(loss, ref_loss, atol=atol, rtol=0)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    ["ac=full"],
    ["ac=selective", "ac.selective_option=op"],
    ["ac=selective", "ac.selective_option=2"],
    ["ac=selective", "ac.force_recompute_modules=[feed_forward.w2]"],
    pytest.param(["ac=full", "compile.enabled=true"], marks=pytest.mark.slow),
    pytest.param(["ac=selective", "compile.enabled=true"], marks=pytest.mark.slow),
])
def test_checkpointing_gives_the_same_loss_and_gradients(overrides, reference, steps):
    _assert_same(steps[tuple(overrides)], reference, atol=1e-6 if "compile.enabled=true" not in overrides else 1e-5)


@pytest.fixture(scope="module")
def budgets():
    """One step at budgets 0.0 and 1.0, and per block 0.0 for the bottom half, 1.0 for the top."""
    return {b: one_step("ac=memory_budget", f"ac.memory_budget={b}") for b in ("0.0", "1.0", "0.0*2+1.0*2")}


@pytest.mark.slow
def test_memory_budget_trains_like_none(budgets, reference):
    for result in budgets.values():
        _assert_same(result, reference, atol=1e-5)


@pytest.mark.slow
def test_per_block_budgets_save_what_each_block_would_alone(budgets):
    """Each block compiled with its own budget keeps exactly the bytes it keeps when the whole model has that
    budget: blocks 0-1 as at 0.0, blocks 2-3 as at 1.0, and different from each other."""
    low, high, mixed = (budgets[b][3] for b in ("0.0", "1.0", "0.0*2+1.0*2"))
    assert [mixed[i] for i in range(4)] == [low[0], low[1], high[2], high[3]]
    assert mixed[0] < mixed[3]
    assert budgets["0.0*2+1.0*2"][2] == sum(mixed.values())
    assert torch.equal(budgets["0.0*2+1.0*2"][0], budgets["0.0"][0])  # fp32 on CPU: the same loss, bitwise


def test_activation_bytes_order(reference, steps):
    none, full = reference[2], steps["ac=full",][2]
    selective_op = steps["ac=selective", "ac.selective_option=op"][2]
    selective_2 = steps["ac=selective", "ac.selective_option=2"][2]
    forced = steps["ac=selective", "ac.force_recompute_modules=[feed_forward.w2,attention.wo]"][2]
    assert none >= selective_op >= full > 0
    assert none >= selective_2 >= full
    assert forced < selective_op  # forcing matmuls to recompute saves less


@pytest.mark.slow
def test_budget_activation_bytes_order(budgets, steps):
    """The compiled budgets (slow: compiled), against the eager full AC of test_activation_bytes_order."""
    full = steps["ac=full",][2]
    assert budgets["0.0"][2] < budgets["1.0"][2]
    # at 0.0 both keep little more than each block's input
    assert abs(budgets["0.0"][2] - full) <= 0.05 * full


def test_selective_op_saves_only_compute_heavy_ops():
    """What selective AC keeps for backward is the output of matmuls and attention, nothing else: the keys of
    the cache each selective wrapper hands to the counter are the ops whose outputs it saved."""
    cfg = compose_cfg("logger=none", "ac=selective")
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    counter = ActivationCounter(model)
    seen = []
    counter._collect = seen.append  # the caches fill during the forward: read them after it
    with counter.count():
        model(torch.randint(0, cfg.model.vocab_size, (2, 16)))
    # entries of ops to recompute are sentinels; saved ones hold (wrapped) tensors
    saved_ops = {op for cache in seen for op, entries in cache.items()
                 if any(hasattr(leaf, "val") for leaf in tree_leaves(list(entries.values()),
                                                                      is_leaf=lambda x: hasattr(x, "val")))}
    assert saved_ops and saved_ops <= SAVE_OPS
    assert torch.ops.aten.mm.default in saved_ops
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in saved_ops


@pytest.mark.slow
def test_budget_is_scoped_to_the_run(budgets):
    from membudget.internals import functorch_budget

    default = functorch_budget()
    cfg = compose_cfg("ac=memory_budget", "ac.memory_budget=0.3")
    with compiler_scope(cfg.ac):
        assert functorch_budget() == 0.3
    assert functorch_budget() == default
    # runs in one process do not reuse each other's compiled plans
    again = one_step("ac=memory_budget", "ac.memory_budget=0.0")[2]
    assert again == budgets["0.0"][2] < budgets["1.0"][2]


@pytest.mark.slow
def test_pareto_svgs_land_in_the_run_dir(tmp_path):
    one_step("ac=memory_budget", "ac.visualize_pareto=true", run_dir=tmp_path)
    svgs = list((tmp_path / "memory_budget_pareto").glob("*.svg"))
    assert svgs and all(s.read_text().lstrip().startswith(("<?xml", "<svg")) for s in svgs)
