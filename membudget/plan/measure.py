"""Measurement: the trainer's own step on fake tensors (shapes, dtypes and storages without memory) over a fake
process group of the planned world size, recorded op by op.

A probe is a model of a few blocks (a bottom, three periods of the AC policy's pattern over layers, a top: 5
blocks, or 3N+2 for "every N-th block"), built and parallelised by the trainer's `build_parallel_model` and run
through its `forward_backward`: one warm-up micro-batch where a first call differs from the next (it compiles,
initialises FSDP2 and DDP's buckets, fills DTensor's caches; an eager step on one process has none), then a
recorded one from no gradients (a step's first micro-batch) and, with accumulation, one that adds to them (as
the step's last: with replicas it also all-reduces) and, with replicas and three or more micro-batches, one
between them that adds without the replicas' sync. The FLOPs reference records the first micro-batch alone, and
warms up only where the first call computes differently (compiled or TP). The optimizer step (gradient
clipping, AdamW) is recorded on this rank's shards of the whole model, first without optimizer states (step 1),
then with them.

GPU runs are planned on this CPU, emulated where CPU and GPU differ: bf16 autocast as CPU autocast (the model
casts explicitly where the two differ), attention as the CUDA kernel `Numerics` names (its meta kernel yields
what it saves), FSDP2 mixed precision as on GPU, and compile.backend=inductor as aot_eager_decomp_partition:
inductor's decompositions and the same min-cut partitioner under the same budget, without code generation.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from membudget.errors import UserError
from membudget.internals import (
    FUSED_RMS_NORM,
    FUSED_RMS_NORM_BACKWARD,
    SDPA_EFFICIENT,
    SDPA_FLASH,
    FakeTensorMode,
    below_autograd,
    cached_dtensor_sharding_propagation,
    clear_dtensor_caches,
    decomposing_partitioning_backend,
    foreach_kernels_on_meta,
    functional_replaced,
    register_fake_process_group,
    storage_key,
)
from membudget.launch import Launch
from membudget.metrics import ActivationCounter, local_tensor
from membudget.offload import Offloader, find_offloader
from membudget.parallel import build_mesh, clip_grad_norm, defers_sync, gradient_sync, mesh_size
from membudget.rules import compile_enabled
from membudget.schema import CompileBackend, block_policies
from membudget.step import Numerics, build_optimizer, build_parallel_model, forward_backward

from .record import Recorder, fused_graph
from .trace import ACTIVATIONS, COMMUNICATION, GRADIENTS, Alloc, OptimizerRun, Probe, Run


@contextlib.contextmanager
def fake_world(p, world_size: int) -> Iterator[tuple[Optional[object], dict[str, tuple[str, int]]]]:
    """A fake process group of `world_size` ranks (no communication, per-rank shapes) and the trainer's mesh on
    it, seen from rank 0 (with FSDP2's padding it holds the largest shards); the mesh, and for each of its
    groups' names the mesh dimension and its size."""
    if world_size == 1:
        yield None, {}
        return
    if dist.is_initialized():
        raise UserError("the planner runs its own (fake) process group: plan before init_process_group, or in a fresh "
                        "interpreter (membudget.plan.choose_setting_apart)")
    register_fake_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world_size)
    clear_dtensor_caches()  # neither world's meshes may reach the other's DTensors (see its docstring)
    try:
        mesh = build_mesh(p, Launch(0, world_size, 0), torch.device("cpu"))
        yield mesh, {mesh.get_group(d).group_name: (d, mesh[d].size()) for d in mesh.mesh_dim_names}
    finally:
        dist.destroy_process_group()
        clear_dtensor_caches()


@contextlib.contextmanager
def cuda_attention(numerics: Numerics) -> Iterator[None]:
    """scaled_dot_product_attention as the CUDA kernel the run will use, on meta kernels: what it saves for
    backward is what the GPU's kernel saves (flash: output and logsumexp; memory-efficient: the same with its
    own layout, on expanded KV heads)."""
    if numerics.target != "cuda":
        yield
        return

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return SDPA_FLASH(q, k, v, dropout_p, is_causal, scale=scale)[0]

    def efficient(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return SDPA_EFFICIENT(q, k, v, None, grad, dropout_p, is_causal, scale=scale)[0]

    kernel = {"flash": flash, "efficient": efficient}[numerics.attention]
    with functional_replaced("scaled_dot_product_attention", kernel):
        yield


class _FusedRMSNorm(torch.autograd.Function):
    """aten._fused_rms_norm with the autograd formula CUDA runs it under (derivatives.yaml: it saves the input,
    the weight and the inverse RMS, and calls _fused_rms_norm_backward). On the CPU the op has no kernel and
    rms_norm_composite runs op by op under autograd, which also saves the fp32 normalised input (x * rstd) for
    the product with the weight: one more fp32 activation per norm than the GPU keeps."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        with below_autograd():  # the op itself (its fake kernel), not its CPU composite
            out, rstd = FUSED_RMS_NORM(x, normalized_shape, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.normalized_shape = normalized_shape
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1]]
        dx, dw = FUSED_RMS_NORM_BACKWARD(grad, x, ctx.normalized_shape, rstd, weight, mask)
        return dx, dw, None, None


@contextlib.contextmanager
def cuda_norm(numerics: Numerics) -> Iterator[None]:
    """F.rms_norm as CUDA runs it in eager: rms_norm (layer_norm.cpp: rms_norm_symint) calls
    at::_fused_rms_norm whenever the weight's dtype is the input's (the model's norm passes both in fp32), whose
    CUDA kernel runs under the formula _FusedRMSNorm reproduces. Compiled graphs keep the composite: the
    compiler decomposes the op (torch/_decomp: _fused_rms_norm) and its partitioner decides what is saved."""
    if numerics.target != "cuda":
        yield
        return
    composite = F.rms_norm

    def fused(input, normalized_shape, weight=None, eps=None):
        if torch.compiler.is_compiling() or (weight is not None and weight.dtype != input.dtype):
            return composite(input, normalized_shape, weight, eps)
        return _FusedRMSNorm.apply(input, weight, list(normalized_shape), eps)

    with functional_replaced("rms_norm", fused):
        yield


def planning_backend(cfg):
    """How the probe compiles: inductor as aot_eager_decomp_partition (the same decompositions, partitioner and
    budget, without code generation), each graph call marked for the time model to price as fused kernels;
    None (compile.backend as configured) otherwise."""
    if compile_enabled(cfg) and cfg.compile.backend == CompileBackend.inductor:
        return decomposing_partitioning_backend(fused_graph)
    return None


class _KeptActivations(ActivationCounter):
    """ActivationCounter that also hands the storages it counted to the recorder before releasing them."""

    recorder: Optional[Recorder] = None
    kept: set

    def release(self) -> None:
        if self.recorder is not None:
            self.kept = {self.recorder.key_of(s) for s, _ in self._storages.values()} - {None}
        super().release()


def block_kinds(cfg, n_layers: int) -> list[str]:
    """What makes blocks plan differently: their policies (blocks of one policy plan alike)."""
    return [str(p) for p in block_policies(cfg.ac, n_layers)]


def probe_shape(cfg, n_layers: int) -> tuple[int, int]:
    """(depth, period): the kinds repeat every `period` layers; a probe of a bottom block, three periods and a
    top block of the same kind as the model's top (n = depth + k periods). No period: the whole model."""
    kinds = block_kinds(cfg, n_layers)
    period = next(p for p in range(1, n_layers + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return probe_depth(n_layers, period), period


def probe_depth(n_layers: int, period: int) -> int:
    depth = 3 * period + 2
    return n_layers if depth >= n_layers else depth + (n_layers - depth) % period


def _marks(model, recorder: Recorder) -> list:
    """Marks at each block's forward and backward (its output's gradient arriving) and at the loss; prepended so
    that FSDP2's all-gathers fall into the block's own segment."""

    def mark_backward(name):
        def hook(module, args, out):
            out.register_hook(lambda grad: recorder.mark(name))

        return hook

    handles = [model.norm.register_forward_pre_hook(lambda m, a: recorder.mark("loss"), prepend=True),
               model.output.register_forward_hook(mark_backward("output backward"), prepend=True)]
    for i, block in model.layers.items():
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: recorder.mark(f"forward {i}"), prepend=True))
        handles.append(block.register_forward_hook(mark_backward(f"backward {i}"), prepend=True))
    return handles


def _storage_sizes(tensors) -> list[int]:
    """Bytes of the distinct storages behind `tensors` (this rank's shards, FSDP2's padding included)."""
    storages = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        storages.setdefault(storage_key(storage), storage.nbytes())
    return list(storages.values())


def run_probe(cfg, mesh, group_names: dict, numerics: Numerics, micro_batch: int, depth: int, period: int,
              n_micro: int, flops_only: bool = False) -> Probe:
    """Record the probe's micro-batches (see the module docstring); `flops_only`: the first alone, for its FLOPs."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # the device tells FSDP2 whether to train in mixed precision, as on the GPU
    model = build_parallel_model(cfg, mesh, torch.device(numerics.target), n_layers=depth,
                                 compile_backend=planning_backend(cfg))
    model.use_attention_kernels(numerics.expand_kv)
    offloader = find_offloader(model)
    if offloader is not None and numerics.target == "cuda":  # offloaded storages leave the device: no copies
        offloader.target = "plan"
    with fake:
        model.to_empty(device="cpu")
        model.tie_weights()
    counter = _KeptActivations(model)
    blocks = list(model.layers.values())
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    outside = [p for p in model.parameters() if id(p) not in in_blocks]
    # Eager DTensor caches the shapes it derives by running ops on whole-size fake tensors (loss_parallel asks
    # for them); under a fake mode it would redo that in every step, and the recorder would count it.
    with fake, cached_dtensor_sharding_propagation(), cuda_attention(numerics), cuda_norm(numerics):
        tokens = torch.randint(cfg.model.vocab_size, (micro_batch * n_micro, cfg.train.seq_len + 1))
        # as the trainer's: contiguous copies (data.py), split into micro-batches (trainer.train_step), so a saved
        # label is a view of the step's batch of tokens
        inputs, labels = (t.contiguous().split(micro_batch)[0] for t in (tokens[:, :-1], tokens[:, 1:]))
        step = (model, inputs, labels, counter)
        # The warm-up compiles at the step's shapes and fills DTensor's caches for them; else (FSDP2's lazy
        # initialisation, DDP's bucket rebuild) a short sequence does. Not needed where the recording is the same
        # without it: an eager step on one process, or an eager FLOP count outside TP (those first calls
        # allocate, but compute nothing)
        shaped = compile_enabled(cfg) or mesh_size(mesh, "tp") > 1
        if shaped or (mesh is not None and not flops_only):
            forward_backward(*(step if shaped else (model, tokens[:1, :8], tokens[:1, 1:9], counter)), numerics)
            model.zero_grad(set_to_none=True)
        recorder = Recorder(group_names)
        counter.recorder = recorder
        handles = _marks(model, recorder)
        runs = []
        with recorder.tracking():
            # the first micro-batch and the last; between them a middle one where it syncs differently
            if flops_only:
                lasts = [n_micro == 1]  # the step's first micro-batch, also its last when it is the only one
            elif n_micro == 1:
                lasts = [True]
            elif n_micro > 2 and defers_sync(model, mesh):
                lasts = [False, False, True]
            else:
                lasts = [False, True]
            for last in lasts:
                recorder.start()
                with gradient_sync(model, mesh, last=last):
                    # the loss dies here, as the trainer's does by the next step
                    nbytes = forward_backward(*step, numerics)[1]
                runs.append(_run(recorder, counter, model, nbytes, offloader))
            recorder.stop()
        for handle in handles:
            handle.remove()
    return Probe(
        depth=depth, period=period, first=runs[0], last=runs[-1] if len(runs) > 1 else None,
        middle=runs[1] if len(runs) > 2 else None,
        parameters=_storage_sizes(outside), block_parameters=_storage_sizes(blocks[0].parameters()),
        buffers=_storage_sizes(model.buffers()),
        shards={"outside": [(local_tensor(p).shape, p.dtype) for p in outside],
                "block": [(local_tensor(p).shape, p.dtype) for p in blocks[0].parameters()]},
        full_sizes=[p.numel() * 4 for p in model.parameters()],
        sharded=any(isinstance(p, DTensor) for p in model.parameters()),
    )


def _run(recorder: Recorder, counter: _KeptActivations, model, activation_bytes: int,
         offloader: Optional[Offloader]) -> Run:
    categories = {}
    for segment in recorder.segments:
        for event in segment.events:
            if isinstance(event, Alloc) and event.key in recorder.communication:
                categories[event.key] = COMMUNICATION
    for key in counter.kept:
        categories[key] = ACTIVATIONS
    for p in model.parameters():
        if p.grad is not None and (key := recorder.key_of(local_tensor(p.grad).untyped_storage())) is not None:
            categories[key] = GRADIENTS
    segments = {}
    for segment in recorder.segments:  # a segment can recur (a mark fired twice): the step's order holds
        if segment.name in segments:
            segments[segment.name].events += segment.events
            segments[segment.name].ops += segment.ops
        else:
            segments[segment.name] = segment
    host = dict(offloader.host_bytes) if offloader is not None and offloader.target == "plan" else {}
    return Run(segments, categories, activation_bytes, dict(counter.last_per_block), host)


def run_optimizer(cfg, shards: list[tuple[torch.Size, torch.dtype]], numerics: Numerics) -> OptimizerRun:
    """Gradient clipping and the trainer's AdamW on this rank's shards of the whole model: what each rank's
    optimizer allocates (on DTensors it runs the same local ops). For a GPU on the meta device (storages with
    sizes, no memory; faster than fake tensors for AdamW's long tensor lists; its step counters are host tensors,
    as on CUDA, so not counted) with CUDA's _foreach_ kernels, in clipping too; for a CPU on fake CPU tensors,
    which count them, one op per tensor as the CPU runs them."""
    gpu = numerics.target == "cuda"
    with contextlib.nullcontext() if gpu else FakeTensorMode(allow_non_fake_inputs=True):
        holder = nn.Module()
        holder.params = nn.ParameterList([nn.Parameter(torch.empty(shape, dtype=dtype, device="meta" if gpu else "cpu"))
                                          for shape, dtype in shards])
        for p in holder.params:
            p.grad = torch.zeros_like(p)
        optimizer, _ = build_optimizer(holder, cfg)
        for group in optimizer.param_groups:
            group["foreach"] = gpu  # AdamW's default on CUDA, not on CPU
        recorder = Recorder()
        segments = []
        with recorder.tracking():
            for name in ("first optimizer step", "optimizer step"):
                recorder.start()
                recorder.segments[0].name = name
                with foreach_kernels_on_meta() if gpu else contextlib.nullcontext():  # CUDA's, not the CPU's
                    clip_grad_norm(holder, cfg.train.max_grad_norm)
                optimizer.step()
                segments.append(recorder.segments[0])
                recorder.stop()
                if len(segments) == 1:
                    states = [t for state in optimizer.state.values() for t in state.values() if t.device == p.device]
                    keys = {recorder.key_of(t.untyped_storage()) for t in states} - {None}
    return OptimizerRun(segments[0], segments[1], keys, sum(_storage_sizes(states)))
