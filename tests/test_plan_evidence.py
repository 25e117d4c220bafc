"""The planner against public GPU measurements of Llama-3-shaped training (docs/planner/evidence.csv, each row
cited): the reserved peak within the plan's stated uncertainty of every measured peak of a program it models, and
never "fits" for a run that ran out of memory. The rows it does not model (Float8) and those that report only
throughput are planned by `python scripts/bench_plan.py --evidence`, whose table the README shows."""

import pytest
import torch

from membudget.plan.evidence import error, plan_row, rows
from membudget.plan.result import DOES_NOT_FIT, FITS, UNCERTAINTY
from tests.conftest import compose_cfg

GiB = 2**30


def checked(row) -> bool:
    return row.modelled and (row.measured is not None or row.fields["outcome"] == "oom")


@pytest.fixture(scope="module")
def planned():
    torch.set_num_threads(2)
    return {row.id: plan_row(row, lambda overrides: compose_cfg(*overrides)) for row in rows() if checked(row)}


@pytest.mark.slow
def test_reserved_peaks_are_within_the_stated_uncertainty_of_what_was_measured(planned):
    measured = [row for row in rows() if checked(row) and row.measured is not None]
    assert len(measured) >= 4
    for row in measured:
        plan = planned[row.id]
        assert plan.device.name.split()[0] in row.fields["gpu"].replace("-", " "), row.id
        assert abs(error(plan.reserved_peak, row.measured)) <= UNCERTAINTY, (row.id, plan.reserved_peak / GiB)
        assert plan.verdict == FITS, row.id  # each ran, well within its card


@pytest.mark.slow
def test_no_fits_for_a_run_that_ran_out_of_memory(planned):
    ooms = [row for row in rows() if row.fields["outcome"] == "oom"]
    assert ooms and all(planned[row.id].verdict == DOES_NOT_FIT for row in ooms)


@pytest.mark.slow
def test_fsdp_shards_the_state_but_not_the_activations(planned):
    eight, many = planned["tt2412-t1-eager"], planned["tt2412-t3-eager"]  # 8 and 128 ranks, the same step
    for key in ("parameters", "gradients", "optimizer_states"):
        # 16x more shards; FSDP2 pads dim 0 to a multiple of the shard count
        assert getattr(eight, key) / getattr(many, key) == pytest.approx(16, rel=0.01), key
    assert eight.parameters == pytest.approx(8.03e9 * 4 / 8, rel=0.01)  # fp32 master weights
    assert eight.activations == many.activations > 30 * GiB
    assert eight.setting.dtype == "bf16 autocast" and eight.setting.attention == "flash"
