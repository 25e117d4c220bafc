"""Create a saved W&B workspace for one sweep: loss curves and the memory / step-time trade-off.

    python scripts/wandb_workspace.py <sweep dir>            # project, group and entity from its runs
    python scripts/wandb_workspace.py --project membudget --group 2026-12-02_11-30-00

Needs the optional `wandb-workspaces` package (pip install wandb-workspaces), W&B online and the sweep's
runs synced (`wandb sync <sweep dir>/*/wandb/offline-run-*` for offline runs). Otherwise it says what is
missing in one line and exits 1.
"""

import argparse
import os
import sys
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep_dir", nargs="?", type=Path, help="a multirun dir: take project/group/entity from it")
    parser.add_argument("--project", help="W&B project (default: the sweep's, else membudget)")
    parser.add_argument("--group", help="W&B group of the sweep's runs (default: the sweep's)")
    parser.add_argument("--entity", help="W&B entity (default: the sweep's, else your default entity)")
    parser.add_argument("--name", help="workspace name (default: AC sweep <group>)")
    args = parser.parse_args()

    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        sys.exit("wandb-workspaces is not installed: pip install wandb-workspaces (or use the report's plots)")
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        sys.exit(f"WANDB_MODE={os.environ['WANDB_MODE']}: a saved workspace needs W&B online")
    import wandb  # after the checks: a missing package or offline mode is reported at once

    try:
        api = wandb.Api()
    except wandb.errors.UsageError as e:
        sys.exit(f"not logged in to W&B ({e})")

    project, group, entity = args.project, args.group, args.entity
    if args.sweep_dir is not None:
        from membudget.report import load_jobs

        jobs = [j for j in load_jobs(args.sweep_dir.resolve()) if j.summary.get("wandb")]
        if not jobs:
            sys.exit(f"no run in {args.sweep_dir} logged to W&B (logger=none?)")
        info = jobs[0].summary["wandb"]
        project = project or info["project"]
        group = group or info["group"]
        entity = entity or jobs[0].config.get("logger", {}).get("entity")
    if not group:
        sys.exit("give a sweep dir or --group")
    project, entity = project or "membudget", entity or api.default_entity

    # Training runs log `loss` per step and, in their summary, the measurements the report compares.
    memory, step_time = wr.SummaryMetric("activation_bytes"), wr.SummaryMetric("median_step_time_s")
    workspace = ws.Workspace(
        name=args.name or f"AC sweep {group}", entity=entity, project=project,
        runset_settings=ws.RunsetSettings(filters=f"Metric('Group') == '{group}'"),
        sections=[
            ws.Section(name="Loss", is_open=True, panels=[
                wr.LinePlot(title="loss", x="Step", y=["loss"]),
                wr.LinePlot(title="tokens/s", x="Step", y=["tokens_per_s"]),
                wr.LinePlot(title="waiting for data (s a step)", x="Step", y=["data_wait_s"]),
            ]),
            ws.Section(name="Memory vs speed", is_open=True, panels=[
                wr.ScatterPlot(title="activation memory vs step time", x=memory, y=step_time),
                wr.ScatterPlot(title="budget vs activation memory", x=wr.Config("ac.memory_budget"), y=memory),
                wr.ScatterPlot(title="budget vs step time", x=wr.Config("ac.memory_budget"), y=step_time),
            ]),
        ],
    )
    print(f"saved workspace: {workspace.save().url}")


if __name__ == "__main__":
    main()
