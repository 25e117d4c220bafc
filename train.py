"""Train Llama 3 with an activation-checkpointing mode, configured by Hydra.

    python train.py ac=memory_budget ac.memory_budget=0.4
    python train.py -m ac=none,full,selective,memory_budget
"""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from membudget.config import UserError, launch_from_env, register_configs, validate

register_configs()
log = logging.getLogger("membudget")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    # one W&B group per sweep: its output dir, e.g. multirun/2026-12-02/11-30-00 -> 2026-12-02_11-30-00
    group = "_".join(Path(hc.sweep.dir).parts[-2:]) if hc.mode == RunMode.MULTIRUN else None
    try:
        validate(cfg, launch_from_env().world_size)  # before torch loads: a bad config fails in a second
        from membudget.trainer import train

        summary = train(cfg, Path(hc.runtime.output_dir), wandb_group=group)
    except UserError as e:
        if hc.mode == RunMode.MULTIRUN:
            # the sweep's launcher reports the failed job (SLURM: back in the submitting process): name it
            raise UserError(f"job {hc.job.num} [{' '.join(hc.overrides.task)}]: {e}") from None
        log.error("error: %s", e)
        sys.exit(2)
    return summary["final_loss"]


if __name__ == "__main__":
    main()
