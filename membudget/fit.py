"""Whether a run can fit at all, checked before anything is allocated: a run that cannot is refused in one
line instead of being killed by the OOM killer minutes later (CPU) or failing at its first step (GPU).

The figure is a floor, never an estimate: what any AC setting must hold per rank (fp32 weights, gradients and
AdamW's two moments, sharded as configured; each block's input, which even full AC keeps; the fp32 logits the
loss keeps). The planner (`python -m membudget.plan`) predicts the real peak.
"""

from __future__ import annotations

import logging

from membudget.errors import UserError
from membudget.rules import mesh_degrees
from membudget.schema import ACMode, block_policies, ffn_hidden_size
from membudget.units import GiB

log = logging.getLogger("membudget")


# Bytes of fp32 training state per parameter: its weight, its gradient and AdamW's two moments. A checkpoint holds
# the weights and the moments.
WEIGHT_BYTES, GRADIENT_BYTES, ADAMW_BYTES = 4, 4, 8
CHECKPOINT_BYTES_PER_PARAMETER = WEIGHT_BYTES + ADAMW_BYTES


def parameter_count(m) -> int:
    """Llama 3's parameters from its config (a tied output projection counted once)."""
    n_kv = m.n_kv_heads or m.n_heads
    head = m.dim // m.n_heads
    ffn = ffn_hidden_size(m.dim, m.multiple_of, m.ffn_dim_multiplier)
    block = m.dim * head * (2 * m.n_heads + 2 * n_kv) + 3 * m.dim * ffn + 2 * m.dim
    return m.n_layers * block + m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.dim


def floor_bytes(cfg, shape, world_size: int) -> dict[str, int]:
    """The least a rank holds during a step, by part."""
    degrees = mesh_degrees(cfg.parallelism, world_size)
    shards = degrees["dp_shard"] * degrees["tp"]
    m = cfg.model
    tokens = shape.micro_batch * shape.seq_len
    return {
        "weights, gradients and AdamW states (fp32)":
            (WEIGHT_BYTES + GRADIENT_BYTES + ADAMW_BYTES) * parameter_count(m) // shards,
        "each block's input": 4 * m.n_layers * tokens * m.dim // degrees["tp"],
        "the loss's fp32 logits": 4 * tokens * m.vocab_size // degrees["tp"],
    }


def available_bytes(device: torch.device, local_ranks: int) -> tuple[int, str]:
    """Memory this rank can use, and what it is: the GPU's, or this host's available memory shared by the
    ranks on it."""
    if device.type == "cuda":
        import torch  # here, not at the top: parameter_count serves the torch-free SLURM submitter too

        return torch.cuda.mem_get_info(device)[1], f"{torch.cuda.get_device_name(device)}'s memory"
    import psutil

    free = psutil.virtual_memory().available
    share = f" shared by {local_ranks} ranks" if local_ranks > 1 else ""
    return free // max(1, local_ranks), f"this host's available memory{share}"


def check_fits(cfg, shape, device: torch.device, world_size: int, local_ranks: int = 1) -> None:
    parts = floor_bytes(cfg, shape, world_size)
    need = sum(parts.values())
    have, what = available_bytes(device, local_ranks)
    if need <= have:
        return
    worst = max(parts, key=parts.get)
    t = cfg.train
    key, value = (("model", cfg.model.name) if worst.startswith("weights") else
                  ("train.micro_batch_size", t.micro_batch_size) if t.micro_batch_size else
                  ("train.global_batch_size", t.global_batch_size))
    raise UserError(
        f"{key}={value!r}: this run needs at least {need / GiB:.1f} GiB per rank ({worst}: "
        f"{parts[worst] / GiB:.1f} GiB) but {what} is {have / GiB:.1f} GiB; use a smaller model or "
        "train.micro_batch_size / train.seq_len, or shard over more ranks; `python -m membudget.plan` with the "
        "same overrides predicts the peak")


def check_host_fits(cfg, shape, device: torch.device, world_size: int, local_ranks: int = 1) -> None:
    """Offloading blocks hold what they save in pinned host memory, at least each one's input (bf16), for every
    rank on this host: refused in one line when the host has not that much available, or cannot pin it. On a
    CPU nothing is copied (offloading saves nothing there)."""
    policies = block_policies(cfg.ac, cfg.model.n_layers)
    offloaded = sum(p.offload for p in policies)
    if not offloaded or device.type != "cuda":
        return
    import psutil

    from membudget.offload import check_pinned_memory, host_bytes_needed

    tp = mesh_degrees(cfg.parallelism, world_size)["tp"]
    per_rank = host_bytes_needed([2 * shape.micro_batch * shape.seq_len * cfg.model.dim // tp] * offloaded)
    key, value = ("ac.blocks", cfg.ac.blocks) if cfg.ac.mode == ACMode.per_block else ("ac", "offload")
    have = psutil.virtual_memory().available
    if per_rank * local_ranks > have:
        raise UserError(
            f"{key}={value}: {offloaded} offloading blocks need at least {per_rank * local_ranks / GiB:.1f} GiB of "
            f"host memory for the {local_ranks} ranks on this host, which has {have / GiB:.1f} GiB available; "
            "offload fewer blocks (ac=per_block), or use a smaller train.micro_batch_size")
    check_pinned_memory(per_rank, key, value)
