"""`python -m membudget.plan <overrides>`: the plan of one setting, or a sweep (ac.memory_budget=sweep) or the
auto choice (ac.memory_budget=auto, ac.blocks=auto), written as plan.json and plan.md (a sweep also sweep.png/.svg) into its
Hydra dir, outputs/plan/<date>/<time>."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from membudget.errors import UserError
from membudget.schema import budget_of, is_auto

from .blocks import per_target, targets_between
from .planner import Planner
from .sweep import chosen_point, choose_or_explain, plan_sweep, plan_with_reshard_policies, reshard_policies
from .report import blocks_markdown, non_monotonic, plan_markdown, plot_sweep, reshard_markdown, sweep_markdown

log = logging.getLogger("membudget")


def run(cfg, out_dir: Path) -> dict:
    """What the command does: plan, write plan.json and plan.md (a sweep: also the plots), log the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep, auto = budget_of(cfg.ac) == "sweep", is_auto(cfg.ac)
    chosen = error = None
    reshard = []
    if sweep or auto:
        with Planner(cfg) as planner:  # one for the sweep and the mixes: what they share is measured once
            plans = plan_sweep(cfg, offload=True, planner=planner)
            if auto:
                try:
                    choice, chosen = choose_or_explain(plans, cfg, None, planner=planner)
                    reshard = reshard_policies(planner, chosen_point(planner, cfg, choice), chosen)
                except UserError as e:  # raised once the sweep that shows it is written
                    error = e
            choices = []
            if sweep:  # where a per-block plan beats the best single setting, over a range of targets
                limit = plans[0].limit or max(p.judged_bytes for p in plans)
                choices = per_target(planner, plans, targets_between(plans, limit))
        text = (sweep_markdown(plans, chosen) + ("\n" + blocks_markdown(choices, plans) if choices else "")
                + ("" if chosen is None else "\n" + plan_markdown(chosen) + reshard_markdown(chosen, reshard)))
        result = {"rank": 0, "plans": [p.to_dict() for p in plans],
                  "non_monotonic": [p.label for p in non_monotonic(plans)],
                  "chosen": None if chosen is None else chosen.to_dict(),
                  "reshard_policies": [p.to_dict() for p in reshard],
                  "per_block": [{"target": c.target, "single": c.single and c.single.label,
                                 "per_block": c.per_block and c.per_block.to_dict(), "gain": c.gain}
                                for c in choices]}
        plot_sweep(plans, out_dir, chosen, [c.per_block for c in choices if c.per_block is not None])
    else:
        plan, reshard = plan_with_reshard_policies(cfg)
        text = plan_markdown(plan) + reshard_markdown(plan, reshard)
        result = {"rank": 0, **plan.to_dict(), "reshard_policies": [p.to_dict() for p in reshard]}
    (out_dir / "plan.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out_dir / "plan.md").write_text(text)
    log.info("\n%s\nwritten to %s", text, out_dir)
    if error is not None:
        raise error
    return result


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from membudget.launch import register_configs
    from membudget.options import CONF_DIR

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def plan_main(cfg) -> None:
        try:
            run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except UserError as e:
            log.error("error: %s", e)
            sys.exit(2)

    register_configs()
    if not any(arg.startswith("hydra.run.dir=") for arg in sys.argv[1:]):
        sys.argv.append("hydra.run.dir=outputs/plan/${now:%Y-%m-%d}/${now:%H-%M-%S}")
    plan_main()
