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

from membudget.errors import Stopped, UserError
from membudget.launch import launch_from_env
from membudget.rules import validate
from membudget.launch import register_configs
from membudget.search import objective

register_configs()
log = logging.getLogger("membudget")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    # one W&B group per sweep: its output dir, e.g. multirun/2026-12-02/11-30-00-123 -> 2026-12-02_11-30-00-123
    group = "_".join(Path(hc.sweep.dir).parts[-2:]) if multirun else None
    try:
        validate(cfg, launch_from_env().world_size)  # before torch loads: a bad config fails in a second
        from membudget.trainer import train

        summary = train(cfg, Path(hc.runtime.output_dir), wandb_group=group)
    except UserError as e:
        if multirun:
            # the sweep's launcher reports the failed job (SLURM: back in the submitting process): name it
            raise UserError(f"job {hc.job.num} [{' '.join(hc.overrides.task)}]: {e}") from None
        log.error("error: %s", e)
        sys.exit(2)
    except Stopped as e:
        log.warning("%s: %s; rerun the same command to resume", e.status, e)
        sys.exit(143 if e.signal_name == "SIGTERM" else 130)
    except KeyboardInterrupt:
        log.error("interrupted: stopped at once by a second Ctrl-C; the last checkpoint is intact")
        sys.exit(130)
    # an Optuna search's values (a failed run raised above: the study records a failed trial), else the loss
    return objective(cfg, summary)


if __name__ == "__main__":
    main()
