"""The rules that span fields, one small function per config section, checked before anything heavy loads.

Types, keys and choices are the schema's job (Hydra rejects them at composition); what is left is how values
relate: a budget needs a compiler that reads it, mesh degrees must multiply to the world size, a TP degree must
divide the heads. Each failure is a UserError of one line: `key=value: what is wrong; the fix`, and every
override a fix suggests composes (tests/test_bad_input.py checks that). After a run, one rule reads its
measurements: whether its steps waited for their data (data_wait_line).
"""

from __future__ import annotations

import dataclasses
import math
from enum import Enum
from typing import Any, Optional

from membudget.errors import UserError
from membudget.schema import (
    BUDGET_BACKENDS,
    POLICY_NAMES,
    ACMode,
    RunConfig,
    Solver,
    block_policies,
    budget_list,
    budget_of,
    ffn_hidden_size,
    is_auto,
    parse_block_budgets,
    parse_block_policies,
)

# torch.manual_seed takes at most 64 bits
_MAX_SEED = 2**64 - 1


def fail(key: str, value: Any, fix: str) -> None:
    shown = value.value if isinstance(value, Enum) else value
    raise UserError(f"{key}={shown!r}: {fix}")


def compile_enabled(cfg: Any) -> bool:
    """Whether blocks are compiled: the explicit setting, else on exactly when a block has a memory budget
    (ac=memory_budget; ac=per_block with a budget:<b> block or auto, which may choose one)."""
    if cfg.compile.enabled is None:
        return uses_budget(cfg.ac)
    return bool(cfg.compile.enabled)


def uses_budget(ac: Any) -> bool:
    """Whether a block's activations are left to the compiler's memory budget."""
    if ac.mode == ACMode.per_block:
        return is_auto(ac) or any(p.compiled for p in parse_block_policies(ac.blocks))
    return ac.mode == ACMode.memory_budget


def mesh_degrees(p: Any, world_size: int) -> dict[str, int]:
    """The degrees of the (dp_replicate, dp_shard, tp) mesh, one -1 inferred from the world size."""
    degrees = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp}
    for key, value in degrees.items():
        if value == 0 or value < -1:
            fail(f"parallelism.{key}", value, "use a positive degree, or -1 to infer it from the world size")
    inferred = [k for k, v in degrees.items() if v == -1]
    if len(inferred) > 1:
        fail(f"parallelism.{inferred[1]}", -1, "only one degree can be -1 (inferred); set the others")
    known = math.prod(v for v in degrees.values() if v != -1)
    if inferred:
        if world_size % known:
            fail(f"parallelism.{inferred[0]}", -1, f"world size {world_size} is not a multiple of the other degrees' "
                 f"product {known}; launch a multiple of {known} processes")
        degrees[inferred[0]] = world_size // known
    product = math.prod(degrees.values())
    if product != world_size:
        shown = ", ".join(f"{k}={v}" for k, v in degrees.items())
        fail("parallelism", p.name, f"degrees {shown} multiply to {product} but the world size is {world_size}; "
             f"launch {product} processes or set one degree to -1 to infer it")
    return degrees


def _torch_version() -> str:
    from importlib.metadata import version  # not `import torch`: validation runs before torch loads

    return version("torch").split("+")[0]


def dp_size(cfg: Any, world_size: int) -> int:
    degrees = mesh_degrees(cfg.parallelism, world_size)
    return degrees["dp_replicate"] * degrees["dp_shard"]


# --- the whole config ------------------------------------------------------------------------------------

def check_resolvable(cfg: Any) -> None:
    """A value left at ??? or an interpolation that does not resolve (${nope}) is named, not a traceback."""
    from omegaconf import OmegaConf  # here, not at the top: scripts/gpu_check.py imports the rules without it
    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (MissingMandatoryValue, InterpolationResolutionError) as e:
        value: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in e.full_key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        fail(e.full_key, value, f"{str(e).splitlines()[0]}; set a value, e.g. {e.full_key}=<value>")


def check_known_keys(cfg: Any) -> None:
    """`+section.key=value` appends a key the schema lacks, which nothing would read: name it."""
    from omegaconf import OmegaConf
    schema = {f.name: {g.name for g in dataclasses.fields(f.default_factory)} for f in dataclasses.fields(RunConfig)}
    for section in cfg:
        known = schema.get(section)
        extra = [section] if known is None else [f"{section}.{k}" for k in cfg[section] if k not in known]
        if extra:
            fail(extra[0], OmegaConf.select(cfg, extra[0]), "not a config key, so nothing reads it: check its spelling")


# --- per section -------------------------------------------------------------------------------------------

def check_ac(cfg: Any) -> None:
    ac = cfg.ac
    check_target(ac)
    if ac.mode == ACMode.selective:
        opt = str(ac.selective_option)
        if opt != "op" and not (opt.isdigit() and int(opt) > 0):
            fail("ac.selective_option", ac.selective_option,
                 "use 'op' for the per-op policy or a positive integer N to fully checkpoint every N-th block")
    if ac.mode == ACMode.per_block:
        check_block_policies(cfg)
    selective_op = ((ac.mode == ACMode.selective and str(ac.selective_option) == "op")
                    or (ac.mode == ACMode.offload and ac.offload_with == "selective")
                    or (ac.mode == ACMode.per_block and "selective" in str(ac.blocks)))
    if ac.force_recompute_modules and not selective_op:
        fail("ac.force_recompute_modules", list(ac.force_recompute_modules),
             "only selective op reads it (ac=selective, a selective block of ac=per_block, ac.offload_with="
             "selective); drop it, or use ac=selective")
    if ac.offload_with != "none" and ac.mode != ACMode.offload:
        fail("ac.offload_with", ac.offload_with, "only ac=offload reads it; drop it, or use ac=offload")
    if not uses_budget(ac):
        return
    if ac.mode == ACMode.memory_budget:
        check_budget(cfg)
    if cfg.compile.enabled is False:
        fail("compile.enabled", False, f"{_budget_key(ac)} works inside the compiler: drop compile.enabled=false "
             "(it turns compile on)")
    if cfg.compile.backend not in BUDGET_BACKENDS:
        fail("compile.backend", cfg.compile.backend, "this backend's partitioner ignores the memory budget: use "
             "compile.backend=inductor (or aot_eager_decomp_partition for fast CPU tests)")
    if ac.solver == Solver.ilp:
        try:
            import scipy.optimize  # noqa: F401
        except ImportError:
            fail("ac.solver", "ilp", "the ilp solver needs scipy: pip install scipy (or use ac.solver=dp)")
    if ac.visualize_pareto:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("ac.visualize_pareto", True, "the Pareto plots need matplotlib: pip install matplotlib")


def _budget_key(ac: Any) -> str:
    return f"ac.blocks={ac.blocks}" if ac.mode == ACMode.per_block else "ac=memory_budget"


def is_budget(value: float) -> bool:
    """A memory budget is a number in [0, 1] (NaN is not)."""
    return 0.0 <= value <= 1.0


def check_target(ac: Any) -> None:
    """ac.target_memory_gib, the memory an auto setting (or a search's trial) must fit: unset (the device's) or a
    positive number, whatever the mode: a run not set to auto may be a search's trial."""
    if ac.target_memory_gib is not None and not 0 < ac.target_memory_gib < math.inf:
        fail("ac.target_memory_gib", ac.target_memory_gib, "set a positive number of GiB per rank")


def check_block_policies(cfg: Any) -> None:
    """ac.blocks: one known policy per block, budgets in [0, 1], or auto."""
    ac, n = cfg.ac, cfg.model.n_layers
    if is_auto(ac):
        return
    try:
        policies = parse_block_policies(ac.blocks)
    except ValueError:
        fail("ac.blocks", ac.blocks, f"give policy*count terms of {POLICY_NAMES}, one policy per block, e.g. "
             f"ac.blocks='full*{n // 2}+budget:0.3*{n - n // 2}'")
    if len(policies) != n:
        fail("ac.blocks", ac.blocks, f"gives {len(policies)} policies but model.n_layers={n}; give one per block, "
             f"e.g. ac.blocks='full*{n // 2}+none*{n - n // 2}'")
    for p in policies:
        if p.compiled and not is_budget(p.budget):
            fail("ac.blocks", ac.blocks, "budgets are numbers in [0, 1] (budget:0.0 recomputes the whole compiled "
                 f"block, budget:1.0 is the default plan), e.g. ac.blocks='budget:0.3*{n}'")


def check_budget(cfg: Any, planning: bool = False) -> None:
    """A budget in [0, 1], per block or auto; `sweep` only for the planner."""
    ac = cfg.ac
    budget = budget_of(ac)
    if budget == "sweep":
        if not planning:
            fail("ac.memory_budget", budget, "a sweep is planned, not trained: python -m membudget.plan "
                 "ac=memory_budget ac.memory_budget=sweep; train with a number or auto")
        return
    if budget == "auto":
        return
    if isinstance(budget, str):
        try:
            budgets = parse_block_budgets(budget)
        except ValueError:
            fail("ac.memory_budget", budget, "set a number in [0, 1], auto, or one budget per block such as "
                 f"ac.memory_budget=0.3*{cfg.model.n_layers // 2}+0.6*{cfg.model.n_layers - cfg.model.n_layers // 2}")
        if len(budgets) != cfg.model.n_layers:
            fail("ac.memory_budget", budget, f"gives {len(budgets)} budgets but model.n_layers={cfg.model.n_layers}; "
                 f"give one per block, e.g. ac.memory_budget=0.5*{cfg.model.n_layers}")
    else:
        budgets = [budget]
    for b in budgets:
        if not is_budget(b):
            fail("ac.memory_budget", budget,
                 "set numbers in [0, 1]: 0.0 recomputes the whole compiled block, 1.0 is the default plan")


def check_model(cfg: Any) -> None:
    m = cfg.model
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len", "rope_original_max_seq_len"):
        if getattr(m, key) <= 0:
            fail(f"model.{key}", getattr(m, key), "must be a positive integer")
    if m.n_kv_heads is not None and m.n_kv_heads <= 0:
        fail("model.n_kv_heads", m.n_kv_heads, "must be a positive integer, or null for model.n_heads")
    for key in ("norm_eps", "rope_theta"):
        if not 0 < getattr(m, key) < math.inf:
            fail(f"model.{key}", getattr(m, key), "must be a positive number")
    for key in ("rope_scaling_factor", "ffn_dim_multiplier"):
        if getattr(m, key) is not None and not 0 < getattr(m, key) < math.inf:
            fail(f"model.{key}", getattr(m, key), "must be a positive number, or null for none")
    if m.rope_scaling_factor is not None and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        fail("model.rope_low_freq_factor", m.rope_low_freq_factor,
             f"must be positive and below model.rope_high_freq_factor={m.rope_high_freq_factor}")
    if m.dim % m.n_heads:
        fail("model.dim", m.dim, f"must be divisible by model.n_heads={m.n_heads}")
    n_kv = m.n_kv_heads or m.n_heads
    if m.n_heads % n_kv:
        fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    if (m.dim // m.n_heads) % 2:
        fail("model.dim", m.dim, f"the head size model.dim / model.n_heads = {m.dim // m.n_heads} must be even "
             "(RoPE rotates pairs of features)")


def check_parallelism(cfg: Any, world_size: int) -> None:
    p = cfg.parallelism
    if p.timeout_s <= 0:
        fail("parallelism.timeout_s", p.timeout_s, "must be a positive number of seconds")
    degrees = mesh_degrees(p, world_size)
    tp = degrees["tp"]
    if tp > 1:
        m = cfg.model
        for key, size in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads or m.n_heads),
                          ("FFN hidden size", ffn_hidden_size(m.dim, m.multiple_of, m.ffn_dim_multiplier)),
                          ("train.seq_len", cfg.train.seq_len)):
            if size % tp:
                fail("parallelism.tp", tp, f"must divide {key}={size}; choose a divisor of it")
        # an auto setting has no blocks yet: they are the planner's choice
        full_blocks = not is_auto(cfg.ac) and any(p.ac == "full" for p in block_policies(cfg.ac, cfg.model.n_layers))
        if full_blocks and compile_enabled(cfg):
            # torch 2.13: AOTAutograd saves the TP mesh among a compiled checkpoint's tensors and fails in backward
            fail("compile.enabled", True, f"torch {_torch_version()} cannot compile fully checkpointed blocks under "
                 "TP (a DeviceMesh among the saved tensors); drop compile.enabled=true, or use ac=memory_budget "
                 "ac.memory_budget=0.0 (the compiler's own full recompute)")


def check_global_batch(global_batch_size: int, dp: int) -> None:
    """The global batch splits evenly across the data-parallel ranks (each keeps global_batch_size // dp rows)."""
    if global_batch_size % dp:
        fail("train.global_batch_size", global_batch_size,
             f"must divide across the {dp} data-parallel ranks; use a multiple of {dp}")


def check_train(cfg: Any, world_size: int) -> None:
    t = cfg.train
    for key in ("steps", "global_batch_size", "seq_len", "log_every", "max_skipped_steps"):
        if getattr(t, key) <= 0:
            fail(f"train.{key}", getattr(t, key), "must be a positive integer")
    if t.seq_len > cfg.model.max_seq_len:
        fail("train.seq_len", t.seq_len, f"must be at most model.max_seq_len={cfg.model.max_seq_len}")
    dp = dp_size(cfg, world_size)
    check_global_batch(t.global_batch_size, dp)
    if t.micro_batch_size is not None:
        per_rank = t.global_batch_size // dp
        if t.micro_batch_size <= 0 or per_rank % t.micro_batch_size:
            fail("train.micro_batch_size", t.micro_batch_size,
                 f"must be a positive divisor of the per-rank batch {per_rank} "
                 f"(train.global_batch_size={t.global_batch_size} over {dp} data-parallel ranks)")
    if not t.max_grad_norm > 0:
        fail("train.max_grad_norm", t.max_grad_norm, "must be a positive number (inf: no clipping)")
    if not 0 <= t.seed <= _MAX_SEED:
        fail("train.seed", t.seed, "must be an integer in [0, 2**64)")
    if t.gc_every_steps is not None and t.gc_every_steps <= 0:
        fail("train.gc_every_steps", t.gc_every_steps, "must be a positive number of steps, or null (the collector's "
             "own thresholds)")
    if t.peak_flops is not None and not 0 < t.peak_flops < math.inf:
        fail("train.peak_flops", t.peak_flops, "must be a positive number of FLOP/s per device, or null")


def check_optimizer(cfg: Any) -> None:
    o, s = cfg.optimizer, cfg.lr_schedule
    if not 0 < o.lr < math.inf:
        fail("optimizer.lr", o.lr, "must be a positive number")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            fail(f"optimizer.{key}", getattr(o, key), "must be in [0, 1)")
    if not 0 < o.eps < math.inf:
        fail("optimizer.eps", o.eps, "must be a positive number")
    if not 0 <= o.weight_decay < math.inf:
        fail("optimizer.weight_decay", o.weight_decay, "must be a non-negative number")
    if s.warmup_steps < 0:
        fail("lr_schedule.warmup_steps", s.warmup_steps, "must be a non-negative integer")
    if not 0 <= s.min_lr_ratio <= 1:
        fail("lr_schedule.min_lr_ratio", s.min_lr_ratio, "must be in [0, 1]: a fraction of the peak LR")


def check_checkpoint(cfg: Any) -> None:
    c = cfg.checkpoint
    if c.enabled:
        for key in ("every_steps", "keep"):
            if getattr(c, key) < 1:
                fail(f"checkpoint.{key}", getattr(c, key),
                     "must be at least 1; use checkpoint.enabled=false to save no checkpoints")
    if not 0 < c.write_gbps < math.inf:
        fail("checkpoint.write_gbps", c.write_gbps, "must be a positive number of GB/s")
    if c.timeout_s is not None and c.timeout_s <= 0:
        fail("checkpoint.timeout_s", c.timeout_s, "must be a positive number of seconds, or null to size it")


def check_data(cfg: Any) -> None:
    if cfg.data.prefetch < 0:
        fail("data.prefetch", cfg.data.prefetch, "must be 0 (no background loading) or a positive number of batches")
    if cfg.data.tokenize_threads is not None and cfg.data.tokenize_threads < 1:
        fail("data.tokenize_threads", cfg.data.tokenize_threads,
             "must be a positive number of threads, or null to use this rank's share of the CPUs")


def check_plan(cfg: Any) -> None:
    """plan.budgets: the budgets a sweep plans and auto chooses among, at least one, each in [0, 1], each once;
    the ranks and the device memory planned for, if set, positive; the margin kept free, none or more (a negative
    one would call a plan above the device's memory "fits")."""
    p = cfg.plan
    budgets = list(p.budgets)
    if not budgets or not all(map(is_budget, budgets)) or len(set(budgets)) < len(budgets):
        raise UserError(f"plan.budgets={budget_list(budgets)}: give distinct numbers in [0, 1], "
                        "e.g. plan.budgets=[0.3,0.5,0.7]")
    if p.world_size is not None and p.world_size < 1:
        fail("plan.world_size", p.world_size, "set a positive number of ranks, or null (the product of the "
             "parallelism degrees)")
    if p.device_gib is not None and not 0 < p.device_gib < math.inf:
        fail("plan.device_gib", p.device_gib, "set a positive number of GiB per rank, or null (plan.gpu's memory)")
    if not 0 <= p.margin_gib < math.inf:
        fail("plan.margin_gib", p.margin_gib, "set the GiB kept free per rank, 0 or more")


def check_diagnostics(cfg: Any) -> None:
    """The debug presets' step counts: the steps recorded at least 1, those waited and warmed up 0 or more (what
    torch.profiler's schedule accepts; checked here, not when the profiler starts after the model is built)."""
    d = cfg.diagnostics
    for key, least in (("snapshot_steps", 1), ("profile_active", 1), ("profile_wait", 0), ("profile_warmup", 0)):
        if getattr(d, key) < least:
            fail(f"diagnostics.{key}", getattr(d, key), f"must be a step count of at least {least}")


SECTIONS = (check_ac, check_model, check_optimizer, check_checkpoint, check_data, check_plan, check_diagnostics)


def validate(cfg: Any, world_size: int = 1) -> None:
    """Check the rules that span fields; raise UserError naming the key, the bad value and the fix."""
    check_resolvable(cfg)
    check_known_keys(cfg)
    for check in SECTIONS:
        check(cfg)
    check_parallelism(cfg, world_size)
    check_train(cfg, world_size)


# --- after a run: what its measurements say

# A run whose steps wait longer than this share of a step for their batches is told so: the data path (reading,
# and every rank tokenizing the whole global batch) is slower than the GPUs
DATA_WAIT_SHARE = 0.05


def data_wait_line(summary: dict[str, Any]) -> Optional[str]:
    """A line when the run's steps waited for their batches (medians over the steady steps), else None."""
    wait, step = summary.get("median_data_wait_s"), summary.get("median_step_time_s")
    if not wait or not step or wait <= DATA_WAIT_SHARE * step:
        return None
    waited = f"the steps waited {wait:.3g} s each for their batches, {wait / step:.0%} of a step"
    if (summary.get("config") or {}).get("data", {}).get("name") == "tokens":  # nothing tokenized: the storage
        return f"{waited}: raise data.prefetch, or copy the token file to faster storage"
    return (f"{waited}: every rank reads and tokenizes the whole global batch; tokenize the corpus once (python -m "
            "membudget.pretokenize, then data=tokens: each rank reads only its rows), or raise data.tokenize_threads "
            "(a BPE tokenizer) or data.prefetch, or read the data from faster storage")
