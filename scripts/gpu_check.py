"""GPU self-check: the planner's predictions against real training steps on this machine.

    python scripts/gpu_check.py                 # the visible GPU: Llama 3 8B's shapes with 4 blocks, seq 8192
    python scripts/gpu_check.py --layers 8 --seq 4096 --settings none,full,0.5
    python scripts/gpu_check.py --device cpu    # the debug model on this CPU (the tests run this path)

For each AC setting (none, full, selective, memory budgets 0.0, 0.5 and 1.0 by default; "selective:2" is full AC
on every second block) it plans the run, then trains it for a few steps here and prints planned against measured:
max_memory_allocated and max_memory_reserved over the first two steps (step 1 has no optimizer states) and
tokens/s over the steps after, each with its error. On the CPU the measured peak is torch's MemTracker's, which the
plan matches exactly, and there is no time model. On one GPU it takes a few minutes (inductor compiles each
budget once).

A setting with the suffix "@compile" ("selective@compile") has its blocks compiled, as torchtitan's compiled rows.

Sections, in the order --sections names them, each in its own try/except (a failure is one line in the results, and
the rest run): env (torch, the GPU, read-only nvidia-smi); micro (the ceilings, a device copy counting read+write
bytes and a square bf16 matmul, then kernels at Llama 3 8B's shapes: each linear's forward, input- and
weight-gradient GEMMs, causal SDPA with each backend, memory-bound ops, AdamW over 8B's parameters split over 8
ranks, the host cost of a tiny op; FLOPs and bytes as counted: each input read once, each output written once;
causal SDPA forward 4*B*H*S*S*D/2, backward 2.5x that); profile (--profile-settings trained with torch.profiler
over --profile-steps after the timed steps: GPU kernel time per op class, and the step's wall time less it);
settings (the other settings, planned against measured); expandable (none, full and 0.5 again in a fresh process
with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, planned with plan.expandable_segments=true); fsdp_expandable
(FSDP2 over a 1-rank process group, whose all-gather copy-in and reduce-scatter streams allocate as on 8 GPUs, once
under each allocator in a fresh process: planned against measured, the allocator's peaks and segments per pool and
per stream, and the allocator model replayed on the GPU's own allocation trace, which isolates the allocator model
from the program's; see fsdp_one_rank). Sections (and settings) not begun within --budget-s are skipped. Results go
to <--out, default $OUT>/gpu_check.json, .md and .log after each setting; the markdown tables are printed last. On
the CPU every section runs at tiny shapes.

It runs from the source tree on torch 2.11 or newer without Hydra, OmegaConf or W&B: the config is the schema's
dataclasses, the model's sizes read from conf/model/<name>.yaml. Per-block budgets ("0.3*8+0.6*24") need torch
2.13 (torch.autograd.graph.region_activation_memory_budget) and are not among its settings.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def gqa_flop_formulas() -> bool:
    """torch < 2.13's SDPA FLOP formulas (torch.utils.flop_counter) reject grouped-query shapes, fewer K/V heads
    than query heads, which the planner (membudget/plan/record.py) meets on Llama 3: count them as torch 2.13
    does, K/V broadcast to the query's heads. True when patched."""
    import torch.utils.flop_counter as fc

    try:
        fc.sdpa_flop_count((1, 4, 8, 2), (1, 2, 8, 2), (1, 2, 8, 2))
        return False
    except AssertionError:
        pass
    fwd, bwd = fc.sdpa_flop_count, fc.sdpa_backward_flop_count

    def widen(q, kv):
        return (kv[0], q[1], *kv[2:])

    fc.sdpa_flop_count = lambda q, k, v: fwd(q, widen(q, k), widen(q, v))
    fc.sdpa_backward_flop_count = lambda g, q, k, v: bwd(g, q, widen(q, k), widen(q, v))
    return True


GQA_PATCHED = gqa_flop_formulas()

from membudget.ac import compiler_scope  # noqa: E402
from membudget.collector import collect_rarely  # noqa: E402
from membudget.metrics import ActivationCounter  # noqa: E402
from membudget.parallel import clip_grad_norm  # noqa: E402
from membudget.plan import Planner, plan_setting  # noqa: E402
from membudget.schema import is_auto  # noqa: E402
from membudget.units import GiB, MiB, fmt_bytes  # noqa: E402
from membudget.offload import find_offloader  # noqa: E402
from membudget.schema import ACMode, CompileBackend, OffloadWith, RunConfig, TrainDevice  # noqa: E402
from membudget.step import Numerics, build_model, build_optimizer, forward_backward  # noqa: E402

SETTINGS = ("none", "full", "selective", "0.0", "0.5", "1.0")
COMPILED = "@compile"  # a setting's suffix: its blocks compiled (memory budgets are compiled anyway)
SECTIONS = ("env", "micro", "profile", "settings", "expandable", "fsdp_expandable", "offload")


def model_preset(name: str) -> dict:
    """conf/model/<name>.yaml: flat `key: value` lines (the schema converts the values)."""
    values = {}
    for line in (ROOT / "conf" / "model" / f"{name}.yaml").read_text().splitlines():
        key, sep, value = line.partition("#")[0].partition(":")
        if sep and value.strip():
            text = value.strip()
            try:
                values[key.strip()] = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                values[key.strip()] = {"true": True, "false": False, "null": None}.get(text, text)
    return values


def build_config(setting: str, device: str, model: str, layers: Optional[int], seq: int, batch: int,
                 expandable: Optional[bool] = None) -> RunConfig:
    """The run's config for one AC setting, as Hydra would compose it from the schema and conf/model."""
    cfg = RunConfig()
    cfg.plan.expandable_segments = expandable
    types = {f.name: f.type for f in dataclasses.fields(cfg.model)}
    for key, value in model_preset(model).items():
        kind = str(types[key])
        setattr(cfg.model, key, float(value) if "float" in kind and value is not None else value)
    if layers is not None:
        cfg.model.n_layers = layers
    cfg.train.device = TrainDevice(device)
    cfg.train.seq_len, cfg.train.global_batch_size = seq, batch
    cfg.compile.backend = CompileBackend.inductor if device == "cuda" else CompileBackend.aot_eager_decomp_partition
    if setting.endswith(COMPILED):  # torchtitan's compiled rows: the blocks compiled whatever their AC
        setting, cfg.compile.enabled = setting.removesuffix(COMPILED), True
    mode, _, option = setting.partition(":")
    if setting.startswith("blocks="):  # a policy per block: per_block's spelling
        cfg.ac.mode, cfg.ac.blocks = ACMode.per_block, setting.partition("=")[2]
    elif mode == "offload":
        cfg.ac.mode, cfg.ac.offload_with = ACMode.offload, OffloadWith(option or "none")
    elif mode in ("none", "full", "selective"):
        cfg.ac.mode = ACMode(mode)
        cfg.ac.selective_option = option or "op"
    else:
        cfg.ac.mode, cfg.ac.memory_budget = ACMode.memory_budget, float(mode)
    return cfg


@dataclass
class Measured:
    activations: int
    parameters: int
    gradients: int
    optimizer_states: int
    max_allocated: int  # over steps 1 and 2 (on the CPU: MemTracker's peak, the batch of tokens excluded)
    max_reserved: Optional[int]
    tokens_per_s: float  # over the steps after the first two
    step_s: float = 0.0  # the median step's wall time over those steps
    profile: Optional[dict] = None  # profile_steps(): the kernel table of steps profiled after the timed ones
    allocator: Optional[dict] = None  # with `history` on a GPU: allocator_record() of the first two steps
    host_bytes: int = 0  # offloaded activations' peak in host memory (offload.py's count)


def measure(cfg, device: torch.device, steps: int, profile_steps: int = 0, mesh=None,
            history: bool = False) -> Measured:
    """Train `steps` steps as the trainer does (forward and backward, clipping, AdamW, zero_grad), on `mesh` if
    given; then, with `profile_steps`, that many more under torch.profiler (kernel_table()). With `history` on a
    GPU, the caching allocator's own record of the model's building and first two steps (allocator_record)."""
    cuda = device.type == "cuda"
    history = history and cuda
    if history:  # every allocation and free from here (the batch included), without stacks
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                                 max_entries=HISTORY_ENTRIES)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1),
                           device=device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the trainer's batches
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    peaks, times, profile, record = [], [], None, None
    with compiler_scope(cfg.ac, n_layers=cfg.model.n_layers):
        model = build_model(cfg, device, mesh=mesh)
        optimizer, _ = build_optimizer(model, cfg)
        counter = ActivationCounter(model)
        numerics = Numerics.for_target(cfg, device.type, torch.cuda.get_device_capability(device) if cuda else (0, 0))

        def one_step():
            activations = forward_backward(model, inputs, labels, counter, numerics, device.type)[1]
            gradients = sum(p.grad.nbytes for p in model.parameters())
            clip_grad_norm(model, cfg.train.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return activations, gradients

        for step in range(steps):
            tracker = None if cuda or step >= 2 else _mem_tracker(model, optimizer)
            start = time.perf_counter()
            with tracker or contextlib.nullcontext(), warnings.catch_warnings():
                # MemTracker's module hooks are global, so torch warns that they fire once more for each compiled
                # block: that moves only its per-module attribution, not the total peak read here
                warnings.filterwarnings("ignore",
                                        message="Using `torch.compile\\(module\\)` when there are global hooks")
                activations, gradients = one_step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if step == 1 and cuda:
                peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
                if history:
                    record = allocator_record(torch.cuda.memory._snapshot(), torch.cuda.memory_stats())
                    torch.cuda.memory._record_memory_history(enabled=None)
            elif tracker is not None:
                peaks.append(tracker.get_tracker_snapshot("peak")[device]["Total"] - inputs.nbytes - labels.nbytes)
        timed = times[2:] or times[1:]
        if profile_steps:
            profile = profile_steps_table(one_step, device, profile_steps, statistics.median(timed))
    return Measured(
        activations=activations,
        parameters=sum(p.nbytes for p in model.parameters()),
        gradients=gradients,
        optimizer_states=sum(t.nbytes for s in optimizer.state.values() for t in s.values()),
        max_allocated=peaks[0] if cuda else max(peaks, default=0),
        max_reserved=peaks[1] if cuda else None,
        tokens_per_s=cfg.train.global_batch_size * cfg.train.seq_len / statistics.median(timed),
        step_s=statistics.median(timed),
        profile=profile,
        allocator=record,
        host_bytes=find_offloader(model).peak_host_bytes if find_offloader(model) else 0,
    )


def _mem_tracker(model, optimizer):
    from torch.distributed._tools.mem_tracker import MemTracker

    class CompiledMemTracker(MemTracker):
        """torch's MemTracker, kept on while compiled graphs run (aot_eager graphs run op by op)."""

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

    tracker = CompiledMemTracker()
    tracker.track_external(model, optimizer)
    return tracker


@dataclass
class Row:
    setting: str
    plan: object
    measured: Optional[Measured]
    skipped: str = ""
    seconds: float = 0.0


def check(settings=SETTINGS, device: str = "cuda", model: str = "llama3_8b", layers: Optional[int] = 4,
          seq: int = 8192, batch: int = 1, steps: int = 5, expandable: Optional[bool] = None,
          profile_steps: int = 0, after=None, deadline: Optional[float] = None) -> list[Row]:
    """Plan and train each setting; `after(rows)` after each (progressive output); settings left when
    time.perf_counter() passes `deadline` are skipped. The settings' runs differ in their AC alone: one Planner
    plans them all and measures what they share once (the optimizer step, the FLOPs recompute is counted
    against); on one rank it opens no process group, so it may stay open while the steps run."""
    rows = []
    with contextlib.ExitStack() as stack:
        planner = None
        for setting in settings:
            if deadline is not None and time.perf_counter() > deadline:
                rows.append(Row(setting, None, None, "skipped: out of --budget-s"))
                continue
            begun = time.perf_counter()
            plan = None
            try:
                cfg = build_config(setting, device, model, layers, seq, batch, expandable)
                if is_auto(cfg.ac):  # blocks=auto: the planner's own choice
                    plan = plan_setting(cfg)
                else:
                    planner = planner or stack.enter_context(Planner(cfg))
                    plan = planner.plan(planner.point(**dataclasses.asdict(cfg.ac)))  # cfg, as plan_setting plans it
                if plan.verdict == "does not fit":
                    rows.append(Row(setting, plan, None, f"planned not to fit: {plan.verdict_reason}"))
                else:
                    rows.append(Row(setting, plan, measure(cfg, torch.device(device), steps, profile_steps)))
            except Exception as e:  # one failing setting (a kernel this torch lacks) must not hide the others
                rows.append(Row(setting, plan, None, one_line(e)))
            rows[-1].seconds = time.perf_counter() - begun
            log(f"  setting {setting}: {rows[-1].seconds:.0f} s{(' ' + rows[-1].skipped) if rows[-1].skipped else ''}")
            if device == "cuda":
                torch.cuda.empty_cache()
            if after is not None:
                after(rows)
    return rows


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _cell(planned: Optional[float], measured: Optional[float], show) -> str:
    if measured is None or planned is None:
        return "-" if measured is None else f"- / {show(measured)}"
    return f"{show(planned)} / {show(measured)} ({(planned - measured) / measured:+.1%})"


def table(rows: list[Row]) -> str:
    lines = ["| setting | max_memory_allocated, planned / measured | max_memory_reserved | tokens/s |",
             "|---|---|---|---|"]
    host = any(getattr(r.plan, "host_bytes", 0) for r in rows)
    if host:
        lines = [lines[0][:-1] + " offloaded to host |", lines[1] + "---|"]
    for r in rows:
        if r.measured is None:
            planned = f"planned {fmt_bytes(r.plan.max_allocated)}; " if getattr(r.plan, "max_allocated", None) else ""
            lines.append(f"| {r.setting} | {planned}{r.skipped} | | |")
            continue
        p, m = r.plan, r.measured
        lines.append(f"| {p.label} | {_cell(p.max_allocated, m.max_allocated, fmt_bytes)} | "
                     f"{_cell(p.reserved.nbytes if p.reserved else None, m.max_reserved, fmt_bytes)} | "
                     f"{_cell(p.tokens_per_s, m.tokens_per_s, lambda v: f'{v:,.0f}')} |"
                     + (f" {_cell(p.host_bytes, m.host_bytes, fmt_bytes)} |" if host else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Output: every section writes $OUT/gpu_check.json and $OUT/gpu_check.md as soon as it has something, and the log
# goes to $OUT/gpu_check.log too, so a timeout still leaves data.

OUT: Optional[Path] = None


def log(text: str = "") -> None:
    print(text, flush=True)
    if OUT is not None:
        with open(OUT / "gpu_check.log", "a") as f:
            f.write(text + "\n")


class Report:
    """The results so far, rewritten to <out>/gpu_check.json and gpu_check.md after each update."""

    def __init__(self, out: Optional[Path]):
        self.out, self.data, self.md = out, {"sections": {}}, {}

    def set(self, key: str, value, md: Optional[str] = None) -> None:
        self.data[key] = value
        if md is not None:
            self.md[key] = md
        self.write()

    def write(self) -> None:
        if self.out is None:
            return
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=_jsonable))
        (self.out / "gpu_check.md").write_text("\n\n".join(self.md.values()) + "\n" + self.summary() + "\n")

    def summary(self) -> str:
        lines = ["| section | status | s |", "|---|---|---|"]
        for name, s in self.data["sections"].items():
            error = f": {s['error']}" if s.get("error") else ""
            lines.append(f"| {name} | {s['status']}{error} | {s['seconds']:.0f} |")
        return "\n".join(lines)


def _jsonable(value):
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return str(value)


def run_sections(sections: list[tuple[str, object]], report: Report, budget_s: float, start: float) -> None:
    """Each section in its own try/except; those begun after `budget_s` from `start` are skipped."""
    for name, fn in sections:
        elapsed = time.perf_counter() - start
        if elapsed > budget_s:
            report.data["sections"][name] = {"status": "skipped", "error": f"out of --budget-s {budget_s:g}",
                                             "seconds": 0.0}
            report.write()
            log(f"== {name}: skipped (out of --budget-s {budget_s:g} s)")
            continue
        log(f"== {name} (at {elapsed:.0f} s)")
        begun = time.perf_counter()
        status, error = "ok", ""
        try:
            fn()
        except Exception as e:
            status, error = "error", one_line(e)
            log(f"   {name} failed: {error}")
        report.data["sections"][name] = {"status": status, "error": error, "seconds": time.perf_counter() - begun}
        report.write()
        log(f"== {name}: {status}, {time.perf_counter() - begun:.1f} s")


# ---------------------------------------------------------------------------------------------------------------
# Microbenchmarks at the model's own shapes: the ceilings first, then each op class, each row with its FLOPs and
# bytes (each input read once, each output written once) and the fraction of the measured ceilings.


@dataclass
class Shapes:
    dim: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    tokens: int = 8192  # a micro-batch's tokens: seq 8192
    layers: int = 32
    ranks: int = 8  # AdamW's parameter shards: the model's parameters over this many ranks
    square: int = 8192  # the matmul ceiling's side
    copy_bytes: int = 2 << 30  # the copy ceiling's buffer
    seqs: tuple = (2048, 8192)  # SDPA's sequence lengths
    elementwise: int = 8192 * 14336  # the memory-bound ops' elements


LLAMA3_8B = Shapes()
TINY = Shapes(dim=256, heads=4, kv_heads=2, head_dim=64, ffn=512, vocab=1024, tokens=256, layers=2, ranks=8,
              square=512, copy_bytes=16 << 20, seqs=(128, 256), elementwise=1 << 20)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


BENCH_MS = 60.0  # each microbenchmark's timed reps take about this long (5 reps at least, 50 at most)


def bench(fn, device: torch.device, target_ms: Optional[float] = None, min_reps: int = 5, max_reps: int = 50) -> float:
    """The median ms of `fn` after a warm-up: CUDA events around each rep on a GPU, the host clock on the CPU."""
    fn()
    sync(device)
    begun = time.perf_counter()
    fn()
    sync(device)
    target_ms = BENCH_MS if target_ms is None else target_ms
    reps = max(min_reps, min(max_reps, int(target_ms / max((time.perf_counter() - begun) * 1e3, 1e-3))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for s, e in events:
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in events)
    times = []
    for _ in range(reps):
        begun = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begun) * 1e3)
    return statistics.median(times)


class Micro:
    """The microbenchmark rows; `ceilings` (TFLOP/s of a square bf16 matmul, GB/s of a device copy) once measured."""

    def __init__(self, device: torch.device, shapes: Shapes, report: Report):
        self.device, self.shapes, self.report = device, shapes, report
        self.rows: list[dict] = []
        self.ceilings = {"tflops": None, "gbps": None}

    def row(self, op_class: str, name: str, shape: str, fn, flops: float = 0.0, nbytes: float = 0.0) -> Optional[dict]:
        try:
            ms = bench(fn, self.device)
            tflops, gbps = flops / ms / 1e9 if flops else None, nbytes / ms / 1e6 if nbytes else None
            r = {"class": op_class, "op": name, "shape": shape, "ms": ms, "flops": flops, "bytes": nbytes,
                 "tflops": tflops, "gbps": gbps,
                 "of_peak_flops": tflops / self.ceilings["tflops"] if tflops and self.ceilings["tflops"] else None,
                 "of_peak_bw": gbps / self.ceilings["gbps"] if gbps and self.ceilings["gbps"] else None}
        except Exception as e:
            r = {"class": op_class, "op": name, "shape": shape, "error": one_line(e)}
        self.rows.append(r)
        self.report.set("micro", {"ceilings": self.ceilings, "rows": self.rows},
                        md=micro_table(self.ceilings, self.rows))
        return r

    def rand(self, *shape, dtype=torch.bfloat16, requires_grad=False):
        return torch.randn(*shape, device=self.device, dtype=dtype).requires_grad_(requires_grad)


def micro_table(ceilings: dict, rows: list[dict]) -> str:
    def f(v, fmt):
        return "" if v is None else format(v, fmt)

    lines = [f"Ceilings: {f(ceilings['tflops'], '.3g')} TFLOP/s (bf16 matmul), {f(ceilings['gbps'], '.0f')} GB/s "
             "(device copy, read+write)",
             "| class | op | shape | ms | TFLOP/s | GB/s | of peak F | of peak BW |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['class']} | {r['op']} | {r['shape']} | {r['error'][:90]} | | | | |")
            continue
        lines.append(f"| {r['class']} | {r['op']} | {r['shape']} | {r['ms']:.3f} | {f(r['tflops'], '.4g')} | "
                     f"{f(r['gbps'], '.4g')} | {f(r['of_peak_flops'], '.0%')} | {f(r['of_peak_bw'], '.0%')} |")
    return "\n".join(lines)


def run_ceilings(m: Micro) -> None:
    s, dev = m.shapes, m.device
    src = torch.randn(s.copy_bytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    r = m.row("ceiling", "copy_", f"{s.copy_bytes >> 20} MiB bf16", lambda: dst.copy_(src), nbytes=2 * src.nbytes)
    m.ceilings["gbps"] = r.get("gbps")
    del src, dst
    n = s.square
    a, b = m.rand(n, n), m.rand(n, n)
    r = m.row("ceiling", "mm", f"{n}^3 bf16", lambda: a @ b, flops=2 * n ** 3, nbytes=3 * 2 * n * n)
    m.ceilings["tflops"] = r.get("tflops")
    for r in m.rows:  # the ceilings' own fractions
        if r.get("tflops"):
            r["of_peak_flops"] = r["tflops"] / m.ceilings["tflops"] if m.ceilings["tflops"] else None
        if r.get("gbps"):
            r["of_peak_bw"] = r["gbps"] / m.ceilings["gbps"] if m.ceilings["gbps"] else None
    m.report.set("micro", {"ceilings": m.ceilings, "rows": m.rows}, md=micro_table(m.ceilings, m.rows))


def gemm_rows(m: Micro) -> None:
    """Each linear's forward x @ W^T, its input gradient dY @ W and its weight gradient dY^T @ X (as autograd
    computes them, transposes included), then smaller and small-K shapes."""
    s, T = m.shapes, m.shapes.tokens
    linears = {"wq/wo": (s.dim, s.heads * s.head_dim), "wk/wv": (s.dim, s.kv_heads * s.head_dim),
               "w1/w3": (s.dim, s.ffn), "w2": (s.ffn, s.dim), "output": (s.dim, s.vocab)}
    for name, (fan_in, fan_out) in linears.items():
        x, w, dy = m.rand(T, fan_in), m.rand(fan_out, fan_in), m.rand(T, fan_out)
        flops, nbytes = 2 * T * fan_in * fan_out, 2 * (T * fan_in + fan_in * fan_out + T * fan_out)
        for kind, fn, shape in (("fwd", lambda: x @ w.t(), f"({T}x{fan_in})@({fan_in}x{fan_out})"),
                                ("dgrad", lambda: dy @ w, f"({T}x{fan_out})@({fan_out}x{fan_in})"),
                                ("wgrad", lambda: dy.t() @ x, f"({fan_out}x{T})@({T}x{fan_in})")):
            m.row("gemm", f"{name} {kind}", shape, fn, flops, nbytes)
        del x, w, dy
    d = s.dim
    for M, K, N in ((T // 4, d, d), (T // 16, d, d), (T, s.head_dim, T // 4), (T, 64, d), (s.square // 8,) * 3,
                    (s.square // 4,) * 3, (s.square // 2,) * 3):
        a, b = m.rand(M, K), m.rand(K, N)
        m.row("gemm", "mm small", f"({M}x{K})@({K}x{N})", lambda: a @ b, 2 * M * N * K, 2 * (M * K + K * N + M * N))


def sdpa_rows(m: Micro) -> None:
    """Causal SDPA at B=1: FLOPs 4*B*H*S*S*D/2 forward (the causal half of QK^T and PV), 2.5x that backward;
    bytes q, k, v, out (forward) and q, k, v, out, dout, dq, dk, dv (backward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    s = m.shapes
    H, D = s.heads, s.head_dim
    backends = [("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")]
    if m.device.type == "cpu":
        backends = [("flash", "FLASH_ATTENTION"), ("math", "MATH")]
    for S in s.seqs:
        q, k, v = (m.rand(1, H, S, D, requires_grad=True) for _ in range(3))
        dout = m.rand(1, H, S, D)
        fwd_flops = 4 * H * S * S * D / 2
        io = 2 * H * S * D
        for label, attr in backends:
            backend = getattr(SDPBackend, attr, None)
            if backend is None:
                m.rows.append({"class": "attention", "op": f"sdpa {label}", "shape": f"S={S}",
                               "error": f"no SDPBackend.{attr} in this torch"})
                continue

            def fwd():
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            m.row("attention fwd", f"sdpa {label} fwd", f"B1 H{H} S{S} D{D} causal", fwd, fwd_flops, 4 * io)
            try:
                out = fwd()
            except Exception:
                continue  # the forward's row has the error
            m.row("attention bwd", f"sdpa {label} bwd", f"B1 H{H} S{S} D{D} causal",
                  lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), 2.5 * fwd_flops, 8 * io)
            del out
        del q, k, v, dout


def memory_bound_rows(m: Micro) -> None:
    import torch.nn.functional as F

    s, n = m.shapes, m.shapes.elementwise
    a, b, out = m.rand(n), m.rand(n), m.rand(n)
    e = a.element_size()
    shape = f"{n / 1e6:.0f}M bf16"
    m.row("copy/cast", "copy_ bf16", shape, lambda: out.copy_(a), nbytes=2 * n * e)
    m.row("elementwise", "add", shape, lambda: a + b, n, 3 * n * e)
    m.row("elementwise", "mul", shape, lambda: a * b, n, 3 * n * e)
    m.row("elementwise", "silu(a)*b (eager, 2 kernels)", shape, lambda: F.silu(a) * b, 5 * n, 3 * n * e)
    a32 = m.rand(n, dtype=torch.float32)
    m.row("copy/cast", "fp32->bf16", f"{n / 1e6:.0f}M", lambda: a32.to(torch.bfloat16), nbytes=n * 6)
    del a, b, out, a32
    x, w = m.rand(s.tokens, s.dim), m.rand(s.dim)
    shape, nb, eps = f"({s.tokens}x{s.dim}) bf16", 2 * x.numel() * 2 + w.numel() * 2, 1e-5

    def composite():
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w

    m.row("reduction/norm", "rmsnorm composite (eager)", shape, composite, 4 * x.numel(), nb)
    if hasattr(F, "rms_norm"):
        m.row("reduction/norm", "F.rms_norm", shape, lambda: F.rms_norm(x, (s.dim,), w, eps), 4 * x.numel(), nb)
    if hasattr(torch, "_fused_rms_norm"):
        m.row("reduction/norm", "torch._fused_rms_norm", shape, lambda: torch._fused_rms_norm(x, [s.dim], w, eps),
              4 * x.numel(), nb)
    m.row("reduction/norm", "sum(-1) bf16", shape, lambda: x.sum(-1), x.numel(), 2 * x.numel())
    del x, w
    logits = m.rand(s.tokens, s.vocab)
    labels = torch.randint(0, s.vocab, (s.tokens,), device=m.device)
    shape, n = f"({s.tokens}x{s.vocab})", logits.numel()
    m.row("softmax/CE", "softmax bf16", shape + " bf16", lambda: torch.softmax(logits, -1), 5 * n, 4 * n)
    m.row("softmax/CE", "log_softmax fp32 out", shape + " bf16",
          lambda: torch.log_softmax(logits, -1, dtype=torch.float32), 5 * n, 6 * n)
    m.row("softmax/CE", "cross_entropy(logits.float())", shape, lambda: F.cross_entropy(logits.float(), labels),
          5 * n, 2 * n)
    lg = logits.float().requires_grad_(True)
    m.row("softmax/CE", "cross_entropy fwd+bwd fp32", shape,
          lambda: torch.autograd.grad(F.cross_entropy(lg, labels), lg), 10 * n, 12 * n)
    del logits, lg


def adamw_rows(m: Micro) -> None:
    """AdamW over the model's fp32 parameters split over `ranks` (the shards of FSDP's dim 0): reads p, g, m, v
    and writes p, m, v, 28 bytes a parameter."""
    s = m.shapes
    hd = s.head_dim
    block = [(s.heads * hd, s.dim), (s.kv_heads * hd, s.dim), (s.kv_heads * hd, s.dim), (s.dim, s.heads * hd),
             (s.ffn, s.dim), (s.dim, s.ffn), (s.ffn, s.dim), (s.dim,), (s.dim,)]
    shapes = block * s.layers + [(s.vocab, s.dim), (s.vocab, s.dim), (s.dim,)]
    params = []
    for shape in shapes:
        p = torch.randn(-(-shape[0] // s.ranks), *shape[1:], device=m.device).requires_grad_(True)
        p.grad = torch.randn_like(p)
        params.append(p)
    numel = sum(p.numel() for p in params)
    label = f"{len(params)} shards, {numel / 1e6:.0f}M fp32"
    for flavour in ("foreach", "fused"):
        try:
            opt = torch.optim.AdamW(params, lr=1e-6, **{flavour: True})
        except Exception as e:
            m.rows.append({"class": "optimizer", "op": f"AdamW {flavour}", "shape": label, "error": one_line(e)})
            continue
        m.row("optimizer", f"AdamW {flavour}", label, opt.step, 12 * numel, 28 * numel)
        del opt


def host_rows(m: Micro) -> None:
    """The eager host cost of a tiny op: 1000 adds timed on the host with one sync at the end; on a GPU also the
    same 1000 adds replayed from a CUDA graph."""
    x = torch.randn(16, device=m.device)
    n = 1000

    def adds():
        y = x
        for _ in range(n):
            y = y + 1
        return y

    for _ in range(2):
        adds()
    sync(m.device)
    times = []
    for _ in range(5):
        begun = time.perf_counter()
        adds()
        sync(m.device)
        times.append((time.perf_counter() - begun) * 1e6 / n)
    us = statistics.median(times)
    m.rows.append({"class": "host", "op": "eager tiny add, us per dispatch", "shape": "(16,) x1000",
                   "ms": us / 1e3, "flops": 0, "bytes": 0, "tflops": None, "gbps": None, "of_peak_flops": None,
                   "of_peak_bw": None, "us_per_op": us})
    if m.device.type == "cuda":
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                adds()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                adds()
            ms = bench(graph.replay, m.device)
            m.rows.append({"class": "host", "op": "tiny add in CUDA graph, us per op", "shape": "(16,) x1000",
                           "ms": ms, "flops": 0, "bytes": 0, "tflops": None, "gbps": None, "of_peak_flops": None,
                           "of_peak_bw": None, "us_per_op": ms * 1e3 / n})
        except Exception as e:
            m.rows.append({"class": "host", "op": "tiny add in CUDA graph", "shape": "(16,) x1000",
                           "error": one_line(e)})
    m.report.set("micro", {"ceilings": m.ceilings, "rows": m.rows}, md=micro_table(m.ceilings, m.rows))


def nvidia_smi() -> dict:
    """Read only: the GPU's name, power limits, clocks and memory."""
    query = "name,power.limit,power.max_limit,clocks.max.sm,clocks.sm,memory.total,driver_version"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True,
                          timeout=30)
    return {"query": query, "stdout": done.stdout.strip(), "stderr": done.stderr.strip()[-300:]}


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "device": str(device), "cpu_count": os.cpu_count()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(name=p.name, memory=p.total_memory, sms=p.multi_processor_count,
                   capability=torch.cuda.get_device_capability(device),
                   cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
        try:
            import triton
            env["triton"] = triton.__version__
        except Exception as e:
            env["triton"] = one_line(e)
    return env


# ---------------------------------------------------------------------------------------------------------------
# The profiler's kernel table of real training steps, per op class.

CLASSES = ("attention bwd", "attention fwd", "gemm", "triton fused", "optimizer", "softmax/CE", "copy/cast",
           "reduction/norm", "elementwise", "other")
_ATTENTION = re.compile(r"flash|fmha|efficient_attention|attention|sdpa|cudnn.*(fprop|bprop)")
_BACKWARD = re.compile(r"bwd|backward|cutlassb|bprop")
_RULES = (
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|triton_tem_|^aten::(mm|addmm|bmm|baddbmm)$|sm[0-9]+_")),
    ("triton fused", re.compile(r"^triton_|^triton")),
    ("optimizer", re.compile(r"multi_tensor_apply|foreach|fused_adam|adamw|^aten::_fused_adam")),
    ("softmax/CE", re.compile(r"softmax|nll|cross_entropy|logsumexp")),
    ("copy/cast", re.compile(r"copy|memcpy|memset|_to_copy|^aten::to$|cast|convert")),
    ("reduction/norm", re.compile(r"reduce|norm|rms|^aten::(sum|mean|max|min|amax|var)$|welford")),
    ("elementwise", re.compile(r"elementwise|vectorized|^aten::(add|add_|mul|mul_|sub|div|silu|neg|pow|rsqrt|"
                               r"where|fill_|zero_|cos|sin|cat|exp|lerp_|addcmul_|addcdiv_|sqrt|clamp|_unsafe_view)$")),
)


def classify(name: str) -> str:
    """The op class of a GPU kernel (or, on the CPU, an aten op) by its name."""
    low = name.lower()
    if _ATTENTION.search(low) and "triton_" not in low:
        return "attention bwd" if _BACKWARD.search(low) else "attention fwd"
    for cls, rule in _RULES:
        if rule.search(low):
            return cls
    return "other"


def _kernels_from_trace(prof) -> dict:
    """{kernel name: [count, total us]} from the profile's Chrome trace (kernels, memcpys and memsets)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    kernels = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            k = kernels.setdefault(ev.get("name", "?"), [0, 0.0])
            k[0] += 1
            k[1] += float(ev.get("dur", 0.0))
    return kernels


def _kernels_from_averages(prof, cuda: bool) -> dict:
    """{name: [count, self us]} from key_averages(): device time of CUDA kernels, else the CPU ops' self time."""
    kernels = {}
    for evt in prof.key_averages():
        if cuda:
            us = getattr(evt, "self_device_time_total", None)
            us = getattr(evt, "self_cuda_time_total", 0.0) if us is None else us
            if str(getattr(evt, "device_type", "")).endswith("CUDA") and us:
                kernels[evt.key] = [evt.count, float(us)]
        elif not evt.key.startswith("ProfilerStep") and evt.self_cpu_time_total:
            kernels[evt.key] = [evt.count, float(evt.self_cpu_time_total)]
    return kernels


def profile_steps_table(one_step, device: torch.device, steps: int, unprofiled_step_s: float) -> dict:
    """`steps` training steps under torch.profiler (CUDA kernels on a GPU; on the CPU, aten ops' self time)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            begun = time.perf_counter()
            one_step()
            sync(device)
            walls.append(time.perf_counter() - begun)
    source = "chrome trace"
    kernels = _kernels_from_trace(prof) if cuda else {}
    if not kernels:
        kernels, source = _kernels_from_averages(prof, cuda), "key_averages " + ("device" if cuda else "cpu self")
    return kernel_table(kernels, steps, statistics.median(walls), unprofiled_step_s, source)


def kernel_table(kernels: dict, steps: int, step_s: float, unprofiled_step_s: Optional[float] = None,
                 source: str = "") -> dict:
    classes = {c: {"count": 0, "ms_per_step": 0.0} for c in CLASSES}
    for name, (count, us) in kernels.items():
        c = classes[classify(name)]
        c["count"] += count / steps
        c["ms_per_step"] += us / 1e3 / steps
    total = sum(c["ms_per_step"] for c in classes.values())
    for c in classes.values():
        c["share_of_step"] = c["ms_per_step"] / (step_s * 1e3) if step_s else None
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"source": source, "steps": steps, "step_ms_profiled": step_s * 1e3,
            "step_ms_unprofiled": None if unprofiled_step_s is None else unprofiled_step_s * 1e3,
            "kernel_ms_per_step": total, "gap_ms_profiled": step_s * 1e3 - total,
            "gap_ms_unprofiled": None if unprofiled_step_s is None else unprofiled_step_s * 1e3 - total,
            "classes": {k: v for k, v in classes.items() if v["count"]},
            "kernels": [{"name": n, "class": classify(n), "count": c, "total_us": us} for n, (c, us) in top]}


def profile_md(setting: str, p: dict) -> str:
    lines = [f"Profile {setting} ({p['source']}): step {p['step_ms_profiled']:.1f} ms profiled, "
             f"{p['step_ms_unprofiled'] or 0:.1f} ms unprofiled; kernels {p['kernel_ms_per_step']:.1f} ms/step; "
             f"gap (wall - kernels) {p['gap_ms_profiled']:.1f} ms profiled, {p['gap_ms_unprofiled'] or 0:.1f} ms "
             "unprofiled",
             "| class | kernels/step | ms/step | share of step |", "|---|---|---|---|"]
    for cls, c in sorted(p["classes"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
        share = "" if c["share_of_step"] is None else f"{c['share_of_step']:.1%}"
        lines.append(f"| {cls} | {c['count']:.0f} | {c['ms_per_step']:.2f} | {share} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 over one rank, under each allocator (issue 23). torchtitan's 8-GPU Llama 3 8B rows plan 5-7 % under their
# measured max_reserved with expandable segments and within 2 % with PyTorch's default allocator. What differs
# between one GPU and eight is FSDP2: its all-gather copy-in stream and reduce-scatter stream allocate from pools
# (and, with expandable segments, segments) of their own. Over a 1-rank process group FSDP2 runs the same program
# (its streams, copies and frees) with whole shards; each allocator in a fresh process, as PYTORCH_CUDA_ALLOC_CONF
# is read when CUDA starts. The caching allocator's own trace of the run (every allocation and free, with its
# stream) replayed through the planner's allocator model (membudget/plan/allocator.py) separates the allocator model
# from the program: replayed reserved == measured reserved means the model has the allocator's rules; a gap means
# a rule it lacks, which the per-stream segments below locate.

HISTORY_ENTRIES = 2_000_000  # the allocator's trace buffer: the model's building and two steps fit many times
FSDP_SETTINGS = "selective"  # torchtitan's rows: selective op AC
FSDP_LAYERS = 2


def _keep_size_1_dims(mesh):
    """membudget.parallel.dp_dims, keeping a data-parallel dimension of size 1 (it drops them)."""
    return tuple(name for name in ("dp_replicate", "dp_shard") if mesh is not None and name in mesh.mesh_dim_names)


@contextlib.contextmanager
def _one_rank_fake_world(p, world_size):
    """membudget.plan.measure.fake_world for one rank, keeping the 1-rank dp_shard dimension (it builds none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from membudget.internals import register_fake_process_group

    register_fake_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
        yield mesh, {mesh.get_group("dp_shard").group_name: ("dp_shard", 1)}
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_fsdp():
    """The trainer and the planner build no mesh for one process (issue 23: no size-1 dimensions): inside, both
    keep a 1-rank dp_shard dimension, so FSDP2 (mixed precision, streams, copies) wraps the model as on N ranks."""
    import membudget.parallel as parallel
    import membudget.plan.planner as planning

    with mock.patch.object(parallel, "dp_dims", _keep_size_1_dims), \
            mock.patch.object(planning, "fake_world", _one_rank_fake_world):
        yield


def fsdp_config(setting: str, device: str, model: str, layers: Optional[int], seq: int, batch: int,
                expandable: bool) -> RunConfig:
    cfg = build_config(setting, device, model, layers, seq, batch, expandable)
    cfg.parallelism.name, cfg.parallelism.dp_shard = "fsdp", -1
    return cfg


def fsdp_one_rank(cfg, device: torch.device, steps: int) -> dict:
    """Plan `cfg` (FSDP2 over one rank), then train it here over a real 1-rank process group (NCCL on a GPU, gloo
    on the CPU, initialised in this process from a file): the plan, what was measured and, on a GPU, the allocator's
    record with the planner's allocator model replayed on the GPU's own trace (replayed_reserved)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    cuda = device.type == "cuda"
    with one_rank_fsdp():
        plan = plan_setting(cfg, world_size=1)  # before init_process_group: the planner runs a fake one
        with tempfile.TemporaryDirectory() as tmp:
            index = device.index if device.index is not None else torch.cuda.current_device() if cuda else None
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{tmp}/pg", rank=0,
                                    world_size=1, **({"device_id": torch.device("cuda", index)} if cuda else {}))
            try:
                mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
                measured = measure(cfg, device, steps, mesh=mesh, history=cuda)
            finally:
                dist.destroy_process_group()
    record = measured.allocator or {}
    measured.allocator = None
    return {"allocator": "expandable segments" if cfg.plan.expandable_segments else "default",
            "plan": {"label": plan.label, "verdict": plan.verdict, "max_allocated": plan.max_allocated,
                     "reserved": plan.reserved.nbytes if plan.reserved else None,
                     "reserved_other": plan.reserved_other.nbytes if plan.reserved_other else None,
                     "allocated": plan.allocated.nbytes},
            "measured": {k: v for k, v in dataclasses.asdict(measured).items() if k not in ("profile", "allocator")},
            "record": record}


def allocator_record(snapshot: dict, stats: dict) -> dict:
    """What the caching allocator holds and did: memory_stats()'s peaks per pool, its segments (one per contiguous
    mapped range under expandable segments) by stream and pool, and the planner's allocator model replayed on its
    trace under both settings (replay_trace)."""
    keys = ("reserved_bytes.all.peak", "reserved_bytes.large_pool.peak", "reserved_bytes.small_pool.peak",
            "allocated_bytes.all.peak", "active_bytes.all.peak", "segment.all.peak", "segment.large_pool.peak",
            "segment.small_pool.peak", "num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms",
            "num_sync_all_streams")
    streams: dict = {}
    for seg in snapshot.get("segments", []):
        key = f"{seg.get('stream')}/{seg.get('segment_type', 'large' if seg.get('is_large', True) else 'small')}"
        entry = streams.setdefault(key, {"segments": 0, "bytes": 0, "allocated": 0, "expandable": False})
        entry["segments"] += 1
        entry["bytes"] += seg.get("total_size", 0)
        entry["allocated"] += seg.get("allocated_size", 0)
        entry["expandable"] = entry["expandable"] or bool(seg.get("is_expandable"))
    traces = snapshot.get("device_traces") or [[]]
    events = [e for e in traces[0] if e.get("action") in ("alloc", "free_requested", "free_completed")]
    codes = {"alloc": 0, "free_requested": 1, "free_completed": 2}
    return {"stats": {k: stats.get(k) for k in keys}, "streams": streams, "events": len(events),
            "replay": replay_trace(events),
            "trace": [[codes[e["action"]], e["addr"], e["size"], e.get("stream", 0)] for e in events]}


def replay_trace(events: list[dict]) -> dict:
    """The planner's allocator model (both settings) on the allocator's own trace: each `alloc` (its requested
    size, its stream) and each `free_completed`, in order. Also what was freed only later than requested (a block
    used on another stream, record_stream: its event pending): how often, and the most bytes so held at once."""
    from membudget.plan.allocator import CachingAllocator

    models = {"default": CachingAllocator(), "expandable": CachingAllocator(expandable=True)}
    streams: dict = {}
    live, requested = {}, {}  # address -> size; address -> the allocations made before its free was requested
    allocs = pending = most_pending = late = 0
    for e in events:
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            stream = streams.setdefault(e.get("stream", 0), len(streams))
            live[addr] = size
            allocs += 1
            most_pending = max(most_pending, pending)
            for model in models.values():
                model.malloc(addr, size, stream)
        elif addr not in live:  # freed before the trace began
            continue
        elif action == "free_requested":
            requested[addr] = allocs
            pending += live[addr]
        else:  # free_completed
            if addr in requested:
                late += requested.pop(addr) < allocs  # an allocation came between: it could not reuse this block
                pending -= live[addr]
            del live[addr]
            for model in models.values():
                model.free(addr)
    return {"streams": len(streams), "late_frees": late, "most_pending_bytes": most_pending,
            **{f"{name}_reserved": m.peak_reserved for name, m in models.items()},
            **{f"{name}_allocated": m.peak_allocated for name, m in models.items()}}


def fsdp_md(results: list[dict], error: str = "") -> str:
    lines = ["FSDP2 over one rank (its copy-in and reduce-scatter streams), each allocator in a fresh process"
             f"{': ' + error if error else ''}. Replayed: the planner's allocator model on the GPU's own trace.",
             "| allocator | setting | max_allocated planned / measured | max_reserved planned / measured | replayed "
             "reserved / measured | segments large / small (peak) | reserved by stream/pool |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r.get('allocator', '?')} | {r.get('setting', '')} | {r['error']} | | | | |")
            continue
        p, m, rec = r["plan"], r["measured"], r.get("record") or {}
        stats, replay = rec.get("stats") or {}, rec.get("replay") or {}
        mine = "expandable" if r["allocator"].startswith("expandable") else "default"
        streams = ", ".join(f"{k} {fmt_bytes(v['bytes'])} in {v['segments']}" for k, v in
                            sorted((rec.get("streams") or {}).items()))
        lines.append(f"| {r['allocator']} | {r.get('setting', '')} | "
                     f"{_cell(p['max_allocated'], m['max_allocated'], fmt_bytes)} | "
                     f"{_cell(p['reserved'], m['max_reserved'], fmt_bytes)} | "
                     f"{_cell(replay.get(mine + '_reserved'), m['max_reserved'], fmt_bytes)} | "
                     f"{stats.get('segment.large_pool.peak')} / {stats.get('segment.small_pool.peak')} | {streams} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------


def rows_json(rows: list[Row]) -> list[dict]:
    out = []
    for r in rows:
        p, m = r.plan, r.measured
        out.append({"setting": r.setting, "skipped": r.skipped, "seconds": r.seconds,
                    "plan": None if p is None else {
                        "label": getattr(p, "label", None), "verdict": getattr(p, "verdict", None),
                        "max_allocated": getattr(p, "max_allocated", None),
                        "reserved": p.reserved.nbytes if getattr(p, "reserved", None) else None,
                        "tokens_per_s": getattr(p, "tokens_per_s", None),
                        "allocator": getattr(p, "allocator", None)},
                    "measured": None if m is None else {k: v for k, v in dataclasses.asdict(m).items()
                                                        if k != "profile"}})
    return out


def settings_table(rows: list[Row]) -> str:
    return table([r for r in rows if r.plan is not None or r.measured is not None]) + "".join(
        f"\n| {r.setting} | {r.skipped} | | |" for r in rows if r.plan is None and r.measured is None)


# ---------------------------------------------------------------------------------------------------------------
# offload: the host link's copy rates, activation offloading's settings planned against measured, and its copies
# checked against a run without them.

OFFLOAD_SETTINGS = "offload:full,offload:selective,offload,blocks=offload+offload:selective+full+none"


def host_link(device: torch.device, nbytes: int = GiB) -> dict:
    """Pinned host <-> device copy rates, GB/s: each way alone on a side stream, and both at once (one copy
    engine each way), as offload.py copies; on a CPU plain host copies (a smoke test)."""
    nbytes = nbytes if device.type == "cuda" else MiB
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    back = torch.empty_like(host)
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else (None, None)

    def copy(dst, src, stream):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            dst.copy_(src, non_blocking=True)

    rates = {"d2h": bench(lambda: copy(back, dev, streams[0]), device),
             "h2d": bench(lambda: copy(dev, host, streams[1]), device)}
    dev2 = torch.empty_like(dev)
    rates["duplex"] = bench(lambda: (copy(back, dev, streams[0]), copy(dev2, host, streams[1])), device)
    out = {k: nbytes / ms / 1e6 for k, ms in rates.items()}  # GB/s; duplex: each way
    if device.type == "cuda":
        from membudget.devices import by_cuda_name
        from membudget.devices import GPUS

        key = by_cuda_name(torch.cuda.get_device_name(device))
        if key:
            link = GPUS[key].host_link_bandwidth / 1e9
            out.update(link_gbps=link, **{f"{k}_share": v / link for k, v in list(out.items())})
    return out


def offload_bitwise(device: torch.device, model: str, seq: int) -> dict:
    """Two blocks of `model`, one step without offloading, again without, and with every block offloaded (and
    with offload:full), in the run's numerics: the loss, and the largest gradient difference from the first run.
    The second run without offloading shows what the GPU's own kernels vary by (atomics in backward)."""
    results = {}
    reference = None
    for name, setting in (("none", "none"), ("none again", "none"), ("offload", "offload"),
                          ("offload:full", "offload:full"), ("full", "full")):
        cfg = build_config(setting, device.type, model, 2, seq, 1)
        torch.manual_seed(0)
        net = build_model(cfg, device)
        numerics = Numerics.for_target(cfg, device.type, torch.cuda.get_device_capability(device)
                                       if device.type == "cuda" else (0, 0))
        torch.manual_seed(1)
        tokens = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), device=device)
        loss = forward_backward(net, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                                ActivationCounter(net), numerics, device.type)[0].item()
        grads = [p.grad.detach().float().clone() for p in net.parameters()]
        if reference is None:
            reference = (loss, grads)
        diff = max((a - b).abs().max().item() for a, b in zip(grads, reference[1]))
        offloader = find_offloader(net)
        results[name] = {"loss": loss, "loss_equal": loss == reference[0], "max_grad_diff": diff,
                         "bitwise": loss == reference[0] and diff == 0.0,
                         "host_bytes": offloader.peak_host_bytes if offloader else 0}
        del net, grads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def offload_md(link: dict, bitwise: dict, rows: list) -> str:
    lines = []
    if link:
        lines.append("Host link (pinned, side streams), GB/s: " + ", ".join(
            f"{k} {v:.1f}" if not k.endswith("share") else f"{k} {v:.2f}" for k, v in link.items()))
    if bitwise:
        lines += ["", "| run (2 blocks, one step) | loss | same loss | max grad diff vs none | host bytes |",
                  "|---|---:|---|---:|---:|"]
        lines += [f"| {k} | {v['loss']:.6f} | {v['loss_equal']} | {v['max_grad_diff']:.3g} | "
                  f"{fmt_bytes(v['host_bytes'])} |" for k, v in bitwise.items()]
    if rows:
        lines += ["", settings_table(rows)]
    return "\n".join(lines)


def main(argv=None) -> dict:
    global OUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"AC settings; a suffix {COMPILED} compiles the blocks (selective{COMPILED})")
    parser.add_argument("--model", default=None, help="a conf/model preset (llama3_8b on a GPU, llama3_debug on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (4 for llama3_8b; the preset's otherwise)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (8192 on a GPU, 64 on CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences a step (1 on a GPU, 2 on CPU)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out",
                        help="where gpu_check.json, .md and .log go ($OUT, else ./gpu_check_out)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="wall-clock seconds after which the sections (and settings) not begun are skipped")
    parser.add_argument("--sections", default="env,micro,profile,settings,expandable",
                        help="run in this order: env (nvidia-smi), micro (ceilings and kernels at 8B's shapes), "
                             "profile (kernel table of real steps), settings (planned vs measured), expandable "
                             "(expandable segments), fsdp_expandable (FSDP2 over one rank under each allocator; not "
                             "in the default), offload (the host link, offloading's settings planned vs measured and "
                             "its copies checked; not in the default)")
    parser.add_argument("--profile-settings", default="none,0.5", help="settings profiled (they count as measured)")
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--expandable-settings", default="none,full,0.5")
    parser.add_argument("--offload-settings", default=OFFLOAD_SETTINGS, help="offload's settings")
    parser.add_argument("--fsdp-settings", default=FSDP_SETTINGS, help="fsdp_expandable's AC settings")
    parser.add_argument("--fsdp-layers", type=int, default=FSDP_LAYERS, help="fsdp_expandable's blocks")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the expandable subprocess's JSON
    parser.add_argument("--fsdp-child", default=None, help=argparse.SUPPRESS)  # fsdp_expandable's subprocess
    a = parser.parse_args(argv)
    wanted = a.sections.split(",")
    unknown = [n for n in wanted if n not in SECTIONS]
    if unknown:  # before --out is touched: a typo loses no earlier results
        parser.error(f"--sections={a.sections}: no section {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    start = time.perf_counter()
    gpu = a.device == "cuda"
    model = a.model or ("llama3_8b" if gpu else "llama3_debug")
    layers = a.layers if a.layers is not None else (4 if model == "llama3_8b" else None)
    seq, batch = a.seq or (8192 if gpu else 64), a.batch or (1 if gpu else 2)
    common = dict(device=a.device, model=model, layers=layers, seq=seq, batch=batch, steps=a.steps)
    if a.fsdp_child:  # FSDP2 over one rank under the allocator the parent set in PYTORCH_CUDA_ALLOC_CONF
        fsdp_child(Path(a.fsdp_child), a, model, seq, batch)
        return {}
    if a.child:  # measure under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set by the parent
        path = Path(a.child)
        check(a.settings.split(","), expandable=True, deadline=start + a.budget_s,
              after=lambda rows: path.write_text(json.dumps(rows_json(rows), default=_jsonable)), **common)
        return {}
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_check.log").write_text("")
    report = Report(OUT)
    device = torch.device(a.device)
    profiled: list[Row] = []
    settings_rows: list[Row] = []
    log(f"gpu_check: {model}{f' with {layers} blocks' if layers else ''}, seq {seq}, batch {batch}, "
        f"{a.steps} steps, on {a.device}; budget {a.budget_s:g} s; out {OUT}")

    def env():
        report.set("environment", environment(device), md="Environment: " + ", ".join(
            f"{k} {v}" for k, v in environment(device).items()) + f"; GQA FLOP formulas patched: {GQA_PATCHED}")
        log(f"   {report.data['environment']}")
        if gpu:
            smi = nvidia_smi()
            report.set("nvidia_smi", smi, md="nvidia-smi: " + (smi["stdout"] or smi["stderr"]).replace("\n", " / "))
            log("   " + smi["stdout"].replace("\n", "\n   "))

    micro = Micro(device, LLAMA3_8B if gpu else TINY, report)

    def micro_all():
        for part in (run_ceilings, gemm_rows, sdpa_rows, memory_bound_rows, adamw_rows, host_rows):
            if time.perf_counter() - start > a.budget_s:
                micro.rows.append({"class": part.__name__, "op": "", "shape": "", "error": "skipped: out of budget"})
                continue
            begun = time.perf_counter()
            try:
                part(micro)
            except Exception as e:
                micro.rows.append({"class": part.__name__, "op": "", "shape": "", "error": one_line(e)})
            if gpu:
                torch.cuda.empty_cache()
            log(f"   {part.__name__}: {time.perf_counter() - begun:.1f} s")
        report.set("micro", {"ceilings": micro.ceilings, "rows": micro.rows}, md=micro_table(micro.ceilings,
                                                                                              micro.rows))

    def profile_all():
        def after(rows):
            report.set("profile", {r.setting: r.measured.profile if r.measured else {"error": r.skipped}
                                   for r in rows},
                       md="\n\n".join(profile_md(r.setting, r.measured.profile) for r in rows
                                       if r.measured and r.measured.profile))
            report.set("settings", rows_json(rows), md=settings_table(rows))

        profiled.extend(check(a.profile_settings.split(","), profile_steps=a.profile_steps, after=after,
                              deadline=start + a.budget_s, **common))

    def settings_all():
        done = {r.setting for r in profiled if r.measured is not None}
        todo = [s for s in a.settings.split(",") if s not in done]
        check(todo, deadline=start + a.budget_s, after=lambda rows: (
            settings_rows.clear(), settings_rows.extend(rows),
            report.set("settings", rows_json(profiled + rows), md=settings_table(profiled + rows))), **common)

    def expandable():
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "child.json"
            left = max(30.0, a.budget_s - (time.perf_counter() - start))
            env_vars = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", PYTHONUNBUFFERED="1")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(path), "--budget-s", str(left),
                   "--settings", a.expandable_settings, "--device", a.device, "--model", model, "--seq", str(seq),
                   "--batch", str(batch), "--steps", str(a.steps)] + (["--layers", str(layers)] if layers else [])
            error = ""
            try:
                done = subprocess.run(cmd, env=env_vars, capture_output=True, text=True, timeout=left + 60)
                if done.returncode:
                    error = f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or [""])[-1][:200]
            except subprocess.TimeoutExpired:
                error = "timed out"
            rows = json.loads(path.read_text()) if path.exists() else []
        report.set("expandable", {"rows": rows, "error": error}, md=expandable_md(rows, error))
        if error:
            raise RuntimeError(error)

    def fsdp_expandable():
        results, errors = [], []
        for allocator in ("default", "expandable"):
            left = a.budget_s - (time.perf_counter() - start)
            if left < 20:
                errors.append(f"{allocator}: out of --budget-s")
                continue
            rows, error = fsdp_subprocess(allocator, a, model, seq, batch, timeout=left + 60)
            results += rows or [{"allocator": allocator, "error": error}]
            if error:
                errors.append(f"{allocator}: {error}")
            report.set("fsdp_expandable", {"results": results, "error": "; ".join(errors)},
                       md=fsdp_md(results, "; ".join(errors)))
        if errors:
            raise RuntimeError("; ".join(errors))

    def offload():
        data = {"host_link": {}, "bitwise": {}, "settings": []}
        rows: list[Row] = []

        def write():
            report.set("offload", {**data, "settings": rows_json(rows)}, md=offload_md(data["host_link"],
                                                                                      data["bitwise"], rows))
        data["host_link"] = host_link(device)
        write()
        data["bitwise"] = offload_bitwise(device, model, seq)
        write()
        check(a.offload_settings.split(","), deadline=start + a.budget_s,
              after=lambda done: (rows.clear(), rows.extend(done), write()), **common)

    sections = dict(zip(SECTIONS, (env, micro_all, profile_all, settings_all, expandable, fsdp_expandable, offload)))
    run_sections([(n, sections[n]) for n in wanted], report, a.budget_s, start)  # in the order asked for
    report.data["elapsed_s"] = time.perf_counter() - start
    report.write()
    log()
    log((OUT / "gpu_check.md").read_text())
    log(f"{model}{f' with {layers} blocks' if layers else ''} on {a.device}, torch {torch.__version__}, "
        f"{time.perf_counter() - start:.0f} s; written to {OUT}/gpu_check.json, .md, .log")
    return report.data


def fsdp_subprocess(allocator: str, a, model: str, seq: int, batch: int, timeout: float) -> tuple[list, str]:
    """fsdp_expandable's child for one allocator: a fresh process whose PYTORCH_CUDA_ALLOC_CONF sets it (the
    config is read when CUDA starts). (its results, an error or "")."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"fsdp_{allocator}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--fsdp-child", str(path), "--out", str(OUT or tmp),
               "--device", a.device, "--model", model, "--seq", str(seq), "--batch", str(batch), "--steps",
               str(a.steps), "--fsdp-settings", a.fsdp_settings, "--fsdp-layers", str(a.fsdp_layers)]
        error = ""
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if done.returncode:
                error = f"exit {done.returncode}: " + (done.stderr.strip().splitlines() or [""])[-1][:200]
        except subprocess.TimeoutExpired:
            error = "timed out"
        rows = json.loads(path.read_text()) if path.exists() else []
    return rows, error


def fsdp_child(path: Path, a, model: str, seq: int, batch: int) -> None:
    """Each of --fsdp-settings under this process's allocator: fsdp_one_rank's results to `path` (JSON) after each,
    the allocator's trace beside the results in --out (fsdp_trace_<allocator>_<setting>.json: [[0 alloc, 1 free
    requested, 2 free completed; address; bytes; stream], ...]) for replays of later allocator models."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    device = torch.device(a.device)
    results = []
    for setting in a.fsdp_settings.split(","):
        try:
            cfg = fsdp_config(setting, a.device, model, a.fsdp_layers, seq, batch, expandable)
            result = fsdp_one_rank(cfg, device, max(2, a.steps))
            trace = result["record"].pop("trace", None)
            if trace is not None and a.out:
                plain = re.sub(r"[^A-Za-z0-9._-]", "-", setting)  # a file name any copier keeps
                name = f"fsdp_trace_{'expandable' if expandable else 'default'}_{plain}.json"
                (Path(a.out) / name).write_text(json.dumps(trace))
            results.append({"setting": setting, **result})
        except Exception as e:  # the next setting still runs
            results.append({"setting": setting, "allocator": "expandable" if expandable else "default",
                            "error": one_line(e)})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        path.write_text(json.dumps(results, default=_jsonable))


def expandable_md(rows: list[dict], error: str) -> str:
    lines = [f"Expandable segments (a fresh process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"
             f"{': ' + error if error else ''}",
             "| setting | max_allocated planned / measured | reserved planned / measured |", "|---|---|---|"]
    for r in rows:
        p, m = r.get("plan") or {}, r.get("measured")
        if m is None:
            lines.append(f"| {r['setting']} | {r['skipped']} | |")
            continue
        lines.append(f"| {p.get('label')} | {_cell(p.get('max_allocated'), m['max_allocated'], fmt_bytes)} | "
                     f"{_cell(p.get('reserved'), m['max_reserved'], fmt_bytes)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    collect_rarely()  # as train.py's processes collect
    main()
