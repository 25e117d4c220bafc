"""Public GPU measurements of Llama-3-shaped training (docs/planner/evidence.csv, each row cited there) and the
planner's prediction for each: the same model, GPU, FSDP degree, batch, sequence, AC and compile, planned as this
trainer runs them."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .planner import Planner
from .result import Plan

TABLE = Path(__file__).resolve().parents[2] / "docs" / "planner" / "evidence.csv"
GiB = 2**30


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

    def overrides(self) -> list[str]:
        f = self.fields
        gpus, batch = int(f["gpus"]), int(f["local_batch"])
        ac = {"selective op": ["ac=selective", "ac.selective_option=op"], "full": ["ac=full"],
              "none": ["ac=none"]}[f["ac"]]
        return ["logger=none", *f["overrides"].split(), "parallelism=fsdp", f"plan.world_size={gpus}",
                f"train.global_batch_size={batch * gpus}", f"train.seq_len={f['seq_len']}", f"plan.gpu={f['gpu']}",
                "plan.margin_gib=0", f"plan.expandable_segments={str(f['allocator'] == 'expandable').lower()}",
                f"compile.enabled={str(f['compile'] == 'yes').lower()}", *ac]


def rows() -> list[Row]:
    with TABLE.open() as f:
        return [Row(r) for r in csv.DictReader(f)]


def plan_row(row: Row, compose) -> Plan:
    """The plan for one row; `compose` turns overrides into the run's config (Hydra's compose)."""
    cfg = compose(row.overrides())
    with Planner(cfg) as planner:
        return planner.plan(planner.point(cfg.ac.mode), recompute=False)


def error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured
