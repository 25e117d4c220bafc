"""Llama 3 in plain PyTorch: RMSNorm, RoPE (with optional Llama 3.1 scaling), grouped-query attention on
scaled_dot_product_attention, SwiGLU feed-forward. Blocks live in `model.layers` (a ModuleDict keyed by
index) so AC, compile and sharding apply per block and swap blocks in place.

Two choices are explicit so that a CPU (the planner, the tests) and a GPU build the same graph:
- RMSNorm computes in fp32 and returns the autocast dtype when autocast is on (CUDA's autocast runs
  rms_norm in fp32, CPU's in bf16; either way each of wq/wk/wv would otherwise keep its own cast copy).
- Attention's kernel (`attention_kernels`): flash where it applies (bf16/fp16 on sm80+, GQA in the kernel),
  else memory-efficient with the KV heads expanded (it has no GQA); never the math kernel's S^2 memory.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from membudget.schema import ModelConfig, ffn_hidden_size


class ModelArgs(ModelConfig):
    """The model's shape: the schema's `model` section (its fields, defaults and docstrings), as plain values."""

    @classmethod
    def from_config(cls, cfg) -> "ModelArgs":
        return cls(**{k: getattr(cfg, k) for k in cls.__dataclass_fields__})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return ffn_hidden_size(self.dim, self.multiple_of, self.ffn_dim_multiplier)


def rope_frequencies(args: ModelArgs, seq_len: int, device=None) -> torch.Tensor:
    """Complex rotations [seq_len, head_dim/2]; with Llama 3.1 scaling of the low frequencies."""
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    if args.rope_scaling_factor is not None:
        low_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
        high_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
        wavelen = 2 * math.pi / freqs
        smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
            args.rope_high_freq_factor - args.rope_low_freq_factor
        )
        scaled = (1 - smooth) * freqs / args.rope_scaling_factor + smooth * freqs
        freqs = torch.where(wavelen > low_wavelen, freqs / args.rope_scaling_factor,
                            torch.where(wavelen < high_wavelen, freqs, scaled))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    # x: [batch, seq, heads, head_dim]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)
    return rotated.type_as(x)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm in fp32, its output in the autocast dtype while autocast is on (else the input's dtype)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):
            out = F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps)
        return out.to(dtype)


def attention_kernels(device_type: str, dtype: torch.dtype, capability: tuple[int, int] = (9, 0)):
    """(SDPA backends allowed on this device, whether the KV heads must be expanded for them). On CUDA the math
    kernel (S^2 memory) is never allowed: a case no other kernel covers fails loudly instead of silently."""
    from torch.nn.attention import SDPBackend

    if device_type != "cuda":
        return None, False  # the CPU flash kernel takes GQA and every dtype
    if dtype in (torch.bfloat16, torch.float16) and capability >= (8, 0):
        return [SDPBackend.FLASH_ATTENTION], False
    return [SDPBackend.EFFICIENT_ATTENTION], True


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.expand_kv = False  # set by `use_attention_kernels` where the kernel has no GQA
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 instead of the head count so a tensor-parallel shard (fewer local heads) works unchanged
        q = self.wq(x).view(bsz, seq, -1, self.head_dim)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim)
        q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        gqa = self.n_kv_heads != self.n_heads
        if gqa and self.expand_kv:
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # Depth-scaled init of the output projections keeps the residual stream's variance bounded.
        self.init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for lin in (self.attention.wq, self.attention.wk, self.attention.wv, self.feed_forward.w1):
            init_(lin.weight, lambda w: nn.init.trunc_normal_(w, std=0.02))
        for lin in (self.attention.wo, self.feed_forward.w2, self.feed_forward.w3):
            init_(lin.weight, lambda w: nn.init.trunc_normal_(w, std=self.init_std))
        for norm in (self.attention_norm, self.ffn_norm):
            init_(norm.weight, nn.init.ones_)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # A buffer so it follows .to(device); not persistent: it is derived from args, not learned.
        self.register_buffer("freqs_cis", rope_frequencies(args, args.max_seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))

    def tie_weights(self) -> None:
        """Share the embedding's weight with the output projection (after building, sharding or `to_empty`,
        each of which leaves two separate parameters)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def use_attention_kernels(self, expand_kv: bool) -> None:
        for module in self.modules():
            if isinstance(module, Attention):
                module.expand_kv = expand_kv

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every weight (also after building on the meta device and `to_empty`); a tied output
        projection is the embedding, initialised once."""
        self.freqs_cis = rope_frequencies(self.args, self.args.max_seq_len, device=self.freqs_cis.device)
        bound = 3 / math.sqrt(self.args.dim)
        output_init = lambda w: nn.init.trunc_normal_(w, std=self.args.dim**-0.5, a=-bound, b=bound)  # noqa: E731
        # a tied weight is also the output projection: the output's scale keeps the first logits near uniform
        init_(self.tok_embeddings.weight, output_init if self.args.tie_embeddings else nn.init.normal_)
        # modules() reaches the blocks through AC, compile and FSDP wrappers too
        for module in self.modules():
            if isinstance(module, TransformerBlock):
                module.init_weights()
        init_(self.norm.weight, nn.init.ones_)
        if not self.args.tie_embeddings:
            init_(self.output.weight, output_init)


def init_(param: torch.Tensor, init_fn) -> None:
    """Initialise `param`; a sharded (DTensor) one without a full-size copy where DTensor's random ops work
    (CUDA: each rank draws its own shard), else (CPU) as one whole tensor of which this rank keeps its part,
    one parameter at a time: exactly the values of a single process, so every layout starts alike."""
    if isinstance(param, DTensor) and shard_local_init(param.device_mesh):
        init_fn(param)
    elif isinstance(param, DTensor):
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        init_fn(full)
        param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))
    else:
        init_fn(param)


def shard_local_init(mesh) -> bool:
    """Whether DTensor's random ops can initialise shards in place on `mesh` (CUDA-like devices only)."""
    return mesh.device_type != "cpu"


def num_params(model: Transformer) -> int:
    """The model's parameters (a tied embedding counts once), by the one formula, membudget.fit.parameter_count,
    which the torch-free SLURM submitter uses too; tests/test_model.py checks it against the built models."""
    from membudget.fit import parameter_count

    return parameter_count(model.args)
