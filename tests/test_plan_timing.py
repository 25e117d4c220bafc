"""The step-time model's terms (membudget/plan/timing.py): each kernel's efficiency, inductor's fusion, the bytes of
mutating ops, collectives' latency, and the bound a plan names."""

import dataclasses

import pytest
import torch

from membudget.devices import GPUS
from membudget.plan.record import Recorder, fused_graph
from membudget.plan.fusion import fused_bytes, fused_intermediates, fused_kernels
from membudget.plan.timing import (
    COMPUTE,
    HOST,
    attention_efficiency,
    collective_seconds,
    cost,
    gemm_efficiency,
    memory_seconds,
    op_seconds,
)
from membudget.plan.trace import ATTENTION, GEMM, MEMORY, VIEW, Collective, Op, Run, Segment
from membudget.units import GiB, MiB
from tests.conftest import TINY, compose_cfg

H100 = GPUS["H100"]
DEGREES = {"dp_replicate": 1, "dp_shard": 8, "tp": 1}


def test_gemm_efficiency_grows_with_k_and_is_highest_for_full_waves():
    e = H100.efficiency
    ks = [64, 256, 1024, 4096, 16384]
    shares = [gemm_efficiency((1, 8192, 4096, k), H100) for k in ks]
    assert shares == sorted(shares) and len(set(shares)) == len(shares)
    assert shares[-1] <= e.gemm and shares[-1] > 0.95 * e.gemm
    # one full wave of output tiles against one tile more: the extra tile costs a whole wave
    tile_m, tile_n = e.gemm_tile
    full = (1, tile_m * H100.sms, tile_n, 4096)
    one_more = (1, tile_m * (H100.sms + 1), tile_n, 4096)
    assert gemm_efficiency(one_more, H100) == pytest.approx(gemm_efficiency(full, H100) * (H100.sms + 1)
                                                            / (2 * H100.sms))
    small = gemm_efficiency((1, 128, 256, 4096), H100)  # one tile on 132 multiprocessors
    assert small < 0.01 * e.gemm


def test_attention_efficiency_grows_with_the_sequence_and_backward_is_slower():
    def op(seq, backward):
        name = "aten._scaled_dot_product_flash_attention" + ("_backward" if backward else "")
        return Op(name, 1, 1, True, kind=ATTENTION, shape=(1, 32, seq, 128, True, backward))

    for backward in (False, True):
        shares = [attention_efficiency(op(s, backward), H100) for s in (512, 2048, 8192, 32768)]
        assert shares == sorted(shares) and shares[-1] < H100.efficiency.attention["flash"][backward]
    assert attention_efficiency(op(8192, True), H100) < attention_efficiency(op(8192, False), H100)
    cudnn = Op("aten._scaled_dot_product_cudnn_attention", 1, 1, True, kind=ATTENTION,
               shape=(1, 32, 8192, 128, True, False))
    assert attention_efficiency(cudnn, H100) > attention_efficiency(op(8192, False), H100)


def test_memory_bound_ops_have_a_floor_and_scale_with_bytes_at_the_achieved_bandwidth():
    e = H100.efficiency
    assert memory_seconds(1, H100) == e.kernel_floor
    big = 10 * GiB
    assert memory_seconds(big, H100) == pytest.approx(big / (H100.hbm_bandwidth * e.memory))
    assert memory_seconds(2 * big, H100) == pytest.approx(2 * memory_seconds(big, H100))
    gemm = Op("aten.mm", 2 * 8192 * 4096 * 4096, 3 * 8192 * 4096 * 2, True, kind=GEMM, shape=(1, 8192, 4096, 4096))
    fp32 = dataclasses.replace(gemm, low_precision=False)
    assert op_seconds(fp32, H100) > 10 * op_seconds(gemm, H100)  # fp32 has no tensor-core peak
    assert op_seconds(Op("aten.view", 0, 0, False, kind=VIEW), H100) == 0


def _graph():
    """A compiled graph: norm (pow, mean, rsqrt, mul), a GEMM, SiLU on it, a second GEMM on the norm's output
    independent of the SiLU, the product of both, the graph returning the product and saving the norm's output.
    Allocations: 1 input, 2..5 the norm's, 6 GEMM1, 7 SiLU, 8 GEMM2, 9 product; weights -1, -2."""
    ops = [Op("aten.pow", 0, 2 * MiB, False, region=1, reads=((1, MiB),), writes=((2, MiB),)),
           Op("aten.mean", 0, MiB, False, region=1, reads=((2, MiB),), writes=((3, 1024),)),
           Op("aten.rsqrt", 0, 2048, False, region=1, reads=((3, 1024),), writes=((4, 1024),)),
           Op("aten.mul", 0, 3 * MiB, False, region=1, reads=((1, MiB), (4, 1024)), writes=((5, MiB),)),
           Op("aten.mm", 1, 1, True, kind=GEMM, shape=(1, 1, 1, 1), region=1, reads=((5, MiB), (-1, MiB)),
              writes=((6, MiB),)),
           Op("aten.silu", 0, 2 * MiB, False, region=1, reads=((6, MiB),), writes=((7, MiB),)),
           Op("aten.mm", 1, 1, True, kind=GEMM, shape=(1, 1, 1, 1), region=1, reads=((5, MiB), (-2, MiB)),
              writes=((8, MiB),)),
           Op("aten.mul", 0, 3 * MiB, False, region=1, reads=((7, MiB), (8, MiB)), writes=((9, MiB),)),
           Op("graph outputs", 0, 0, False, kind=VIEW, region=1, reads=((9, MiB), (5, MiB)))]
    return ops


def test_fusion_groups_by_dependency_and_charges_only_what_crosses_the_kernel():
    ops = _graph()
    kernels = fused_kernels(ops)
    names = [[op.name for op in k] for k in kernels]
    # the SiLU joins the product across the second GEMM, which does not depend on it
    assert names == [["aten.pow", "aten.mean", "aten.rsqrt", "aten.mul"], ["aten.mm"], ["aten.silu", "aten.mul"],
                     ["aten.mm"]]
    norm, _, silu_mul, _ = kernels
    assert fused_bytes(norm, ops) == MiB + MiB  # reads the input once, writes its output (GEMMs and the graph read it)
    assert fused_bytes(silu_mul, ops) == 3 * MiB  # reads both GEMMs' outputs, writes the product
    eager = sum(op.nbytes for op in ops if op.kind == MEMORY)
    c = cost(ops, H100, DEGREES)
    assert c.kernels["fused"] == pytest.approx(memory_seconds(2 * MiB, H100) + memory_seconds(3 * MiB, H100))
    assert c.kernels["memory"] == 0 and eager > 2 * (5 * MiB)
    assert c.host == pytest.approx(H100.efficiency.host_graph + 4 * H100.efficiency.host_kernel)


def test_a_value_read_only_inside_its_fused_kernel_is_never_allocated():
    """What the memory replay leaves out of a compiled graph on a GPU: the norm's pow, mean and rsqrt (read by
    the norm's kernel alone) and nothing else: the norm's output feeds the GEMMs and the graph's outputs, the
    GEMMs' outputs are anchors' (cuBLAS writes them to memory), SiLU's output is read by the product in the same
    kernel, the product is returned. A view of an intermediate is no reader of its own; a later graph (the
    backward) reading a value keeps it; an op outside any graph (eager) fuses nothing."""
    ops = _graph()
    run = Run({"forward 0": Segment("forward 0", ops=ops)}, {}, 0, {})
    assert fused_intermediates(run) == {2, 3, 4, 7}
    viewed = ops[:1] + [Op("aten.view", 0, 0, False, kind=VIEW, region=1, reads=((2, MiB),))] + ops[1:]
    assert fused_intermediates(Run({"forward 0": Segment("forward 0", ops=viewed)}, {}, 0, {})) == {2, 3, 4, 7}
    backward = [Op("aten.mul", 0, 2 * MiB, False, region=2, reads=((7, MiB),), writes=((10, MiB),)),
                Op("graph outputs", 0, 0, False, kind=VIEW, region=2, reads=((10, MiB),))]
    run = Run({"forward 0": Segment("forward 0", ops=ops), "backward 0": Segment("backward 0", ops=backward)},
              {}, 0, {})
    assert fused_intermediates(run) == {2, 3, 4}  # SiLU's output is saved for the backward
    eager = [dataclasses.replace(op, region=None, reads=(), writes=()) for op in ops]
    assert fused_intermediates(Run({"forward 0": Segment("forward 0", ops=eager)}, {}, 0, {})) == set()


def test_an_op_that_feeds_an_anchor_it_waits_for_is_not_fused_with_it():
    ops = [Op("aten.neg", 0, 2 * MiB, False, region=1, reads=((1, MiB),), writes=((2, MiB),)),
           Op("aten.mm", 1, 1, True, kind=GEMM, shape=(1, 1, 1, 1), region=1, reads=((2, MiB),), writes=((3, MiB),)),
           Op("aten.add", 0, 3 * MiB, False, region=1, reads=((2, MiB), (3, MiB)), writes=((4, MiB),)),
           Op("graph outputs", 0, 0, False, kind=VIEW, region=1, reads=((4, MiB),))]
    assert [[op.name for op in k] for k in fused_kernels(ops)] == [["aten.neg"], ["aten.mm"], ["aten.add"]]


def _recorded(fn, *args):
    recorder = Recorder()
    with recorder.tracking():
        recorder.start()
        fn(*args)
        recorder.stop()
    return [op for segment in recorder.segments for op in segment.ops]


def test_mutating_ops_that_return_nothing_are_charged_what_they_write():
    params = [torch.randn(1000), torch.randn(3000)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, foreach=True)
    optimizer.step()  # the states exist: the recorded step is a steady one
    ops = _recorded(optimizer.step)
    foreach = [op for op in ops if "_foreach_" in op.name and op.name.endswith("_")]
    assert foreach and all(op.nbytes > 0 for op in foreach)
    lerp = next(op for op in foreach if "lerp_" in op.name)  # exp_avg += (grad - exp_avg) * (1 - beta1)
    assert lerp.nbytes == 4 * 4000 * 3  # reads exp_avg and grads, writes exp_avg
    # FSDP2's copy-out of a reduce-scatter's output into the gradients: split_with_sizes_copy(out=...)
    flat = torch.randn(4000)
    outs = [torch.empty(1000), torch.empty(3000)]
    copy = _recorded(lambda: torch.split_with_sizes_copy(flat, [1000, 3000], out=outs))
    assert [op.nbytes for op in copy if "split_with_sizes_copy" in op.name] == [2 * 4 * 4000]


def test_storages_of_no_bytes_in_a_fused_graph_each_keep_a_key_of_their_own():
    """A storage of no bytes (SDPA's empty outputs) has no allocation to key it by, and a dead one's address comes
    back for the next: each has a key of its own, or which ops share a tensor (what is fused) would follow the
    heap's layout, and one plan differ from run to run (tt2506-8b-tp's fused kernels did)."""
    def graph(args):
        for _ in range(50):
            torch.empty(0).neg()  # each empty storage dies before the next is made

    ops = _recorded(lambda: fused_graph(graph)([]))
    reads = [op.reads[0][0] for op in ops if op.name == "aten.neg"]
    assert len(reads) == 50 == len(set(reads))


def test_collectives_cost_a_latency_and_their_bytes_at_the_achieved_bus_bandwidth():
    e = H100.efficiency
    small = Collective("all_gather", 8, 8, "dp_shard")
    assert collective_seconds(small, H100, DEGREES) == pytest.approx(e.nccl_latency, rel=1e-3)
    big = Collective("all_gather", 8 * GiB, 8, "dp_shard")
    expected = e.nccl_latency + 7 / 8 * big.nbytes / (H100.intra_node_bandwidth * e.nccl_bus_nvlink)
    assert collective_seconds(big, H100, DEGREES) == pytest.approx(expected)
    across = {"dp_replicate": 1, "dp_shard": 64, "tp": 1}  # 8 nodes: the network, not NVLink
    assert collective_seconds(Collective("all_gather", big.nbytes, 64, "dp_shard"), H100, across) > 5 * expected
    reduce = Collective("all_reduce", big.nbytes, 8, "dp_shard")
    assert collective_seconds(reduce, H100, DEGREES) - e.nccl_latency == pytest.approx(2 * (expected - e.nccl_latency))
    assert collective_seconds(Collective("all_reduce", big.nbytes, 1, "dp_replicate"), H100, DEGREES) == 0


def test_a_step_of_many_tiny_eager_ops_is_bound_by_the_host():
    from membudget.plan.replay import Phase
    from membudget.plan.timing import step_time

    tiny = [Op("aten.add", 0, 1024, False) for _ in range(1000)]
    phase = Phase("forward 0", 2, 0, "forward", ops=tiny)
    t = step_time([phase], H100, DEGREES)
    assert t.bound == HOST and t.seconds == pytest.approx(1000 * H100.efficiency.host_op)
    big = [Op("aten.mm", 2 * 8192**3, 3 * 8192**2 * 2, True, kind=GEMM, shape=(1, 8192, 8192, 8192))] * 10
    t = step_time([Phase("forward 0", 2, 0, "forward", ops=big)], H100, DEGREES)
    assert t.bound == COMPUTE and t.seconds == pytest.approx(10 * op_seconds(big[0], H100))


def test_every_gpu_of_the_table_has_what_the_time_model_needs():
    for key, device in GPUS.items():
        assert device.peak_flops > device.peak_flops_fp32 > 0 and device.hbm_bandwidth > 0 and device.sms > 0, key
        assert device.memory > 0 and device.tdp_w and 0 < device.compute_scale <= 1, key
        assert device.power_limit_w is None or device.power_limit_w < device.tdp_w, key


@pytest.mark.slow
def test_fused_kernels_match_inductors_own_compile_of_a_block():
    """The grouping against inductor's scheduler on the debug model's block (forward and backward, on this CPU):
    the kernels it generates (externs such as GEMMs, attention and RoPE's complex product left out) and the bytes
    they read and write, each within 15 %. The scheduler's nodes are read through its post-fusion hook, a private
    inductor setting used by this test alone."""
    import torch._inductor.config as inductor_config
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    from membudget.internals import decomposing_partitioning_backend
    from membudget.model import ModelArgs, TransformerBlock, rope_frequencies
    from membudget.plan.record import fused_graph
    from membudget.plan.trace import FALLBACK
    from membudget.step import StepShape

    # a block of a tiny run (one process): the kernels of the README's inductor test, so inductor compiles them once
    cfg = compose_cfg(*TINY)
    shape = StepShape.from_config(cfg, world_size=1)
    args = dataclasses.replace(ModelArgs.from_config(cfg.model), n_layers=1)
    freqs = rope_frequencies(args, shape.seq_len)
    x = torch.randn(shape.micro_batch, shape.seq_len, args.dim)

    def step(backend):
        torch.manual_seed(0)
        block = torch.compile(TransformerBlock(0, args), backend=backend)
        block(x.clone().requires_grad_(), freqs).sum().backward()
        return block

    generated = []

    def post_fusion(nodes):
        generated.extend(n.get_read_write_buffers_sizes() for n in nodes
                         if not isinstance(n, (ExternKernelSchedulerNode, NopKernelSchedulerNode)))
        return nodes

    torch.compiler.reset()
    with inductor_config.patch(_post_fusion_custom_pass=post_fusion):
        step("inductor")
    torch.compiler.reset()
    block = step(decomposing_partitioning_backend(fused_graph))  # compiles; the recorded step runs compiled
    recorder = Recorder()
    with recorder.tracking():
        recorder.start()
        block(x.clone().requires_grad_(), freqs).sum().backward()
        recorder.stop()
    torch.compiler.reset()
    ops = [op for segment in recorder.segments for op in segment.ops if op.region is not None]
    ours = []
    for region in sorted({op.region for op in ops}):
        graph = [op for op in ops if op.region == region]
        ours += [fused_bytes(k, graph) for k in fused_kernels(graph)
                 if k[0].kind not in (GEMM, ATTENTION, FALLBACK) and k[0].collective is None]
    assert len({op.region for op in ops}) == 2  # the forward and the backward graph
    assert len(ours) == pytest.approx(len(generated), rel=0.15), (len(ours), len(generated))
    assert sum(ours) == pytest.approx(sum(generated), rel=0.15), (sum(ours), sum(generated))
