import torch

from membudget.model import ModelArgs, Transformer, num_params, rope_frequencies
from tests.conftest import compose_cfg


def _meta_model(name: str) -> Transformer:
    cfg = compose_cfg(f"model={name}")
    with torch.device("meta"):
        return Transformer(ModelArgs.from_config(cfg.model))


def test_llama3_8b_parameter_count_on_meta():
    model = _meta_model("llama3_8b")
    assert num_params(model) == 8_030_261_248
    assert model.args.ffn_hidden == 14336
    assert all(p.is_meta for p in model.parameters())  # nothing of 8B size was allocated


def test_other_llama3_sizes():
    # Meta's published counts; the 3.2 models tie the output to the embedding
    assert num_params(_meta_model("llama3_1b")) == 1_235_814_400
    assert num_params(_meta_model("llama3_3b")) == 3_212_749_824
    assert num_params(_meta_model("llama3_70b")) == 70_553_706_496


def test_rope_scaling_only_changes_low_frequencies():
    plain = ModelArgs(dim=256, n_layers=1, n_heads=2, vocab_size=8)
    scaled = ModelArgs(dim=256, n_layers=1, n_heads=2, vocab_size=8, rope_scaling_factor=8.0)
    a, b = rope_frequencies(plain, 16), rope_frequencies(scaled, 16)
    assert torch.allclose(a[:, 0], b[:, 0])  # highest frequency untouched
    assert not torch.allclose(a[:, -1], b[:, -1])  # lowest frequency slowed down


def test_forward_shapes_and_init_scale():
    cfg = compose_cfg()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg.model))
    model.to_empty(device="cpu")
    model.init_weights()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, cfg.model.vocab_size)
    # a fresh model predicts close to uniform: loss near log(vocab)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    assert abs(loss.item() - torch.log(torch.tensor(258.0)).item()) < 0.5
    # depth-scaled init: later blocks' output projections are smaller
    stds = [model.layers[str(i)].feed_forward.w2.weight.std().item() for i in range(cfg.model.n_layers)]
    assert stds == sorted(stds, reverse=True)
