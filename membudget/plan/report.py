"""plan.md, plan.json and the sweep's plots: what a plan says, in words a user reads before a GPU job."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from membudget.units import GiB, fmt_bytes

from .blocks import TargetChoice, cost, fits
from .result import DOES_NOT_FIT, Plan
from .trace import CATEGORIES


def _compile_words(plan: Plan) -> str:
    s = plan.setting
    if not s.compile:
        return "blocks not compiled (eager)"
    if s.planned_backend != s.configured_backend:
        return (f"blocks compiled with {s.configured_backend}, planned as {s.planned_backend} (the same "
                f"decompositions, partitioner and budget, without code generation; its pointwise ops priced as "
                f"the fused kernels {s.configured_backend} makes of them)")
    return f"blocks compiled with {s.planned_backend}"


def _estimator_words(plan: Plan) -> str:
    """What the plan assumed of the partitioner's runtime estimator, where it differs from the run's."""
    if plan.ac_mode != "memory_budget" or plan.setting.runtime_estimator == "flops":
        return ""
    return (f" Recompute chosen as with ac.runtime_estimator=flops: the run's {plan.setting.runtime_estimator} "
            f"times each op on the GPU, which a plan cannot, so it may recompute a different set; plan and "
            f"train with flops to get what is planned.")


def _reshard_words(setting) -> str:
    """FSDP2's reshard policy, where one applies (sharded groups) and it is not the default."""
    if setting.dp_shard == 1 or setting.reshard_after_forward == "default":
        return ""
    return f"; parallelism.reshard_after_forward={setting.reshard_after_forward}"


def _verdict(plan: Plan) -> str:
    return plan.verdict.upper() if plan.verdict == DOES_NOT_FIT else plan.verdict


def plan_markdown(plan: Plan) -> str:
    s, d = plan.setting, plan.device
    rows = [("allocated peak", plan.allocated.nbytes, plan.allocated.describe())]
    if plan.reserved is not None:
        other = "default" if s.allocator != "default" else "expandable segments"
        rows += [(f"reserved peak ({s.allocator} allocator)", plan.reserved.nbytes, plan.reserved.describe()),
                 ("torch.cuda.max_memory_allocated (blocks as rounded)", plan.max_allocated, ""),
                 (f"reserved peak with the {other} allocator", plan.reserved_other.nbytes,
                  plan.reserved_other.describe())]
        rows += [(f"outside the allocator: {name}", nbytes, "") for name, nbytes in plan.overheads.items()]
        rows.append(("needed: reserved peak and the above", plan.needed, ""))
    rows.append((f"limit: {plan.limit_source}", plan.limit, ""))
    lines = [
        f"# Plan: {s.model}, {plan.label}",
        "",
        f"**{_verdict(plan)}**: {plan.verdict_reason}.",
        "",
        f"Device: {d.name} ({d.reason}). Each of {s.world_size} ranks alike (dp_replicate {s.dp_replicate}, "
        f"dp_shard {s.dp_shard}, tp {s.tp}; FSDP2 pads every shard to one size{_reshard_words(s)}); micro-batch "
        f"{s.micro_batch} x {s.seq_len} tokens, {s.grad_accumulation} per step; {s.dtype}, {s.attention} attention; "
        f"{_compile_words(plan)}; planned in {plan.seconds:.1f} s.{_estimator_words(plan)}",
        "",
        "| memory per rank | | when |", "|---|---:|---|",
        *[f"| {name} | {fmt_bytes(value)} | {when} |" for name, value, when in rows],
        "",
        "| part | at the allocated peak | at the reserved peak |", "|---|---:|---:|",
    ]
    reserved = plan.reserved.breakdown if plan.reserved is not None else {}
    for part in (*CATEGORIES, "allocator slack"):
        lines.append(f"| {part} | {fmt_bytes(plan.allocated.breakdown.get(part))} | {fmt_bytes(reserved.get(part))} |")
    lines += [
        "",
        f"Per rank: parameters {fmt_bytes(plan.parameters)}, buffers {fmt_bytes(plan.buffers)}, gradients "
        f"{fmt_bytes(plan.gradients)}, AdamW states {fmt_bytes(plan.optimizer_states)}; activations saved for backward "
        f"{fmt_bytes(plan.activations)} a micro-batch; initialisation holds {fmt_bytes(plan.init_transient)} more than the "
        "parameters (a CPU mesh initialises each parameter at full size, a GPU mesh each shard in place).",
        "",
        f"Blocks' policies, bottom first: `{plan.policies}`; on the device they keep "
        + ", ".join(f"{fmt_bytes(b.activation_bytes)} ({b.policy})" for b in plan.blocks) + " (the probe's blocks)"
        + (f"; offloaded to pinned host memory: {fmt_bytes(plan.host_bytes)} a micro-batch, copies "
           f"{plan.time.offload_transfers * 1e3:.1f} ms on the host link of which the step waits "
           f"{plan.time.offload_waits * 1e3:.1f} ms" if plan.host_bytes and plan.time else
           f"; offloaded to host memory: {fmt_bytes(plan.host_bytes)}" if plan.host_bytes else "") + ".",
        "",
        "| step | allocated peak | when |", "|---|---:|---|",
        *[f"| {step}{' (no optimizer states before its optimizer step)' if step == 1 else ''} | {fmt_bytes(m.nbytes)} | "
          f"{m.phase} |" for step, m in sorted(plan.per_step.items()) if step],
        "",
    ]
    if plan.time is not None:
        t = plan.time
        lines += [
            f"Predicted on {d.name}: {t.seconds:.3f} s a step, {plan.tokens_per_s_per_device:,.0f} tokens/s per "
            f"device ({plan.tokens_per_s:,.0f} in all), **bound by {t.bound}**; the compute stream "
            f"{t.compute:.3f} s (" + ", ".join(f"{kind} kernels {s:.3f} s" for kind, s in t.kernels.items() if s)
            + (f", TP's collectives {t.tp_communication:.3f} s" if t.tp_communication else "")
            + f"), the host {t.host:.3f} s to issue it, FSDP communication {t.communication:.3f} s of which "
            f"{t.exposed_communication:.3f} s exposed"
            + ("" if plan.recompute_flops is None else
               f"; recompute {plan.recompute_flops / 1e12:.4g} TFLOP ({plan.recompute_ratio:.0%} of the forward)")
            + f". Every rank that tokenizes reads the whole global batch: {plan.tokens_per_s / 1e6:.3g} M tokens/s at "
              "this speed (the run's `data_wait_s` says whether it keeps up; `data.tokenize_threads`; a corpus "
              "tokenized once, data=tokens, is read by each rank for its own rows only).",
            "",
        ]
    return "\n".join(lines)


def reshard_markdown(plan: Plan, others: list[Plan]) -> str:
    """The plan's setting under each of FSDP2's reshard policies (plan.sweep.plan_with_reshard_policies); "" where
    nothing is sharded."""
    if not others:
        return ""
    timed = plan.time is not None
    lines = ["", "## FSDP's reshard policies (parallelism.reshard_after_forward), the same setting", "",
             "never keeps each block's gathered parameters from its forward to its backward (no all-gather in the "
             "backward); always also frees the last block's after its forward; default frees every block's but the "
             "last's.", "",
             f"| policy | {plan.peak_name} | against the limit | verdict |"
             + (" step s | tokens/s per device |" if timed else ""),
             "|---|---:|---:|---|" + ("---:|---:|" if timed else "")]
    for p in sorted([plan, *others], key=lambda p: p.setting.reshard_after_forward):
        name = p.setting.reshard_after_forward + (" (this plan)" if p is plan else "")
        speed = f" {p.step_seconds:.3f} | {p.tokens_per_s_per_device:,.0f} |" if timed else ""
        lines.append(f"| {name} | {fmt_bytes(p.reserved_peak)} | {fmt_bytes(p.judged_bytes)} | {p.verdict} |{speed}")
    return "\n".join(lines) + "\n"


def non_monotonic(plans: list[Plan]) -> list[Plan]:
    """Budget points whose reserved peak is below that of a smaller budget: the peak is not monotonic there."""
    budgets = sorted((p for p in plans if p.ac_mode == "memory_budget"), key=lambda p: p.memory_budget)
    return [p for i, p in enumerate(budgets) if any(q.reserved_peak > p.reserved_peak for q in budgets[:i])]


def sweep_markdown(plans: list[Plan], chosen: Optional[Plan] = None) -> str:
    first = plans[0]
    flagged = non_monotonic(plans)
    timed = first.time is not None
    lines = [
        f"# Sweep: {first.setting.model}, each of {first.setting.world_size} ranks, limit {fmt_bytes(first.limit)} on "
        f"{first.device.name} ({first.device.reason})",
        "",
        "| setting | activations | allocated peak | " + ("reserved peak | " if first.reserved else "")
        + "when | verdict | " + ("step s | tokens/s per device | " if timed else "") + "recompute (of forward) |",
        "|---|---:|---:|" + ("---:|" if first.reserved else "") + "---|---|" + ("---:|---:|" if timed else "")
        + "---:|",
    ]
    for p in plans + ([chosen] if chosen is not None and chosen not in plans else []):
        note = (" (peak below a smaller budget's)" if p in flagged else "") + (" **chosen**" if p is chosen else "")
        when = (p.reserved or p.allocated).describe()
        speed = f"{p.step_seconds:.3f} | {p.tokens_per_s_per_device:,.0f} | " if timed else ""
        reserved = f"{fmt_bytes(p.reserved_peak)} | " if first.reserved else ""
        lines.append(f"| {p.label}{note} | {fmt_bytes(p.activations)} | {fmt_bytes(p.peak)} | {reserved}{when} | {p.verdict} | "
                     f"{speed}{p.recompute_ratio:.1%} |")
    return "\n".join(lines) + "\n"


def _speed(plan: Optional[Plan]) -> str:
    """tokens/s per device, or without a time model the recompute share."""
    if plan is None:
        return "-"
    if plan.time is None:
        return f"{plan.recompute_ratio:.1%} recompute"
    return f"{plan.tokens_per_s_per_device:,.0f}"


def blocks_markdown(choices: list[TargetChoice], plans: list[Plan]) -> str:
    """Per memory target: full, selective, the best uniform setting and the best per-block plan, and the gain."""
    timed = plans[0].time is not None
    named = {p.label: p for p in plans if p.ac_mode in ("full", "selective")}
    lines = ["## Per-block policies against single settings, by memory target", "",
             ("Predicted tokens/s per device" if timed else "Recompute, share of the forward FLOPs (no time model "
              "on a CPU)") + "; `-` where the setting does not fit the target. Targets fall between the peaks of "
             "single settings; the per-block plan is planned again as a whole. gain: the per-block plan against the "
             "best single setting; vs full: the better of the two against ac=full (eager), by predicted time.", "",
             "| target | " + " | ".join(named) + " | best single setting | per-block policies | gain | vs full |",
             "|---:|" + "---:|" * len(named) + "---|---|---:|---:|"]
    for c in choices:
        fitting = [_speed(p) if fits(p, c.target) else "-" for p in named.values()]
        single = c.single
        mixed = (f"{c.per_block.policies}: {_speed(c.per_block)} ({fmt_bytes(c.per_block.judged_bytes)})"
                 if c.per_block else "none beats it")
        gain = "-" if c.gain is None else f"{c.gain:+.1%}"
        against_full = "-"
        full = named.get("full")
        if c.best is not None and full is not None and c.best.time is not None:
            against_full = f"{cost(full) / cost(c.best) - 1:+.1%}"
        lines.append(f"| {fmt_bytes(c.target)} | " + " | ".join(fitting) + " | "
                     + (f"{single.label}: {_speed(single)} ({fmt_bytes(single.judged_bytes)})" if single else "-")
                     + f" | {mixed} | {gain} | {against_full} |")
    return "\n".join(lines) + "\n"


def plot_sweep(plans: list[Plan], out_dir: Path, chosen: Optional[Plan] = None,
               per_block: Optional[list[Plan]] = None) -> list[Path]:
    """Reserved peak against predicted step time (recompute FLOPs without a time model), and the peak against
    the budget; PNG and SVG."""
    from matplotlib.figure import Figure  # no pyplot: the Agg canvas, no display

    timed = plans[0].time is not None
    x_of = (lambda p: p.step_seconds) if timed else (lambda p: 100 * p.recompute_ratio)
    budgets = sorted((p for p in plans if p.ac_mode == "memory_budget"), key=lambda p: p.memory_budget)
    flagged = non_monotonic(plans)
    fig = Figure(figsize=(12, 5), layout="constrained")
    ax, peak_ax = fig.subplots(1, 2)
    ax.plot([x_of(p) for p in budgets], [p.reserved_peak / GiB for p in budgets], "o-", label="memory budget")
    labels: dict[tuple[float, float], list[str]] = {}  # budgets that land on one point share a label
    for p in budgets:
        labels.setdefault((round(x_of(p), 6), round(p.reserved_peak / GiB, 3)), []).append(f"{p.memory_budget:g}")
    for xy, names in labels.items():
        ax.annotate(", ".join(names), xy, textcoords="offset points", xytext=(4, 4), fontsize=8)
    peak_ax.plot([p.memory_budget for p in budgets], [p.reserved_peak / GiB for p in budgets], "o-",
                 label="memory budget")
    for p, marker in zip((p for p in plans if p.ac_mode != "memory_budget"), "s^D"):
        (point,) = ax.plot(x_of(p), p.reserved_peak / GiB, marker, markersize=9, label=p.label)
        peak_ax.axhline(p.reserved_peak / GiB, linestyle=":", color=point.get_color(), label=p.label)
    for p in flagged:
        peak_ax.plot(p.memory_budget, p.reserved_peak / GiB, "o", markersize=14, mfc="none", mec="red")
    if flagged:
        peak_ax.plot([], [], "o", mfc="none", mec="red", label="peak below a smaller budget's")
    for i, p in enumerate(per_block or []):
        ax.plot(x_of(p), p.reserved_peak / GiB, "P", markersize=10, color="purple",
                label="per-block plans" if i == 0 else None)
        ax.annotate(str(p.memory_budget), (x_of(p), p.reserved_peak / GiB), textcoords="offset points",
                    xytext=(4, -10), fontsize=7, color="purple")
    if chosen is not None:
        ax.plot(x_of(chosen), chosen.reserved_peak / GiB, "*", markersize=16, color="green", label="chosen (auto)")
    if chosen is not None and not isinstance(chosen.memory_budget, str):  # a per-block plan has no one budget
        peak_ax.plot(chosen.memory_budget, chosen.reserved_peak / GiB, "*", markersize=16, color="green",
                     label="chosen (auto)")
    if plans[0].limit is not None:
        for axis in (ax, peak_ax):
            axis.axhline(plans[0].limit / GiB, color="gray", linestyle="--", label="limit")
    memory = "reserved" if plans[0].reserved is not None else "allocated"
    ax.set(xlabel=f"predicted step time on {plans[0].device.name}, s" if timed else "recompute, % of forward FLOPs",
           ylabel=f"{memory} peak, GiB per rank", title="memory against time")
    peak_ax.set(xlabel="ac.memory_budget", ylabel=f"{memory} peak, GiB per rank", title="peak against the budget")
    for axis in (ax, peak_ax):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    paths = [out_dir / f"sweep.{fmt}" for fmt in ("png", "svg")]
    for path in paths:
        fig.savefig(path)
    return paths
