"""Turn a Hydra multirun of AC settings into a verdict: which setting is fastest at which memory, and
did any change the loss.

    python -m membudget.report <sweep dir> [--tolerance X] [--memory-tie F] [--time-tie F] [--strict] [--no-wandb]
                               [--no-plan]

Reads each job's `.hydra/config.yaml`, `metrics.jsonl` and `summary.json` (see the trainer) and writes
into the sweep dir: `report.md`, `report.csv` (one row per finished run) and plots as PNG and SVG
(`loss`, `memory_vs_time`, and for budget sweeps `budget`). Unless --no-wandb, it also logs a summary
run (`job_type="report"`) into the W&B group of the sweep's training runs.

Each run's loss is compared step by step with the ac=none run of the same settings (all config keys but
`ac`, `compile` and `logger` equal); a run is flagged when the loss differs anywhere by more than
tolerance * (1 + |baseline loss|). With --strict the command exits 1 when a run is flagged or no run
could be compared. The Pareto front of activation memory against step time treats runs within
--memory-tie and --time-tie of each other as ties and names the better one (membudget.report.pareto).

A search's dir (experiment=budget_search, membudget.search) reads as a grid does, plus its study: report.md
lists every trial (failed ones with their error, repeated proposals counted, trials still running), the
`study` column marks the study's Pareto front ("front") or best trial ("best"), and the verdict says whether
the study's front agrees with the report's tie-aware one. Unless --no-plan, each run's own config is planned
(membudget.plan, about a second a job on the debug model) and the plan's activations and peak sit beside the
measured ones.

Modules: jobs (a sweep dir read back), compare (rows, loss against ac=none), pareto, planned (the plan beside
each run), study (a search's trials and front), plots, write (report.md, report.csv, W&B), cli.
"""

from membudget.report.cli import Analysis, analyse, main
from membudget.report.compare import COLUMNS, TOLERANCE, build_rows
from membudget.report.jobs import Job, Sweep, load_jobs, load_sweep
from membudget.report.pareto import FrontPoint, Ties, pareto_front

__all__ = ["Analysis", "analyse", "COLUMNS", "TOLERANCE", "FrontPoint", "Job", "Sweep", "Ties", "build_rows", "load_jobs", "load_sweep",
           "main", "pareto_front"]
