import math

import pytest
import torch

from membudget.model import ModelArgs, Transformer, num_params, rope_frequencies
from tests.conftest import compose_cfg


def counted(model: torch.nn.Module) -> int:
    """The parameters a built model holds, each once (a tied embedding once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _meta_model(*overrides: str) -> Transformer:
    with torch.device("meta"):
        return Transformer(ModelArgs.from_config(compose_cfg(*overrides).model))


def _debug_model() -> Transformer:
    """The default config's model, initialised on the CPU (seed 0)."""
    torch.manual_seed(0)
    model = _meta_model()
    model.to_empty(device="cpu")
    model.init_weights()
    return model


def test_llama3_8b_parameter_count_on_meta():
    model = _meta_model("model=llama3_8b")
    assert num_params(model) == counted(model) == 8_030_261_248
    assert model.args.ffn_hidden == 14336
    assert model.output.weight is not model.tok_embeddings.weight  # 8B does not tie


def test_other_llama3_sizes():
    # Meta's published counts; the 3.2 models tie the output to the embedding
    for name, count in (("llama3_1b", 1_235_814_400), ("llama3_3b", 3_212_749_824), ("llama3_70b", 70_553_706_496)):
        model = _meta_model(f"model={name}")
        assert num_params(model) == counted(model) == count, name


@pytest.mark.parametrize("name", ["llama3_debug", "llama3_1b", "llama3_3b", "llama3_8b", "llama3_70b"])
@pytest.mark.parametrize("tie", [False, True])
def test_the_parameter_formula_counts_the_built_model(name, tie):
    """fit.parameter_count (num_params, the SLURM submitter's checkpoint sizing, the fit check) is what a built
    model holds, tied or not."""
    model = _meta_model(f"model={name}", f"model.tie_embeddings={str(tie).lower()}")
    assert num_params(model) == counted(model), (name, tie)


def test_rope_scaling_only_changes_low_frequencies():
    plain = ModelArgs(dim=256, n_layers=1, n_heads=2, vocab_size=8)
    scaled = ModelArgs(dim=256, n_layers=1, n_heads=2, vocab_size=8, rope_scaling_factor=8.0)
    a, b = rope_frequencies(plain, 16), rope_frequencies(scaled, 16)
    assert torch.allclose(a[:, 0], b[:, 0])  # highest frequency untouched
    assert not torch.allclose(a[:, -1], b[:, -1])  # lowest frequency slowed down


def test_forward_shapes_and_init_scale():
    cfg = compose_cfg()
    model = _debug_model()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.model.vocab_size)
    # a fresh model predicts close to uniform: loss near log(vocab)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(258.0)).item()) < 0.5
    # depth-scaled init: later blocks' output projections are smaller
    stds = [model.layers[str(i)].feed_forward.w2.weight.std().item() for i in range(cfg.model.n_layers)]
    assert stds == sorted(stds, reverse=True)


def _fake_materialised(model_name: str, parallelism: str, world: int):
    """The model as a run of `world` ranks materialises it (rank 0), on fake tensors over a fake process group."""
    import torch.distributed as dist

    from membudget.internals import FakeTensorMode, register_fake_process_group
    from membudget.launch import Launch
    from membudget.parallel import build_mesh
    from membudget.step import build_parallel_model, materialize

    cfg = compose_cfg(f"model={model_name}", f"parallelism={parallelism}", "logger=none")
    if world > 1:
        register_fake_process_group()
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    try:
        model = build_parallel_model(cfg, build_mesh(cfg.parallelism, Launch(0, world, 0), torch.device("cpu")))
        with FakeTensorMode(allow_non_fake_inputs=True):
            materialize(model, "cpu", init=False)
        return model
    finally:
        if world > 1:
            dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("parallelism,world", [("single", 1), ("fsdp", 2), ("tp", 2)])
def test_tied_models_keep_the_published_counts_once_materialised(parallelism, world):
    """Materialising (to_empty) used to untie the output projection from the embedding: the run then trained
    an untied, uninitialised head. Under every layout the head stays the embedding."""
    for name, count in (("llama3_1b", 1_235_814_400), ("llama3_3b", 3_212_749_824)):
        model = _fake_materialised(name, parallelism, world)
        assert model.output.weight is model.tok_embeddings.weight, (name, parallelism)
        assert num_params(model) == counted(model) == count, (name, parallelism)


def test_tied_head_is_initialised_and_trained():
    from membudget.metrics import ActivationCounter
    from membudget.step import build_model, build_optimizer, forward_backward

    cfg = compose_cfg("model.tie_embeddings=true", "logger=none")
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    assert model.output.weight is model.tok_embeddings.weight
    assert num_params(model) == counted(model) == sum(p.numel() for p in model.parameters())  # counted once
    weight = model.output.weight
    assert weight.std().item() == pytest.approx(cfg.model.dim ** -0.5, rel=0.1)  # initialised, not ~1e-40
    optimizer, _ = build_optimizer(model, cfg)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 33))
    loss, _ = forward_backward(model, tokens[:, :-1], tokens[:, 1:], ActivationCounter(model))
    assert abs(loss.item() - math.log(cfg.model.vocab_size)) > 1e-4  # the bug gave exactly ln(vocab)
    before = weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.tok_embeddings.weight) and model.output.weight is model.tok_embeddings.weight


def test_norm_output_dtype_is_explicit_under_autocast():
    """RMSNorm computes in fp32 and returns the autocast dtype on every device (CUDA's autocast runs rms_norm
    in fp32, CPU's in bf16: the planner's emulated GPU graph must match the GPU's)."""
    from membudget.model import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(2, 8, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x.bfloat16())
    expected = torch.nn.functional.rms_norm(x.bfloat16().float(), (64,), norm.weight, 1e-5).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert norm(x).dtype == torch.float32  # no autocast: the input's dtype


def test_attention_kernels_never_fall_back_to_math_on_cuda():
    from torch.nn.attention import SDPBackend

    from membudget.model import attention_kernels

    assert attention_kernels("cuda", torch.bfloat16, (9, 0)) == ([SDPBackend.FLASH_ATTENTION], False)
    # flash needs bf16/fp16 on sm80+; the memory-efficient kernel has no GQA: the KV heads are expanded
    assert attention_kernels("cuda", torch.float32, (9, 0)) == ([SDPBackend.EFFICIENT_ATTENTION], True)
    assert attention_kernels("cuda", torch.bfloat16, (7, 5)) == ([SDPBackend.EFFICIENT_ATTENTION], True)
    assert attention_kernels("cpu", torch.float32) == (None, False)


def test_expanded_kv_heads_give_the_same_attention():
    cfg = compose_cfg()
    model = _debug_model()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    gqa = model(tokens)
    model.use_attention_kernels(expand_kv=True)
    assert torch.allclose(model(tokens), gqa, atol=1e-5)
