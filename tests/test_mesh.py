"""The device mesh has only the dimensions of degree above 1 (as torchtitan builds it): no step issues a
collective over a one-rank group. Planned over fake process groups; the losses of every layout against one
process are in test_distributed.py."""

import pytest
import torch
import torch.distributed as dist

from membudget.internals import register_fake_process_group
from membudget.launch import Launch
from membudget.parallel import build_mesh, dp_coordinates, mesh_size
from membudget.plan.planner import Planner
from tests.conftest import compose_cfg

LAYOUTS = {  # parallelism, world size -> the mesh's dimensions
    ("ddp", 2): {"dp_replicate": 2},
    ("fsdp", 4): {"dp_shard": 4},
    ("hsdp", 4): {"dp_replicate": 2, "dp_shard": 2},
    ("tp", 2): {"tp": 2},
    ("fsdp_tp", 4): {"dp_shard": 2, "tp": 2},
}


@pytest.mark.parametrize("parallelism, world", list(LAYOUTS))
def test_the_mesh_has_only_dimensions_above_1(parallelism, world):
    cfg = compose_cfg(f"parallelism={parallelism}", "logger=none",
                      *(["parallelism.dp_shard=2"] if parallelism == "hsdp" else []))
    register_fake_process_group()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=world)
    try:
        mesh = build_mesh(cfg.parallelism, Launch(0, world, 0), torch.device("cpu"))
        dims = LAYOUTS[parallelism, world]
        assert dict(zip(mesh.mesh_dim_names, mesh.shape)) == dims
        assert [mesh_size(mesh, d) for d in ("dp_replicate", "dp_shard", "tp")] == [
            dims.get(d, 1) for d in ("dp_replicate", "dp_shard", "tp")]
        assert dp_coordinates(mesh) == (0, dims.get("dp_replicate", 1) * dims.get("dp_shard", 1))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("parallelism, world", [("fsdp", 4), ("ddp", 2), ("fsdp_tp", 4), ("hsdp", 4)])
def test_no_collective_runs_over_a_one_rank_group(parallelism, world):
    """The probe of a plan records every collective with its group's ranks: FSDP over 4 ranks issued 34
    all-reduces over the 1-rank dp_replicate group when the mesh was (1, 4)."""
    overrides = [f"parallelism={parallelism}", "train.global_batch_size=8", "train.micro_batch_size=2",
                 "model=llama3_debug", "logger=none", "train.seq_len=32"]
    if parallelism == "hsdp":
        overrides.append("parallelism.dp_shard=2")
    with Planner(compose_cfg(*overrides), world_size=world, device="cuda") as planner:
        cfg = planner.point("full")
        probe, _ = planner.probes.probe(cfg)
    collectives = [op.collective for run in probe.runs for segment in run.segments.values() for op in segment.ops
                   if op.collective is not None]
    assert collectives  # the probe records them
    assert [c for c in collectives if c.ranks == 1] == []
    kinds = {c.kind for c in collectives}
    if parallelism in ("fsdp", "fsdp_tp", "hsdp"):
        assert {"all_gather", "reduce_scatter"} <= kinds
    if parallelism in ("ddp", "hsdp"):
        assert "all_reduce" in kinds


@pytest.mark.parametrize("parallelism, world", [("ddp", 2), ("hsdp", 4), ("fsdp", 2)])
def test_middle_micro_batches_accumulate_without_the_replicas_sync(parallelism, world):
    """Four micro-batches: replicas all-reduce once per step, in the last; the probe records a middle micro-batch
    apart from the last one only where they differ (replicas), and the replay gives it to micro-batches 1 and 2."""
    overrides = [f"parallelism={parallelism}", f"train.global_batch_size={4 * world}", "train.micro_batch_size=1",
                 "model=llama3_debug", "model.n_layers=2", "logger=none", "train.seq_len=32"]
    if parallelism != "ddp":
        overrides += [f"parallelism.dp_shard={world // 2 if parallelism == 'hsdp' else world}"]
    with Planner(compose_cfg(*overrides), world_size=world, device="cuda") as planner:
        probe, _ = planner.probes.probe(planner.point("full"))

    def reduces(run) -> int:
        return sum(op.collective is not None and op.collective.kind == "all_reduce"
                   for segment in run.segments.values() for op in segment.ops)

    replays = [probe.run_of(i, 4) for i in range(4)]
    if parallelism == "fsdp":
        assert probe.middle is None and replays == [probe.first, probe.last, probe.last, probe.last]
        return
    assert reduces(probe.first) == reduces(probe.middle) == 0 < reduces(probe.last)
    assert replays == [probe.first, probe.middle, probe.middle, probe.last]
