"""Turn a Hydra multirun of AC settings into a verdict: which setting is fastest at which memory, and
did any change the loss.

    python -m membudget.report <sweep dir> [--tolerance X] [--memory-tie F] [--time-tie F] [--strict] [--no-wandb]

Reads each job's `.hydra/config.yaml`, `metrics.jsonl` and `summary.json` (see the trainer) and writes
into the sweep dir: `report.md`, `report.csv` (one row per finished run) and plots as PNG and SVG
(`loss`, `memory_vs_time`, and for budget sweeps `budget`). Unless --no-wandb, it also logs a summary
run (`job_type="report"`) into the W&B group of the sweep's training runs.

Each run's loss is compared step by step with the ac=none run of the same settings (all config keys but
`ac`, `compile` and `logger` equal); a run is flagged when the loss differs anywhere by more than
tolerance * (1 + |baseline loss|). With --strict the command exits 1 when a run is flagged or no run
could be compared. The Pareto front of activation memory against step time treats runs within
--memory-tie and --time-tie of each other as ties and names the better one (membudget.report.pareto).

Modules: jobs (a sweep dir read back), compare (rows, loss against ac=none), pareto, plots, write
(report.md, report.csv, W&B), cli.
"""

from membudget.report.cli import Analysis, analyse, main
from membudget.report.compare import COLUMNS, TOLERANCE, build_rows
from membudget.report.jobs import Job, Sweep, load_jobs, load_sweep
from membudget.report.pareto import FrontPoint, Ties, pareto_front

__all__ = ["Analysis", "analyse", "COLUMNS", "TOLERANCE", "FrontPoint", "Job", "Sweep", "Ties", "build_rows", "load_jobs", "load_sweep",
           "main", "pareto_front"]
