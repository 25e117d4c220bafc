"""The training loop, read top to bottom:

    train(cfg, run_dir)
      setup          launch, device, process group, run dir (locked), data, model, optimizer, resume
      for each step:
        train_step   micro-batches forward/backward, clip; a non-finite loss or grad norm never reaches the
                     optimizer; one host sync per step
        log_step     on logged steps: reduce over ranks, one metrics row (jsonl, W&B, console)
        checkpoint   every N steps, at the end, and when a signal asks the run to stop
      finish         summary.json, W&B run finished
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from membudget import compile_cache, peers
from membudget.ac import compiler_scope
from membudget.auto import choose_for_run, write_plan
from membudget.checkpoint import Checkpointer, config_changes, save_seconds
from membudget.collector import scheduled_gc
from membudget.data import (
    Prefetcher,
    TokenBatches,
    data_changes,
    data_fingerprint,
    switch_to_token_file,
    tokenize_threads,
    unpinned_hub_data,
)
from membudget.diagnostics import Diagnostics
from membudget.dirlock import DirLock
from membudget.console import quiet_log_file_errors
from membudget.errors import Stopped, UserError
from membudget.fit import CHECKPOINT_BYTES_PER_PARAMETER, WEIGHT_BYTES, check_fits, check_host_fits
from membudget.launch import (Launch, check_same_run, init_distributed, launch_from_env, pick_device,
                              warn_if_unused_allocation)
from membudget.metrics import (
    ActivationCounter,
    MetricsWriter,
    Progress,
    device_peak_flops,
    flops_per_token,
    init_wandb,
    local_tensor,
    peak_memory,
    quiet_console,
    reset_peak_memory,
    write_json,
)
from membudget.model import num_params
from membudget.offload import find_offloader
from membudget.parallel import all_reduce, broadcast_object, build_mesh, clip_grad_norm, dp_coordinates, gradient_sync
from membudget.rules import compile_enabled, data_wait_line, validate
from membudget.rundir import start_fresh
from membudget.schema import (ACMode, NonFinite, ac_label, block_policies, budget_of, compact_policies, is_auto,
                              resolved)
from membudget.step import Numerics, StepShape, build_model, build_optimizer, forward_backward
from membudget.stop import StopSignals, stopped_by
from membudget.tokenizer import build_tokenizer, vocab_size_check
from membudget.units import GiB, MiB

log = logging.getLogger("membudget")


class LossNotFinite(UserError):
    """The loss or the gradient norm became NaN or inf: the run stops before the optimizer steps on it."""


@dataclass
class Run:
    """Everything one training run is made of, built by `setup`."""

    cfg: Any
    run_dir: Path
    launch: Launch
    device: torch.device
    mesh: Any
    shape: StepShape
    numerics: Numerics
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    batches: Prefetcher
    counter: ActivationCounter
    checkpointer: Checkpointer
    writer: Optional[MetricsWriter]
    wandb_run: Any
    data_fingerprint: dict  # what the run reads (data.data_fingerprint): each checkpoint keeps it
    start_step: int = 0
    rows: list = field(default_factory=list)
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    compile_s: Optional[float] = None
    flops_per_token: float = 0.0  # training FLOPs per token, for MFU
    peak_flops: Optional[float] = None  # this device's, in the run's dtype; None: MFU is not reported
    plan: Any = None  # the plan ac.memory_budget=auto or ac.blocks=auto chose (auto.choose_for_run); None otherwise

    @property
    def label(self) -> str:
        """The whole AC setting, as the start line, the bar and the final line show it."""
        backend = f"compile {self.cfg.compile.backend}" if compile_enabled(self.cfg) else "eager"
        extra = ""
        if self.cfg.ac.mode == ACMode.memory_budget:
            extra = f" (solver {self.cfg.ac.solver}, estimator {self.cfg.ac.runtime_estimator})"
        return f"ac={ac_label(self.cfg.ac)}{extra}, {backend}"


@dataclass
class StepResult:
    loss: torch.Tensor  # this rank's mean over micro-batches (on the device)
    grad_norm: torch.Tensor
    activation_bytes: int
    per_block: list[int]
    data_wait_s: float = 0.0  # how long the step waited for its batch (the data path could not keep up)
    skipped: bool = False


# --- setup ---------------------------------------------------------------------------------------------------

def _on_rank0(fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 alone; a UserError it raises is raised on every rank (one decision for the job)."""
    message = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            fn()
        except UserError as e:
            message = str(e)
    message = broadcast_object(message, torch.device("cpu")) if dist.is_initialized() else message
    if message is not None:
        raise UserError(message)


def _agree_on_run_dir(run_dir: Path, launch: Launch) -> Path:
    """Rank 0's run dir for every rank: its name comes from what the job shares, but a rank whose own
    resolved dir differs (a node's clock, another launcher) follows rank 0 and logs there."""
    chosen = Path(broadcast_object(str(run_dir), torch.device("cpu")))
    if chosen != Path(run_dir):
        log.warning("rank %d resolved run dir %s, rank 0 %s: writing to rank 0's", launch.rank, run_dir, chosen)
        chosen.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(chosen / f"train_rank{launch.rank}.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        logging.getLogger().addHandler(handler)
    return chosen


def _kept_metrics(run_dir: Path, n: int, is_main: bool) -> list[dict[str, Any]]:
    """The first n metrics rows, those up to the checkpoint; rank 0 drops the rest, as those steps run again."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)[:n] if path.exists() else []
    if is_main:
        tmp = path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, path)
    return [json.loads(line) for line in lines]


def _resume(cfg, checkpointer: Checkpointer, model, optimizer, scheduler, data: dict) -> Optional[dict]:
    """Restore the checkpoint to continue from, if any, after checking that this run's config and data (its
    fingerprint, `data`) may continue it: what changes the model or the data stream is refused; the optimizer's
    and the schedule's settings are applied (and logged); the rest (AC, compile, layout, logging) is allowed. A run
    over a source may continue on its token file (data=tokens), from the same token, and one over such a file on
    another of the same source (a larger --most-tokens)."""
    if cfg.checkpoint.resume == "never":
        return None
    now = resolved(cfg)
    on_token_file = {}  # step -> the checkpoint's data position in this run's token file, where it read another

    def accept(state: dict) -> None:
        switch = switch_to_token_file((state.get("config") or {}).get("data"), state["extra"].get("data_fingerprint"),
                                      cfg.data, data)
        refused, applied, allowed = config_changes(state.get("config"), now, same_stream=switch is not None)
        if refused:
            raise UserError(f"checkpoint.resume={cfg.checkpoint.resume!r}: the checkpoint at step {state['step']} was "
                            f"trained with other settings that change the model or the data ({'; '.join(refused)}); "
                            "set them back, or start fresh with checkpoint.resume=never "
                            "checkpoint.archive_old_run=true")
        # a checkpoint from before fingerprints has none: nothing to compare
        reads = data if switch is None else switch.compared
        changed = data_changes(state["extra"].get("data_fingerprint", reads), reads)
        what = ("the data changed since" if switch is None
                else f"the token file {cfg.data.path} stands for other data than")
        if changed and not cfg.checkpoint.allow_data_change:
            raise UserError(f"checkpoint.resume={cfg.checkpoint.resume!r}: {what} the checkpoint at step "
                            f"{state['step']} ({'; '.join(changed)}), so its position points into other text; "
                            "restore the data, or set checkpoint.allow_data_change=true to continue anyway")
        if changed:
            log.warning("resuming over changed data (checkpoint.allow_data_change=true): %s", "; ".join(changed))
        if switch is not None:
            on_token_file[state["step"]] = switch.position(state["extra"]["data"])
        if state["step"] > cfg.train.steps:  # refused before any change is announced as taking effect
            raise UserError(f"train.steps={cfg.train.steps}: the checkpoint to resume is at step {state['step']}; "
                            f"set train.steps={state['step']} or more to continue it")
        for change in applied:
            log.warning("resuming with a changed setting, which takes effect now: %s", change)
        for change in allowed:
            log.info("resuming with a changed setting that leaves the math alone: %s", change)

    path = None if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
    restored = checkpointer.restore(model, optimizer, scheduler, path=path, accept=accept)
    if restored is None:
        return None
    _apply_optimizer_settings(cfg, optimizer, scheduler)
    state = restored[1]
    if state["step"] in on_token_file:
        was, state["extra"]["data"] = state["extra"]["data"], on_token_file[state["step"]]
        log.info("continuing on the token file %s from the checkpoint's place in what it read (epoch %d, %s tokens "
                 "into document %s): token %s of epoch %d", cfg.data.path, was["epoch"], f"{was['offset']:,}",
                 f"{was['doc']:,}", f"{state['extra']['data']['offset']:,}", state["extra"]["data"]["epoch"])
    return state


def _apply_optimizer_settings(cfg, optimizer, scheduler) -> None:
    """The configured optimizer and LR peak, over what the checkpoint's param groups hold (the schedule's shape
    is code, taken from this config already)."""
    o = cfg.optimizer
    for group, decay in zip(optimizer.param_groups, (o.weight_decay, 0.0)):
        group.update(betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=decay, initial_lr=o.lr)
    scheduler.base_lrs = [o.lr for _ in optimizer.param_groups]
    for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["lr"] = o.lr * lr_lambda(scheduler.last_epoch)


def setup(cfg, run_dir: Path, wandb_group: Optional[str], stack: contextlib.ExitStack, stop: StopSignals) -> Run:
    """Build the run; every check that can fail is done before anything is written into the run dir."""
    launch = launch_from_env()
    warn_if_unused_allocation()
    validate(cfg, launch.world_size)
    if launch.world_size == 1 and cfg.parallelism.name != "single":
        log.warning("parallelism=%s on one process: nothing is sharded or replicated; launch it with "
                    "`torchrun --nproc-per-node N train.py ...` or `srun`", cfg.parallelism.name)
    device = pick_device(str(cfg.train.device), launch)
    init_distributed(launch, device, cfg.parallelism.timeout_s)  # once per process: a multirun's jobs share it
    quiet_console(launch.is_main)
    if is_auto(cfg.ac):
        chosen, inputs = choose_for_run(cfg, launch, device.type, stop, Path(run_dir))
        validate(cfg, launch.world_size)  # the choice too: e.g. full blocks compiled under TP
    else:
        chosen = inputs = None
    peers.at("the check that every rank has the same config and data", None)
    data = data_fingerprint(cfg.data, cfg.tokenizer)
    if unpinned := unpinned_hub_data(cfg.data):
        log.warning(unpinned)
    check_same_run(resolved(cfg), data, launch)  # before any model
    peers.at("setup (the run dir, the model, resuming)", None)
    run_dir = _agree_on_run_dir(Path(run_dir), launch)
    quiet_log_file_errors()  # this rank's log file, if it follows rank 0's dir
    shape = StepShape.from_config(cfg, launch.world_size)
    numerics = Numerics.for_target(cfg, device.type, torch.cuda.get_device_capability(device)
                                   if device.type == "cuda" else (0, 0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    check_fits(cfg, shape, device, launch.world_size, local_ranks)
    check_host_fits(cfg, shape, device, launch.world_size, local_ranks)

    tokenizer = build_tokenizer(cfg.tokenizer)
    vocab_size_check(tokenizer, cfg.model.vocab_size)
    mesh = build_mesh(cfg.parallelism, launch, device)
    dp_rank, dp_size = dp_coordinates(mesh)
    threads = tokenize_threads(cfg.data, cfg.tokenizer, local_ranks)
    batches = TokenBatches(cfg.data, tokenizer, cfg.train.global_batch_size, cfg.train.seq_len, cfg.train.seed,
                           dp_rank=dp_rank, dp_size=dp_size, threads=threads)
    stack.callback(batches.close)
    batches.peek()  # the first batch read now: data with no text at all fails before any artefact is written

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, device, mesh, numerics)
    optimizer, scheduler = build_optimizer(model, cfg)

    lock = DirLock(run_dir)  # the first write into the run dir
    _on_rank0(lock.acquire)
    stack.callback(lock.release)
    # fp32 weights and AdamW's two moments: what each rank writes per save
    weights = sum(local_tensor(p).nbytes for p in {id(p): p for p in model.parameters()}.values())
    state_bytes = weights * CHECKPOINT_BYTES_PER_PARAMETER // WEIGHT_BYTES  # the weights and AdamW's moments
    checkpointer = Checkpointer(run_dir, cfg.checkpoint, timeout_s=cfg.checkpoint.timeout_s
                                or save_seconds(state_bytes, cfg.checkpoint.write_gbps))
    checkpointer.check_writable()
    state = _resume(cfg, checkpointer, model, optimizer, scheduler, data)
    if state is None:
        _on_rank0(lambda: start_fresh(run_dir, cfg.checkpoint.resume, cfg.checkpoint.archive_old_run))
    else:
        batches.load_state_dict(state["extra"]["data"])
    if rereads := batches.rereads(cfg.train.steps - (state["step"] if state else 0)):
        log.warning(rereads)
    wandb_run = None
    if launch.is_main:
        write_plan(run_dir, chosen, inputs)
        wandb_run = init_wandb(cfg, run_dir, wandb_group, resume_id=state["extra"].get("wandb_id") if state else None)
    prefetcher = Prefetcher(batches, cfg.data.prefetch, pin=device.type == "cuda")
    stack.callback(prefetcher.close)
    rows = _kept_metrics(run_dir, state["extra"]["metrics_rows"] if state else 0, launch.is_main)
    if compile_enabled(cfg):
        compile_cache.load(run_dir)  # an earlier start's compiled code (a requeue on another node)
    return Run(cfg, run_dir, launch, device, mesh, shape, numerics, model, optimizer, scheduler, prefetcher,
               ActivationCounter(model), checkpointer, MetricsWriter(run_dir, wandb_run) if launch.is_main else None,
               wandb_run, data, start_step=state["step"] if state else 0, rows=rows,
               flops_per_token=flops_per_token(model, shape.seq_len),
               peak_flops=device_peak_flops(device, numerics.bf16, cfg.train.peak_flops), plan=chosen)


# How long the other ranks wait for rank 0's auto plan, past the process group's timeout: the 8B grid took 2
# minutes on this project's 2-core test machine (README, "Planning memory and speed"); any grid is well within it
# --- one step ------------------------------------------------------------------------------------------------

def train_step(run: Run) -> StepResult:
    """One optimizer step's forward and backward over its micro-batches, and the gradient clip."""
    waited = time.perf_counter()
    inputs, labels = next(run.batches)
    waited = time.perf_counter() - waited
    inputs = inputs.to(run.device, non_blocking=True)
    labels = labels.to(run.device, non_blocking=True)
    micro, n_micro = run.shape.micro_batch, run.shape.n_micro
    loss_sum = torch.zeros((), device=run.device)
    activation_bytes, per_block = 0, []
    for i, (x, y) in enumerate(zip(inputs.split(micro), labels.split(micro))):
        with gradient_sync(run.model, run.mesh, last=i == n_micro - 1):
            loss, nbytes = forward_backward(run.model, x, y, run.counter, run.numerics, run.device.type,
                                            scale=1 / n_micro)
        if nbytes >= activation_bytes:  # activations live from one micro-batch's forward to its backward
            activation_bytes, per_block = nbytes, _blocks(run.counter.last_per_block, run.model)
        loss_sum += loss
    grad_norm = clip_grad_norm(run.model, run.cfg.train.max_grad_norm)
    return StepResult(loss_sum / n_micro, grad_norm, activation_bytes, per_block, data_wait_s=waited)


def _blocks(per_block: dict, model) -> list[int]:
    return [per_block.get(i, 0) for i in range(len(model.layers))]


def _agree_to_stop(run: Run, stop: StopSignals, received: list[int], when: str) -> bool:
    """Whether any rank received a stop signal (`received`: each rank's signal, 0 for none, reduced over the
    ranks); the first agreement is kept in `stop` and, over several ranks, said once: which signal reached which
    ranks, and that every rank stops `when`."""
    if any(received) and stop.agreed is None:
        stop.received_by = next(r for r, v in enumerate(received) if v)
        stop.agreed = received[stop.received_by]
        ranks = [r for r, v in enumerate(received) if v]
        stop.reached = ("every rank" if len(ranks) == len(received)
                        else ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks)))
        if run.launch.world_size > 1:
            log.warning("received %s on %s%s: every rank stops %s", signal.Signals(stop.agreed).name, stop.reached,
                        f" ({stop.why})" if stop.why else "", when)
    return any(received)


def _stopped(run: Run, stop: StopSignals, what: str) -> Stopped:
    """The Stopped that ends the run once the ranks agreed to stop: `what` happened (after step N, ...)."""
    where = f" to {stop.reached}" if run.launch.world_size > 1 and stop.reached else ""
    why = f" ({stop.why})" if stop.why else ""
    return stopped_by(stop.agreed or stop.received, f"{where}{why} {what}")


def _signals(run: Run, stop: StopSignals) -> torch.Tensor:
    """This rank's received signal (0: none) at its index, 0 elsewhere: a MAX all-reduce gives each rank's."""
    signals = torch.zeros(run.launch.world_size, device=run.device)
    signals[run.launch.rank] = float(stop.received or 0)
    return signals


def stop_before_training(run: Run, stop: StopSignals) -> None:
    """A stop signal received while the run was set up (building, resuming; on a rank that waited for rank 0's
    plan, planning too) ends it before its first step, on every rank: nothing was trained since the start or its
    checkpoint, so there is nothing to save, and no step (a first compiled one can take minutes) is run only to
    be stopped."""
    signals = _signals(run, stop)
    if dist.is_initialized():
        peers.at("the all-reduce before the first step", None)
        dist.all_reduce(signals, op=dist.ReduceOp.MAX)
    first = run.start_step + 1
    if _agree_to_stop(run, stop, [int(v) for v in signals.tolist()], f"before step {first}, with nothing to save"):
        since = f"since the checkpoint of step {run.start_step}" if run.start_step else "yet"
        raise _stopped(run, stop, f"before step {first}, during set-up: nothing trained {since}, nothing to save")


def apply_step(run: Run, result: StepResult, stop: StopSignals, step: int) -> tuple[bool, Optional[str]]:
    """The optimizer step, unless the loss or the gradient norm is not finite: then the step is skipped (its
    gradients dropped, the schedule not advanced) and, unless train.on_nonfinite=skip allows another one, the
    run is to stop. The step's one host sync reads that verdict, together with whether any rank was asked to
    stop. Returns (stop after this step, why the run diverged or None)."""
    bad = ~(torch.isfinite(result.loss) & torch.isfinite(result.grad_norm))
    # [not finite, the signal each rank received (0: none)]: every rank learns which signal reached which rank
    flags = torch.cat([bad.float().reshape(1), _signals(run, stop)])
    if dist.is_initialized():
        peers.at(f"the all-reduce that ends step {step}", step)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    values = flags.tolist()
    nonfinite = values[0] > 0
    stop_now = _agree_to_stop(run, stop, [int(v) for v in values[1:]], f"after step {step}" + (
        ", with a checkpoint" if run.cfg.checkpoint.enabled else ""))
    if not nonfinite:
        run.skipped_in_a_row = 0
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.scheduler.step()
        return stop_now, None
    run.optimizer.zero_grad(set_to_none=True)
    run.skipped_in_a_row += 1
    run.skipped_total += 1
    result.skipped = True
    t = run.cfg.train
    if t.on_nonfinite == NonFinite.skip and run.skipped_in_a_row <= t.max_skipped_steps:
        log.warning("step %d: loss or gradient norm is not finite: skipped (%d in a row, at most %d)", step,
                    run.skipped_in_a_row, t.max_skipped_steps)
        return stop_now, None
    why = (f"loss={local_tensor(result.loss).item()}, grad_norm={result.grad_norm.item()} at train step {step}: "
           f"training diverged; the optimizer did not step on it and no checkpoint holds it; lower optimizer.lr "
           f"(now {run.cfg.optimizer.lr}) or train.max_grad_norm, or check the data")
    if t.on_nonfinite == NonFinite.skip:
        why += f" ({run.skipped_in_a_row} steps in a row were not finite: train.max_skipped_steps)"
    return True, why


def log_step(run: Run, step: int, result: StepResult, lr: float, seconds_per_step: float,
             data_wait_s: float) -> dict[str, Any]:
    """One metrics row, reduced over ranks: the mean loss, the slowest rank's step time and wait for data, and the
    largest rank's memory (per rank figures). The interval's peak memory is reset for the next row."""
    (loss,) = all_reduce([local_tensor(result.loss).item()], dist.ReduceOp.SUM, run.device)
    loss /= run.launch.world_size  # TP peers hold equal losses: the mean over data-parallel ranks
    memory = peak_memory(run.device)
    offloader = find_offloader(run.model)
    host = offloader.peak_host_bytes if offloader is not None else 0
    maxima = all_reduce([seconds_per_step, data_wait_s, result.activation_bytes, host, *memory.values(),
                         *result.per_block], dist.ReduceOp.MAX, run.device)
    seconds, data_wait_s, activation_bytes, host = maxima[0], maxima[1], int(maxima[2]), int(maxima[3])
    memory = dict(zip(memory, map(int, maxima[4:4 + len(memory)])))
    reset_peak_memory(run.device)
    if offloader is not None:  # the interval's peak starts again
        offloader.peak_host_bytes = offloader.held_host_bytes
    tokens_per_s = run.shape.tokens_per_step / seconds
    per_device = tokens_per_s / run.launch.world_size
    flops, peak_flops = run.flops_per_token, run.peak_flops
    row = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": result.grad_norm.item(),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "step_time_s": seconds,
        "data_wait_s": data_wait_s,
        "activation_bytes": activation_bytes,
        "activation_bytes_per_block": [int(b) for b in maxima[4 + len(memory):]],
        **memory,
        "offload_host_bytes": host if offloader is not None else None,
        "mfu": per_device * flops / peak_flops if peak_flops else None,
        "skipped": result.skipped,
    }
    run.rows.append(row)
    if run.writer is not None:
        try:
            run.writer.write(row)
        except OSError as e:
            raise UserError(f"train.log_every={run.cfg.train.log_every}: could not write {run.writer.path} "
                            f"({e.strerror or e}); free space, then rerun the same command to resume") from None
    return row


def save_checkpoint(run: Run, step: int) -> None:
    extra = {"data": run.batches.state_dict(), "data_fingerprint": run.data_fingerprint,
             "metrics_rows": len(run.rows), "wandb_id": run.wandb_run.id if run.wandb_run is not None else None}
    config = resolved(run.cfg)
    run.checkpointer.save(step, run.model, run.optimizer, run.scheduler, extra, config)


# --- the loop ------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loop(run: Run, stop: StopSignals, progress: Progress, diagnostics: Diagnostics,
         collect: Callable[[int, bool], None]) -> None:
    t = run.cfg.train
    if run.start_step < t.steps:
        stop_before_training(run, stop)
    interval_start, interval_steps, interval_wait = time.perf_counter(), 0, 0.0
    for step in range(run.start_step + 1, t.steps + 1):
        first = step == run.start_step + 1
        if first and compile_enabled(run.cfg):
            log.info("compiling %d blocks (%s) in the first step: it takes longer, and is kept out of the "
                     "median tokens/s", run.cfg.model.n_layers, run.cfg.compile.backend)
        peers.at("the forward and backward (their collectives)", step)
        result = train_step(run)
        lr = run.optimizer.param_groups[0]["lr"]  # what this step's optimizer step uses
        stop_now, diverged = apply_step(run, result, stop, step)
        interval_steps += 1
        interval_wait += result.data_wait_s
        progress.advance(1)
        if first and compile_enabled(run.cfg):
            run.compile_s = time.perf_counter() - interval_start
            log.info("step %d with compilation took %.1f s; saved activations per block: %s", step, run.compile_s,
                     ", ".join(f"{b / MiB:.2f} MiB" for b in result.per_block))
            if run.launch.is_main:
                compile_cache.save(run.run_dir)  # for a later start of the run, wherever it lands
        if step % t.log_every == 0 or step == t.steps or stop_now or result.skipped:
            _sync(run.device)
            peers.at("the all-reduce of the metrics", step)
            seconds = (time.perf_counter() - interval_start) / interval_steps
            progress.update(log_step(run, step, result, lr, seconds, interval_wait / interval_steps))
            interval_start, interval_steps, interval_wait = time.perf_counter(), 0, 0.0
        if diverged:
            raise LossNotFinite(diverged)
        if run.cfg.checkpoint.enabled and (stop_now or run.checkpointer.due(step, t.steps)):
            peers.at("the checkpoint save", step)
            save_checkpoint(run, step)
        diagnostics.on_step_end(step)
        collect(step, first)
        if stop_now:
            saved = "checkpoint saved" if run.cfg.checkpoint.enabled else "checkpointing is off"
            raise _stopped(run, stop, f"after step {step}, {saved}")


def _steps_words(span: Optional[list[int]]) -> str:
    """[first, last] steps as words: "steps 26-100", "step 1", "no step"."""
    if not span:
        return "no step"
    return f"step {span[0]}" if span[0] == span[1] else f"steps {span[0]}-{span[1]}"


def summarize(run: Run) -> dict[str, Any]:
    rows = [r for r in run.rows if r.get("loss") is not None]
    # the first logged steps include compilation: leave them out of the medians when there are enough
    steady = rows[len(rows) // 4:] if len(rows) >= 4 else rows
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    return {
        "status": "completed",
        "num_params": num_params(run.model),
        "param_bytes_per_rank": sum(local_tensor(p).nbytes for p in {id(p): p for p in run.model.parameters()}.values()),
        "steps": run.cfg.train.steps,
        "final_loss": rows[-1]["loss"] if rows else None,
        "median_steps": [steady[0]["step"], steady[-1]["step"]] if steady else None,  # what the medians cover
        "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady) if steady else None,
        "median_step_time_s": statistics.median(r["step_time_s"] for r in steady) if steady else None,
        "median_data_wait_s": statistics.median(r["data_wait_s"] for r in steady) if steady else None,
        "peak_memory_bytes": max((r["peak_memory_bytes"] for r in run.rows), default=None),
        "steady_peak_memory_bytes": max((r["peak_memory_bytes"] for r in steady), default=None),
        "offload_host_bytes": max((r["offload_host_bytes"] or 0 for r in run.rows), default=None)
        if run.rows and run.rows[-1].get("offload_host_bytes") is not None else None,
        "activation_bytes": run.rows[-1]["activation_bytes"] if run.rows else None,
        "activation_bytes_per_block": run.rows[-1].get("activation_bytes_per_block") if run.rows else None,
        "mfu": statistics.median(mfus) if mfus else None,
        "skipped_steps": run.skipped_total,
        "compile_s": run.compile_s,
    }


def _summary_header(cfg, world_size: int, wandb_run, plan=None) -> dict[str, Any]:
    budget = budget_of(cfg.ac)
    return {
        # what auto's plan predicted, beside what the run measured (keys as the measured ones)
        "planned": None if plan is None else {
            "activation_bytes": plan.activations, "peak_memory_bytes": plan.peak,
            "reserved_peak_bytes": plan.reserved_peak if plan.reserved is not None else None,
            "tokens_per_s_per_device": plan.tokens_per_s_per_device, "verdict": plan.verdict,
            "device": plan.device.name,
        },
        "world_size": world_size,
        "ac_mode": str(cfg.ac.mode),
        "ac_label": ac_label(cfg.ac),
        "memory_budget": float(budget) if isinstance(budget, (int, float)) else budget,
        "selective_option": str(cfg.ac.selective_option) if cfg.ac.mode == ACMode.selective else None,
        "ac_policies": compact_policies(block_policies(cfg.ac, cfg.model.n_layers)),
        "compile": compile_enabled(cfg),
        "wandb": None if wandb_run is None else {
            "project": wandb_run.project, "entity": wandb_run.entity, "group": wandb_run.group, "id": wandb_run.id,
            "dir": wandb_run.dir,
        },
        "config": resolved(cfg),
    }


def train(cfg, run_dir: Path, wandb_group: Optional[str] = None) -> dict[str, Any]:
    """Train per `cfg`, writing metrics.jsonl and summary.json into `run_dir`; returns the summary. Raises
    UserError for what the user can fix, Stopped after SIGTERM/Ctrl-C (checkpoint and summary written); after
    SLURM's USR2 it hands over to submitit, which requeues the job."""
    summary: dict[str, Any] = {"status": "failed"}
    quiet_log_file_errors()  # train.log on a full disk: no `--- Logging error ---` tracebacks
    stop = StopSignals()
    run: Optional[Run] = None
    stopped: Optional[Stopped] = None
    failure: Optional[BaseException] = None
    try:
        with contextlib.ExitStack() as stack:
            try:
                peers.at("setup (joining, checking the config, resuming)", None)
                run = setup(cfg, Path(run_dir), wandb_group, stack, stop)
                log.info("model %s: %s parameters (%.1f MiB on this rank), %s, parallelism=%s on %s, rank %d/%d "
                         "pid %d", cfg.model.name, f"{num_params(run.model):,}",
                         sum(local_tensor(p).nbytes for p in run.model.parameters()) / MiB, run.label,
                         cfg.parallelism.name, run.device, run.launch.rank, run.launch.world_size, os.getpid())
                diagnostics = Diagnostics(cfg.diagnostics, run.run_dir, run.device, run.launch.rank,
                                          steps=cfg.train.steps - run.start_step)
                stack.callback(diagnostics.close)  # also when the loop fails: an OOM's snapshot is the one wanted
                progress = Progress(str(cfg.train.progress) if run.launch.is_main else "lines", cfg.train.steps,
                                    run.start_step, run.label)
                try:
                    with compiler_scope(cfg.ac, run.run_dir, cfg.model.n_layers), \
                            scheduled_gc(cfg.train.gc_every_steps) as collect:
                        loop(run, stop, progress, diagnostics, collect)
                finally:
                    progress.close()
                summary = summarize(run)
                if waited := data_wait_line(summary):
                    log.warning(waited)
                log.info("done: %s; final loss %s, median %.0f tok/s over %s, activations %.1f MiB, peak memory "
                         "%.2f GiB", run.label, summary["final_loss"], summary["median_tokens_per_s"] or 0,
                         _steps_words(summary["median_steps"]), (summary["activation_bytes"] or 0) / MiB,
                         (summary["peak_memory_bytes"] or 0) / GiB)
            except Stopped as e:  # at a step boundary, or while rank 0 planned (no run yet, nothing written)
                summary, stopped = {**(summarize(run) if run else {}), "status": e.status, "stopped": str(e)}, e
            except BaseException as e:
                line = (peers.peer_lost_line(cfg, run.run_dir if run else Path(run_dir),
                                              run.checkpointer.timeout_s if run else None, e)
                        if peers.is_peer_failure(e) else None)
                if line is not None:  # a peer died or stalled in a collective: one line, no traceback
                    log.debug("collective failed: %s", e)
                    failure = peers.PeerLost(line)
                summary["error"] = f"{type(failure or e).__name__}: {failure or e}"
                if isinstance(e, KeyboardInterrupt):
                    summary["status"] = "interrupted"
                if failure is not None:
                    raise failure from None
                failure = e
                raise
            finally:
                if run is not None:
                    missing = _finish(run, summary)
                    ending = stopped or failure
                    if missing and isinstance(ending, (UserError, Stopped)) and ending.args:
                        ending.args = (f"{ending.args[0]}; {missing}", *ending.args[1:])  # still one line
                    elif missing:
                        log.error("%s", missing)
    finally:
        requeue = stop.previous.get(signal.SIGUSR2)
        stop.restore()
        if isinstance(failure, peers.PeerLost) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun's shutdown: the line is said first
    if stopped is not None and stopped.status == "preempted":
        if callable(requeue):
            requeue(signal.SIGUSR2, None)  # submitit's handler: requeue the job (rank 0), then exit
        raise SystemExit(0)
    if stopped is not None:
        raise stopped
    return summary


def _finish(run: Run, summary: dict[str, Any]) -> Optional[str]:
    """summary.json (rank 0, atomically) and the W&B run's end, whatever happened. On a full disk the summary
    is written without its config (.hydra/config.yaml holds it) if that fits; returns why summary.json is
    missing (or stale), else None."""
    missing = None
    if run.launch.is_main:
        summary.update(_summary_header(run.cfg, run.launch.world_size, run.wandb_run, run.plan))
        path = run.run_dir / "summary.json"
        try:
            write_json(path, summary)
        except OSError:
            try:
                write_json(path, {k: v for k, v in summary.items() if k != "config"})
            except OSError as e:
                state = "is the earlier run's, not updated" if path.exists() else "is missing"
                missing = f"{path} {state} ({e.strerror or e})"
    if run.wandb_run is not None:
        run.wandb_run.summary.update({k: v for k, v in summary.items() if k not in ("config", "wandb")})
        run.wandb_run.finish(exit_code=0 if summary["status"] in ("completed", "preempted", "interrupted") else 1)
    return missing
