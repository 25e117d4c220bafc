"""What a Planner measures, each once: the probe of an AC setting (measure.run_probe; probed again at full depth
when its middle blocks allocate differently from one another), the optimizer step on this rank's shards, and
the FLOPs of the run without AC that recompute is counted against."""

from __future__ import annotations

import copy
import logging
from typing import Optional

from membudget.ac import compiler_scope
from membudget.step import Numerics, StepShape

from .measure import probe_shape, run_optimizer, run_probe
from .replay import Layout, consistent
from .trace import OptimizerRun, Probe

log = logging.getLogger("membudget")


class Probes:
    """The measurements of one run (its mesh, numerics and step shape) under any AC setting."""

    def __init__(self, mesh, groups: dict, numerics: Numerics, shape: StepShape,
                 optimizer_runs: Optional[dict] = None):
        """`optimizer_runs`: where recorded optimizer steps are kept (see `optimizer`), one store that a caller
        may share between runs; None: this run's own."""
        self.mesh, self.groups, self.numerics, self.shape = mesh, groups, numerics, shape
        self._optimizer_runs = {} if optimizer_runs is None else optimizer_runs
        self._reference: Optional[dict[str, float]] = None
        self._latest: Optional[tuple] = None  # (config, probe, layout): the last probe, which the next may repeat

    def probe(self, cfg, flops_only: bool = False) -> tuple[Probe, Layout]:
        """The probe of `cfg` (a Planner's point) under its compiler settings, and how it lays out the model; the
        last one again when `cfg` equals its config (an eager ac=none point is also the FLOPs reference).
        `flops_only`: its first micro-batch alone, for what it computes (run_probe), not kept for a later plan."""
        if self._latest is not None and self._latest[0] == cfg:
            return self._latest[1:]
        n = cfg.model.n_layers
        depth, period = probe_shape(cfg, n)
        with compiler_scope(cfg.ac, n_layers=n):
            probe = self._run(cfg, depth, period, flops_only)
            layout = Layout(n, depth, period)
            if depth < n and not all(consistent(r, layout) for r in probe.runs):
                log.warning("plan: the probe's middle blocks allocate differently; probing all %d blocks", n)
                probe, layout = self._run(cfg, n, 1, flops_only), Layout(n, n, 1)
        if not flops_only:
            self._latest = (copy.deepcopy(cfg), probe, layout)  # a copy: a caller may change its config afterwards
        return probe, layout

    def _run(self, cfg, depth: int, period: int, flops_only: bool) -> Probe:
        return run_probe(cfg, self.mesh, self.groups, self.numerics, self.shape.micro_batch, depth, period,
                         self.shape.n_micro, flops_only)

    def optimizer(self, cfg, probe: Probe) -> OptimizerRun:
        """Gradient clipping and AdamW on this rank's shards of the whole model (the same for every AC setting): a
        function of the key alone (plain tensors, no process group), so runs with the same key share one recording."""
        n = cfg.model.n_layers
        shards = probe.shards["outside"][:1] + probe.shards["block"] * n + probe.shards["outside"][1:]
        key = (tuple(shards), self.numerics.target, repr(cfg.optimizer), cfg.train.max_grad_norm)
        if key not in self._optimizer_runs:
            self._optimizer_runs[key] = run_optimizer(cfg, shards, self.numerics)
        return self._optimizer_runs[key]

    def reference(self, none) -> dict[str, float]:
        """The step's forward and backward FLOPs of `none` (this run without AC and without compile: the same
        config at every call, so it is measured once): what recompute is counted against."""
        if self._reference is None:
            probe, layout = self.probe(none, flops_only=True)
            flops = {"forward": 0, "backward": 0}
            for kind, j in layout.order():
                segment = probe.first.segments.get(layout.segment_name(kind, j))
                if segment is not None:
                    flops["backward" if kind in ("output backward", "backward") else "forward"] += segment.flops
            self._reference = {k: self.shape.n_micro * v for k, v in flops.items()}
        return self._reference
