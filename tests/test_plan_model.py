"""The planner's models, without running a model: the CUDA caching allocator's documented rules, the replay's
layout of probe blocks, the device it assumes and says why, the time model, the verdict and auto's choice."""

import dataclasses

import pytest

from membudget.errors import UserError
from membudget.plan import choose
from membudget.plan.allocator import CachingAllocator, round_size, segment_size
from membudget.devices import GPUS
from membudget.plan.devices import assumed_device, expandable_segments
from membudget.plan.measure import probe_depth
from membudget.plan.replay import Layout, Moment
from membudget.plan.report import non_monotonic, plan_markdown, sweep_markdown
from membudget.plan.result import DOES_NOT_FIT, FITS, TIGHT, Plan, Setting
from membudget.units import GiB, KiB, MiB, fmt_bytes
from membudget.plan.timing import StepTime, step_time
from membudget.plan.trace import Collective, Op
from membudget.schema import PlanConfig


# --- the caching allocator ---------------------------------------------------------------------------------

def test_sizes_round_to_512_bytes_and_segments_follow_the_pools():
    assert [round_size(n) for n in (1, 512, 513, 10**6)] == [512, 512, 1024, 1000448]
    assert segment_size(round_size(100)) == 2 * MiB  # small pool: 2 MiB segments
    assert segment_size(1 * MiB) == 2 * MiB  # 1 MiB is still small
    assert segment_size(1 * MiB + 512) == 20 * MiB  # 1 to 10 MiB: a 20 MiB segment
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: its size rounded up to 2 MiB
    assert segment_size(11 * MiB + 1) == 12 * MiB


def test_small_requests_share_a_segment_and_large_ones_split_it():
    a = CachingAllocator()
    for key in range(4):
        a.malloc(key, 100 * KiB)  # 4 x 100 KiB in one 2 MiB segment
    assert a.reserved == 2 * MiB and a.allocated == 4 * round_size(100 * KiB)
    a.malloc("x", 3 * MiB)  # a 20 MiB segment, split: 17 MiB left cached
    a.malloc("y", 5 * MiB)  # from the cached rest
    assert a.reserved == 22 * MiB and a.allocated == 4 * round_size(100 * KiB) + 8 * MiB


def test_a_large_block_is_not_split_when_the_rest_is_under_1_mib():
    a = CachingAllocator()
    a.malloc("big", 12 * MiB)
    a.free("big")
    a.malloc("a bit smaller", 12 * MiB - 600 * KiB)  # best fit: the whole 12 MiB block, unsplit
    assert a.reserved == 12 * MiB and a.allocated == 12 * MiB


def test_freed_blocks_merge_and_are_reused_only_on_their_stream():
    a = CachingAllocator()
    a.malloc("a", 3 * MiB, stream=0)
    a.malloc("b", 3 * MiB, stream=0)  # both from one 20 MiB segment
    a.free("a")
    a.free("b")
    a.malloc("c", 15 * MiB, stream=0)  # the two merged with the rest: the whole segment again
    assert a.reserved == 20 * MiB
    a.free("c")
    a.malloc("d", 3 * MiB, stream=1)  # another stream's pool: a segment of its own
    assert a.reserved == 40 * MiB and a.peak_allocated == 15 * MiB


def test_under_a_capacity_the_cache_is_released_before_failing():
    a = CachingAllocator(capacity=100 * MiB)
    a.malloc("a", 60 * MiB)
    a.free("a")  # 60 MiB cached
    a.malloc("b", 80 * MiB)  # releases the cached segment, then fits
    assert (a.retries, a.ooms, a.reserved) == (1, 0, 80 * MiB)
    a.malloc("c", 40 * MiB)  # nothing left to release
    assert a.ooms == 1


def test_expandable_segments_grow_by_pages_and_reuse_what_default_segments_cannot():
    pattern = [("a", 30 * MiB), ("b", 30 * MiB), ("free", "a"), ("free", "b"), ("c", 50 * MiB)]
    reserved = {}
    for expandable in (False, True):
        a = CachingAllocator(expandable=expandable)
        for key, arg in pattern:
            a.free(arg) if key == "free" else a.malloc(key, arg)
        reserved[expandable] = a.peak_reserved
    # default: two 30 MiB segments, then a 50 MiB one; expandable: one segment of 20 MiB pages, the freed 60
    # MiB merge at its start and hold the 50
    assert reserved == {False: 110 * MiB, True: 60 * MiB}


# --- the replay's layout ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, period", [(32, 1), (80, 1), (12, 2), (21, 3), (4, 1)])
def test_every_block_replays_a_probe_block_of_its_kind_with_neighbours_of_theirs(n, period):
    depth = probe_depth(n, period)
    assert depth == min(n, 3 * period + 2 + (n - 3 * period - 2) % period)
    layout = Layout(n, depth, period)
    reps = [layout.rep(j) for j in range(n)]
    assert reps[0] == 0 and reps[-1] == depth - 1  # the ends as themselves
    assert all(j % period == r % period for j, r in enumerate(reps))  # same kind
    for j in range(1, n - 1):  # a block's neighbours are replayed from its probe block's neighbours' kinds
        assert reps[j - 1] % period == (reps[j] - 1) % period and reps[j + 1] % period == (reps[j] + 1) % period
        assert (reps[j - 1] == 0) == (j == 1) and (reps[j + 1] == depth - 1) == (j == n - 2)


# --- the device, and why ------------------------------------------------------------------------------------

def test_the_plan_says_which_gpu_it_assumed_and_how_to_change_it(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    auto = assumed_device(PlanConfig(), "cuda")
    assert auto.name.startswith("H100") and auto.reason == "no GPU visible: H100 80GB assumed, set plan.gpu"
    a100 = assumed_device(PlanConfig(gpu="a100-40gb"), "cuda")
    assert a100.memory == GPUS["A100-40GB"].memory and a100.reason == "plan.gpu=A100-40GB"
    sized = assumed_device(PlanConfig(gpu="H200", device_gib=100), "cuda")
    assert sized.memory == 100 * GiB and "plan.device_gib=100" in sized.reason
    host = assumed_device(PlanConfig(), "cpu")
    assert host.name == "cpu" and host.memory > 0 and "host's available memory" in host.reason and not host.is_gpu
    with pytest.raises(UserError, match=r"^plan.gpu='V100': .*H100.*plan.device_gib$"):
        assumed_device(PlanConfig(gpu="V100"), "cuda")


def test_the_allocator_setting_comes_from_the_config_else_the_environment(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert not expandable_segments(PlanConfig())
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    assert expandable_segments(PlanConfig())
    assert not expandable_segments(PlanConfig(expandable_segments=False))


# --- time ---------------------------------------------------------------------------------------------------

H100 = GPUS["H100"]
DEGREES = {"dp_replicate": 1, "dp_shard": 16, "tp": 1}


def _phase(kind, compute_s, comm=()):
    from membudget.plan.replay import Phase

    ops = [Op("aten.mm", int(compute_s * 989e12), 0, True)]  # priced at the peak: a memory-kind op's FLOPs
    bus = 50e9 * H100.efficiency.nccl_bus_network
    ops += [Op(f"c10d.{k}", 0, 0, True, Collective(k, int(s * bus * 16 / 15), 16, "dp_shard")) for k, s in comm]
    return Phase(kind, 2, 0, kind, ops=ops)


def test_fsdp_communication_hides_behind_compute_when_shorter_and_shows_when_longer():
    blocks = 8
    hidden = [_phase("forward", 0.010, [("all_gather", 0.004)]) for _ in range(blocks)]
    hidden += [_phase("backward", 0.020, [("all_gather", 0.004), ("reduce_scatter", 0.008)]) for _ in range(blocks)]
    t = step_time(hidden, H100, DEGREES)
    # compute overlapping NCCL's kernels loses their multiprocessors: at most their share slower
    share = H100.efficiency.nccl_sm_share
    assert blocks * 0.030 < t.compute <= blocks * 0.030 / (1 - share)
    assert t.exposed_communication < 0.015  # the first gather and the last reduce-scatter
    slow = [_phase(p.kind, 0.001, [(op.collective.kind, 0.010) for op in p.ops[1:]]) for p in hidden]
    t = step_time(slow, H100, DEGREES)
    assert t.seconds >= t.communication > 10 * t.compute


# --- verdicts and the choice --------------------------------------------------------------------------------

SETTING = Setting("llama3_8b", 8, 1, 8, 1, 8192, 2, 1, "bf16 autocast", "flash", True, "inductor",
                  "aot_eager_decomp_partition", "default")


def plan(label="memory_budget 0.5", budget=0.5, reserved=60 * GiB, seconds=1.0, verdict=FITS, limit=75 * GiB):
    step = StepTime(seconds, seconds, 0.0, 0.0, seconds / 3, 2 * seconds / 3, 0.0)
    peak = Moment(reserved - GiB, "loss", 2, {"activations": reserved // 2})
    return Plan(label, "memory_budget" if budget is not None else label, budget, SETTING, GPUS["H100"],
                parameters=GiB, buffers=0, gradients=GiB, optimizer_states=2 * GiB, activations=reserved // 2,
                init_transient=0, allocated=peak, per_step={1: peak, 2: peak},
                reserved=Moment(reserved, "loss", 2, {"allocator slack": GiB}),
                reserved_other=Moment(reserved + GiB, "loss", 2), max_allocated=reserved - GiB,
                overheads={"CUDA context": GiB // 2}, limit=limit, limit_source="the device", verdict=verdict,
                judged_bytes=reserved + GiB // 2,
                verdict_reason="needs x of y", time=step, tokens_per_step=16 * 8192, forward_flops=1e15,
                recompute_flops=budget and (1 - budget) * 1e15,
                policies=f"budget:{budget:g}*4" if budget is not None else f"{label.split()[0]}*4")


def test_auto_picks_the_fastest_budget_that_fits():
    plans = [plan(f"memory_budget {b}", b, reserved=int((40 + 40 * b) * GiB), seconds=2 - b,
                  verdict=FITS if b <= 0.6 else TIGHT if b <= 0.8 else DOES_NOT_FIT)
             for b in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)]
    assert choose(plans).memory_budget == 0.6  # fastest of those that fit; tight and does-not-fit never
    assert choose([p for p in plans if p.verdict != FITS]) is None
    slow_but_small = [dataclasses.replace(plans[0], time=dataclasses.replace(plans[0].time, seconds=0.5))]
    assert choose(plans + slow_but_small) is slow_but_small[0]  # time decides, not the budget


def test_non_monotonic_reserved_peaks_are_flagged_and_the_reports_say_what_was_assumed():
    plans = [plan(f"memory_budget {b}", b, reserved=int((40 + 40 * b) * GiB)) for b in (0.0, 0.5, 1.0)]
    assert non_monotonic(plans) == []
    bumped = [dataclasses.replace(p, reserved=Moment(90 * GiB, "loss", 2)) if p.memory_budget == 0.0 else p
              for p in plans]
    assert [p.memory_budget for p in non_monotonic(bumped)] == [0.5, 1.0]
    text = plan_markdown(plans[1])
    for words in ("**fits**", "H100 80GB (SXM)", "reserved peak (default allocator)", "allocator slack",
                  "planned as aot_eager_decomp_partition", "step 2", "tokens/s per device"):
        assert words in text, words
    assert "(peak below a smaller budget's)" in sweep_markdown(bumped)
    assert plans[1].summary_line().startswith("planned reserved peak 60.0 GiB + 512 MiB outside the allocator of "
                                              "75.0 GiB (the device) per rank: fits, predicted ")
    # under ac.target_memory_gib the verdict holds the reserved peak alone against the target
    targeted = dataclasses.replace(plans[1], limit_source="ac.target_memory_gib=75", judged_bytes=60 * GiB)
    assert targeted.summary_line().startswith("planned reserved peak 60.0 GiB of 75.0 GiB (ac.target_memory_gib=75) "
                                              "per rank: fits, ")
    assert fmt_bytes(1536 * MiB) == "1.50 GiB" and fmt_bytes(3 * KiB) == "3.00 KiB"
