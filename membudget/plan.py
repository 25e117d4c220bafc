"""Plan a run's memory per rank before running it, from the same Hydra config as train.py.

    python -m membudget.plan model=llama3_8b parallelism=fsdp plan.world_size=64 train.seq_len=8192 ac=full
    python -m membudget.plan ... ac=memory_budget ac.memory_budget=sweep  # budgets 0.0..1.0, none/full/selective
    python -m membudget.plan ... ac=memory_budget ac.memory_budget=auto   # least recompute that fits the target

Writes plan.json and plan.md (a sweep also sweep.png/.svg) into its Hydra dir, outputs/plan/<date>/<time>.

How: the trainer's own path runs on fake tensors (shapes, dtypes and storages without memory) and a fake
process group of the planned world size: meta model -> `parallelize` (TP, the AC policy, torch.compile, FSDP2)
-> `forward_backward` under `ActivationCounter`, so `activations` is training's `activation_bytes` by
construction. Identical blocks are not run n_layers times: a probe of a few blocks (a bottom, a top, and one
period of the AC policy's pattern over layers between: 3 blocks, or N+2 for "every N-th block") is run and
scaled block by block.
A dispatch-mode tracker follows the probe's memory (bytes of the storages ops allocate, and FSDP2's storage
resizes) and FLOPs in segments: each block's forward, the loss, the output's backward, each block's backward.
The n-layer step is replayed from those segments, block by block, to find the peak.

GPU runs are planned on this CPU, emulated where CPU and GPU differ: bf16 autocast as CPU autocast (the same
ops of this model cast), attention as CUDA's flash kernel (its meta kernel yields what it saves), FSDP2 mixed
precision as on GPU, and compile.backend=inductor as aot_eager_decomp_partition: inductor's decompositions and
the same min-cut partitioner under the same budget, without code generation (inductor's fused kernels would
hide the ops from the tracker). Not modelled: the CUDA caching allocator's fragmentation and stream-ordered
frees (plan.margin_gib covers them), and NCCL's buffers.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Optional
from unittest import mock

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from membudget.ac import compiler_scope
from membudget.config import UserError, compile_enabled, mesh_degrees, register_configs, validate
from membudget.metrics import ActivationCounter, local_tensor
from membudget.model import ModelArgs, Transformer
from membudget.parallel import Launch, build_mesh, parallelize
from membudget.trainer import build_optimizer, forward_backward

log = logging.getLogger("membudget")
GiB = 2**30
SWEEP_BUDGETS = tuple(round(0.1 * i, 1) for i in range(11))
# Memory as torch.cuda reports it (total_memory), a little under the data sheet's GB
GPU_GIB = {"H100": 79.1, "H200": 139.8, "A100-80GB": 79.2, "A100-40GB": 39.4}

aten = torch.ops.aten
# torch's formulas, plus CPU's flash attention (same arguments first) so CPU plans count attention too
_FLOPS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[aten._scaled_dot_product_flash_attention_backward],
}


# --- measuring a step --------------------------------------------------------------------------------------

@dataclass
class _Segment:
    name: str
    start: int  # bytes alive when it began
    peak: int
    end: int = 0
    flops: int = 0


class _Tracker(TorchDispatchMode):
    """Memory and FLOPs of the ops that run while it is on, in segments between `mark`s.

    Memory: the storages that ops allocate (an output whose storage no input has) and storage resizes (FSDP2
    allocates and frees unsharded parameters that way), until the storage dies. Compiled graphs count too:
    with `ignore_compile_internals` Dynamo keeps this mode off while it traces and on while the graph runs,
    and aot_eager graphs run op by op.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self):
        super().__init__()
        self.live = 0
        self.segments: list[_Segment] = []
        self._sizes = WeakIdKeyDictionary()  # storage -> [bytes], shared with its finalizer
        self.mark("start")

    def mark(self, name: str) -> None:
        if self.segments:
            self.segments[-1].end = self.live
        self.segments.append(_Segment(name, self.live, self.live))

    def _resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        size = self._sizes.get(storage)
        if size is None:
            size = self._sizes[storage] = [0]
            weakref.finalize(storage, self._free, size)
        self.live += nbytes - size[0]
        size[0] = nbytes
        self.segments[-1].peak = max(self.segments[-1].peak, self.live)

    def _free(self, size: list[int]) -> None:
        self.live -= size[0]

    @contextmanager
    def tracking(self) -> Iterator["_Tracker"]:
        """On for the ops, and for `UntypedStorage.resize_`, which no dispatch mode sees."""
        resize = torch.UntypedStorage.resize_

        def tracked_resize(storage, nbytes):
            resize(storage, nbytes)
            self._resize(storage, nbytes)

        with mock.patch.object(torch.UntypedStorage, "resize_", tracked_resize), self:
            yield self
        self.segments[-1].end = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # DTensor runs its local ops through this mode
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops._c10d_functional.wait_tensor.default:
            # Eagerly the input itself; its fake kernel makes a new tensor. So the output keeps the input's
            # (counted) storage alive, as the alias would: else a waited collective's output goes uncounted.
            kept = args[0].untyped_storage()
            if out.untyped_storage()._cdata != kept._cdata:
                weakref.finalize(out.untyped_storage(), lambda: kept)
            return out
        formula = _FLOPS.get(getattr(func, "_overloadpacket", None))
        if formula is not None:
            self.segments[-1].flops += formula(*args, **kwargs, out_val=out)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in inputs and storage not in self._sizes:
                    self._resize(storage, storage.nbytes())
        return out


def _mark_step(model: Transformer, tracker: _Tracker) -> list:
    """Marks at each block's forward and backward (its output's gradient arriving) and at the loss;
    prepended so that FSDP2's all-gathers fall into the block's own segment."""

    def mark_backward(name):
        def hook(module, args, out):
            out.register_hook(lambda grad: tracker.mark(name))

        return hook

    handles = [model.norm.register_forward_pre_hook(lambda m, a: tracker.mark("loss"), prepend=True),
               model.output.register_forward_hook(mark_backward("output backward"), prepend=True)]
    for i, block in model.layers.items():
        handles.append(block.register_forward_pre_hook(lambda m, a, i=i: tracker.mark(f"forward {i}"), prepend=True))
        handles.append(block.register_forward_hook(mark_backward(f"backward {i}"), prepend=True))
    return handles


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    # What CUDA runs for this model's causal bf16 GQA attention; it saves the output and the logsumexp.
    return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


def _kind(block: torch.nn.Module) -> tuple[str, ...]:
    """The wrappers around a block (FSDP, compile, checkpoint): blocks of one kind plan alike."""
    kinds = [type(block).__name__]
    while (inner := getattr(block, "_orig_mod", None) or getattr(block, "_checkpoint_wrapped_module", None)):
        block = inner
        kinds.append(type(block).__name__)
    return tuple(kinds)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (this rank's shards, FSDP2's padding included)."""
    storages = {}
    for t in tensors:
        storage = local_tensor(t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


# --- the plan ----------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """One setting, per rank. Bytes, and FLOPs of one optimizer step."""

    label: str
    ac_mode: str
    memory_budget: Optional[float]
    parameters: int
    buffers: int  # the RoPE table
    gradients: int
    optimizer_states: int
    activations: int  # training's activation_bytes (one micro-batch)
    backward_working_set: int  # allocated during one block's backward at most: recompute, gradients, gathers
    peak: int
    peak_phase: str
    target: Optional[int]
    forward_flops: float  # the step's forward, ac=none
    recompute_flops: float  # extra forward FLOPs run in backward, against ac=none
    seconds: float
    setting: dict = field(default_factory=dict)

    @property
    def fits(self) -> Optional[bool]:
        return None if self.target is None else self.peak <= self.target

    @property
    def recompute_ratio(self) -> float:
        return self.recompute_flops / self.forward_flops if self.forward_flops else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits, "recompute_ratio": self.recompute_ratio}


class Planner:
    """Plans the AC settings of one run (model, parallelism, shapes); a fake process group while open."""

    def __init__(self, cfg, world_size: Optional[int] = None):
        self.cfg = cfg
        p = cfg.parallelism
        if world_size is None:
            world_size = cfg.plan.world_size
        if world_size is None:
            if -1 in (p.dp_replicate, p.dp_shard, p.tp):
                raise UserError(f"parallelism={p.name} infers a degree from the world size: set plan.world_size=N")
            world_size = p.dp_replicate * p.dp_shard * p.tp
        self.world_size = world_size
        self.degrees = mesh_degrees(p, world_size)
        t = cfg.train
        local_batch = t.global_batch_size // (self.degrees["dp_replicate"] * self.degrees["dp_shard"])
        self.micro = t.micro_batch_size or local_batch
        self.n_micro = max(1, local_batch // self.micro)
        self.gpu = t.device != "cpu"  # auto: the run is planned for the GPU it will train on
        self.bf16 = t.dtype == "bfloat16" or (t.dtype == "auto" and self.gpu)
        self.device_name, device_bytes = _device_memory(cfg, self.gpu)
        target = cfg.ac.target_memory_gib
        self.target = (int(target * GiB) if target is not None
                       else None if device_bytes is None else device_bytes - int(cfg.plan.margin_gib * GiB))
        self._static: Optional[tuple[int, int, int, int, int]] = None
        self._reference: dict[str, float] = {}

    def __enter__(self) -> "Planner":
        self._stack = ExitStack()
        if self.world_size > 1:
            if dist.is_initialized():
                raise UserError("the planner runs its own (fake) process group: plan before init_process_group")
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
            self._stack.callback(dist.destroy_process_group)
        # rank 0: with FSDP2's padding it holds the largest shards
        self.mesh = build_mesh(self.cfg.parallelism, Launch(0, self.world_size, 0), torch.device("cpu"))
        if self.gpu:
            self._stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", _flash_attention))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def point(self, mode: str, budget: Optional[float] = None):
        """The run's config with another AC mode or budget, as the planner runs it."""
        cfg = copy.deepcopy(self.cfg)
        cfg.ac.mode = mode
        if budget is not None:
            cfg.ac.memory_budget = budget
        validate(cfg, self.world_size)
        cfg.ac.visualize_pareto = False
        cfg.ac.runtime_estimator = "flops"  # "profile" times kernels, which fake tensors cannot run
        if compile_enabled(cfg) and cfg.compile.backend == "inductor":
            cfg.compile.backend = "aot_eager_decomp_partition"
        return cfg

    def _build(self, cfg, n_layers: int, fake: Optional[FakeTensorMode]) -> Transformer:
        """The trainer's build_model with `n_layers` blocks, on fake storage (None: left on meta)."""
        cfg = copy.deepcopy(cfg)
        cfg.model.n_layers = n_layers
        with torch.device("meta"):
            model = Transformer(ModelArgs.from_config(cfg.model))
        # the device only tells FSDP2 whether to train in mixed precision
        parallelize(model, cfg, self.mesh, torch.device("cuda" if self.gpu else "cpu"))
        if fake is not None:
            with fake:
                model.to_empty(device="cpu")
        return model

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16) if self.bf16 else nullcontext()

    def _probe(self, cfg, n_layers: int, track: bool) -> tuple[int, dict[str, _Segment]]:
        """One micro-batch through the trainer's forward_backward on a model of `n_layers` blocks: its
        activation bytes and, when tracked, its segments by name."""
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        model = self._build(cfg, n_layers, fake)
        counter = ActivationCounter(model)
        # Eager DTensor caches the shapes it derives by running ops on whole-size fake tensors (loss_parallel
        # asks for them); under a fake mode it would redo that in every step, and the tracker would count it.
        cached = mock.patch.object(ShardingPropagator, "_propagate_tensor_meta",
                                   ShardingPropagator._propagate_tensor_meta_cached)
        with fake, cached:  # fake active, so that what FSDP2 and the loss allocate is fake too
            tokens = torch.randint(cfg.model.vocab_size, (self.micro, cfg.train.seq_len + 1))
            step = (model, tokens[:, :-1], tokens[:, 1:], counter, self._autocast())
            nbytes = forward_backward(*step)[1]
            if not track:
                return nbytes, {}
            # The tracked step is a steady one: the first compiled, initialised FSDP2 and filled DTensor's
            # sharding-propagation cache (which runs ops on whole-size tensors). With accumulation the tracked
            # micro-batch adds into the first one's gradients, else it starts from none, as after zero_grad.
            if self.n_micro == 1:
                model.zero_grad(set_to_none=True)
            tracker = _Tracker()
            handles = _mark_step(model, tracker)
            with tracker.tracking():
                nbytes = forward_backward(*step)[1]
        for handle in handles:
            handle.remove()
        return nbytes, {s.name: s for s in tracker.segments}

    def static(self) -> tuple[int, int, int, int, int]:
        """Parameters, buffers, gradients, optimizer states and what an optimizer step allocates on top, from
        the whole model sharded as configured (the trainer's AdamW on fake shards)."""
        if self._static is None:
            cfg = self.point("none")
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            model = self._build(cfg, cfg.model.n_layers, fake)
            params = list(model.parameters())
            with fake:
                for p in params:
                    p.grad = torch.zeros_like(p)  # sharded like its parameter, as FSDP2 leaves it
                optimizer, _ = build_optimizer(model, cfg)
                for group in optimizer.param_groups:
                    group["foreach"] = self.gpu  # AdamW's default on CUDA, not on CPU
                optimizer.step()  # allocates the states; the tracked step is a steady one (see _probe)
                tracker = _Tracker()
                with tracker.tracking():
                    optimizer.step()
            states = [t for state in optimizer.state.values() for t in state.values()]
            self._static = (_storage_bytes(params), _storage_bytes(model.buffers()),
                            _storage_bytes(p.grad for p in params), _storage_bytes(states), tracker.segments[-1].peak)
        return self._static

    def plan(self, cfg, label: str) -> Plan:
        """Plan one point (from `point`) by probes of a few blocks, scaled to the model's depth."""
        start = time.perf_counter()
        params, buffers, grads, opt_states, opt_temporaries = self.static()
        n = cfg.model.n_layers
        with compiler_scope(cfg.ac):
            period = self._period(cfg)
            depth = _probe_depth(n, period)
            activations, segments = self._probe(cfg, depth, track=True)
            if depth < n:  # n = depth + k periods of middle blocks; each adds what one adds to the probe
                smaller = self._probe(cfg, depth - period, track=False)[0]
                activations += (n - depth) // period * (activations - smaller)
        replay = _replay(segments, n, depth, period)
        base = params + buffers + opt_states + (grads if self.n_micro > 1 else 0)
        step_peak, phase = base + replay["peak"], replay["phase"]
        if params + buffers + grads + opt_states + opt_temporaries > step_peak:
            step_peak, phase = params + buffers + grads + opt_states + opt_temporaries, "optimizer step"
        reference = self.reference()
        return Plan(
            label=label,
            ac_mode=cfg.ac.mode,
            memory_budget=float(cfg.ac.memory_budget) if cfg.ac.mode == "memory_budget" else None,
            parameters=params,
            buffers=buffers,
            gradients=grads,
            optimizer_states=opt_states,
            activations=activations,
            backward_working_set=replay["backward_working_set"],
            peak=step_peak,
            peak_phase=phase,
            target=self.target,
            forward_flops=reference["forward"],
            recompute_flops=max(0.0, self.n_micro * replay["backward_flops"] - reference["backward"]),
            seconds=time.perf_counter() - start,
            setting=self.setting(cfg),
        )

    def _period(self, cfg) -> int:
        """Over how many layers the block kinds under `cfg` repeat (N for full AC on every N-th block)."""
        kinds = [_kind(block) for block in self._build(cfg, cfg.model.n_layers, None).layers.values()]
        return next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))

    def reference(self) -> dict[str, float]:
        """The step's FLOPs without AC and without compile: what recompute is counted against."""
        if not self._reference:
            cfg = self.point("none")
            cfg.compile.enabled = False
            n = cfg.model.n_layers
            with compiler_scope(cfg.ac):
                segments = self._probe(cfg, _probe_depth(n, 1), track=True)[1]
            replay = _replay(segments, n, _probe_depth(n, 1), 1)
            self._reference = {k: self.n_micro * replay[f"{k}_flops"] for k in ("forward", "backward")}
        return self._reference

    def setting(self, cfg) -> dict:
        t = cfg.train
        return {
            "model": cfg.model.name, "world_size": self.world_size, **self.degrees, "seq_len": t.seq_len,
            "micro_batch_size": self.micro, "grad_accumulation": self.n_micro,
            "device": self.device_name, "dtype": "bf16 autocast" if self.bf16 else "fp32",
            "compile": compile_enabled(cfg), "configured_backend": self.cfg.compile.backend,
            "planned_backend": cfg.compile.backend if compile_enabled(cfg) else None,
        }


def _probe_depth(n_layers: int, period: int) -> int:
    """Blocks in a probe: a bottom block and a top one, which the step treats apart (the embedding's backward
    follows the bottom's; FSDP2 keeps a block's gradient-reduce buffer until the next block's backward, so
    the top's nets more), and a period of middle blocks between; the top of the same kind as the model's."""
    depth = period + 2
    return min(n_layers, depth + (n_layers - depth) % period)


def _replay(segments: dict[str, _Segment], n_layers: int, depth: int, period: int) -> dict:
    """The step of an `n_layers` model, segment after segment, from a probe of `depth` blocks: memory alive,
    its peak and where, the largest backward working set, FLOPs. Middle block j stands in for itself in the
    probe's middle of the same kind (layer mod period)."""

    def rep(j: int) -> int:
        if depth == n_layers or j == 0:
            return j
        return depth - 1 if j == n_layers - 1 else (j - 1) % period + 1

    order = ([("start", "embedding")] + [(f"forward {rep(j)}", f"forward of block {j}") for j in range(n_layers)]
             + [("loss", "loss"), ("output backward", "output's backward")]
             + [(f"backward {rep(j)}", f"backward of block {j}") for j in reversed(range(n_layers))])
    live = peak = working = 0
    phase = ""
    flops = {"forward": 0, "backward": 0}
    for i, (name, label) in enumerate(order):
        s = segments[name]
        if live + s.peak - s.start > peak:
            peak, phase = live + s.peak - s.start, label
        live += s.end - s.start
        flops["forward" if i <= n_layers + 1 else "backward"] += s.flops
        if name.startswith("backward"):
            working = max(working, s.peak - s.start)
    return {"peak": peak, "phase": phase, "backward_working_set": working,
            "forward_flops": flops["forward"], "backward_flops": flops["backward"]}


def _device_memory(cfg, gpu: bool) -> tuple[str, Optional[int]]:
    """The device planned for and its memory in bytes (None: no limit known, a CPU)."""
    p = cfg.plan
    if p.device_gib is not None:
        return f"{p.device_gib:g} GiB", int(p.device_gib * GiB)
    if not gpu:
        return "cpu", None
    if p.gpu == "auto" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory
    name = "H100" if p.gpu == "auto" else p.gpu
    gpus = {k.lower(): k for k in GPU_GIB}
    if name.lower() not in gpus:
        raise UserError(f"plan.gpu={p.gpu!r}: choose one of {', '.join(GPU_GIB)} or auto, or set plan.device_gib")
    name = gpus[name.lower()]
    return name, int(GPU_GIB[name] * GiB)


# --- entry points --------------------------------------------------------------------------------------

def plan_setting(cfg, world_size: Optional[int] = None) -> Plan:
    """The plan of `cfg`'s own AC setting; for ac.memory_budget=auto, of the budget it chooses."""
    budget = cfg.ac.memory_budget if cfg.ac.mode == "memory_budget" else None
    if budget == "auto":
        return choose_budget(cfg, world_size)[1]
    with Planner(cfg, world_size) as planner:
        return planner.plan(planner.point(cfg.ac.mode, budget), _label(cfg.ac.mode, budget))


def plan_sweep(cfg, world_size: Optional[int] = None, references: bool = True) -> list[Plan]:
    """none, full, selective (as configured) and memory budgets 0.0, 0.1, ..., 1.0."""
    with Planner(cfg, world_size) as planner:
        modes = [(m, None) for m in ("none", "full", "selective")] if references else []
        return [planner.plan(planner.point(m, b), _label(m, b))
                for m, b in modes + [("memory_budget", b) for b in SWEEP_BUDGETS]]


def choose(plans: list[Plan]) -> Optional[Plan]:
    """The budget with the least recompute among those that fit (ties: the lower peak), or None."""
    fitting = [p for p in plans if p.ac_mode == "memory_budget" and p.fits]
    return min(fitting, key=lambda p: (p.recompute_flops, p.peak, -p.memory_budget), default=None)


def choose_budget(cfg, world_size: Optional[int] = None) -> tuple[float, Plan]:
    """For ac.memory_budget=auto: the budget with the least recompute whose planned peak fits
    ac.target_memory_gib (default: device memory minus plan.margin_gib). UserError when none fits."""
    return _choose(plan_sweep(cfg, world_size, references=False), cfg, world_size)


def _choose(plans: list[Plan], cfg, world_size: Optional[int]) -> tuple[float, Plan]:
    if plans[0].target is None:
        raise UserError("ac.memory_budget=auto needs a memory target on CPU: set ac.target_memory_gib=N (GiB)")
    best = choose(plans)
    if best is not None:
        return best.memory_budget, best
    lowest = min(plans, key=lambda p: p.peak)
    full = next((p for p in plans if p.ac_mode == "full"), None)
    if full is None:
        with Planner(cfg, world_size) as planner:
            full = planner.plan(planner.point("full"), "full")
    raise UserError(
        f"ac.memory_budget=auto: no budget fits {_gib(lowest.target)} GiB per rank (lowest planned peak "
        f"{_gib(lowest.peak)} GiB, {lowest.label}); ac=full plans {_gib(full.peak)} GiB"
        f"{' and fits' if full.fits else ''}; or lower train.micro_batch_size / train.seq_len, or shard over "
        f"more ranks (parallelism=fsdp with a larger plan.world_size)")


def _label(mode: str, budget) -> str:
    return f"budget {float(budget)!r}" if mode == "memory_budget" else mode


def _gib(nbytes: Optional[int]) -> str:
    return "-" if nbytes is None else f"{nbytes / GiB:.4g}"


# --- reports -------------------------------------------------------------------------------------------

def plan_markdown(plan: Plan) -> str:
    s = plan.setting
    fits = {None: "no target", True: "fits", False: "DOES NOT FIT"}[plan.fits]
    rows = [
        ("parameters", plan.parameters), ("buffers", plan.buffers), ("gradients", plan.gradients),
        ("optimizer states (AdamW)", plan.optimizer_states), ("activations saved for backward", plan.activations),
        ("backward working set of a block (recompute, gradients)", plan.backward_working_set),
        (f"**predicted peak** ({plan.peak_phase})", plan.peak), ("target", plan.target),
    ]
    return "\n".join([
        f"# Memory plan: {s['model']}, {plan.label}",
        "",
        f"Per rank of {s['world_size']} (dp_replicate {s['dp_replicate']}, dp_shard {s['dp_shard']}, tp {s['tp']}); "
        f"micro-batch {s['micro_batch_size']} x {s['seq_len']} tokens, {s['grad_accumulation']} per step; "
        f"{s['dtype']}; device {s['device']}; compile {s['planned_backend'] or 'off'} "
        f"(configured: {s['configured_backend']}); planned in {plan.seconds:.1f} s.",
        "",
        "| memory per rank | GiB |", "|---|---:|",
        *[f"| {name} | {_gib(value)} |" for name, value in rows],
        f"| verdict | {fits} |",
        "",
        "| FLOPs per rank and step | TFLOP |", "|---|---:|",
        f"| forward (ac=none) | {plan.forward_flops / 1e12:.4g} |",
        f"| recompute | {plan.recompute_flops / 1e12:.4g} ({plan.recompute_ratio:.0%} of forward) |",
        "",
    ])


def sweep_markdown(plans: list[Plan], chosen: Optional[Plan] = None) -> str:
    flagged = non_monotonic(plans)
    lines = [
        f"# Memory budget sweep: {plans[0].setting['model']}, per rank of {plans[0].setting['world_size']}, "
        f"target {_gib(plans[0].target)} GiB",
        "",
        "| setting | activations GiB | backward working set GiB | peak GiB | fits | recompute (of forward) | "
        "planned in s |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for p in plans:
        note = (" (peak below a smaller budget's)" if p in flagged else "") + (" **chosen**" if p is chosen else "")
        lines.append(f"| {p.label}{note} | {_gib(p.activations)} | {_gib(p.backward_working_set)} | {_gib(p.peak)} | "
                     f"{'-' if p.fits is None else 'yes' if p.fits else 'no'} | {p.recompute_ratio:.1%} | "
                     f"{p.seconds:.1f} |")
    return "\n".join(lines) + "\n"


def non_monotonic(plans: list[Plan]) -> list[Plan]:
    """Budget points whose peak is below that of a smaller budget: the peak is not monotonic there."""
    budgets = sorted((p for p in plans if p.ac_mode == "memory_budget"), key=lambda p: p.memory_budget)
    return [p for i, p in enumerate(budgets) if any(q.peak > p.peak for q in budgets[:i])]


def plot_sweep(plans: list[Plan], out_dir: Path, chosen: Optional[Plan] = None) -> list[Path]:
    """Activation memory against recompute, and the peak against the budget; PNG and SVG."""
    from matplotlib.figure import Figure  # no pyplot: the Agg canvas, no display

    budgets = sorted((p for p in plans if p.ac_mode == "memory_budget"), key=lambda p: p.memory_budget)
    flagged = non_monotonic(plans)
    fig = Figure(figsize=(12, 5), layout="constrained")
    ax, peak_ax = fig.subplots(1, 2)
    ax.plot([100 * p.recompute_ratio for p in budgets], [p.activations / GiB for p in budgets], "o-",
            label="memory budget")
    labels: dict[tuple[float, float], list[str]] = {}  # budgets that land on one point share a label
    for p in budgets:
        labels.setdefault((100 * p.recompute_ratio, p.activations / GiB), []).append(f"{p.memory_budget:g}")
    for xy, names in labels.items():
        ax.annotate(", ".join(names), xy, textcoords="offset points", xytext=(4, 4), fontsize=8)
    peak_ax.plot([p.memory_budget for p in budgets], [p.peak / GiB for p in budgets], "o-", label="memory budget")
    for p, marker in zip((p for p in plans if p.ac_mode != "memory_budget"), "s^D"):
        (point,) = ax.plot(100 * p.recompute_ratio, p.activations / GiB, marker, markersize=9, label=p.label)
        peak_ax.axhline(p.peak / GiB, linestyle=":", color=point.get_color(), label=p.label)
    for p in flagged:
        ax.plot(100 * p.recompute_ratio, p.activations / GiB, "o", markersize=14, mfc="none", mec="red")
        peak_ax.plot(p.memory_budget, p.peak / GiB, "o", markersize=14, mfc="none", mec="red")
    if flagged:
        peak_ax.plot([], [], "o", mfc="none", mec="red", label="peak below a smaller budget's")
    if chosen is not None:
        peak_ax.plot(chosen.memory_budget, chosen.peak / GiB, "*", markersize=16, color="green", label="chosen (auto)")
    if plans[0].target is not None:
        peak_ax.axhline(plans[0].target / GiB, color="gray", linestyle="--", label="target")
    peak_ax.set(xlabel="ac.memory_budget", ylabel="predicted peak, GiB per rank", title="predicted peak memory")
    for axis in (ax, peak_ax):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    paths = [out_dir / f"sweep.{fmt}" for fmt in ("png", "svg")]
    for path in paths:
        fig.savefig(path)
    return paths


def run(cfg, out_dir: Path) -> dict:
    """What the command does: plan, write plan.json and plan.md (a sweep: also the plots), log the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = cfg.ac.memory_budget if cfg.ac.mode == "memory_budget" else None
    chosen = error = None
    if budget in ("sweep", "auto"):
        plans = plan_sweep(cfg)
        if budget == "auto":
            try:
                chosen = _choose(plans, cfg, None)[1]
            except UserError as e:  # raised once the sweep that shows it is written
                error = e
        text = sweep_markdown(plans, chosen) + ("" if chosen is None else "\n" + plan_markdown(chosen))
        result = {"plans": [p.to_dict() for p in plans], "non_monotonic": [p.label for p in non_monotonic(plans)],
                  "chosen": None if chosen is None else chosen.to_dict()}
        plot_sweep(plans, out_dir, chosen)
    else:
        plan = plan_setting(cfg)
        text, result = plan_markdown(plan), plan.to_dict()
    (out_dir / "plan.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "plan.md").write_text(text)
    log.info("\n%s\nwritten to %s", text, out_dir)
    if error is not None:
        raise error
    return result


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except UserError as e:
        log.error("error: %s", e)
        sys.exit(2)


if __name__ == "__main__":
    register_configs()
    if not any(arg.startswith("hydra.run.dir=") for arg in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=outputs/plan/${launch_time:%Y-%m-%d}/${launch_time:%H-%M-%S}")
    main()
