"""How long the planner takes, and how close it comes to public GPU measurements.

    python scripts/bench_plan.py                      # Llama 3 8B, seq 8192, FSDP over 64 ranks, 2 threads
    python scripts/bench_plan.py plan.world_size=8 train.global_batch_size=8
    python scripts/bench_plan.py --evidence           # every row of docs/planner/evidence.csv: prediction, error
    python scripts/bench_plan.py --blocks             # per-block policies against single settings (issue 26)

Extra arguments are Hydra overrides on top of that setting. Targets (issue 14): one setting under a minute, the
11-point budget sweep under five, on 2 CPU cores. Each is timed in a fresh Planner, so it pays for the probes, the
optimizer step and the ac=none reference as a user's command would (not Python's start-up). --evidence writes
docs/planner/evidence.md, the table the README's planner section shows. --blocks writes docs/planner/per_block.md:
for each setting of BLOCK_SETTINGS, at full AC's own peak and at memory targets between the single settings' peaks,
the predicted tokens/s of full AC, selective, the best single setting and the best per-block plan (offloading
included).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.plan import Planner, plan_setting, plan_sweep  # noqa: E402
from membudget.plan.blocks import best_single, cost, fits, per_target, targets_between  # noqa: E402
from membudget.plan.result import limit_for  # noqa: E402
from membudget.plan.report import blocks_markdown  # noqa: E402
from membudget.devices import GPUS  # noqa: E402
from membudget.plan.evidence import error, plan_row, ranked_pairs, rows, speed_summary  # noqa: E402
from membudget.collector import collect_rarely  # noqa: E402
from membudget.launch import compose_config  # noqa: E402
from membudget.units import GiB, KiB, fmt_bytes  # noqa: E402

SETTING = ["logger=none", "model=llama3_8b", "train.seq_len=8192", "parallelism=fsdp", "plan.world_size=64",
           "train.global_batch_size=64", "train.micro_batch_size=1", "ac=memory_budget", "ac.memory_budget=0.5"]


def timings(overrides: list[str]) -> None:
    cfg = compose_config(SETTING + overrides)
    print(f"{cfg.model.name}, seq {cfg.train.seq_len}, parallelism={cfg.parallelism.name} over "
          f"{cfg.plan.world_size} ranks, {torch.get_num_threads()} threads")
    start = time.perf_counter()
    plan = plan_setting(cfg)
    print(f"one setting ({plan.label}): {time.perf_counter() - start:.1f} s  (target < 60 s); "
          f"reserved peak {plan.reserved_peak / GiB:.2f} GiB at {plan.reserved.describe()}")
    start = time.perf_counter()
    plans = plan_sweep(cfg, references=False)
    seconds = time.perf_counter() - start
    print(f"budget sweep, {len(plans)} points: {seconds:.1f} s  (target < 300 s); per point: "
          + ", ".join(f"{p.memory_budget:g}: {p.seconds:.1f}" for p in plans))
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KiB / GiB:.2f} GiB")


COMMON = ["logger=none", "train.seq_len=8192", "ac=memory_budget", "ac.memory_budget=0.5"]
BLOCK_SETTINGS = {
    "Llama 3 8B, FSDP over 8 H100s, batch 2 x 8192 per GPU":
        ["model=llama3_8b", "parallelism=fsdp", "plan.world_size=8", "train.global_batch_size=16",
         "train.micro_batch_size=2"],
    "Llama 3 8B, FSDP over 64 H100s, batch 2 x 8192 per GPU":
        ["model=llama3_8b", "parallelism=fsdp", "plan.world_size=64", "train.global_batch_size=128",
         "train.micro_batch_size=2"],
    "Llama 3 70B, FSDP 8 x TP 8 over 64 H100s, batch 1 x 8192 per replica":
        ["model=llama3_70b", "parallelism=fsdp_tp", "parallelism.tp=8", "plan.world_size=64",
         "train.global_batch_size=8", "train.micro_batch_size=1"],
}


def at_full_ac(plans, choice) -> str:
    """One line: at full AC's own peak, the chosen per-block plan against full AC, the best single budget and
    selective op (each at its own peak: `fits` says whether it fits the target)."""
    full = next(p for p in plans if p.label == "full")
    best = choice.best
    if best is None or best.time is None:
        return "at full AC's peak: nothing beats full AC"
    parts = [f"**{best.policies}**: {best.tokens_per_s_per_device:,.0f} tokens/s per GPU at "
             f"{fmt_bytes(best.judged_bytes)}"]
    budgets = [p for p in plans if p.ac_mode == "memory_budget"]
    rivals = {"full AC": full, "the best single budget that fits": best_single(budgets, choice.target),
              "the fastest single budget": min(budgets, key=cost),
              "selective op": next(p for p in plans if p.label == "selective op")}
    for name, p in rivals.items():
        if p is None:
            parts.append(f"{name}: none")
            continue
        where = "fits" if fits(p, choice.target) else "does not fit"
        parts.append(f"{cost(p) / cost(best) - 1:+.1%} over {name} ({p.label}, {fmt_bytes(p.judged_bytes)}, {where})")
    return "At full AC's peak: " + "; ".join(parts)


def blocks(most_targets: int = 2) -> str:
    parts = []
    for title, overrides in BLOCK_SETTINGS.items():
        start = time.perf_counter()
        cfg = compose_config(COMMON + overrides)
        plans = plan_sweep(cfg, offload=True)
        full = next(p for p in plans if p.label == "full")
        at_full = int(limit_for(full.judged_bytes)) + 1  # full AC just fits: its own memory
        targets = [at_full] + [t for t in targets_between(plans, plans[0].limit, most_targets) if t != at_full]
        with Planner(cfg) as planner:
            choices = per_target(planner, plans, targets)
        seconds = time.perf_counter() - start
        table = blocks_markdown(choices, plans).split("\n", 2)[2]  # without its heading
        parts.append(f"### {title}\n\n`{' '.join(overrides)}` (planned in {seconds:.0f} s)\n\n"
                     f"{at_full_ac(plans, choices[0])}.\n\n{table}")
        print(parts[-1], flush=True)
    return "\n".join(parts)


def _pct(predicted, measured) -> str:
    return "-" if predicted is None or measured is None else f"{error(predicted, measured):+.1%}"


def evidence() -> str:
    lines = ["| row | measured GiB | reserved peak, as run | error | with the other allocator | error | verdict | "
             "measured tokens/s per GPU | predicted | error | speed |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    all_rows, plans, by_config = rows(), {}, {}
    for row in all_rows:
        f = row.fields
        if int(f["dp_shard"]) * int(f.get("tp") or 1) != int(f["gpus"]) or f["gpu"] not in GPUS:
            continue  # pipeline or context parallelism, or a GPU the table lacks: nothing to plan
        key = tuple(row.overrides())
        if key not in by_config:
            start = time.perf_counter()
            try:
                by_config[key] = plan_row(row, compose_config)
            except Exception as e:  # a layout this trainer refuses (e.g. pipeline stages): a row without a plan
                by_config[key] = e
            print(f"{row.id}: planned in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        plan, measured = by_config[key], row.measured
        measured_gib = "OOM" if row.fields["outcome"] == "oom" else "-" if measured is None else f"{measured / GiB:.2f}"
        note = "" if row.modelled else " (not modelled)"
        if isinstance(plan, Exception):
            lines.append(f"| {row.id}{note} | {measured_gib} | not planned: {str(plan).splitlines()[0][:80]} |"
                         + " |" * 8)
            continue
        plans[row.id] = plan
        other = plan.reserved_other.nbytes
        role = "-" if not (row.modelled and row.measured_speed) else "fitted" if row.fitted else "held out"
        lines.append(
            f"| {row.id}{note} | {measured_gib} | {plan.reserved_peak / GiB:.2f} | "
            f"{_pct(plan.reserved_peak, measured)} | "
            f"{other / GiB:.2f} | {_pct(other, measured)} | {plan.verdict} | "
            f"{'-' if not row.measured_speed else f'{row.measured_speed:,.0f}'} | "
            f"{plan.tokens_per_s_per_device:,.0f} | {_pct(plan.tokens_per_s_per_device, row.measured_speed)} | "
            f"{role} |")
    summary = speed_summary(all_rows, plans)
    lines += ["", f"Tokens/s of modelled rows: {summary.line()}.", "",
              "Settings of one run whose measured speeds differ by 5 % or more, faster first:", ""]
    for fast, slow in ranked_pairs(all_rows):
        same = plans[fast.id].tokens_per_s_per_device > plans[slow.id].tokens_per_s_per_device
        lines.append(f"- {fast.id} over {slow.id}: measured {fast.measured_speed / slow.measured_speed - 1:+.1%}, "
                     f"planned {plans[fast.id].tokens_per_s_per_device / plans[slow.id].tokens_per_s_per_device - 1:+.1%}"
                     f" ({'same order' if same else 'WRONG ORDER'})")
    return "\n".join(lines) + "\n"


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(2)
    collect_rarely()  # as the planner's CLI plans
    args = sys.argv[1:]
    if "--evidence" in args:
        text = evidence()
        (ROOT / "docs" / "planner" / "evidence.md").write_text(
            "# The planner against public measurements\n\nWritten by `python scripts/bench_plan.py --evidence` "
            "from docs/planner/evidence.csv (sources and configurations there). \"As run\": the row's allocator "
            "setting (PyTorch's default unless the source sets PYTORCH_CUDA_ALLOC_CONF).\n\n" + text)
        print(text)
    elif "--blocks" in args:
        text = blocks()
        (ROOT / "docs" / "planner" / "per_block.md").write_text(
            "# Per-block policies against single settings\n\nWritten by `python scripts/bench_plan.py --blocks` "
            f"(common overrides `{' '.join(COMMON)}`); the H100 80GB SXM's limit less plan.margin_gib.\n\n" + text)
    else:
        timings(args)


if __name__ == "__main__":
    main()
