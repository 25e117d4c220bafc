"""Public GPU measurements of Llama-3-shaped training (docs/planner/evidence.csv, each row cited there) and the
planner's prediction for each: the same model, GPU, FSDP degree, batch, sequence, AC and compile, planned as this
trainer runs them.

    python -m membudget.plan.evidence tt2412-t1-eager tt2412-t1-compile   # those rows' memory, both allocators
    python -m membudget.plan.evidence                                      # every row with a measured peak

(`python scripts/bench_plan.py --evidence` plans every row and writes docs/planner/evidence.md.)"""

from __future__ import annotations

import csv
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from membudget.devices import FITTED, GPUS
from membudget.units import GiB

from .planner import Planner
from .result import Plan

TABLE = Path(__file__).resolve().parents[2] / "docs" / "planner" / "evidence.csv"


@dataclass
class Row:
    fields: dict[str, str]

    @property
    def id(self) -> str:
        return self.fields["id"]

    @property
    def measured(self) -> Optional[float]:
        value = self.fields["measured_reserved_gib"]
        return float(value) * GiB if value else None

    @property
    def measured_speed(self) -> Optional[float]:
        value = self.fields["measured_tokens_per_s_per_gpu"]
        return float(value) if value else None

    @property
    def modelled(self) -> bool:
        return self.fields["modelled"] == "yes"

    @property
    def fitted(self) -> bool:
        """Whether a constant of its device entry was fitted to this row (membudget/devices.py FITTED): then it
        is not evidence of the time model."""
        return any(self.id in fitted.values() for fitted in FITTED.values())

    def overrides(self) -> list[str]:
        f = self.fields
        tp, dp, batch = int(f.get("tp") or 1), int(f["dp_shard"]), int(f["local_batch"])
        mode, _, option = f["ac"].partition(" ")
        ac = [f"ac={mode}"] + ([f"ac.selective_option={option}"] if option else [])
        layout = (["parallelism=fsdp_tp", f"parallelism.dp_shard={dp}", f"parallelism.tp={tp}"] if tp > 1
                  else ["parallelism=fsdp"])
        return ["logger=none", *f["overrides"].split(), *layout, f"plan.world_size={f['gpus']}",
                f"train.global_batch_size={batch * dp}", f"train.seq_len={f['seq_len']}", f"plan.gpu={f['gpu']}",
                "plan.margin_gib=0", f"plan.expandable_segments={str(f['allocator'] == 'expandable').lower()}",
                f"compile.enabled={str(f['compile'] == 'yes').lower()}", *ac]


def rows() -> list[Row]:
    with TABLE.open() as f:
        return [Row(r) for r in csv.DictReader(f)]


def plan_row(row: Row, compose, optimizer_runs: Optional[dict] = None) -> Plan:
    """The plan for one row; `compose` turns overrides into the run's config (Hydra's compose);
    `optimizer_runs`: a store of optimizer steps shared with other plans (Planner)."""
    cfg = compose(row.overrides())
    with Planner(cfg, optimizer_runs=optimizer_runs) as planner:
        return planner.plan(planner.point(cfg.ac.mode), recompute=False)


def plan_rows(chosen: list[Row], compose, optimizer_runs: Optional[dict] = None) -> dict[str, Plan]:
    """The plans of `chosen` by row id, recording the optimizer step once for the rows of one model and mesh."""
    optimizer_runs = {} if optimizer_runs is None else optimizer_runs
    return {row.id: plan_row(row, compose, optimizer_runs) for row in chosen}


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


@contextmanager
def device_entry(key: str, **changes):
    """The device table's entry `key` with `changes`, for the plans made inside (fitting a constant)."""
    saved = GPUS[key]
    GPUS[key] = replace(saved, **changes)
    try:
        yield
    finally:
        GPUS[key] = saved


def fit_compute_scale(row: Row, compose) -> float:
    """The compute_scale of the row's device entry at which the row's predicted tokens/s equals the measured: a
    compute-bound step takes a + b / compute_scale seconds, so plans at 1.0 and 0.5 give a and b.
    tests/test_plan_evidence.py checks that the table's fitted values reproduce their rows."""
    key = row.fields["gpu"]
    plans, optimizer_runs = {}, {}
    for scale in (1.0, 0.5):
        with device_entry(key, compute_scale=scale):
            plans[scale] = plan_row(row, compose, optimizer_runs)
    b = plans[0.5].step_seconds - plans[1.0].step_seconds  # (a + 2b) - (a + b)
    a = plans[1.0].step_seconds - b
    target = plans[1.0].tokens_per_step / (row.measured_speed * int(row.fields["gpus"]))
    return b / (target - a)


# Two measured settings whose speeds differ by less than this are not ranked (within the run-to-run noise)
RANKED_GAP = 0.05
# What a row's configuration is beyond its AC setting and compile: rows that share it can be ranked
_SAME_RUN = ("model", "overrides", "gpu", "gpus", "dp_shard", "tp", "local_batch", "seq_len", "float8")


def timed(all_rows: list[Row]) -> list[Row]:
    """The rows whose tokens/s the planner predicts: modelled, with a measured speed."""
    return [r for r in all_rows if r.modelled and r.measured_speed]


def ranked_pairs(all_rows: list[Row]) -> list[tuple[Row, Row]]:
    """(faster, slower) pairs of timed rows of one run that differ only in AC setting or compile, and whose
    measured speeds differ by at least RANKED_GAP."""
    rows_ = timed(all_rows)
    pairs = []
    for i, a in enumerate(rows_):
        for b in rows_[i + 1:]:
            if all(a.fields.get(k) == b.fields.get(k) for k in _SAME_RUN):
                fast, slow = (a, b) if a.measured_speed > b.measured_speed else (b, a)
                if fast.measured_speed >= (1 + RANKED_GAP) * slow.measured_speed:
                    pairs.append((fast, slow))
    return pairs


@dataclass
class SpeedSummary:
    held_out: list[tuple[str, float]]  # (row id, error of predicted tokens/s)
    fitted: list[tuple[str, float]]

    @property
    def mean(self) -> float:
        return sum(abs(e) for _, e in self.held_out) / len(self.held_out)

    @property
    def worst(self) -> tuple[str, float]:
        return max(self.held_out, key=lambda item: abs(item[1]))

    def line(self) -> str:
        worst = self.worst
        return (f"held-out rows: {len(self.held_out)}, mean |error| {self.mean:.1%}, worst {worst[1]:+.1%} "
                f"({worst[0]}); fitted rows (not evidence): {', '.join(r for r, _ in self.fitted)}")


def speed_summary(all_rows: list[Row], plans: dict[str, Plan]) -> SpeedSummary:
    """Each timed row's error of predicted tokens/s per GPU, split into held-out and fitted rows."""
    held, fitted = [], []
    for row in timed(all_rows):
        e = error(plans[row.id].tokens_per_s_per_device, row.measured_speed)
        (fitted if row.fitted else held).append((row.id, e))
    return SpeedSummary(held, fitted)


def memory_lines(ids: list[str], compose) -> list[str]:
    """A table of the rows `ids` (every row with a measured peak or an OOM when empty): measured max_reserved, the
    plan under the row's as-run allocator and under the other, each with its error, and the verdict."""
    chosen = [r for r in rows() if (r.id in ids if ids else r.measured is not None or r.fields["outcome"] == "oom")]
    unknown = set(ids) - {r.id for r in chosen}
    if unknown:
        raise SystemExit(f"no such row in {TABLE.name}: {', '.join(sorted(unknown))}")
    lines = ["| row | as run | measured GiB | planned, as run | error | other allocator | error | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    plans = plan_rows(chosen, compose)
    for row in chosen:
        plan = plans[row.id]
        measured = row.measured

        def cell(nbytes):
            return f"{nbytes / GiB:.2f} | " + ("-" if measured is None else f"{error(nbytes, measured):+.1%}")

        shown = "OOM" if row.fields["outcome"] == "oom" else "-" if measured is None else f"{measured / GiB:.2f}"
        lines.append(f"| {row.id} | {row.fields['allocator']} | {shown} | {cell(plan.reserved_peak)} | "
                     f"{cell(plan.reserved_other.nbytes)} | {plan.verdict} |")
    return lines


def main(argv: Optional[list[str]] = None) -> None:
    import sys

    import torch

    from membudget.launch import compose_config

    torch.set_num_threads(2)
    print("\n".join(memory_lines(sys.argv[1:] if argv is None else argv, compose_config)))


if __name__ == "__main__":
    main()
