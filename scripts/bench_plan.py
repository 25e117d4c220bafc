"""How long the planner takes: one setting, and the 11-point budget sweep that ac.memory_budget=auto runs.

    python scripts/bench_plan.py                      # Llama 3 8B, seq 8192, FSDP over 64 ranks, 2 threads
    python scripts/bench_plan.py parallelism.dp_shard=8 plan.world_size=8 train.global_batch_size=8

Extra arguments are Hydra overrides on top of that setting. Targets (issue 5): one setting under a minute,
the sweep under five, on 2 CPU cores. Each is timed in a fresh Planner, so it pays for building the sharded
model, the optimizer states and the ac=none reference as a user's command would (not Python's start-up).
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from membudget.config import register_configs  # noqa: E402
from membudget.plan import plan_setting, plan_sweep  # noqa: E402

SETTING = ["logger=none", "model=llama3_8b", "train.seq_len=8192", "parallelism=fsdp", "plan.world_size=64",
           "train.global_batch_size=64", "train.micro_batch_size=1", "ac=memory_budget", "ac.memory_budget=0.5"]


def main() -> None:
    torch.set_num_threads(2)
    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=SETTING + sys.argv[1:])
    p = cfg.parallelism
    print(f"{cfg.model.name}, seq {cfg.train.seq_len}, parallelism={p.name} over {cfg.plan.world_size} ranks, "
          f"{torch.get_num_threads()} threads")

    start = time.perf_counter()
    plan = plan_setting(cfg)
    print(f"one setting ({plan.label}): {time.perf_counter() - start:.1f} s  (target < 60 s); "
          f"peak {plan.peak / 2**30:.2f} GiB")

    start = time.perf_counter()
    plans = plan_sweep(cfg, references=False)
    seconds = time.perf_counter() - start
    print(f"budget sweep, {len(plans)} points: {seconds:.1f} s  (target < 300 s); per point: "
          + ", ".join(f"{p.memory_budget:g}: {p.seconds:.1f}" for p in plans))
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
