"""The training step that training, planning, benchmarks and tests share: how a step is cut into micro-batches,
its numerics (dtype, attention kernel), the model build, the optimizer and schedule, and one micro-batch's
forward and backward. The trainer runs it on real tensors; the planner runs it on fake ones.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from membudget.metrics import ActivationCounter, local_tensor
from membudget.model import ModelArgs, Transformer, attention_kernels
from membudget.parallel import parallelize
from membudget.rules import dp_size
from membudget.schema import Decay, TrainDType


@dataclass(frozen=True)
class StepShape:
    """One optimizer step of one rank: `n_micro` forward/backward passes of `micro_batch` sequences."""

    global_batch: int
    seq_len: int
    dp_size: int
    micro_batch: int

    @classmethod
    def from_config(cls, cfg, world_size: int) -> StepShape:
        dp = dp_size(cfg, world_size)
        t = cfg.train
        return cls(t.global_batch_size, t.seq_len, dp, t.micro_batch_size or t.global_batch_size // dp)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def n_micro(self) -> int:
        return self.local_batch // self.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class Numerics:
    """How the step's math runs on its target device (a GPU the planner emulates on the CPU, too)."""

    target: str  # "cuda" or "cpu": the device the run trains on
    bf16: bool  # bf16 autocast
    expand_kv: bool  # attention's kernel has no GQA: KV heads are repeated before it
    attention: str  # the SDPA kernel: flash | efficient (CUDA), cpu

    @classmethod
    def for_target(cls, cfg, target: str, capability: tuple[int, int] = (9, 0)) -> Numerics:
        dtype = cfg.train.dtype
        bf16 = dtype == TrainDType.bfloat16 or (dtype == TrainDType.auto and target == "cuda")
        backends, expand_kv = attention_kernels(target, torch.bfloat16 if bf16 else torch.float32, capability)
        attention = "cpu" if backends is None else backends[0].name.split("_")[0].lower()
        return cls(target, bf16, expand_kv, attention)

    @contextlib.contextmanager
    def context(self, device_type: str, autocast: bool = True) -> Iterator[None]:
        """Autocast on `device_type` (the CPU when the planner emulates a GPU; `autocast=False` for a backward),
        and on CUDA the one attention kernel chosen, so a case it cannot run fails instead of falling back to the
        math kernel, and a recompute in the backward runs the forward's kernel."""
        with contextlib.ExitStack() as stack:
            if self.bf16 and autocast:
                stack.enter_context(torch.autocast(device_type, dtype=torch.bfloat16))
            if device_type == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                # an enum attribute: torch 2.11's SDPBackend takes no subscript
                stack.enter_context(sdpa_kernel([getattr(SDPBackend, self.attention.upper() + "_ATTENTION")]))
            yield


def build_parallel_model(cfg, mesh=None, device: torch.device = torch.device("cpu"),
                         n_layers: Optional[int] = None, compile_backend=None) -> Transformer:
    """Llama 3 on the meta device, parallelised per block (TP, AC, compile, FSDP) for `device`: no memory yet.
    `compile_backend`: a torch.compile backend in place of compile.backend's (the planner's)."""
    args = ModelArgs.from_config(cfg.model)
    if n_layers is not None:
        args.n_layers = n_layers
    with torch.device("meta"):
        model = Transformer(args)
    parallelize(model, cfg, mesh, device, compile_backend)
    return model


def materialize(model: Transformer, device, init: bool = True) -> None:
    """Storage for every parameter on `device` (this rank's shards only), then the initial weights (not for
    the planner's fake tensors, which hold no values)."""
    model.to_empty(device=device)
    model.tie_weights()
    if init:
        model.init_weights()


def build_model(cfg, device: torch.device, mesh=None, numerics: Optional[Numerics] = None) -> Transformer:
    """The model a run trains: built on meta, parallelised, materialised and initialised; nothing is allocated
    at full size before it is sharded (on the CPU one parameter at a time is, for exact initial values)."""
    model = build_parallel_model(cfg, mesh, device)
    materialize(model, device)
    numerics = numerics or Numerics.for_target(cfg, device.type, _capability(device))
    model.use_attention_kernels(numerics.expand_kv)
    return model


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def lr_lambda(cfg):
    """Linear warmup to the peak LR, then cosine or linear decay to min_lr_ratio of it."""
    warmup, total = cfg.lr_schedule.warmup_steps, cfg.train.steps
    floor, decay = cfg.lr_schedule.min_lr_ratio, cfg.lr_schedule.decay

    def factor(step: int) -> float:  # step counts from 0
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if decay == Decay.constant:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == Decay.cosine else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def build_optimizer(model: torch.nn.Module, cfg):
    """AdamW (no weight decay on norms, the 1-D weights) and its LR schedule."""
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def forward_backward(model, inputs, labels, counter: ActivationCounter, numerics: Optional[Numerics] = None,
                     device_type: str = "cpu", scale: float = 1.0):
    """One micro-batch: forward under the activation counter (with `numerics` on `device_type`: autocast, the
    attention kernel), loss, backward of `scale * loss` (with the same attention kernel: checkpointed blocks
    recompute their forward there, and must run what it ran).

    Returns the detached loss and the activation bytes the forward kept for backward. The logits are released
    before backward: the loss's graph keeps what it needs (log-softmax's fp32 output), nothing else does.
    """
    def context(autocast: bool):
        return numerics.context(device_type, autocast) if numerics is not None else contextlib.nullcontext()

    with counter.count(), context(autocast=True):
        logits = model(inputs)
        # Under TP the logits are a DTensor sharded on the vocabulary: loss_parallel computes the cross-entropy
        # and, below, its backward on the shards
        on_shards = loss_parallel if isinstance(logits, DTensor) else contextlib.nullcontext
        with on_shards():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        del logits
    nbytes = counter.nbytes
    counter.release()
    with on_shards(), context(autocast=False):
        (loss * scale).backward()
    return local_tensor(loss).detach(), nbytes
