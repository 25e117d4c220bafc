"""Plan a run's memory and speed per rank before running it, from the same config as train.py.

    python -m membudget.plan model=llama3_8b parallelism=fsdp plan.world_size=64 train.seq_len=8192 ac=full
    python -m membudget.plan ... ac=memory_budget ac.memory_budget=sweep  # plan.budgets, none/full/selective
    python -m membudget.plan ... ac=memory_budget ac.memory_budget=auto   # the fastest budget that fits
    python -m membudget.plan ... ac=per_block                             # the fastest policy per block that fits

Layout, in the order of the data: `record` (the op-level recorder) and `measure` (probes on fake tensors over a
fake process group) measure, and `trace` holds what they record; `replay` (the first two steps of the whole
model), `allocator` (the CUDA caching allocator), `fusion` (inductor's kernels: the bytes they move, the values
they keep in registers), `timing` (roofline, communication, overlap, offloading's copies) and `devices` model;
`result` holds a plan; `probes` measures once per run what the plans of its settings share; `verdict` judges a
plan against the device; `planner` plans one setting; `blocks` chooses a policy per block; `sweep` plans several
settings and chooses among them; `report` and `cli` write the plans.
"""

from .planner import Planner
from .result import Plan
from .sweep import (auto_inputs, changed_inputs, choose, choose_or_explain, choose_setting, choose_setting_apart,
                    plan_setting, plan_sweep)

__all__ = ["Plan", "Planner", "auto_inputs", "changed_inputs", "choose", "choose_setting", "choose_setting_apart",
           "choose_or_explain", "plan_setting", "plan_sweep"]
