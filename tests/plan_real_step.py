"""Real training steps of the debug model on CPU, measured by torch's MemTracker, for the planner's exactness tests:
in this process (`real_steps`), or over two gloo processes under torchrun (`main` in each rank, or run as a script:
one JSON line per setting on rank 0, each setting's overrides given as one argument)."""

from __future__ import annotations

import itertools
import json
import sys
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist

from membudget.ac import compiler_scope
from membudget.collector import collect_rarely
from membudget.internals import mem_tracker_class, tree_leaves
from membudget.metrics import ActivationCounter
from membudget.parallel import dp_coordinates
from membudget.step import Numerics, StepShape, build_model, build_optimizer
from membudget.trainer import train_step

CPU = torch.device("cpu")  # the device of every step here (built once: the tracker reads it per op)


class CompiledMemTracker(mem_tracker_class()):
    """torch's MemTracker, kept on while compiled graphs run (aot_eager graphs run op by op), over every
    micro-batch of a step: the root's forward starts a new micro-batch, where torch's refuses a second call. The
    peaks (what the tests read) span the whole step; the per-module statistics are the last micro-batch's.

    It also bounds what gloo's threads can add to the peak. A collective's Work holds its tensors, and gloo's
    worker thread drops it after the main thread's wait has returned; a storage the main thread no longer holds
    is then freed on that thread, whenever it next gets the GIL, so under load the free can land after the main
    thread's next allocations and raise the peak. Program order, which the plan follows, frees it right after the
    main thread's last use of it. So the tracker keeps the total after each op, the last op that used each
    storage, and each free made off the main thread; `peak_is_exact()` says whether moving each such free back to
    its last use leaves the peak as measured (then the measured peak is program order's)."""

    def __init__(self) -> None:
        super().__init__()
        self.totals: list[int] = []  # the device total at each peak update, one per op: the peak is their max
        self._last_use: dict[int, int] = {}  # id(storage's record) -> index in totals of the last op using it
        self._late_frees: list[tuple[int, int, int]] = []  # (bytes, last use, index in totals when freed)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw \
                and set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        super()._update_peak_stats(peak_state)
        self.totals.append(self._curr_mem_snap[CPU]["Total"])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented:
            for t in tree_leaves((args, kwargs, out)):
                if type(t) in (torch.Tensor, torch.nn.Parameter):
                    record = self._WINFO.get(t.untyped_storage())
                    if record is not None:
                        self._last_use[id(record[0])] = len(self.totals) - 1
        return out

    def _delete_callback(self, winfo, w_st) -> None:
        if threading.current_thread() is not threading.main_thread() and winfo.mem_consumed > 0:
            self._late_frees.append((winfo.mem_consumed, self._last_use.get(id(winfo), -1), len(self.totals)))
        super()._delete_callback(winfo, w_st)

    def peak_is_exact(self) -> bool:
        """Whether the frees made off the main thread, moved back to right after their storage's last use, leave
        the peak unchanged (a lower bound on program order's peak that equals the measured upper one)."""
        lowered = list(self.totals)
        for nbytes, last_use, freed_at in self._late_frees:
            for i in range(last_use + 1, freed_at):
                lowered[i] -= nbytes
        return max(lowered, default=0) == max(self.totals, default=0)


def real_steps(cfg, mesh=None, attempts: int = 3) -> dict:
    """Two real training steps of `cfg` as the trainer takes them (forward and backward, gradient clipping, AdamW,
    zero_grad), each under MemTracker: activation bytes, the bytes of the parameters, gradients (before the
    optimizer step) and optimizer states, and each step's peak less the batch of tokens (not in the plan).

    Taken again, from a new model, while a free on one of gloo's threads may have raised a step's peak on any
    rank (`CompiledMemTracker.peak_is_exact`); after `attempts` the last steps stand, and the test shows them."""
    for attempt in range(1, attempts + 1):
        real, exact = _two_steps(cfg, mesh)
        if dist.is_initialized():
            flag = torch.tensor([int(exact)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            exact = bool(flag.item())
        if exact:
            break
        print(f"attempt {attempt} of {attempts}: a free on one of gloo's threads may have raised a peak"
              + ("; measuring again" if attempt < attempts else ""), file=sys.stderr)
    return real


def _two_steps(cfg, mesh) -> tuple[dict, bool]:
    torch.manual_seed(0)  # TP ranks must see the same batch
    rows = cfg.train.global_batch_size // dp_coordinates(mesh)[1]
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.train.seq_len + 1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the trainer's batches
    peaks, exact = [], True
    numerics = Numerics.for_target(cfg, CPU.type, (0, 0))
    with compiler_scope(cfg.ac, None, cfg.model.n_layers):  # as the trainer enters it
        model = build_model(cfg, CPU, mesh, numerics)
        optimizer, _ = build_optimizer(model, cfg)
        # what the trainer's train_step reads of its Run: this batch every step
        run = SimpleNamespace(cfg=cfg, device=CPU, mesh=mesh, numerics=numerics, model=model,
                              shape=StepShape.from_config(cfg, dist.get_world_size() if dist.is_initialized() else 1),
                              batches=itertools.repeat((inputs, labels)), counter=ActivationCounter(model))
        for _ in range(2):
            tracker = CompiledMemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                activations = train_step(run).activation_bytes  # forward, backward and the gradient clip
                gradients = sum(p.grad.nbytes for p in model.parameters())
                optimizer.step()  # then AdamW, as the trainer's apply_step on a finite step
                optimizer.zero_grad(set_to_none=True)
            peaks.append(tracker.get_tracker_snapshot("peak")[CPU]["Total"] - inputs.nbytes - labels.nbytes)
            exact = exact and tracker.peak_is_exact()
    return {
        "activations": activations,
        "parameters": sum(p.nbytes for p in model.parameters()),
        "gradients": gradients,
        "optimizer_states": sum(t.nbytes for s in optimizer.state.values() for t in s.values()),
        "peaks": peaks,
    }, exact


def main(*settings: str) -> list[dict]:
    """A rank's real steps of each setting (its overrides as one string): what rank 0 measured, [] on the others."""
    from membudget.launch import init_distributed, launch_from_env
    from membudget.parallel import build_mesh
    from tests.conftest import compose_cfg

    collect_rarely()  # as train.py's processes collect
    launch = launch_from_env()
    init_distributed(launch, CPU)
    measured = []
    for overrides in settings:
        cfg = compose_cfg(*overrides.split())
        real = real_steps(cfg, build_mesh(cfg.parallelism, launch, CPU))
        if launch.rank == 0:
            measured.append({"overrides": overrides, **real})
    return measured


if __name__ == "__main__":
    for setting in main(*sys.argv[1:]):
        print(json.dumps(setting), flush=True)
