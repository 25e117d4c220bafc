"""A small training run for the checkpoint tests, built like the trainer builds it.

Run under torchrun (`-m tests.checkpoint_driver OUT_DIR parallelism=fsdp`) it trains, saves, trains on, then
resumes a fresh model from the checkpoint and writes both loss curves to OUT_DIR/losses_rank<R>.json.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from membudget.ac import compiler_scope
from membudget.checkpoint import Checkpointer
from membudget.collector import collect_rarely
from membudget.data import TokenBatches
from membudget.tokenizer import build_tokenizer
from membudget.launch import init_distributed, launch_from_env
from membudget.metrics import ActivationCounter
from membudget.parallel import build_mesh, dp_coordinates
from membudget.step import Numerics, StepShape, build_model, build_optimizer
from membudget.trainer import train_step
from tests.conftest import compose_cfg

# fp32 on CPU, no dropout: a resumed run must reproduce the uninterrupted one bit for bit
SMALL = ("logger=none", "data=synthetic", "train.seq_len=32", "train.global_batch_size=4", "train.steps=6",
         "lr_schedule.warmup_steps=2")


def scope(cfg):
    """The run's compiler settings (ac=memory_budget's budget), as the trainer enters them around its loop: a
    Run trains within it."""
    return compiler_scope(cfg.ac, None, cfg.model.n_layers)


@dataclass
class Run:
    """Model, optimizer, scheduler and data of one training run (the fields the trainer's `train_step` reads),
    and the trainer's step."""

    cfg: object
    device: torch.device
    mesh: object
    shape: StepShape
    numerics: Numerics
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    batches: TokenBatches
    counter: ActivationCounter

    @classmethod
    def build(cls, cfg, mesh=None) -> Run:
        device = torch.device("cpu")
        numerics = Numerics.for_target(cfg, device.type, (0, 0))
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg, device, mesh, numerics)
        optimizer, scheduler = build_optimizer(model, cfg)
        dp_rank, dp_size = dp_coordinates(mesh)
        batches = TokenBatches(cfg.data, build_tokenizer(cfg.tokenizer), cfg.train.global_batch_size,
                               cfg.train.seq_len, cfg.train.seed, dp_rank=dp_rank, dp_size=dp_size)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return cls(cfg, device, mesh, StepShape.from_config(cfg, world_size), numerics, model, optimizer, scheduler,
                   batches, ActivationCounter(model))

    def train(self, steps: int) -> list[float]:
        """`steps` optimizer steps as the trainer takes them (its train_step, then AdamW and the schedule, as its
        apply_step does on a finite step); this rank's losses. `activation_bytes`: each step's, appended."""
        losses = []
        for _ in range(steps):
            result = train_step(self)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            losses.append(result.loss.item())
            self.activation_bytes.append(result.activation_bytes)
        return losses

    def __post_init__(self) -> None:
        self.activation_bytes: list[int] = []

    def save(self, checkpointer: Checkpointer, step: int) -> None:
        checkpointer.save(step, self.model, self.optimizer, self.scheduler, {"data": self.batches.state_dict()})

    def load(self, checkpointer: Checkpointer, path: Path | None = None) -> tuple[Path, dict]:
        """The newest intact checkpoint (or `path`), restored: (its path, its train state)."""
        path, state = checkpointer.restore(self.model, self.optimizer, self.scheduler, path=path)
        self.batches.load_state_dict(state["extra"]["data"])
        return path, state


def main(out_dir: Path, *overrides: str) -> None:
    cfg = compose_cfg(*SMALL, *overrides)
    launch = launch_from_env()
    init_distributed(launch, torch.device("cpu"))
    mesh = build_mesh(cfg.parallelism, launch, torch.device("cpu"))
    checkpointer = Checkpointer(out_dir, cfg.checkpoint)
    checkpointer.check_writable()

    with scope(cfg):
        run = Run.build(cfg, mesh)
        run.train(3)
        run.save(checkpointer, 3)
        uninterrupted = run.train(3)

        resumed = Run.build(cfg, mesh)
        _, state = resumed.load(checkpointer)
        assert state["step"] == 3
        losses = {"uninterrupted": uninterrupted, "resumed": resumed.train(3)}
    (out_dir / f"losses_rank{launch.rank}.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    collect_rarely()  # as train.py's processes collect
    main(Path(sys.argv[1]), *sys.argv[2:])
