"""Real training steps of the debug model on CPU, measured by torch's MemTracker, for the planner's exactness tests:
in this process (`real_steps`), or over two gloo processes under torchrun (run as a script: one JSON line per
setting on rank 0, each setting's overrides given as one argument)."""

from __future__ import annotations

import itertools
import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from membudget.ac import compiler_scope
from membudget.internals import mem_tracker_class
from membudget.metrics import ActivationCounter
from membudget.parallel import dp_coordinates
from membudget.step import Numerics, StepShape, build_model, build_optimizer
from membudget.trainer import train_step


class CompiledMemTracker(mem_tracker_class()):
    """torch's MemTracker, kept on while compiled graphs run (aot_eager graphs run op by op), over every
    micro-batch of a step: the root's forward starts a new micro-batch, where torch's refuses a second call. The
    peaks (what the tests read) span the whole step; the per-module statistics are the last micro-batch's."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw \
                and set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


def real_steps(cfg, mesh=None) -> dict:
    """Two real training steps of `cfg` as the trainer takes them (forward and backward, gradient clipping, AdamW,
    zero_grad), each under MemTracker: activation bytes, the bytes of the parameters, gradients (before the
    optimizer step) and optimizer states, and each step's peak less the batch of tokens (not in the plan)."""
    torch.manual_seed(0)  # TP ranks must see the same batch
    rows = cfg.train.global_batch_size // dp_coordinates(mesh)[1]
    tokens = torch.randint(0, cfg.model.vocab_size, (rows, cfg.train.seq_len + 1))
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the trainer's batches
    peaks = []
    device = torch.device("cpu")
    numerics = Numerics.for_target(cfg, device.type, (0, 0))
    with compiler_scope(cfg.ac, None, cfg.model.n_layers):  # as the trainer enters it
        model = build_model(cfg, device, mesh, numerics)
        optimizer, _ = build_optimizer(model, cfg)
        # what the trainer's train_step reads of its Run: this batch every step
        run = SimpleNamespace(cfg=cfg, device=device, mesh=mesh, numerics=numerics, model=model,
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
            peaks.append(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - inputs.nbytes - labels.nbytes)
    return {
        "activations": activations,
        "parameters": sum(p.nbytes for p in model.parameters()),
        "gradients": gradients,
        "optimizer_states": sum(t.nbytes for s in optimizer.state.values() for t in s.values()),
        "peaks": peaks,
    }


def main() -> None:
    from membudget.launch import init_distributed, launch_from_env
    from membudget.parallel import build_mesh
    from tests.conftest import compose_cfg

    launch = launch_from_env()
    init_distributed(launch, torch.device("cpu"))
    for overrides in sys.argv[1:]:
        cfg = compose_cfg(*overrides.split())
        real = real_steps(cfg, build_mesh(cfg.parallelism, launch, torch.device("cpu")))
        if launch.rank == 0:
            print(json.dumps({"overrides": overrides, **real}), flush=True)


if __name__ == "__main__":
    main()
