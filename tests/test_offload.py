"""Activation offloading changes where activations wait, not the math: every saved tensor comes back bit for bit,
gradients equal the run without offloading (alone, under full AC, under selective AC, compiled), block i-1 comes
back when block i's backward starts, nothing stays held after backward; on a CPU nothing is copied by default.
The CUDA path (pinned copies on side streams) is checked by `scripts/gpu_check.py --sections offload`."""

import logging
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from membudget import offload
from membudget.errors import UserError
from membudget.internals import FakeTensorMode, checkpoint_wrapper, selective_cache
from membudget.metrics import ActivationCounter
from membudget.model import ModelArgs, Transformer
from membudget.offload import (
    MIN_OFFLOAD_BYTES,
    OffloadedBlock,
    Offloader,
    check_pinned_memory,
    find_offloader,
    host_bytes_needed,
)

ARGS = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32, max_seq_len=64)


def _selective(block, offloader):
    """Selective AC keeping matmul outputs, its cache handed to the offloader as ac.py's context_fn would."""

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    def context_fn():
        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
        if offloader is not None:
            offloader.offload_cache(selective_cache(forward_ctx))
        return forward_ctx, recompute_ctx

    return checkpoint_wrapper(block, context_fn=context_fn)


INNER = {
    "plain": lambda block, offloader: block,
    "full": lambda block, offloader: checkpoint_wrapper(block),
    "selective": _selective,
    "compiled": lambda block, offloader: torch.compile(block, backend="aot_eager"),
}


def build(inner="plain", offloader=None, init=True):
    """The tiny Llama with each block under `inner`, offloaded by `offloader` when given (`init`: initial weights;
    not for fake tensors, which hold no values)."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    if init:
        model.init_weights()
    for index, (name, block) in enumerate(list(model.layers.named_children())):
        block = INNER[inner](block, offloader)
        model.layers.register_module(name, block if offloader is None else OffloadedBlock(block, offloader, index))
    return model


def batches(n, shape=(2, 17)):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, ARGS.vocab_size, shape, generator=gen) for _ in range(n)]


def loss_of(model, tokens):
    tokens = tokens.to(model.freqs_cis.device)
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def train(model, offloader=None, steps=2, micro=2):
    """Losses and gradients of `steps` AdamW steps of `micro` accumulated micro-batches."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    data = iter(batches(steps * micro))
    for _ in range(steps):
        for _ in range(micro):
            loss = loss_of(model, next(data))
            (loss / micro).backward()
            losses.append(loss.detach())
            if offloader is not None:
                assert offloader.held_host_bytes == 0  # everything released by each backward
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return losses, grads


def test_round_trip_is_bitwise_and_frees_the_originals():
    """Every saved tensor comes back bit for bit with its dtype, shape and strides; each block's device originals
    are freed once the next block's forward ends (when, on CUDA, their copies have had its compute to finish), the
    top block's at its own end."""
    offloader = Offloader(target="cpu", min_bytes=0)
    model = build("plain", offloader)
    packed, originals, alive = {}, {i: [] for i in range(ARGS.n_layers)}, []
    pack, unpack = offloader._pack, offloader._unpack

    def spy_pack(t):
        out = pack(t)
        packed[id(out)] = (out, t.clone(), t.dtype, t.shape, t.stride())
        if not isinstance(out, torch.Tensor):
            originals[offloader._current.index].append(weakref.ref(t.untyped_storage()))
        return out

    def spy_unpack(p):
        t = unpack(p)
        _, want, dtype, shape, stride = packed.pop(id(p))
        assert (t.dtype, t.shape, t.stride()) == (dtype, shape, stride)
        assert torch.equal(t, want)
        return t

    offloader._pack, offloader._unpack = spy_pack, spy_unpack
    # seen as the next module starts (a block's own forward hook would still hold its input)
    for module in [*list(model.layers.values())[1:], model.norm]:
        module.register_forward_pre_hook(lambda m, a: alive.append([any(r() for r in refs) for refs in originals.values()]))
    loss = loss_of(model, batches(1)[0])
    assert alive == [[True, False, False], [False, True, False], [False, False, False]]
    assert all(refs for refs in originals.values())
    assert offloader.held_host_bytes == sum(offloader.host_bytes.values()) > 0
    loss.backward()
    assert not packed  # every saved tensor came back, and was checked
    assert offloader.held_host_bytes == 0


@pytest.mark.parametrize("inner", ["plain", "full", "selective"])
def test_gradients_equal_no_offload(inner):
    """Offloaded alone or around AC: bitwise the losses and gradients of the same AC without offloading, over 2
    steps of 2 micro-batches."""
    offloader = Offloader(target="cpu", min_bytes=0)
    losses, grads = train(build(inner, offloader), offloader)
    ref_losses, ref_grads = train(build(inner))
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(g, r) for step, ref in zip(grads, ref_grads) for g, r in zip(step, ref))
    assert all(offloader.host_bytes[i] > 0 for i in range(ARGS.n_layers))


def test_selective_cache_is_offloaded():
    """Selective AC's cached matmul outputs leave the device too: more bytes than full AC (the block input)."""
    per_block = {}
    for inner in ("full", "selective"):
        offloader = Offloader(target="cpu", min_bytes=0)
        loss_of(build(inner, offloader), batches(1)[0]).backward()
        per_block[inner] = offloader.host_bytes[0]
    block_input = 2 * 16 * ARGS.dim * 4
    assert per_block["full"] == block_input
    assert per_block["selective"] > block_input


def test_prefetch_order_and_nothing_left_after_backward():
    offloader = Offloader(target="cpu", min_bytes=0)
    model = build("plain", offloader)
    events = []
    fetch, starts = offloader._fetch, offloader._backward_starts

    def spy_fetch(index):
        if any(r() is not None and r().fetched is None for r in offloader._saved.get(index, [])):
            events.append(f"fetch {index}")
        fetch(index)

    def spy_starts(index):
        events.append(f"backward {index}")
        starts(index)

    offloader._fetch, offloader._backward_starts = spy_fetch, spy_starts
    loss_of(model, batches(1)[0]).backward()
    assert events == ["backward 2", "fetch 2", "fetch 1", "backward 1", "fetch 0", "backward 0"]
    assert offloader.held_host_bytes == 0 and not offloader._pending and not offloader._cached
    assert all(r() is None for refs in offloader._saved.values() for r in refs)
    assert offloader.peak_host_bytes == sum(offloader.host_bytes.values())


def test_cpu_default_copies_nothing_and_says_so_once(caplog):
    offload._note_cpu.cache_clear()
    offloader = Offloader()
    model, plain = build("plain", offloader), build("plain")
    with caplog.at_level(logging.INFO, logger="membudget"):
        counted = []
        for m in (model, plain):
            for tokens in batches(2):
                counter = ActivationCounter(m)
                with counter.count():
                    loss = loss_of(m, tokens)
                counted.append(counter.nbytes)
                loss.backward()
    notes = [r for r in caplog.records if "offloading saves nothing" in r.getMessage()]
    assert len(notes) == 1
    assert offloader.host_bytes == {} and offloader.peak_host_bytes == 0
    assert counted[:2] == counted[2:]  # the counter sees the same activations as without the wrapper
    assert find_offloader(model) is offloader and find_offloader(plain) is None


def test_plan_target_under_fake_tensors():
    """A planner probe: fake CPU tensors offloaded to storage-less copies; the originals are freed, backward runs,
    and the host bytes are those of real copies."""
    real = Offloader(target="cpu", min_bytes=0)
    loss_of(build("plain", real), batches(1)[0]).backward()
    offloader = Offloader(target="plan", min_bytes=0)
    originals = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build("plain", offloader, init=False)
        pack = offloader._pack

        def spy_pack(t):
            out = pack(t)
            if not isinstance(out, torch.Tensor):
                originals.append(weakref.ref(t.untyped_storage()))
            return out

        offloader._pack = spy_pack
        loss = loss_of(model, batches(1)[0])
        assert originals and all(r() is None for r in originals)
        loss.backward()
    assert offloader.host_bytes == real.host_bytes
    assert offloader.held_host_bytes == 0


@pytest.mark.slow
def test_compiled_block_inside():
    """A compiled block's saved tensors (AOTAutograd saves them at run time) pass through the hooks around it."""
    offloader = Offloader(target="cpu", min_bytes=0)
    losses, grads = train(build("compiled", offloader), offloader, steps=1)
    ref_losses, ref_grads = train(build("compiled"), steps=1)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses))
    assert all(torch.equal(g, r) for g, r in zip(grads[0], ref_grads[0]))
    assert all(offloader.host_bytes[i] > 2 * 16 * ARGS.dim * 4 for i in range(ARGS.n_layers))


def test_small_storages_parameters_and_rope_stay():
    """With the default minimum the tiny model's storages are all too small to move; parameters and the RoPE table
    (an input without grad) never move, whatever their size."""
    offloader = Offloader(target="cpu")
    loss_of(build("plain", offloader), batches(1)[0]).backward()
    assert offloader.host_bytes == {0: 0, 1: 0, 2: 0}
    offloader = Offloader(target="cpu", min_bytes=0)
    model = build("plain", offloader)
    pack, moved, kept = offloader._pack, [], []

    def spy_pack(t):
        out = pack(t)
        (kept if isinstance(out, torch.Tensor) else moved).append(t)
        return out

    offloader._pack = spy_pack
    loss_of(model, batches(1)[0])
    rope = model.freqs_cis.untyped_storage().data_ptr()
    assert any(isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter) for t in kept)
    assert any(t.untyped_storage().data_ptr() == rope for t in kept)
    assert not any(isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
                   or t.untyped_storage().data_ptr() == rope for t in moved)


def test_host_memory_helpers(monkeypatch):
    assert host_bytes_needed([MIN_OFFLOAD_BYTES, 3 * MIN_OFFLOAD_BYTES, MIN_OFFLOAD_BYTES - 1]) == 5 * MIN_OFFLOAD_BYTES
    check_pinned_memory(1 << 20)  # nothing to pin without CUDA

    def refuse(*args, pin_memory=False, **kwargs):
        raise RuntimeError("CUDA error: out of memory\nmore")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "empty", refuse)
    with pytest.raises(UserError) as e:
        check_pinned_memory(3 << 30, "ac.blocks", "offload*4+none*28")
    message = str(e.value)
    assert "\n" not in message and message.startswith("ac.blocks=offload*4+none*28: ")
    assert "3.00 GiB" in message and "CUDA error: out of memory" in message and "offload fewer blocks" in message
