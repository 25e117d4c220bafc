"""Plan a run's memory and speed per rank before running it, from the same config as train.py.

    python -m membudget.plan model=llama3_8b parallelism=fsdp plan.world_size=64 train.seq_len=8192 ac=full
    python -m membudget.plan ... ac=memory_budget ac.memory_budget=sweep  # budgets 0.0..1.0, none/full/selective
    python -m membudget.plan ... ac=memory_budget ac.memory_budget=auto   # the fastest budget that fits
    python -m membudget.plan ... ac=per_block                             # the fastest policy per block that fits

Layout: `record` (the op-level recorder) and `measure` (probes on fake tensors over a fake process group) measure;
`replay` (the first two steps of the whole model), `allocator` (the CUDA caching allocator), `timing` (roofline,
communication, overlap, offloading's copies) and `devices` model; `planner` plans and chooses, `blocks` chooses a
policy per block; `result` holds a plan; `report` and `cli` write it.
"""

from .planner import SWEEP_BUDGETS, Planner, choose, choose_setting, choose_or_explain, plan_setting, plan_sweep
from .result import Plan

__all__ = ["SWEEP_BUDGETS", "Plan", "Planner", "choose", "choose_setting", "choose_or_explain", "plan_setting",
           "plan_sweep"]
