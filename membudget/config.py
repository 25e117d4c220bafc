"""The run's config schema, its registration in Hydra's ConfigStore, and the cross-field rules.

Each dataclass types one config group or section; the yaml files under `conf/` are validated against
them when Hydra composes, so a misspelt key or a wrong type fails there. Rules that span fields live in
`validate`, which runs before anything heavy is built.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


class UserError(Exception):
    """A problem the user can fix: shown as one line (key, bad value, fix), never as a traceback."""


AC_MODES = ("none", "full", "selective", "memory_budget")
# Backends whose AOT partitioner is the min-cut one that reads activation_memory_budget.
# Plain "aot_eager" uses the default partitioner, which silently ignores the budget.
BUDGET_BACKENDS = ("inductor", "aot_eager_decomp_partition")
COMPILE_BACKENDS = ("inductor", "aot_eager_decomp_partition", "aot_eager", "eager")
SOLVERS = ("dp", "greedy", "ilp")
RUNTIME_ESTIMATORS = ("flops", "profile")


@dataclass
class ModelConfig:
    name: str = MISSING
    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: Optional[int] = None  # None: same as n_heads (no grouped-query attention)
    vocab_size: int = MISSING
    multiple_of: int = 256  # FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1 RoPE frequency scaling; off (None) for Llama 3.0
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192
    tie_embeddings: bool = False


@dataclass
class ACConfig:
    mode: str = "none"  # none | full | selective | memory_budget
    # full AC (torch.utils.checkpoint, non-reentrant)
    preserve_rng_state: bool = True
    determinism_check: str = "default"  # "default" compares recomputed metadata; "none" skips it
    debug: bool = False
    # selective AC: "op" (per-op policy) or a positive integer N as a string (every N-th block full AC)
    selective_option: str = "op"
    # module names (suffix match, e.g. "feed_forward.w2") whose matmuls are always recomputed
    force_recompute_modules: list[str] = field(default_factory=list)
    # memory_budget: fraction of activations the partitioner may save, in [0, 1]; "auto": the budget with the
    # least recompute whose planned peak fits (membudget.plan); "sweep": planner only, budgets 0.0..1.0
    memory_budget: Any = 0.5
    target_memory_gib: Optional[float] = None  # "auto" fits this per rank; None: device memory - plan.margin_gib
    solver: str = "dp"  # dp | greedy | ilp (ilp needs scipy)
    runtime_estimator: str = "flops"  # flops | profile
    visualize_pareto: bool = False  # SVGs into <run dir>/memory_budget_pareto/ (needs matplotlib)


@dataclass
class CompileConfig:
    # None = automatic: on for ac=memory_budget (the budget lives in the compiler), off otherwise
    enabled: Optional[bool] = None
    backend: str = "inductor"
    fullgraph: bool = True


@dataclass
class ParallelismConfig:
    name: str = "single"
    # Degrees of the device mesh; their product is the world size. -1 = inferred from the world size.
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    # FSDP mixed precision on GPU: parameters in param_dtype, gradients reduced in reduce_dtype
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    # collectives that wait longer than this fail instead of hanging (a rank died, a node was lost)
    timeout_s: int = 600


@dataclass
class TokenizerConfig:
    name: str = "byte"  # byte | tiktoken
    path: Optional[str] = None  # tiktoken: path of the Llama 3 tokenizer.model


@dataclass
class DataConfig:
    name: str = "pydoc"  # pydoc | text | jsonl | synthetic | hf
    path: Optional[str] = None  # text/jsonl: a file, a directory or a glob
    text_field: str = "text"  # jsonl / hf: the field holding the document text
    hf_path: Optional[str] = None  # hf: dataset on the Hub ("allenai/c4") or a local builder ("json")
    hf_name: Optional[str] = None  # hf: the dataset's config name ("en", "sample-10BT")
    hf_data_files: Optional[str] = None  # hf: local files for a builder such as "json"
    split: str = "train"
    streaming: bool = True


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class LRScheduleConfig:
    warmup_steps: int = 10
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1  # final LR as a fraction of the peak


@dataclass
class TrainConfig:
    steps: int = 100
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: Optional[int] = None  # per rank per forward; None = no gradient accumulation
    seq_len: int = 256
    max_grad_norm: float = 1.0
    seed: int = 0
    device: str = "auto"  # auto (CUDA when present, else CPU) | cpu | cuda
    dtype: str = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU | float32 | bfloat16
    log_every: int = 1
    progress: str = "auto"  # auto: a bar on a terminal, log lines otherwise | bar | lines | off
    peak_flops: Optional[float] = None  # per device, for MFU where the device is not known


@dataclass
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 50  # also at the end of the run and when SLURM signals a time limit or preemption
    keep: int = 2  # the last K complete checkpoints are kept
    # auto: continue from the latest complete checkpoint in the run dir, if any | never | a checkpoint path
    resume: str = "auto"


@dataclass
class LoggerConfig:
    name: str = "none"  # wandb | none
    project: str = "membudget"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the sweep's name in a multirun, else none
    tags: list[str] = field(default_factory=list)
    run_name: Optional[str] = None  # None: built from the AC mode and budget
    mode: Optional[str] = None  # None: WANDB_MODE from the environment, else offline


@dataclass
class PlanConfig:
    """What `python -m membudget.plan` plans for beyond the run's own settings."""
    world_size: Optional[int] = None  # ranks; None: the product of the parallelism degrees
    gpu: str = "auto"  # H100 | H200 | A100-80GB | A100-40GB | auto (the visible GPU, else H100)
    device_gib: Optional[float] = None  # device memory per rank, GiB; overrides gpu
    margin_gib: float = 4.0  # kept free for the CUDA context, NCCL buffers and allocator fragmentation


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, from torchrun's or SLURM's environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launch_from_env(env=os.environ) -> Launch:
    """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; `srun` and submitit set SLURM_PROCID/NTASKS/LOCALID."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return Launch(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return Launch()


def launch_time(pattern: str) -> str:
    """The launch's start time, formatted: the same in every rank of a torchrun or srun job (their common
    parent, the torchrun agent or slurmstepd, started once), so that all ranks agree on Hydra's run dir."""
    started = time.time()
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        import psutil

        started = psutil.Process(os.getppid()).create_time()
    return datetime.datetime.fromtimestamp(started).strftime(pattern)


def register_configs() -> None:
    """Register the schema so `conf/config.yaml` and each group option are validated against it, and the
    resolvers that keep the ranks of one job in one run dir with one log file each."""
    OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("rank_suffix", lambda: f"_rank{launch_from_env().rank}" if launch_from_env().rank else "",
                                    replace=True)
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, node in (
        ("model", ModelConfig),
        ("ac", ACConfig),
        ("compile", CompileConfig),
        ("parallelism", ParallelismConfig),
        ("tokenizer", TokenizerConfig),
        ("data", DataConfig),
        ("logger", LoggerConfig),
    ):
        cs.store(group=group, name=f"{group}_schema", node=node)


def _fail(key: str, value: Any, fix: str) -> None:
    raise UserError(f"{key}={value!r}: {fix}")


def compile_enabled(cfg: Any) -> bool:
    """Whether blocks are compiled: explicit setting, else on exactly for ac=memory_budget."""
    if cfg.compile.enabled is None:
        return cfg.ac.mode == "memory_budget"
    return bool(cfg.compile.enabled)


def mesh_degrees(p: Any, world_size: int) -> dict[str, int]:
    """The degrees of the (dp_replicate, dp_shard, tp) mesh, one -1 inferred from the world size."""
    degrees = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard, "tp": p.tp}
    for key, value in degrees.items():
        if value == 0 or value < -1:
            _fail(f"parallelism.{key}", value, "use a positive degree, or -1 to infer it from the world size")
    inferred = [k for k, v in degrees.items() if v == -1]
    if len(inferred) > 1:
        _fail(f"parallelism.{inferred[1]}", -1, "only one degree can be -1 (inferred); set the others")
    known = math.prod(v for v in degrees.values() if v != -1)
    if inferred:
        if world_size % known:
            _fail(f"parallelism.{inferred[0]}", -1,
                  f"world size {world_size} is not a multiple of the other degrees' product {known}; "
                  f"launch a multiple of {known} processes")
        degrees[inferred[0]] = world_size // known
    product = math.prod(degrees.values())
    if product != world_size:
        shown = ", ".join(f"{k}={v}" for k, v in degrees.items())
        _fail("parallelism", p.name, f"degrees {shown} multiply to {product} but the world size is {world_size}; "
              f"launch {product} processes or set one degree to -1 to infer it")
    return degrees


def validate(cfg: Any, world_size: int = 1) -> None:
    """Check the rules that span fields; raise UserError naming the key, the bad value and the fix."""
    import dataclasses

    from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

    try:  # a value left at ??? (model=model_schema) or an interpolation that does not resolve (${nope})
        if hasattr(cfg, "keys"):
            OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (MissingMandatoryValue, InterpolationResolutionError) as e:
        value: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in e.full_key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        _fail(e.full_key, value, f"{str(e).splitlines()[0]}; set a value, e.g. {e.full_key}=<value>")
    # `+section.key=value` appends a key the schema lacks, which nothing would read: name it, don't ignore it
    schema = {f.name: {g.name for g in dataclasses.fields(f.default_factory)} for f in dataclasses.fields(RunConfig)}
    for section in cfg if hasattr(cfg, "keys") else ():
        known = schema.get(section)
        extra = [section] if known is None else [f"{section}.{k}" for k in cfg[section] if k not in known]
        if extra:
            _fail(extra[0], OmegaConf.select(cfg, extra[0]), "not a config key, so nothing reads it: check its spelling")
    ac = cfg.ac
    if ac.mode not in AC_MODES:
        _fail("ac.mode", ac.mode, f"choose one of {', '.join(AC_MODES)}")
    if cfg.compile.backend not in COMPILE_BACKENDS:
        _fail("compile.backend", cfg.compile.backend, f"choose one of {', '.join(COMPILE_BACKENDS)}")
    if ac.mode == "selective":
        opt = str(ac.selective_option)
        if opt != "op" and not (opt.isdigit() and int(opt) > 0):
            _fail("ac.selective_option", ac.selective_option,
                  "use 'op' for the per-op policy or a positive integer N to fully checkpoint every N-th block")
    if ac.mode == "memory_budget":
        budget = ac.memory_budget
        if budget == "sweep":
            _fail("ac.memory_budget", budget, "a sweep is planned, not trained: python -m membudget.plan "
                  "ac=memory_budget ac.memory_budget=sweep; train with a number or auto")
        if budget == "auto":
            if ac.target_memory_gib is not None and not ac.target_memory_gib > 0:
                _fail("ac.target_memory_gib", ac.target_memory_gib, "set a positive number of GiB per rank")
        elif isinstance(budget, bool) or not isinstance(budget, (int, float)) or math.isnan(budget):
            _fail("ac.memory_budget", budget, "set a number in [0, 1] or auto, e.g. ac.memory_budget=0.5")
        elif not 0.0 <= float(budget) <= 1.0:
            _fail("ac.memory_budget", budget,
                  "set a number in [0, 1]: 0.0 recomputes the whole compiled region, 1.0 is the default plan")
        if cfg.compile.enabled is False:
            _fail("compile.enabled", False,
                  "ac=memory_budget works inside the compiler: drop compile.enabled=false (it turns compile on)")
        if cfg.compile.backend not in BUDGET_BACKENDS:
            _fail("compile.backend", cfg.compile.backend,
                  "this backend's partitioner ignores the memory budget: use compile.backend=inductor "
                  "(or aot_eager_decomp_partition for fast CPU tests)")
        if ac.solver not in SOLVERS:
            _fail("ac.solver", ac.solver, f"choose one of {', '.join(SOLVERS)}")
        if ac.runtime_estimator not in RUNTIME_ESTIMATORS:
            _fail("ac.runtime_estimator", ac.runtime_estimator, f"choose one of {', '.join(RUNTIME_ESTIMATORS)}")
        if ac.solver == "ilp":
            try:
                import scipy.optimize  # noqa: F401
            except ImportError:
                _fail("ac.solver", "ilp", "the ilp solver needs scipy: pip install scipy (or use ac.solver=dp)")
        if ac.visualize_pareto:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                _fail("ac.visualize_pareto", True, "the Pareto plots need matplotlib: pip install matplotlib")
    if ac.determinism_check not in ("default", "none"):
        _fail("ac.determinism_check", ac.determinism_check, "choose default or none")

    m = cfg.model
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "max_seq_len"):
        if getattr(m, key) <= 0:
            _fail(f"model.{key}", getattr(m, key), "must be a positive integer")
    if m.n_kv_heads is not None and m.n_kv_heads <= 0:
        _fail("model.n_kv_heads", m.n_kv_heads, "must be a positive integer, or null for model.n_heads")
    if m.dim % m.n_heads:
        _fail("model.dim", m.dim, f"must be divisible by model.n_heads={m.n_heads}")
    n_kv = m.n_kv_heads or m.n_heads
    if m.n_heads % n_kv:
        _fail("model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    if (m.dim // m.n_heads) % 2:
        _fail("model.dim", m.dim, f"the head size model.dim / model.n_heads = {m.dim // m.n_heads} must be even "
              "(RoPE rotates pairs of features)")

    degrees = mesh_degrees(cfg.parallelism, world_size)
    tp = degrees["tp"]
    if tp > 1:
        from membudget.model import ModelArgs

        ffn_hidden = ModelArgs.from_config(m).ffn_hidden
        for key, size in (("model.n_heads", m.n_heads), ("model.n_kv_heads", n_kv), ("FFN hidden size", ffn_hidden),
                          ("train.seq_len", cfg.train.seq_len)):
            if size % tp:
                _fail("parallelism.tp", tp, f"must divide {key}={size}; choose a divisor of it")
    dp = degrees["dp_replicate"] * degrees["dp_shard"]
    if cfg.train.global_batch_size % dp:
        _fail("train.global_batch_size", cfg.train.global_batch_size,
              f"must divide across the {dp} data-parallel ranks; use a multiple of {dp}")

    t = cfg.train
    for key in ("steps", "global_batch_size", "seq_len", "log_every"):
        if getattr(t, key) <= 0:
            _fail(f"train.{key}", getattr(t, key), "must be a positive integer")
    if t.seq_len > m.max_seq_len:
        _fail("train.seq_len", t.seq_len, f"must be at most model.max_seq_len={m.max_seq_len}")
    if t.micro_batch_size is not None:
        per_rank = t.global_batch_size // dp
        if t.micro_batch_size <= 0 or per_rank % t.micro_batch_size:
            _fail("train.micro_batch_size", t.micro_batch_size,
                  f"must be a positive divisor of the per-rank batch {per_rank} "
                  f"(train.global_batch_size={t.global_batch_size} over {dp} data-parallel ranks)")
    if t.device not in ("auto", "cpu", "cuda"):
        _fail("train.device", t.device, "choose auto, cpu or cuda")
    if t.dtype not in ("auto", "float32", "bfloat16"):
        _fail("train.dtype", t.dtype, "choose auto, float32 or bfloat16")
    if t.progress not in ("auto", "bar", "lines", "off"):
        _fail("train.progress", t.progress, "choose auto, bar, lines or off")
    if not t.max_grad_norm > 0:
        _fail("train.max_grad_norm", t.max_grad_norm, "must be a positive number (inf: no clipping)")
    if t.seed < 0:
        _fail("train.seed", t.seed, "must be a non-negative integer")
    if t.peak_flops is not None and not 0 < t.peak_flops < math.inf:
        _fail("train.peak_flops", t.peak_flops, "must be a positive number of FLOP/s per device, or null")
    o = cfg.optimizer
    if o.name != "adamw":
        _fail("optimizer.name", o.name, "only adamw is implemented")
    if not 0 < o.lr < math.inf:
        _fail("optimizer.lr", o.lr, "must be a positive number")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(o, key) < 1:
            _fail(f"optimizer.{key}", getattr(o, key), "must be in [0, 1)")
    if not 0 < o.eps < math.inf:
        _fail("optimizer.eps", o.eps, "must be a positive number")
    if not 0 <= o.weight_decay < math.inf:
        _fail("optimizer.weight_decay", o.weight_decay, "must be a non-negative number")
    if cfg.lr_schedule.warmup_steps < 0:
        _fail("lr_schedule.warmup_steps", cfg.lr_schedule.warmup_steps, "must be a non-negative integer")
    if not 0 <= cfg.lr_schedule.min_lr_ratio <= 1:
        _fail("lr_schedule.min_lr_ratio", cfg.lr_schedule.min_lr_ratio, "must be in [0, 1]: a fraction of the peak LR")
    if cfg.parallelism.timeout_s <= 0:
        _fail("parallelism.timeout_s", cfg.parallelism.timeout_s, "must be a positive number of seconds")
    for key in ("param_dtype", "reduce_dtype"):
        if getattr(cfg.parallelism, key) not in ("float32", "bfloat16", "float16"):
            _fail(f"parallelism.{key}", getattr(cfg.parallelism, key), "choose float32, bfloat16 or float16")
    if cfg.logger.mode not in (None, "online", "offline", "disabled", "shared", "dryrun", "run"):
        _fail("logger.mode", cfg.logger.mode, "choose online, offline or disabled (or null: WANDB_MODE, else offline)")
    if cfg.lr_schedule.decay not in ("cosine", "linear", "constant"):
        _fail("lr_schedule.decay", cfg.lr_schedule.decay, "choose cosine, linear or constant")
    if cfg.logger.name not in ("wandb", "none"):
        _fail("logger.name", cfg.logger.name, "choose logger=wandb or logger=none")
    if cfg.tokenizer.name not in ("byte", "tiktoken"):
        _fail("tokenizer.name", cfg.tokenizer.name, "choose tokenizer=byte or tokenizer=tiktoken")
    if cfg.data.name not in ("pydoc", "text", "jsonl", "synthetic", "hf"):
        _fail("data.name", cfg.data.name, "choose data=pydoc, text, jsonl, synthetic or hf")
