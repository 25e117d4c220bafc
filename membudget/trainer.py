"""The training loop: build everything from the config, train, measure, write metrics and the summary."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from membudget.ac import compiler_scope
from membudget.checkpoint import Checkpointer, read_train_state
from membudget.config import UserError, compile_enabled, validate
from membudget.data import TokenBatches, build_tokenizer, vocab_size_check
from membudget.metrics import (
    ActivationCounter,
    MetricsWriter,
    device_peak_flops,
    finite_or_none,
    flops_per_token,
    init_wandb,
    local_tensor,
    peak_memory,
)
from membudget.model import ModelArgs, Transformer, num_params
from membudget.parallel import (
    Launch,
    all_reduce,
    build_mesh,
    clip_grad_norm,
    dp_coordinates,
    init_distributed,
    launch_from_env,
    parallelize,
    pick_device,
)

log = logging.getLogger("membudget")


class Preempted(Exception):
    """SLURM asked the job to stop (time limit near, or preemption); a checkpoint of `step` was saved."""


class StopSignal:
    """SLURM's warning signal (USR2, which the launcher presets ask for before the time limit and which
    submitit also uses for preemption), noted at once and acted on at the next step boundary, where all
    ranks agree to save a checkpoint; then submitit's own handler requeues the job."""

    def __init__(self, signum: int = signal.SIGUSR2):
        self.signum = signum
        self.received = False
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signum, self._note)

    def _note(self, signum, frame) -> None:
        log.warning("received %s: saving a checkpoint at the end of this step", signal.Signals(signum).name)
        self.received = True

    def restore(self) -> None:
        if self.previous is not None:
            signal.signal(self.signum, self.previous)

    def hand_over(self) -> None:
        """Let the handler that was there before ours (submitit's: requeue, then exit) do its part."""
        self.restore()
        if callable(self.previous):
            self.previous(self.signum, None)


class LossNotFinite(UserError):
    """The loss became NaN or inf: the run stops instead of training on garbage."""


def build_model(cfg, device: torch.device, mesh=None) -> Transformer:
    """Llama 3 built on the meta device, parallelised per block (TP, AC, compile, FSDP), then materialised
    and initialised: nothing is allocated at full size before it is sharded."""
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_config(cfg.model))
    parallelize(model, cfg, mesh, device)
    model.to_empty(device=device)
    model.init_weights()
    return model


def lr_lambda(cfg):
    """Linear warmup to the peak LR, then cosine or linear decay to min_lr_ratio of it."""
    warmup, total = cfg.lr_schedule.warmup_steps, cfg.train.steps
    floor = cfg.lr_schedule.min_lr_ratio

    def factor(step: int) -> float:  # step counts from 0
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.lr_schedule.decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule.decay == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def build_optimizer(model: torch.nn.Module, cfg):
    o = cfg.optimizer
    # No weight decay on norms (1-D weights): the usual choice for Llama-style models.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def forward_backward(model, inputs, labels, counter: ActivationCounter, autocast=nullcontext(), scale: float = 1.0):
    """One micro-batch: forward under the activation counter, loss, backward of `scale * loss`.

    Returns the detached loss and the activation bytes the forward kept for backward.
    """
    with counter.count(), autocast:
        logits = model(inputs)
        # Under TP the logits are a DTensor sharded on the vocabulary: loss_parallel computes the cross-entropy
        # and, below, its backward on the shards
        on_shards = loss_parallel if isinstance(logits, DTensor) else nullcontext
        with on_shards():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    nbytes = counter.nbytes
    counter.release()
    with on_shards():
        (loss * scale).backward()
    return local_tensor(loss).detach(), nbytes


class Progress:
    """A tqdm bar on a terminal; plain log lines otherwise (SLURM logs, pipes)."""

    def __init__(self, mode: str, total: int):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True)

    def update(self, row: dict[str, Any]) -> None:
        mem = row["peak_memory_bytes"] / 2**30
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}", mem=f"{mem:.2f}GiB")
        elif self.mode == "lines":
            log.info("step %d | loss %.4f | lr %.2e | %.0f tok/s | %.3f s/step | peak mem %.2f GiB | act %.1f MiB",
                     row["step"], row["loss"], row["lr"], row["tokens_per_s"], row["step_time_s"], mem,
                     row["activation_bytes"] / 2**20)

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train(cfg, run_dir: Path, wandb_group: Optional[str] = None) -> dict[str, Any]:
    """Train per `cfg`, writing metrics.jsonl and summary.json into `run_dir`; returns the summary."""
    world_size = launch_from_env().world_size
    validate(cfg, world_size)
    if cfg.ac.mode == "memory_budget" and cfg.ac.memory_budget == "auto":
        # planned on fake tensors before the real process group exists; every rank gets the same answer
        from membudget.plan import choose_budget

        budget, plan = choose_budget(cfg, world_size)
        cfg.ac.memory_budget = budget
        log.info("ac.memory_budget=auto -> %s: planned peak %.2f of %.2f GiB per rank, recompute %.0f%% of forward",
                 budget, plan.peak / 2**30, plan.target / 2**30, 100 * plan.recompute_ratio)
    run_dir = Path(run_dir)
    checkpointer = Checkpointer(run_dir, cfg.checkpoint)
    checkpointer.check_writable()
    resume = checkpointer.resume_path()
    device = pick_device(cfg.train.device)
    tokenizer = build_tokenizer(cfg.tokenizer)
    vocab_size_check(tokenizer, cfg.model.vocab_size)
    launch = init_distributed(device, cfg.parallelism.timeout_s)
    mesh = build_mesh(cfg.parallelism, launch, device)
    dp_rank, dp_size = dp_coordinates(mesh)
    batches = TokenBatches(cfg.data, tokenizer, cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.seed,
                           dp_rank=dp_rank, dp_size=dp_size)

    # read (and rewind) the first batch now: data with no text at all fails before any artefact is written
    start = batches.state_dict()
    next(batches)
    batches.load_state_dict(start)

    # only rank 0 writes run artefacts; every rank logs to its own stream
    wandb_id = read_train_state(resume)[1].get("wandb_id") if resume else None
    wandb_run = init_wandb(cfg, run_dir, wandb_group, resume_id=wandb_id) if launch.is_main else None
    summary: dict[str, Any] = {"status": "failed"}
    stop = StopSignal()
    try:
        with compiler_scope(cfg.ac, run_dir):
            summary = _train_loop(cfg, run_dir, device, launch, mesh, batches, wandb_run, checkpointer, resume,
                                  stop)
    except Preempted as e:
        summary = {"status": "preempted", "error": str(e)}
    except BaseException as e:
        summary["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        if launch.is_main:
            summary.update(_summary_header(cfg, launch, wandb_run))
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if wandb_run is not None:
            wandb_run.summary.update({k: v for k, v in summary.items() if k not in ("config", "wandb")})
            wandb_run.finish(exit_code=0 if summary["status"] in ("completed", "preempted") else 1)
        stop.restore()
    if summary["status"] == "preempted":
        stop.hand_over()  # submitit requeues the job (rank 0) and exits; the requeued job resumes
        raise SystemExit(0)
    return summary


def _kept_metrics(run_dir: Path, n: int, is_main: bool) -> list[dict[str, Any]]:
    """The first n metrics rows, those up to the checkpoint; rank 0 drops the rest, as those steps run again."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)[:n] if path.exists() else []
    if is_main:
        path.with_suffix(".tmp").write_text("".join(lines))
        os.replace(path.with_suffix(".tmp"), path)
    return [json.loads(line) for line in lines]


def _summary_header(cfg, launch: Launch, wandb_run) -> dict[str, Any]:
    return {
        "world_size": launch.world_size,
        "ac_mode": cfg.ac.mode,
        "memory_budget": float(cfg.ac.memory_budget) if cfg.ac.mode == "memory_budget" else None,
        "selective_option": str(cfg.ac.selective_option) if cfg.ac.mode == "selective" else None,
        "compile": compile_enabled(cfg),
        "wandb": None if wandb_run is None else {
            "project": wandb_run.project, "entity": wandb_run.entity, "group": wandb_run.group, "id": wandb_run.id,
            "dir": wandb_run.dir,
        },
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _train_loop(cfg, run_dir: Path, device: torch.device, launch: Launch, mesh, batches: TokenBatches,
                wandb_run, checkpointer: Checkpointer, resume: Optional[Path], stop: StopSignal) -> dict[str, Any]:
    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_model(cfg, device, mesh)
    n_params = num_params(model)
    local_param_bytes = sum(local_tensor(p).nbytes for p in model.parameters())
    log.info("model %s: %s parameters (%.1f MiB on this rank), ac=%s, compile=%s, parallelism=%s on %s, rank %d/%d pid %d",
             cfg.model.name, f"{n_params:,}", local_param_bytes / 2**20, cfg.ac.mode,
             cfg.compile.backend if compile_enabled(cfg) else "off", cfg.parallelism.name, device, launch.rank,
             launch.world_size, os.getpid())
    optimizer, scheduler = build_optimizer(model, cfg)
    counter = ActivationCounter(model)
    writer = MetricsWriter(run_dir, wandb_run) if launch.is_main else None

    use_bf16 = t.dtype == "bfloat16" or (t.dtype == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()
    local_batch = t.global_batch_size // dp_coordinates(mesh)[1]
    micro = t.micro_batch_size or local_batch
    n_micro = local_batch // micro
    tokens_per_step = t.global_batch_size * t.seq_len
    args = model.args
    flops_tok = flops_per_token(n_params, args.n_layers, args.n_heads, args.head_dim, t.seq_len)
    peak_flops = device_peak_flops(device, t.peak_flops)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    done, kept_rows = 0, 0  # steps already trained and metrics rows kept, by the run this one resumes
    if resume is not None:
        done, extra = checkpointer.load(resume, model, optimizer, scheduler)
        batches.load_state_dict(extra["data"])
        kept_rows = extra["metrics_rows"]
    # rows past the checkpoint (or all, when starting afresh in this dir) are trained again: drop them
    rows = _kept_metrics(run_dir, kept_rows, launch.is_main)
    progress = Progress(t.progress if launch.is_main else "lines", t.steps)
    progress.advance(done)
    try:
        for step in range(done + 1, t.steps + 1):
            start = time.perf_counter()
            inputs, labels = next(batches)
            inputs, labels = inputs.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            loss_sum = torch.zeros((), device=device)
            activation_bytes = 0
            for x, y in zip(inputs.split(micro), labels.split(micro)):
                # activations live from one micro-batch's forward to its backward: keep the max
                loss, nbytes = forward_backward(model, x, y, counter, autocast, scale=1 / n_micro)
                activation_bytes = max(activation_bytes, nbytes)
                loss_sum += loss
            grad_norm = clip_grad_norm(model, t.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            # the mean over data-parallel ranks (TP peers hold equal losses); syncs, so the timing is complete
            (loss_value,) = all_reduce([(loss_sum / n_micro).item()], dist.ReduceOp.SUM, device)
            loss_value /= launch.world_size
            step_time = time.perf_counter() - start
            if not math.isfinite(loss_value):
                raise LossNotFinite(
                    f"loss={loss_value} at train step {step}: training diverged; lower optimizer.lr "
                    f"(now {cfg.optimizer.lr}) or train.max_grad_norm, or check the data"
                )
            progress.advance(1)
            if step % t.log_every == 0 or step == t.steps:
                # memory is per rank: report the largest rank's, and its slowest step
                memory = peak_memory(device)
                maxima = all_reduce([step_time, activation_bytes, *memory.values()], dist.ReduceOp.MAX, device)
                step_time, activation_bytes = maxima[0], int(maxima[1])
                memory = dict(zip(memory, map(int, maxima[2:])))
                tokens_per_s = tokens_per_step / step_time
                row = {
                    "step": step,
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_per_s,
                    "tokens_per_s_per_device": tokens_per_s / launch.world_size,
                    "step_time_s": step_time,
                    "activation_bytes": activation_bytes,
                    **memory,
                    "mfu": tokens_per_s / launch.world_size * flops_tok / peak_flops if peak_flops else None,
                }
                rows.append(row)
                if writer is not None:
                    writer.write(row)
                progress.update(row)
            # every rank must take part in a save: a signal seen by any rank stops all
            stop_now = all_reduce([float(stop.received)], dist.ReduceOp.MAX, device)[0] > 0
            if cfg.checkpoint.enabled and (stop_now or checkpointer.due(step, t.steps)):
                extra = {"data": batches.state_dict(), "metrics_rows": len(rows),
                         "wandb_id": wandb_run.id if wandb_run is not None else None}
                checkpointer.save(step, model, optimizer, scheduler, extra)
            if stop_now:
                raise Preempted(f"stopped by a SLURM signal after step {step}"
                                + (", checkpoint saved" if cfg.checkpoint.enabled else ", checkpointing is off"))
    finally:
        progress.close()

    # the first logged steps include compilation: leave them out of the medians when there are enough
    steady = rows[len(rows) // 4:] if len(rows) >= 4 else rows
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    summary = {
        "status": "completed",
        "num_params": n_params,
        "param_bytes_per_rank": local_param_bytes,
        "steps": t.steps,
        "final_loss": rows[-1]["loss"],
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steady),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in rows),
        "activation_bytes": rows[-1]["activation_bytes"],
        "mfu": finite_or_none(statistics.median(mfus)) if mfus else None,
    }
    log.info("done: final loss %.4f, median %.0f tok/s, activations %.1f MiB, peak memory %.2f GiB",
             summary["final_loss"], summary["median_tokens_per_s"], summary["activation_bytes"] / 2**20,
             summary["peak_memory_bytes"] / 2**30)
    return summary
