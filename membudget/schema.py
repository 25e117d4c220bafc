"""The run's config schema: one dataclass per config section, every choice an Enum, every default here.

The yaml files under `conf/` only pick options (a model's sizes, an AC mode, a dataset); they are merged into
this schema when Hydra composes, so a misspelt key, a wrong type or an unknown choice (`ac.mode=bogus`,
`train.device=tpu`) fails at composition with Hydra's own message. Rules that span fields live in
`membudget.rules`. Each field's docstring is the string below it (as in torchtitan's job config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

try:
    from omegaconf import MISSING
except ImportError:  # scripts/gpu_check.py builds its config without Hydra/OmegaConf: the same marker
    MISSING = "???"


class Choice(str, Enum):
    """A config choice: compares, formats and serialises as its plain string ("full" == ACMode.full)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class ACMode(Choice):
    none = "none"
    full = "full"
    selective = "selective"
    memory_budget = "memory_budget"
    offload = "offload"
    per_block = "per_block"


class OffloadWith(Choice):
    none = "none"
    selective = "selective"
    full = "full"


class FSDPOuter(Choice):
    """How FSDP2 groups the parameters outside the blocks (embedding, final norm, output)."""

    split = "split"
    root = "root"


class Reshard(Choice):
    """Which FSDP2 groups free their gathered parameters after forward and gather them again for backward."""

    default = "default"
    always = "always"
    never = "never"


class CompileBackend(Choice):
    inductor = "inductor"
    aot_eager_decomp_partition = "aot_eager_decomp_partition"
    aot_eager = "aot_eager"
    eager = "eager"


# Backends whose AOT partitioner is the min-cut one that reads activation_memory_budget.
# Plain "aot_eager" uses the default partitioner, which silently ignores the budget.
BUDGET_BACKENDS = (CompileBackend.inductor, CompileBackend.aot_eager_decomp_partition)


class Solver(Choice):
    dp = "dp"
    greedy = "greedy"
    ilp = "ilp"


class RuntimeEstimator(Choice):
    flops = "flops"
    profile = "profile"


class DeterminismCheck(Choice):
    default = "default"
    none = "none"


class DType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class TrainDevice(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class TrainDType(Choice):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class ProgressMode(Choice):
    auto = "auto"
    bar = "bar"
    lines = "lines"
    off = "off"


class NonFinite(Choice):
    stop = "stop"
    skip = "skip"


class Decay(Choice):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class OptimizerName(Choice):
    adamw = "adamw"


class TokenizerName(Choice):
    byte = "byte"
    tiktoken = "tiktoken"


class DataName(Choice):
    pydoc = "pydoc"
    text = "text"
    jsonl = "jsonl"
    synthetic = "synthetic"
    hf = "hf"
    tokens = "tokens"


class LoggerName(Choice):
    wandb = "wandb"
    none = "none"


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class ModelConfig:
    name: str = MISSING
    """Label of the model preset (conf/model/<name>.yaml); shown in run names and plans."""
    dim: int = MISSING
    """Width of the residual stream."""
    n_layers: int = MISSING
    """Transformer blocks; AC, compile and FSDP apply per block."""
    n_heads: int = MISSING
    """Attention (query) heads; dim / n_heads is the head size."""
    n_kv_heads: Optional[int] = None
    """Key/value heads for grouped-query attention; null: same as n_heads."""
    vocab_size: int = MISSING
    """Rows of the embedding and the output projection; at least the tokenizer's ids."""
    multiple_of: int = 256
    """The FFN hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: Optional[float] = None
    """Scales Meta's 2/3 * 4 * dim FFN hidden size before rounding (1.3 for 8B); null: 1."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon (positive)."""
    rope_theta: float = 500000.0
    """RoPE base frequency (positive)."""
    rope_scaling_factor: Optional[float] = None
    """Llama 3.1 RoPE frequency scaling (8 for 3.1, 32 for 3.2); null: off (Llama 3.0)."""
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192
    """Longest train.seq_len the RoPE table covers."""
    tie_embeddings: bool = False
    """The output projection shares the embedding's weight (Llama 3.2 1B and 3B)."""


def ffn_hidden_size(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """Meta's FFN width: 2/3 of 4 * dim, scaled, rounded up to multiple_of (14336 for 8B)."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class ACConfig:
    mode: ACMode = ACMode.none
    """none: keep every activation | full: recompute each block | selective: per op or every N-th block |
    memory_budget: the compiler's min-cut partitioner keeps a fraction of the activations | offload: each block's
    saved activations wait in pinned host memory | per_block: a policy per block (ac.blocks)."""
    preserve_rng_state: bool = True
    """full/selective: replay the RNG in recompute exactly."""
    determinism_check: DeterminismCheck = DeterminismCheck.default
    """full/selective: compare recomputed tensors' metadata with the forward's (none: skip)."""
    debug: bool = False
    """full/selective: on a determinism error, print the ops of both passes."""
    selective_option: str = "op"
    """selective: "op" (save matmul and attention outputs, every second matmul) or N (full AC on every N-th
    block)."""
    force_recompute_modules: list[str] = field(default_factory=list)
    """selective op: module names (suffix match, e.g. feed_forward.w2) whose matmuls are always recomputed;
    each must match a module of the block."""
    memory_budget: Union[float, str] = 0.5
    """memory_budget: a number in [0, 1] (0.0 recomputes the whole compiled block, 1.0 is the default plan);
    per block, "0.3*8+0.6*24" (value*count terms, one value per block in all); auto (the fastest setting whose
    planned peak fits, from membudget.plan); sweep (planner only: 0.0..1.0)."""
    target_memory_gib: Optional[float] = None
    """auto: the memory each rank must fit, GiB; null: the device's memory."""
    solver: Solver = Solver.dp
    """memory_budget: the partitioner's knapsack solver (ilp needs scipy)."""
    runtime_estimator: RuntimeEstimator = RuntimeEstimator.flops
    """memory_budget: how the partitioner prices recompute (profile benchmarks each op; GPU only)."""
    visualize_pareto: bool = False
    """memory_budget: SVGs of memory against recompute into <run dir>/memory_budget_pareto/ (matplotlib)."""
    offload_with: OffloadWith = OffloadWith.none
    """offload: what else each block does: none (offload every activation it saves), selective or full (offload
    what that policy saves)."""
    blocks: str = "none"
    """per_block: each block's policy, bottom first, as policy*count terms, one policy per block in all:
    "full*4+budget:0.3*20+none*8". Policies: none | full | selective (op) | budget:<b> (compiled with that memory
    budget) | offload | offload:selective | offload:full; auto: the planner's fastest assignment that fits."""


@dataclass
class CompileConfig:
    enabled: Optional[bool] = None
    """Compile each block with torch.compile; null: on exactly for ac=memory_budget (the budget lives in the
    compiler)."""
    backend: CompileBackend = CompileBackend.inductor
    """inductor, or aot_eager_decomp_partition (the same partitioner without code generation: fast CPU runs)."""
    fullgraph: bool = True
    """Fail on a graph break instead of silently splitting a block."""


@dataclass
class ParallelismConfig:
    name: str = "single"
    """Label of the layout preset (conf/parallelism/<name>.yaml)."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or HSDP across groups); -1: inferred from the world size."""
    dp_shard: int = 1
    """FSDP shards (within a group under HSDP); -1: inferred from the world size."""
    tp: int = 1
    """Tensor-parallel degree (inside a node); -1: inferred from the world size."""
    param_dtype: DType = DType.bfloat16
    """FSDP mixed precision on GPU: the dtype parameters are gathered and computed in."""
    reduce_dtype: DType = DType.float32
    """FSDP mixed precision on GPU: the dtype gradients are reduced in."""
    fsdp_outer: FSDPOuter = FSDPOuter.split
    """FSDP2's groups outside the blocks. split: the embedding is a group of its own, gathered for its forward and
    again for its backward, and [final norm, output] one kept gathered from its forward to its backward, whose
    gradient is reduced as soon as that backward ends. root: all three in the root group (as torchtitan groups
    them), gathered through the whole step and reduced after the embedding's backward: the output's gradient is
    held through the backward of every block."""
    reshard_after_forward: Reshard = Reshard.default
    """FSDP2's memory-for-communication trade (torchtitan's reshard_after_forward_policy). default: every group but
    the last block and [final norm, output] frees its gathered parameters after forward and gathers them again for
    backward (those two are needed again at once). always: every group does. never: none does, so each block's
    gathered parameters stay from its forward to its backward (one all-gather per block per step instead of two).
    The root group stays gathered in each."""
    timeout_s: int = 600
    """Collectives that wait longer than this fail instead of hanging (a rank died, a node was lost)."""


@dataclass
class TokenizerConfig:
    name: TokenizerName = TokenizerName.byte
    """byte (tokenizer=byte) or tiktoken (tokenizer=llama3, Meta's BPE)."""
    path: Optional[str] = None
    """tiktoken: path of Meta's Llama 3 tokenizer.model."""


@dataclass
class DataConfig:
    name: DataName = DataName.pydoc
    """pydoc (CPython's docs, offline), text, jsonl, synthetic, hf (data=c4, data=fineweb_edu) or tokens (a corpus
    tokenized once by python -m membudget.pretokenize: each rank reads only its own rows)."""
    path: Optional[str] = None
    """text/jsonl: a file, a directory or a glob; tokens: the token file (a directory)."""
    text_field: str = "text"
    """jsonl/hf: the field holding the document text."""
    hf_path: Optional[str] = None
    """hf: a dataset on the Hub (allenai/c4) or a local builder (json)."""
    hf_name: Optional[str] = None
    """hf: the dataset's config name (en, sample-10BT)."""
    hf_data_files: Optional[str] = None
    """hf: local files for a builder such as json."""
    hf_revision: Optional[str] = None
    """hf: the Hub dataset's revision (a commit hash, a tag or a branch); null: its main branch, whose files may
    change between a run and its resume, or between nodes that start apart. A resume over another revision is
    refused like any other change of data.hf_*."""
    split: str = "train"
    streaming: bool = True
    """hf: stream instead of downloading the whole dataset first."""
    prefetch: int = 2
    """Batches prepared ahead in a background thread (tokenized, this rank's rows); 0: in the loop."""
    tokenize_threads: Optional[int] = None
    """Threads that tokenize the documents ahead of the batches, in order. Every rank tokenizes the whole global
    batch, so each must keep up with the job's tokens/s in all (world size x tokens/s per GPU). null: 1 for the
    byte tokenizer (numpy outruns threads), else this process's CPUs shared among its node's ranks, at most 8."""


@dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 3e-3
    """Peak learning rate (after warmup)."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices; norms (1-D weights) get none."""
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class LRScheduleConfig:
    warmup_steps: int = 10
    """Linear warmup to the peak LR over these steps."""
    decay: Decay = Decay.cosine
    """cosine, linear or constant decay after warmup."""
    min_lr_ratio: float = 0.1
    """The final LR as a fraction of the peak."""


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps of the whole run (a resumed run continues to this)."""
    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: Optional[int] = None
    """Sequences per rank per forward (gradient accumulation); null: the whole per-rank batch at once."""
    seq_len: int = 256
    """Tokens per sequence."""
    max_grad_norm: float = 1.0
    """Clip the total gradient norm to this (inf: no clipping; the norm is still computed and checked)."""
    seed: int = 0
    """Seeds the initial weights and synthetic data."""
    device: TrainDevice = TrainDevice.auto
    """auto (CUDA when present, else CPU), cpu or cuda."""
    dtype: TrainDType = TrainDType.auto
    """auto: bf16 autocast on GPU, fp32 on CPU; float32; bfloat16 (autocast)."""
    log_every: int = 1
    """Write a metrics row (and sync with the GPU) every N steps."""
    progress: ProgressMode = ProgressMode.auto
    """auto: a bar on a terminal, log lines otherwise; bar; lines; off."""
    peak_flops: Optional[float] = None
    """Peak FLOP/s per device for MFU where the device is not in the table."""
    on_nonfinite: NonFinite = NonFinite.stop
    """A NaN/inf loss or gradient norm: stop before the optimizer step, or skip that step."""
    max_skipped_steps: int = 3
    """on_nonfinite=skip: stop once this many steps were skipped in a row."""
    gc_every_steps: Optional[int] = 50
    """Python's cyclic garbage collector (its young generations) runs after the first step and every N steps, at
    the same step on every rank, instead of whenever allocations trigger it: a collection that pauses one rank
    stalls the others at the next collective (torchtitan's training.gc_freq, default 50); null: whenever allocations
    trigger it, at train.py's thresholds (membudget/collector.py)."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 50
    """Save every N steps; also at the end of the run, on SIGTERM/Ctrl-C and on SLURM's time-limit signal."""
    keep: int = 2
    """Keep the last K complete checkpoints."""
    resume: str = "auto"
    """auto: continue from the latest intact checkpoint in the run dir, if any | never: start fresh | a
    checkpoint path."""
    archive_old_run: bool = False
    """Starting fresh in a run dir that holds a finished run (or with resume=never over any run) is refused
    unless true; then that run's files move to <run dir>/archived/<time>/."""
    allow_data_change: bool = False
    """A resume whose data files or tokenizer file differ from those the checkpoint was trained on (a file added,
    removed or edited: its position would point into other text or other tokens) is refused unless true; then the
    change is logged."""
    timeout_s: Optional[int] = None
    """How long a save's barriers wait for the slowest rank; null: sized from the checkpoint's bytes at
    write_gbps."""
    write_gbps: float = 0.25
    """Write bandwidth per rank assumed (GB/s) when sizing the save timeout and SLURM's signal lead (the time
    a preempted job needs to save): slow shared file systems reach a few hundred MB/s per client."""


@dataclass
class LoggerConfig:
    name: LoggerName = LoggerName.none
    """wandb (logger=wandb, the default option) or none."""
    project: str = "membudget"
    entity: Optional[str] = None
    group: Optional[str] = None
    """null: the sweep's name in a multirun, so one sweep's runs share a group."""
    tags: list[str] = field(default_factory=list)
    run_name: Optional[str] = None
    """null: <model>-<AC setting>."""
    mode: Optional[WandbMode] = None
    """null: WANDB_MODE from the environment, else offline (upload later with `wandb sync`)."""


@dataclass
class PlanConfig:
    """What `python -m membudget.plan` plans for beyond the run's own settings."""

    world_size: Optional[int] = None
    """Ranks; null: the product of the parallelism degrees."""
    gpu: str = "auto"
    """The GPU planned for: a key of membudget/devices.py's table (H100, H100-96GB@500W, H200, B200, A100-80GB,
    ...); auto: the visible one, else H100."""
    device_gib: Optional[float] = None
    """Device memory per rank, GiB; overrides the GPU's."""
    margin_gib: float = 4.0
    """Kept free for what the plan does not model."""
    expandable_segments: Optional[bool] = None
    """Whether the run's CUDA caching allocator uses expandable segments; null: as PYTORCH_CUDA_ALLOC_CONF in
    the planning environment says (the run inherits it)."""
    budgets: list[float] = field(default_factory=lambda: [round(0.1 * i, 1) for i in range(11)])
    """The single memory budgets a sweep plans (ac.memory_budget=sweep) and auto chooses among (and mixes per
    block), each in [0, 1]. Each is a compile and a probe of its own: fewer plan sooner, e.g.
    plan.budgets=[0.3,0.5,0.7] around a known good region."""


@dataclass
class DiagnosticsConfig:
    """What the `debug` presets turn on (debug=memory_snapshot, debug=profile); off in a normal run."""

    memory_snapshot: bool = False
    """Record the CUDA caching allocator's history for the first `snapshot_steps` steps and write
    <run dir>/memory_snapshot.pickle for PyTorch's memory visualiser (GPU only; on CPU a profiler trace with
    memory instead)."""
    snapshot_steps: int = 3
    profile: bool = False
    """Write a torch.profiler trace (TensorBoard / Perfetto) of a few steps after warm-up into <run dir>/profile/."""
    profile_wait: int = 1
    """Steps skipped before the profiler warms up (compilation happens in the first)."""
    profile_warmup: int = 1
    profile_active: int = 2
    """Steps recorded."""


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
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)


# --- one AC setting: its budget and its label, used by training, metrics, the planner and the report ---------

def _get(node, key: str, default=None):
    """A field of a config node, a dataclass or a plain dict (a job's config.yaml read back)."""
    if isinstance(node, dict):
        return node.get(key, default)
    return getattr(node, key, default)


def budget_of(ac) -> Optional[Union[float, str]]:
    """The memory budget of an AC setting: only ac=memory_budget has one."""
    return _get(ac, "memory_budget") if str(_get(ac, "mode")) == ACMode.memory_budget else None


def auto_key(mode) -> str:
    """The ac key whose value `auto` leaves an AC mode's setting to the planner: blocks under ac=per_block, else
    memory_budget."""
    return "blocks" if str(mode) == ACMode.per_block else "memory_budget"


def is_auto(ac) -> bool:
    """Whether the run leaves its AC setting to the planner (ac.memory_budget=auto or ac.blocks=auto)."""
    mode = _get(ac, "mode")
    return str(mode) in (ACMode.memory_budget, ACMode.per_block) and str(_get(ac, auto_key(mode))) == "auto"


@dataclass(frozen=True)
class BlockPolicy:
    """What one block does with its activations: its AC (none, full, selective op, or a compiled memory budget)
    and whether what it saves waits in host memory."""

    ac: str = "none"  # none | full | selective | budget
    budget: Optional[float] = None  # ac == "budget" only
    offload: bool = False

    def __str__(self) -> str:
        ac = f"budget:{self.budget:g}" if self.ac == "budget" else self.ac
        if not self.offload:
            return ac
        return "offload" if ac == "none" else f"offload:{ac}"

    @property
    def compiled(self) -> bool:
        """Whether the policy lives in the compiler (a memory budget)."""
        return self.ac == "budget"

    @classmethod
    def parse(cls, text: str) -> "BlockPolicy":
        """"full", "budget:0.3", "offload:selective" -> a policy; ValueError when it is none of them."""
        offload = text == "offload" or text.startswith("offload:")
        ac = text.partition(":")[2] if text.startswith("offload:") else ("none" if offload else text)
        if ac.startswith("budget:"):
            if offload:
                raise ValueError(text)  # hooks around a compiled region's saved tensors: not offered
            return cls("budget", float(ac.partition(":")[2]))
        if ac not in ("none", "full", "selective") or (offload and ac == "none" and text != "offload"):
            raise ValueError(text)
        return cls(ac, None, offload)


POLICY_NAMES = "none, full, selective, budget:<b>, offload, offload:selective, offload:full"


def parse_block_policies(text: str) -> list[BlockPolicy]:
    """"full*4+budget:0.3*2" -> four full blocks then two at budget 0.3. ValueError when malformed."""
    policies: list[BlockPolicy] = []
    for term in str(text).replace(" ", "").split("+"):
        name, _, count = term.partition("*")
        policies += [BlockPolicy.parse(name)] * (int(count) if count else 1)
    return policies


def compact_policies(policies: list[BlockPolicy]) -> str:
    """The shortest spelling of per-block policies: "full*4+budget:0.3*2"."""
    return _compact([str(p) for p in policies], str)


def block_policies(ac, n_layers: int) -> list[BlockPolicy]:
    """Each block's policy under any AC setting; an auto setting (schema.is_auto) has none until the planner
    chooses them (ValueError)."""
    mode = str(_get(ac, "mode", "none"))
    if mode == ACMode.per_block:
        return parse_block_policies(_get(ac, "blocks"))
    if mode == ACMode.memory_budget:
        return [BlockPolicy("budget", b) for b in block_budgets(ac, n_layers)]
    if mode == ACMode.offload:
        return [BlockPolicy(str(_get(ac, "offload_with", "none")), None, True)] * n_layers
    if mode == ACMode.selective and str(_get(ac, "selective_option", "op")) != "op":
        every = int(_get(ac, "selective_option"))
        return [BlockPolicy("full" if (i + 1) % every == 0 else "none") for i in range(n_layers)]
    return [BlockPolicy(mode)] * n_layers


def parse_block_budgets(text: str) -> list[float]:
    """"0.3*8+0.6*24" -> eight 0.3s then twenty-four 0.6s; "0.2+0.4" -> [0.2, 0.4]. ValueError when malformed."""
    budgets: list[float] = []
    for term in str(text).replace(" ", "").split("+"):
        value, _, count = term.partition("*")
        budgets += [float(value)] * (int(count) if count else 1)
    return budgets


def block_budgets(ac, n_layers: int) -> Optional[list[float]]:
    """The budget of each block under ac=memory_budget (a scalar budget is every block's), else None."""
    budget = budget_of(ac)
    if budget is None:
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        return [float(budget)] * n_layers
    return parse_block_budgets(budget)


def compact_budgets(budgets: list[float]) -> Union[float, str]:
    """The shortest spelling of per-block budgets: one number when all agree, else "0.3*8+0.6*24"."""
    if len(set(budgets)) == 1:
        return budgets[0]
    return _compact(budgets, lambda b: f"{b:g}")


def budget_list(budgets) -> str:
    """plan.budgets as typed on the command line: "[0.3,0.5,0.7]"."""
    return "[" + ",".join(f"{b:g}" for b in budgets) + "]"


def _compact(values: list, spell) -> str:
    runs: list[list] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "+".join(f"{spell(v)}*{n}" if n > 1 else spell(v) for v, n in runs)


def ac_label(ac) -> str:
    """How runs, plans and reports name an AC setting: none, full, selective op, selective every 2,
    memory_budget 0.5, memory_budget 0.3*8+0.6*24."""
    mode = str(_get(ac, "mode", "none"))
    if mode == ACMode.memory_budget:
        budget = _get(ac, "memory_budget")
        return f"memory_budget {float(budget)!r}" if isinstance(budget, (int, float)) else f"memory_budget {budget}"
    if mode == ACMode.selective:
        option = str(_get(ac, "selective_option", "op"))
        return "selective op" if option == "op" else f"selective every {option}"
    if mode == ACMode.offload:
        with_ = str(_get(ac, "offload_with", "none"))
        return "offload" if with_ == "none" else f"offload {with_}"
    if mode == ACMode.per_block:
        return f"per_block {_get(ac, 'blocks')}"
    return mode


def resolved(cfg) -> dict:
    """The run's config as plain data, interpolations resolved and enums by name: what summary.json, W&B, a
    checkpoint and the ranks' same-config check hold."""
    from omegaconf import OmegaConf  # here, not at import: scripts/gpu_check.py runs where OmegaConf is not

    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def flat_keys(config: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: value} (`model.dim`), for comparing two configs key by key."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
