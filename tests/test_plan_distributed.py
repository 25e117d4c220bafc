"""The plan for two ranks equals real two-rank steps over gloo: FSDP2 compiled under a memory budget (eight blocks,
planned from a probe of five, with FSDP2's buffers freed by neighbouring blocks and carried across steps), TP
with selective AC, DDP over three micro-batches (the middle one accumulates without the all-reduce; planned as
the last one, synced, it read 2.4x the real peak), and FSDP2 with the embedding, norm and (tied) output in the
root group, as torchtitan groups them."""

import json
import os
import subprocess
import sys

import pytest

from membudget.plan import plan_setting
from tests.conftest import FAST_COMPILE, ROOT, compose_cfg

TWO_RANKS = ["logger=none", "train.device=cpu", FAST_COMPILE, "train.seq_len=64"]
SETTINGS = {"fsdp": ["parallelism=fsdp", "ac=memory_budget", "ac.memory_budget=0.5", "model.n_layers=8",
                     "train.global_batch_size=4"],
            "tp": ["parallelism=tp", "ac=selective", "train.global_batch_size=4"],
            "ddp": ["parallelism=ddp", "train.global_batch_size=6", "train.micro_batch_size=1"],
            "fsdp root": ["parallelism=fsdp", "parallelism.fsdp_outer=root", "model.tie_embeddings=true",
                          "train.global_batch_size=4"]}


@pytest.mark.slow
@pytest.mark.dist
def test_plans_match_real_two_rank_steps():
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(ROOT / "tests" / "plan_real_step.py"), *(" ".join(TWO_RANKS + s) for s in SETTINGS.values())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    # planned while the real ranks run (they mostly wait on each other)
    plans = {name: plan_setting(compose_cfg(*TWO_RANKS, *overrides), world_size=2)
             for name, overrides in SETTINGS.items()}
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    real = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(real) == len(SETTINGS)
    for (name, plan), measured in zip(plans.items(), real):
        assert plan.activations == measured["activations"], name
        for step, peak in zip((1, 2), measured["peaks"]):
            assert plan.per_step[step].nbytes == pytest.approx(peak, abs=1024), (name, step)
