"""How the model is split over ranks: the device mesh, and per block TP -> AC -> compile -> FSDP.

The order follows torchtitan: TP first so that AC and compile see the sharded block; AC wraps the block
before compile so that compile sees the checkpoint (and its selective policy) and the partitioner can plan
across it; FSDP last, around the compiled block, so that its all-gathers stay outside the graph. Blocks are
compiled one by one because they are identical and share one compiled graph.

The mesh has only the dimensions of degree above 1, as torchtitan builds it: a dimension of size 1 would still
issue its collectives over one-rank groups (FSDP2 all-reduces over a 2-D mesh's replicate dimension, DTensor
reduces over every dimension a placement names), each a launch and a stream sync on NCCL. FSDP2 serves every
data-parallel option: `fully_shard` over (dp_replicate, dp_shard) is HSDP, over dp_shard alone FSDP, and its
`replicate` over dp_replicate alone is DDP (replicated parameters, all-reduced gradients).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from membudget.ac import apply_ac
from membudget.offload import OffloadedBlock
from membudget.internals import wait_tensor
from membudget.launch import Launch
from membudget.rules import compile_enabled, mesh_degrees
from membudget.schema import FSDPOuter, Reshard, TrainDType


def build_mesh(p, launch: Launch, device: torch.device) -> Optional[DeviceMesh]:
    if launch.world_size == 1:
        return None
    degrees = {name: degree for name, degree in mesh_degrees(p, launch.world_size).items() if degree > 1}
    return init_device_mesh(device.type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))


def mesh_size(mesh: Optional[DeviceMesh], name: str) -> int:
    """The degree of a mesh dimension: 1 where the mesh has no such dimension (see build_mesh)."""
    return mesh[name].size() if mesh is not None and name in mesh.mesh_dim_names else 1


def dp_dims(mesh: Optional[DeviceMesh]) -> tuple[str, ...]:
    """The mesh's data-parallel dimensions, outermost first."""
    return tuple(name for name in ("dp_replicate", "dp_shard") if mesh_size(mesh, name) > 1)


def dp_coordinates(mesh: Optional[DeviceMesh]) -> tuple[int, int]:
    """(rank, size) of this process among data-parallel ranks: TP peers read the same rows."""
    rank, size = 0, 1
    for name in dp_dims(mesh):
        rank, size = rank * mesh[name].size() + mesh[name].get_local_rank(), size * mesh[name].size()
    return rank, size


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP with sequence parallelism: the residual stream is sharded on the sequence,
    attention and FFN are split column-wise then row-wise, norms run on sequence shards, the output
    projection and the loss on vocabulary shards."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # logits stay sharded on the vocabulary: the loss runs under loss_parallel (see step.forward_backward),
        # so no rank ever holds the whole [batch, seq, vocab] logits
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    # The embedding's reduce-scatter is async: its output is an AsyncCollectiveTensor. Fed as is to a
    # compiled block, AOTAutograd hands DTensor's backward a plain gradient ("'Tensor' object has no
    # attribute '_local_tensor'", pytorch/pytorch#184980). Waiting here (identity in backward) fixes it.
    model.tok_embeddings.register_forward_hook(lambda module, args, out: wait_tensor(out))
    block_plan = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    model.tie_weights()  # the embedding's and the output's weights are both sharded on the vocabulary


def apply_compile(model: nn.Module, cfg, backend=None) -> None:
    """Compile each block with `backend` (a torch.compile backend; default: compile.backend's). An offloaded
    block's hooks stay outside: the block inside it is compiled, and its saved tensors still pass through them."""
    def compiled(block: nn.Module) -> nn.Module:
        return torch.compile(block, backend=backend or str(cfg.compile.backend), fullgraph=cfg.compile.fullgraph)

    for name, block in list(model.layers.named_children()):
        if isinstance(block, OffloadedBlock):
            block.replace_block(compiled(block.block))
        else:
            model.layers.register_module(name, compiled(block))


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, cfg, device: torch.device) -> None:
    """FSDP2 groups, each gathered just before it is used and freed after: every block and, with
    parallelism.fsdp_outer=split, the embedding and [final norm, output] (one group with the embedding when they
    share a weight). The last block and the output group stay gathered after forward, as backward needs them at
    once; the output group's gradient is reduced as soon as its backward ends, not held to the end of the step.
    With fsdp_outer=root the three stay in the root group instead, which FSDP2 keeps gathered through the step.
    Over dp_replicate alone (DDP) the groups are replicated by FSDP2's `replicate`, which neither shards nor
    gathers."""
    # bf16 compute with fp32 gradient reduction on GPU; CPU stays in fp32 like the single-process run
    mp = MixedPrecisionPolicy()
    if device.type == "cuda" and cfg.train.dtype != TrainDType.float32:
        p = cfg.parallelism
        mp = MixedPrecisionPolicy(param_dtype=getattr(torch, str(p.param_dtype)),
                                  reduce_dtype=getattr(torch, str(p.reduce_dtype)))
    if dp_mesh.mesh_dim_names == ("dp_replicate",):  # DDP: the same groups replicated, nothing to reshard
        def shard(modules, **_):
            return replicate(modules, mesh=dp_mesh, mp_policy=mp)
    else:
        def shard(modules, **reshard):
            return fully_shard(modules, mesh=dp_mesh, mp_policy=mp, **reshard)
    policy = cfg.parallelism.reshard_after_forward

    def reshards(needed_at_once: bool) -> bool:
        """Whether a group frees its gathered parameters after forward; `needed_at_once`: its backward follows its
        forward at once (the last block, [final norm, output]), so by default it stays gathered."""
        return policy == Reshard.always or (policy == Reshard.default and not needed_at_once)

    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        shard(block, reshard_after_forward=reshards(i == len(blocks) - 1))
    if cfg.parallelism.fsdp_outer == FSDPOuter.split:
        if model.args.tie_embeddings:
            shard([model.tok_embeddings, model.norm, model.output], reshard_after_forward=reshards(True))
        else:
            shard(model.tok_embeddings, reshard_after_forward=reshards(False))
            shard([model.norm, model.output], reshard_after_forward=reshards(True))
    # the root runs the lazy init and holds what no group took; FSDP2 keeps it gathered after forward
    shard(model)


def parallelize(model: nn.Module, cfg, mesh: Optional[DeviceMesh] = None,
                device: torch.device = torch.device("cpu"), compile_backend=None) -> nn.Module:
    """Apply TP, AC, compile (with `compile_backend`, default compile.backend's) and FSDP to `model` in place,
    per block of `model.layers`."""
    if mesh_size(mesh, "tp") > 1:
        apply_tp(model, mesh["tp"])
    apply_ac(model, cfg.ac)
    if compile_enabled(cfg):
        apply_compile(model, cfg, compile_backend)
    if dp := dp_dims(mesh):
        apply_fsdp(model, mesh[dp], cfg, device)
    return model


def defers_sync(model: nn.Module, mesh: Optional[DeviceMesh]) -> bool:
    """Whether a micro-batch that is not the step's last runs a different sync (gradient_sync): only replicas."""
    return isinstance(model, FSDPModule) and mesh_size(mesh, "dp_replicate") > 1


@contextlib.contextmanager
def gradient_sync(model: nn.Module, mesh: Optional[DeviceMesh], last: bool) -> Iterator[None]:
    """The backward of a micro-batch that is not the step's last skips what it can of the gradient sync:
    replicas (DDP, and HSDP across groups) all-reduce only once per step. FSDP shards still reduce-scatter
    every micro-batch: skipping it would hold every block's unsharded gradient until the last one."""
    if last or not defers_sync(model, mesh):
        yield
        return
    if mesh_size(mesh, "dp_shard") == 1:
        model.set_requires_gradient_sync(False)  # DDP: gradients are whole anyway
    else:
        model.set_requires_all_reduce(False)  # HSDP: reduce-scatter within the group, all-reduce later
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(True)


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip gradients to `max_norm` in total; the norm of sharded (DTensor) gradients is made whole. Returns the
    total norm (before clipping), a tensor on the device: reading it is the step's one sync."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, total)
    return total


def all_reduce(values: list[float], op: dist.ReduceOp, device: torch.device) -> list[float]:
    """Floats reduced over all ranks (SUM or MAX) in one collective; unchanged in a single process."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def broadcast_object(obj, device: torch.device, timeout_s: Optional[float] = None):
    """Rank 0's `obj` on every rank (the run dir, the checkpoint to resume: one decision for the job).
    `timeout_s`: how long the other ranks wait for it, where rank 0 may take longer than the process group's
    timeout to decide (over a gloo group of its own, made and destroyed here)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    if timeout_s is None:
        dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
        return box[0]
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    return box[0]
