"""Train Llama 3 with an activation-checkpointing mode, configured by Hydra.

    python train.py ac=memory_budget ac.memory_budget=0.4
    python train.py -m ac=none,full,selective,memory_budget
"""

import faulthandler
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from membudget.collector import collect_rarely
from membudget.console import log_error_once, one_line_hydra_errors, override_problem, quiet_log_file_errors
from membudget.errors import Stopped, UserError
from membudget.launch import exit_without_stranded_calls, launch_from_env, register_configs
from membudget.options import CONF_DIR
from membudget.rules import validate
from membudget.search import objective

collect_rarely()  # importing torch, Dynamo and inductor builds millions of objects the default collector rescans
if not faulthandler.is_enabled():  # (pytest enables its own)
    # a process that dies of a native fault (glibc's abort on a corrupted heap, a segfault) prints every thread's
    # Python stack on stderr, which torchrun, SLURM and submitit keep: else a rank dies with a signal number alone
    faulthandler.enable(all_threads=True)
register_configs()
log = logging.getLogger("membudget")


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float:
    quiet_log_file_errors()  # train.log on a full disk: its lines are lost, never a `--- Logging error ---`
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
            # one line now; the other jobs run, and the sweep ends with one summary line (membudget.errors).
            # Raised, so that the launcher (SLURM: back in the submitting process) and a search see the failure.
            message = f"job {hc.job.num} [{' '.join(hc.overrides.task)}]: {e}"
            log_error_once(log, message)
            _note_failed_job(Path(hc.runtime.output_dir), f"{type(e).__name__}: {e}")
            raise UserError(message) from None
        log_error_once(log, str(e))  # the ranks of a job fail with one line, printed once
        sys.exit(2)
    except Stopped as e:
        log.warning("%s: %s; rerun the same command to resume", e.status, e)
        sys.exit(143 if e.signal_name == "SIGTERM" else 130)
    except KeyboardInterrupt:
        log.error("interrupted: stopped at once by a second Ctrl-C; the last checkpoint is intact")
        sys.exit(130)
    # an Optuna search's values (a failed run raised above: the study records a failed trial), else the loss
    return objective(cfg, summary)


def _note_failed_job(job_dir: Path, error: str) -> None:
    """A sweep's job that failed before the trainer wrote its summary.json (a config the validation refused):
    a summary saying so, for the sweep's report; never in a dir another run holds."""
    from membudget.dirlock import DirLock

    if (job_dir / "summary.json").exists():
        return
    lock = DirLock(job_dir)
    try:
        lock.acquire()
    except (UserError, OSError):  # held by another run, or not writable
        return
    try:
        from membudget.metrics import write_json

        write_json(job_dir / "summary.json", {"status": "failed", "error": error})
    except OSError:
        pass  # the job's one line says what failed; the report then shows the job as not finished
    finally:
        lock.release()


if __name__ == "__main__":
    # an override Hydra's grammar cannot read (an unquoted path with spaces or accents): one line, before Hydra
    problem = override_problem(sys.argv[1:])
    if problem:
        sys.stderr.write(f"error: {problem}\n")
        sys.exit(1)
    # composition errors, a sweep's failed jobs: one line each, no traceback; a rank whose join or lost-peer
    # lookup outlived its deadline exits with its own code, not SIGABRT
    with exit_without_stranded_calls(), one_line_hydra_errors():
        main()
