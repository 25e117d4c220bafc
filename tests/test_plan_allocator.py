"""The caching-allocator model with expandable segments under memory pressure: pages unmapped when a request
does not fit, mapped again when reused, and an OOM only when the live blocks truly do not fit; best fit as
get_free_block ranks an expandable segment's blocks; each stream's segment and its own high-water mark; the
default allocator's release when a cudaMalloc fails. Its other rules are in test_plan_model.py."""

import random

import pytest

from membudget.plan.allocator import CachingAllocator
from membudget.units import MiB


def check(a: CachingAllocator) -> None:
    """What reserved means: the bytes of the mapped blocks of every segment, each segment laid out without gaps,
    no two free mapped (or two unmapped) neighbours left unmerged."""
    total = 0
    for segment in a._segments:
        mapped, offset, prev = 0, 0, None
        for block in segment.blocks():
            block_mapped = getattr(block, "mapped", True)
            assert block.offset == offset and block.prev is prev and block.size > 0
            if prev is not None:
                assert not (prev.free and block.free and getattr(prev, "mapped", True) == block_mapped)
            assert block.free or block_mapped
            mapped += block.size if block_mapped else 0
            offset, prev = offset + block.size, block
        assert segment.size == mapped >= 0
        total += mapped
    assert a.reserved == total and 0 <= a.allocated <= a.reserved <= a.peak_reserved


def test_pages_unmapped_under_pressure_are_mapped_again_before_reuse():
    a = CachingAllocator(expandable=True, capacity=100 * MiB)
    a.malloc("a", 60 * MiB)  # three 20 MiB pages of stream 0's segment
    a.malloc("x", 20 * MiB)
    a.free("a")
    a.malloc("y", 40 * MiB, stream=1)  # 120 MiB would be mapped: a's free pages are unmapped first
    assert (a.reserved, a.retries, a.ooms) == (60 * MiB, 1, 0)
    check(a)
    a.free("y")
    a.malloc("z", 60 * MiB)  # a's range again: mapped again (releasing y's pages), not reused for free
    assert (a.reserved, a.allocated, a.retries, a.ooms) == (80 * MiB, 80 * MiB, 2, 0)
    assert a._live["z"].offset == 0  # the lowest unmapped range that spans it
    check(a)


def test_an_oom_when_the_live_blocks_do_not_fit_however_often_the_cache_is_released():
    a = CachingAllocator(expandable=True, capacity=100 * MiB)
    a.malloc("a", 60 * MiB)
    a.malloc("x", 20 * MiB)
    a.free("a")
    a.malloc("y", 40 * MiB, stream=1)  # releases a's pages
    a.malloc("w", 50 * MiB, stream=2)  # 110 MiB live in 100: nothing left to release (a's pages count once)
    assert a.ooms == 1
    check(a)
    a.free("w")
    a.malloc("z", 60 * MiB)  # 120 MiB live in 100
    assert a.ooms == 2
    check(a)


def test_only_whole_free_pages_are_unmapped():
    a = CachingAllocator(expandable=True)
    a.malloc("a", 30 * MiB)  # pages [0, 20) and [20, 40) ...
    a.malloc("b", 30 * MiB)  # ... [20, 40) shared with b, and [40, 60)
    a.free("a")
    a.empty_cache()
    assert a.reserved == 40 * MiB  # page [0, 20) only
    check(a)
    a.free("b")
    a.empty_cache()
    assert a.reserved == 0 and a.peak_reserved == 60 * MiB
    check(a)
    a.malloc("c", 50 * MiB)
    assert a.reserved == 60 * MiB
    check(a)


def test_random_replays_under_pressure_keep_reserved_within_capacity():
    retries = clean = 0
    for seed in range(40):
        r = random.Random(seed)
        capacity = r.choice([60, 100, 200]) * MiB
        a = CachingAllocator(expandable=True, capacity=capacity)
        live = []
        for key in range(300):
            if live and r.random() < 0.5:
                a.free(live.pop(r.randrange(len(live))))
            else:
                a.malloc(key, r.choice([r.randrange(1, 2 * MiB), r.randrange(1, 40 * MiB)]), r.randrange(3))
                live.append(key)
            assert a.peak_reserved <= capacity or a.ooms  # above the capacity only after a counted OOM
            check(a)
        retries += a.retries
        clean += a.ooms == 0 and a.retries > 0
    assert retries and clean  # pressure was met, and some replays fit only by releasing


def test_best_fit_keeps_the_segments_growable_end_for_requests_no_other_free_block_holds():
    """get_free_block ranks a free block followed by unmapped pages by what it can grow to: the free block at the
    segment's end only when no other free block fits. Here a 10 MiB request goes to the 40 MiB hole at the
    segment's start, not to the 18 MiB free end, so a later 35 MiB request fits neither and maps a page."""
    a = CachingAllocator(expandable=True)
    a.malloc("a", 40 * MiB)  # pages [0, 40)
    a.malloc("b", 2 * MiB)  # page [40, 60): b, then 18 MiB free at the end
    a.free("a")
    a.malloc("c", 10 * MiB)
    assert a._live["c"].offset == 0 and a.reserved == 60 * MiB
    a.malloc("e", 35 * MiB)  # 30 MiB free after c, 18 at the end: one page more, after the free end
    assert a._live["e"].offset == 42 * MiB and a.reserved == 80 * MiB
    check(a)


def test_each_stream_keeps_the_pages_it_mapped_until_memory_runs_short():
    """One expandable segment per stream and pool: what one stream freed the other cannot use, and pages are
    unmapped only when a request would not fit the capacity (release_cached_blocks); the mapped pages of every
    stream count in reserved (max_memory_reserved)."""
    a = CachingAllocator(expandable=True)
    a.malloc("gather", 60 * MiB, stream=1)  # an all-gather's output on FSDP2's copy-in stream
    a.free("gather")
    a.malloc("activation", 60 * MiB)  # the default stream maps its own pages
    assert (a.reserved, a.peak_reserved) == (120 * MiB, 120 * MiB)
    a.free("activation")
    a.malloc("next gather", 40 * MiB, stream=1)  # its own freed pages again
    assert a.reserved == 120 * MiB and a._live["next gather"].segment.pool == (1, False)
    check(a)
    tight = CachingAllocator(expandable=True, capacity=100 * MiB)
    for key, nbytes, stream in (("gather", 60 * MiB, 1), ("activation", 60 * MiB, 0)):
        tight.malloc(key, nbytes, stream)
        tight.free(key)
    assert (tight.retries, tight.ooms, tight.reserved) == (1, 0, 60 * MiB)  # stream 1's pages went back first
    check(tight)


def test_the_default_allocator_releases_every_unsplit_cached_segment_when_a_cudamalloc_fails():
    """With max_split_size_mb unset, release_available_cached_blocks returns at once, so a failed cudaMalloc
    releases every unsplit free segment of every pool and stream (release_cached_blocks), not one large enough."""
    a = CachingAllocator(capacity=100 * MiB)
    a.malloc("a", 60 * MiB)
    a.malloc("b", 30 * MiB, stream=1)
    a.malloc("s", 100)  # a small-pool segment (2 MiB)
    for key in ("a", "b", "s"):
        a.free(key)
    a.malloc("c", 64 * MiB)  # no cached block holds it; 92 + 64 > 100: all three go, not only a's (enough alone)
    assert (a.retries, a.ooms, a.reserved) == (1, 0, 64 * MiB)


# --- carried frees in the replay ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("parallelism, world", [("hsdp", 4), ("ddp", 2)])
def test_a_carried_free_matched_by_size_frees_the_leftover_whose_choice_changes_no_peak(monkeypatch, parallelism,
                                                                                       world):
    """Replicas keep FSDP2's reduce outputs from one micro-batch to the next: same-size leftovers, freed by
    size (replay.carried). Every carried free finds one, and freeing the newest instead of the oldest changes
    no peak, allocated or reserved, under either allocator."""
    from membudget.plan import planner as planning, replay
    from membudget.plan.planner import Planner
    from tests.conftest import compose_cfg

    phases = []
    monkeypatch.setattr(planning, "simulate", lambda p, a=None: phases.append(p) or replay.simulate(p, a))
    cfg = compose_cfg(f"parallelism={parallelism}", "model=llama3_debug", "logger=none", "train.seq_len=64",
                      f"train.global_batch_size={4 * world}", "train.micro_batch_size=2", "ac=none",
                      "compile.enabled=false", *(["parallelism.dp_shard=2"] if parallelism == "hsdp" else []))
    with Planner(cfg, world_size=world, device="cuda") as planner:
        planner.plan(planner.point("none"), recompute=False)
    phases = phases[0]
    chosen = []

    def newest(live, nbytes, ordinal):
        keys = [k for k, (n, c, when) in live.items() if n == nbytes and when < ordinal
                and c not in ("parameters", "gradients", "optimizer states", "activations")]
        chosen.append(len(keys))
        return keys[-1] if keys else None

    def peaks():
        out = [replay.simulate(phases).allocated.nbytes]
        for expandable in (False, True):
            memory = replay.simulate(phases, CachingAllocator(expandable=expandable))
            out += [memory.reserved.nbytes, memory.allocator_allocated]
        return out

    oldest = peaks()
    monkeypatch.setattr(replay, "carried", newest)
    assert peaks() == oldest
    assert chosen and 0 not in chosen and max(chosen) > 1  # each found its leftover; some had a choice
