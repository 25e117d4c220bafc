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

It runs from the source tree on torch 2.11 or newer without Hydra, OmegaConf or W&B: the config is the schema's
dataclasses, the model's sizes read from conf/model/<name>.yaml. Per-block budgets ("0.3*8+0.6*24") need torch
2.13 (torch.autograd.graph.region_activation_memory_budget) and are not among its settings.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.ac import compiler_scope  # noqa: E402
from membudget.metrics import ActivationCounter  # noqa: E402
from membudget.parallel import clip_grad_norm  # noqa: E402
from membudget.plan import plan_setting  # noqa: E402
from membudget.plan.result import size  # noqa: E402
from membudget.schema import ACMode, CompileBackend, RunConfig, TrainDevice  # noqa: E402
from membudget.step import Numerics, build_model, build_optimizer, forward_backward  # noqa: E402

SETTINGS = ("none", "full", "selective", "0.0", "0.5", "1.0")


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


def build_config(setting: str, device: str, model: str, layers: Optional[int], seq: int, batch: int) -> RunConfig:
    """The run's config for one AC setting, as Hydra would compose it from the schema and conf/model."""
    cfg = RunConfig()
    types = {f.name: f.type for f in dataclasses.fields(cfg.model)}
    for key, value in model_preset(model).items():
        kind = str(types[key])
        setattr(cfg.model, key, float(value) if "float" in kind and value is not None else value)
    if layers is not None:
        cfg.model.n_layers = layers
    cfg.train.device = TrainDevice(device)
    cfg.train.seq_len, cfg.train.global_batch_size = seq, batch
    cfg.compile.backend = CompileBackend.inductor if device == "cuda" else CompileBackend.aot_eager_decomp_partition
    mode, _, option = setting.partition(":")
    if mode in ("none", "full", "selective"):
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


def measure(cfg, device: torch.device, steps: int) -> Measured:
    """Train `steps` steps as the trainer does (forward and backward, clipping, AdamW, zero_grad)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1),
                           device=device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the trainer's batches
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    peaks, times = [], []
    with compiler_scope(cfg.ac, n_layers=cfg.model.n_layers):
        model = build_model(cfg, device)
        optimizer, _ = build_optimizer(model, cfg)
        counter = ActivationCounter(model)
        numerics = Numerics.for_target(cfg, device.type, torch.cuda.get_device_capability(device) if cuda else (0, 0))
        for step in range(steps):
            tracker = None if cuda or step >= 2 else _mem_tracker(model, optimizer)
            start = time.perf_counter()
            with tracker or contextlib.nullcontext():
                activations = forward_backward(model, inputs, labels, counter,
                                               numerics.context(device.type))[1]
                gradients = sum(p.grad.nbytes for p in model.parameters())
                clip_grad_norm(model, cfg.train.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            if step == 1 and cuda:
                peaks = [torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()]
            elif tracker is not None:
                peaks.append(tracker.get_tracker_snapshot("peak")[device]["Total"] - inputs.nbytes - labels.nbytes)
    timed = times[2:] or times[1:]
    return Measured(
        activations=activations,
        parameters=sum(p.nbytes for p in model.parameters()),
        gradients=gradients,
        optimizer_states=sum(t.nbytes for s in optimizer.state.values() for t in s.values()),
        max_allocated=peaks[0] if cuda else max(peaks, default=0),
        max_reserved=peaks[1] if cuda else None,
        tokens_per_s=cfg.train.global_batch_size * cfg.train.seq_len / statistics.median(timed),
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


def check(settings=SETTINGS, device: str = "cuda", model: str = "llama3_8b", layers: Optional[int] = 4,
          seq: int = 8192, batch: int = 1, steps: int = 5) -> list[Row]:
    rows = []
    for setting in settings:
        cfg = build_config(setting, device, model, layers, seq, batch)
        plan = plan_setting(cfg)
        if plan.verdict == "does not fit":
            rows.append(Row(setting, plan, None, f"planned not to fit: {plan.verdict_reason}"))
            continue
        try:
            rows.append(Row(setting, plan, measure(cfg, torch.device(device), steps)))
        except Exception as e:  # one failing setting (a kernel this torch lacks) must not hide the others
            rows.append(Row(setting, plan, None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"))
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def _cell(planned: Optional[float], measured: Optional[float], show) -> str:
    if measured is None or planned is None:
        return "-" if measured is None else f"- / {show(measured)}"
    return f"{show(planned)} / {show(measured)} ({(planned - measured) / measured:+.1%})"


def table(rows: list[Row]) -> str:
    lines = ["| setting | max_memory_allocated, planned / measured | max_memory_reserved | tokens/s |",
             "|---|---|---|---|"]
    for r in rows:
        if r.measured is None:
            lines.append(f"| {r.setting} | {r.skipped} | | |")
            continue
        p, m = r.plan, r.measured
        lines.append(f"| {p.label} | {_cell(p.max_allocated, m.max_allocated, size)} | "
                     f"{_cell(p.reserved.nbytes if p.reserved else None, m.max_reserved, size)} | "
                     f"{_cell(p.tokens_per_s, m.tokens_per_s, lambda v: f'{v:,.0f}')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--model", default=None, help="a conf/model preset (llama3_8b on a GPU, llama3_debug on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="blocks (4 for llama3_8b; the preset's otherwise)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (8192 on a GPU, 64 on CPU)")
    parser.add_argument("--batch", type=int, default=None, help="sequences a step (1 on a GPU, 2 on CPU)")
    parser.add_argument("--steps", type=int, default=5)
    a = parser.parse_args()
    gpu = a.device == "cuda"
    model = a.model or ("llama3_8b" if gpu else "llama3_debug")
    layers = a.layers if a.layers is not None else (4 if model == "llama3_8b" else None)
    start = time.perf_counter()
    rows = check(a.settings.split(","), a.device, model, layers, a.seq or (8192 if gpu else 64),
                 a.batch or (1 if gpu else 2), a.steps)
    device = rows[0].plan.device
    print(f"{model}{f' with {layers} blocks' if layers else ''} on {device.name} ({device.reason}), torch "
          f"{torch.__version__}, {time.perf_counter() - start:.0f} s")
    print(table(rows))


if __name__ == "__main__":
    main()
