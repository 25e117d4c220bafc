"""The report's plots (PNG and SVG, rendered with Agg: no GUI). Every run has one style, the same in every
plot: budget runs coloured by their budget on one colour scale, the other modes in fixed colours, and a
marker of its own per run, so that no two series look alike.

- loss: every run's loss, and beside it one small panel per run with its difference to the ac=none run on a
  shared axis, the loss tolerance shaded: equal curves show as flat lines at zero, each in its own panel.
- memory_vs_time: activation memory against step time, the Pareto front as a step line; labels are placed
  where they overlap no other label or point, and points that coincide share one label.
- budget: the budget against activation memory and step time (budget sweeps), other modes as lines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
from matplotlib.transforms import Bbox

from membudget.report.jobs import Job, mean_budget
from membudget.units import MiB
from membudget.report.pareto import FrontPoint

PLOT_FORMATS = ("png", "svg")
WIDTH, DPI = 9.0, 100  # 900 px wide: about the width GitHub shows a README image at, so text stays legible
FONT = 9
MARKERS = ["o", "s", "D", "^", "v", "P", "X", "*", "<", ">", "h", "p", "d", "8"]
LINESTYLES = ["-", "--", "-.", ":"]
MODE_COLORS = ["black", "tab:red", "tab:pink", "tab:brown", "tab:gray", "tab:olive", "tab:cyan", "tab:purple"]


@dataclass(frozen=True)
class Style:
    color: Any
    marker: str
    linestyle: str


def styles(rows: list[dict[str, Any]]) -> dict[int, Style]:
    """job -> Style; (marker, line style) is unique up to 56 runs, colours carry the budget."""
    cmap = colormaps["viridis"]
    others = 0
    result = {}
    for i, r in enumerate(rows):
        budget = mean_budget(r["memory_budget"])
        if budget is not None:
            color = cmap(0.05 + 0.8 * min(max(budget, 0.0), 1.0))  # 0.85+ is a yellow that white hides
        else:
            color, others = MODE_COLORS[others % len(MODE_COLORS)], others + 1
        result[r["job"]] = Style(color, MARKERS[i % len(MARKERS)], LINESTYLES[i // len(MARKERS) % len(LINESTYLES)])
    return result


def short_label(row: dict[str, Any]) -> str:
    """A budget run by its budget alone (the plots say the numbers are budgets), others by their label."""
    return str(row["memory_budget"]) if row["memory_budget"] is not None else row["run"]


def _new_figure(height: float) -> Figure:
    fig = Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, out_dir: Path, name: str) -> list[Path]:
    if fig.get_layout_engine() is not None:
        _freeze_layout(fig)  # lay out once for all formats: the layout is half of the rendering time
    paths = [out_dir / f"{name}.{fmt}" for fmt in PLOT_FORMATS]
    for path in paths:
        fig.savefig(path, dpi=DPI)
    return paths


def _freeze_layout(fig: Figure):
    """Run the constrained layout once and keep it: labels placed in pixels afterwards stay where put."""
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    return fig.canvas.get_renderer()


# --- loss ---------------------------------------------------------------------------------------------------

def loss_figure(jobs: list[Job], baselines: dict[int, Job], style: dict[int, Style], tolerance: float,
                flagged: set[int]) -> Figure:
    """Left: every run's loss. Right: one strip per run, its loss minus its ac=none run's, scaled so that the
    shaded band is the tolerance: an equal run is a flat line in its own strip, never hidden behind another."""
    done = [j for j in jobs if j.status == "completed" and j.losses and j.num in style]
    # references (the ac=none runs) first, as their own strips: the right panel is the legend of the left
    compared = [j for j in done if baselines.get(j.num) is j] + [j for j in done if baselines.get(j.num) not in (None, j)]
    fig = _new_figure(max(3.6, 0.3 * len(compared) + 1.4))
    ax, strips = fig.subplots(1, 2, width_ratios=[1, 1.2] if compared else [1, 0.001])
    period = max(len(done), 1)
    for i, job in enumerate(done):
        s, steps = style[job.num], sorted(job.losses)
        # each run's markers at its own steps: where curves coincide, every run's markers still show
        ax.plot(steps, [job.losses[k] for k in steps], color=s.color, linestyle=s.linestyle, marker=s.marker,
                markevery=(i % period, period), markersize=4, linewidth=1, label=job.label)
    ax.set_xlabel("step", fontsize=FONT)
    ax.set_ylabel("loss", fontsize=FONT)
    ax.tick_params(labelsize=FONT)
    if len(compared) < 2:
        ax.set_title("Loss of every run", fontsize=FONT + 1)
        ax.legend(fontsize=FONT - 1, framealpha=0.9)
        strips.set_axis_off()
        return fig
    ax.set_title("Loss of every run (markers as on the right)", fontsize=FONT + 1)

    half = 0.4  # the tolerance band's half height in a strip one unit high
    for row, job in enumerate(reversed(compared)):  # the first run on top
        base, s = baselines[job.num], style[job.num]
        steps = sorted(job.losses.keys() & base.losses.keys())
        diff = [job.losses[t] - base.losses[t] for t in steps]
        band = [tolerance * (1 + abs(base.losses[t])) for t in steps]
        scale = half / max(max(band), 1e-30)
        strips.fill_between(steps, [row - b * scale for b in band], [row + b * scale for b in band], color="0.9",
                            linewidth=0)
        # beyond the strip (1.25x the tolerance) a value is drawn at the edge; the text gives its size
        y = [row + max(-0.5, min(0.5, d * scale)) if math.isfinite(d) else math.nan for d in diff]
        strips.plot(steps, y, color=s.color, marker=s.marker, linestyle=s.linestyle, markersize=3.5, linewidth=1.2,
                    markevery=max(1, len(steps) // 8))
        finite = [abs(d) for d in diff if math.isfinite(d)]
        worst = max(finite, default=0.0)
        if base is job:
            what = "the reference"
        elif len(finite) < len(diff):
            what = "not finite"
        elif worst == 0:
            what = "identical"
        else:
            what = f"max |diff| {worst:.1e}"
        strips.annotate(what, (1, row), xycoords=("axes fraction", "data"), xytext=(4, 0), textcoords="offset points",
                        va="center", fontsize=FONT - 1, color="red" if job.num in flagged else "black")
    strips.set_yticks(range(len(compared)), [j.label for j in reversed(compared)], fontsize=FONT - 1)
    strips.set_ylim(-0.6, len(compared) - 0.4)
    strips.tick_params(axis="x", labelsize=FONT)
    strips.set_xlabel("step", fontsize=FONT)
    strips.set_title("loss minus loss of ac=none, per run (shaded: the tolerance)", fontsize=FONT + 1)
    return fig


# --- memory against time ------------------------------------------------------------------------------------

def _overlap(a: Bbox, b: Bbox) -> float:
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w * h if w > 0 and h > 0 else 0.0


def place_labels(ax, points: list[tuple[float, float, str]], renderer, obstacles: list[Bbox],
                 fontsize: float = FONT) -> list:
    """Annotate each (x, y, text) where its label overlaps no placed label, point or obstacle and stays in
    the axes: the first free spot on rings of growing radius around the point (far spots get a leader
    line). Returns the annotations."""
    to_px = ax.transData.transform
    inside = ax.get_window_extent(renderer).padded(-2)
    marks = [Bbox.from_bounds(px - 7, py - 7, 14, 14) for px, py in (to_px((x, y)) for x, y, _ in points)]
    taken = list(obstacles) + marks
    pt_per_px = 72 / ax.figure.dpi
    annotations = []
    for x, y, text in points:
        px, py = to_px((x, y))
        probe = ax.annotate(text, (x, y), fontsize=fontsize)
        box = probe.get_window_extent(renderer)
        probe.remove()
        w, h = box.width, box.height
        best, best_cost = None, math.inf
        for r in (8, 16, 28, 44, 64, 88):
            d = r * 0.7
            for dx, dy in ((r, -h / 2), (-r - w, -h / 2), (d, d), (d, -d - h), (-d - w, d), (-d - w, -d - h),
                           (-w / 2, r), (-w / 2, -r - h)):
                cand = Bbox.from_bounds(px + dx, py + dy, w, h)
                cost = sum(_overlap(cand, t) for t in taken)
                if not inside.contains(cand.x0, cand.y0) or not inside.contains(cand.x1, cand.y1):
                    cost += 1e6
                if cost < best_cost:
                    best, best_cost = (dx, dy, r, cand), cost
            if best_cost == 0:
                break
        dx, dy, r, cand = best
        leader = dict(arrowstyle="-", color="0.55", linewidth=0.6, shrinkA=0, shrinkB=4) if r > 16 else None
        annotations.append(ax.annotate(text, (x, y), xytext=(dx * pt_per_px, dy * pt_per_px),
                                       textcoords="offset points", ha="left", va="bottom", fontsize=fontsize,
                                       arrowprops=leader, zorder=5))
        taken.append(cand.padded(2))
    return annotations


def memory_time_figure(rows: list[dict[str, Any]], front: list[FrontPoint], style: dict[int, Style]) -> Optional[Figure]:
    measured = [r for r in rows if r["activation_bytes"] is not None and r["median_step_time_s"] is not None]
    if not measured:
        return None
    ms = max(r["median_step_time_s"] for r in measured) < 1
    scale, unit = (1e3, "ms") if ms else (1, "s")
    xy = {r["job"]: (r["activation_bytes"] / MiB, r["median_step_time_s"] * scale) for r in measured}
    fig = _new_figure(5.0)
    ax = fig.subplots()
    bests = sorted((p.best for p in front), key=lambda r: r["activation_bytes"])
    if bests:
        ax.step([xy[r["job"]][0] for r in bests], [xy[r["job"]][1] for r in bests], where="post", color="tab:orange",
                linewidth=2.5, alpha=0.5, zorder=1, label="Pareto front (fastest at each memory)")
    named = {p.best["job"] for p in front}
    tied = {t["job"] for p in front for t in p.tied}
    edges = {**{j: "tab:orange" for j in tied}, **{j: "black" for j in named}}
    for r in measured:
        s = style[r["job"]]
        ax.scatter(*xy[r["job"]], color=s.color, marker=s.marker, s=60 if r["job"] in edges else 40, zorder=3,
                   edgecolors=edges.get(r["job"], "none"), linewidths=1.3)
        if r["loss_flagged"]:
            ax.scatter(*xy[r["job"]], marker="x", color="red", s=120, zorder=4, linewidths=1.5)
    if any(r["loss_flagged"] for r in measured):
        ax.scatter([], [], marker="x", color="red", label="loss flagged: off the front")
    ax.scatter([], [], marker="o", color="white", edgecolors="black", label="on the front (black edge)")
    if tied:
        ax.scatter([], [], marker="o", color="white", edgecolors="tab:orange",
                   label="tied with a front run (orange edge)")
    ax.set_xlabel("activation memory (MiB)", fontsize=FONT + 1)
    ax.set_ylabel(f"median step time ({unit})", fontsize=FONT + 1)
    budgets = any(r["memory_budget"] is not None for r in measured)
    ax.set_title("Activation memory vs step time" + (" (numbers: memory_budget)" if budgets else ""),
                 fontsize=FONT + 2)
    ax.tick_params(labelsize=FONT)
    times = [y for _, y in xy.values()]
    if max(times) > 3 * min(times):  # outliers (a loaded machine): a log axis keeps the rest readable
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.margins(x=0.12, y=0.15)
    legend = ax.legend(fontsize=FONT - 0.5, loc="best", framealpha=0.9)
    renderer = _freeze_layout(fig)
    # points that coincide on screen (within a marker) share one label, "0.8, 0.9"
    to_px = ax.transData.transform
    groups: list[list[dict[str, Any]]] = []
    for r in sorted(measured, key=lambda r: (r["pareto"] != "front", xy[r["job"]])):
        px = to_px(xy[r["job"]])
        for g in groups:
            gx = to_px(xy[g[0]["job"]])
            if math.dist(px, gx) < 7:
                g.append(r)
                break
        else:
            groups.append([r])
    labels = [(*xy[g[0]["job"]], ", ".join(short_label(r) + (" (loss flagged)" if r["loss_flagged"] else "")
                                           for r in sorted(g, key=lambda r: r["job"]))) for g in groups]
    place_labels(ax, labels, renderer, [legend.get_window_extent(renderer).padded(3)])
    return fig


# --- budget ----------------------------------------------------------------------------------------------

def _spread(ys: list[float], gap: float) -> list[float]:
    """Positions for labels wanted at ys (pixels): in the same order, at least `gap` apart."""
    order = sorted(range(len(ys)), key=ys.__getitem__)
    out = list(ys)
    for a, b in zip(order, order[1:]):
        out[b] = max(out[b], out[a] + gap)
    return out


def budget_figure(rows: list[dict[str, Any]], style: dict[int, Style]) -> Optional[Figure]:
    budget_rows = [r for r in rows if r["memory_budget"] is not None]
    scalar = sorted((r for r in budget_rows if not isinstance(r["memory_budget"], str)),
                    key=lambda r: float(r["memory_budget"]))
    if len({mean_budget(r["memory_budget"]) for r in budget_rows}) < 2:  # not a budget sweep
        return None
    per_block = [r for r in budget_rows if isinstance(r["memory_budget"], str)]
    refs = [r for r in rows if r["memory_budget"] is None]
    fig = _new_figure(4.0)
    axes = fig.subplots(1, 2)
    ms = max((r["median_step_time_s"] or 0) for r in rows) < 1
    panels = ((axes[0], "activation_bytes", 1 / MiB, "activation memory (MiB)"),
              (axes[1], "median_step_time_s", 1e3 if ms else 1, f"median step time ({'ms' if ms else 's'})"))
    for ax, key, scale, ylabel in panels:
        line = [(float(r["memory_budget"]), r[key] * scale, r) for r in scalar if r[key] is not None]
        ax.plot([x for x, _, _ in line], [y for _, y, _ in line], color="0.6", linewidth=1, zorder=1)
        for x, y, r in line:
            s = style[r["job"]]
            ax.scatter(x, y, color=s.color, marker=s.marker, s=30, zorder=3)
        for r in per_block:
            if r[key] is not None:
                ax.scatter(mean_budget(r["memory_budget"]), r[key] * scale, marker=style[r["job"]].marker, s=45,
                           facecolors="none", edgecolors=style[r["job"]].color, zorder=3)
        for r in refs:
            if r[key] is not None:
                s = style[r["job"]]
                ax.axhline(r[key] * scale, color=s.color, linestyle="--", linewidth=1, zorder=2)
        ax.set_xlabel("memory budget" + (" (hollow: per block, at the mean)" if per_block else ""),
                      fontsize=FONT + 1)
        ax.set_ylabel(ylabel, fontsize=FONT + 1)
        ax.tick_params(labelsize=FONT)
        ax.set_xlim(-0.05, 1.22)  # room on the right for the reference lines' labels
        ax.set_xticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    fig.suptitle("Memory budget sweep (dashed: the other AC modes)", fontsize=FONT + 2)
    renderer = _freeze_layout(fig)
    for ax, key, scale, _ in panels:
        mine = [r for r in refs if r[key] is not None]
        to_px, from_px = ax.transData.transform, ax.transData.inverted().transform
        wanted = [to_px((1.2, r[key] * scale))[1] for r in mine]
        for r, y in zip(mine, _spread(wanted, FONT * 1.5 * DPI / 72)):
            ax.text(1.2, from_px((0, y))[1], short_label(r), fontsize=FONT, ha="right", va="center",
                    color=style[r["job"]].color, bbox=dict(facecolor="white", alpha=0.8, linewidth=0, pad=0.3))
        for r in per_block:
            if r[key] is not None:
                place_labels(ax, [(mean_budget(r["memory_budget"]), r[key] * scale, short_label(r))], renderer, [])
    return fig
