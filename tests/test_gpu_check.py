"""scripts/gpu_check.py's CPU path: real steps of the debug model against the plan, for every AC setting it checks
on a GPU. On the CPU the plan is exact: activation, parameter, gradient and optimizer bytes, and the peak over the
first two steps as torch's MemTracker sees it."""

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from membudget.units import MiB
from tests.conftest import ROOT


def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look it up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_cpu_path_runs_each_setting_and_the_plan_matches_it_exactly(capsys):
    check = gpu_check()
    rows = check.check(check.SETTINGS, device="cpu", model="llama3_debug", layers=6, seq=32, batch=2, steps=2)
    # six blocks planned from a probe of three; two kinds of block (full AC on every second one) from eight
    rows += check.check(["selective:2"], device="cpu", model="llama3_debug", layers=8, seq=32, batch=2, steps=2)
    assert [r.plan.label for r in rows] == ["none", "full", "selective op", "memory_budget 0.0", "memory_budget 0.5",
                                            "memory_budget 1.0", "selective every 2"]
    for row in rows:
        plan, real = row.plan, row.measured
        assert real is not None, row.skipped
        for key in ("activations", "parameters", "gradients", "optimizer_states"):
            assert getattr(plan, key) == getattr(real, key), (row.setting, key)
        assert plan.max_allocated == pytest.approx(real.max_allocated, abs=1024), row.setting
        assert plan.reserved is None and plan.time is None and real.tokens_per_s > 0
    table = check.table(rows)
    assert table.count("\n") == len(rows) + 1 and "(+0.0%)" in table


KERNELS = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT": "gemm",
    "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
    "triton_tem_fused_mm_0": "gemm",
    "aten::mm": "gemm",
    "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>, true>": "attention fwd",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention bwd",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)": "attention fwd",
    "fmha_cutlassB_bf16_aligned_128x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel)": "attention bwd",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention bwd",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention fwd",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "triton fused",
    "triton_poi_fused_mul_silu_1": "triton fused",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>": "optimizer",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, LogSoftMaxForwardEpilogue>":
        "softmax/CE",
    "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>": "softmax/CE",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>":
        "copy/cast",
    "Memcpy DtoD (Device -> Device)": "copy/cast",
    "Memset (Device)": "copy/cast",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>":
        "reduction/norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise",
    "aten::mul": "elementwise",
    "some_unknown_kernel": "other",
}


def test_the_kernel_classifier_maps_known_kernel_names_to_their_op_class():
    check = gpu_check()
    assert {name: check.classify(name) for name in KERNELS} == KERNELS
    assert set(KERNELS.values()) == set(check.CLASSES)


def test_a_chrome_trace_becomes_a_kernel_table_per_class(tmp_path):
    check = gpu_check()

    class Trace:  # a profile whose Chrome trace has two steps' kernels (as a GPU's has) and a CPU op
        def export_chrome_trace(self, path):
            events = [{"ph": "X", "cat": "kernel", "name": "nvjet_tst_128x256", "dur": 300.0},
                      {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_mul_silu_1", "dur": 50.0},
                      {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 10.0},
                      {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 999.0}]
            Path(path).write_text(json.dumps({"traceEvents": events * 2}))

    kernels = check._kernels_from_trace(Trace())
    assert kernels == {"nvjet_tst_128x256": [2, 600.0], "triton_poi_fused_mul_silu_1": [2, 100.0],
                       "Memcpy DtoD (Device -> Device)": [2, 20.0]}
    table = check.kernel_table(kernels, steps=2, step_s=1e-3, unprofiled_step_s=0.9e-3)
    assert table["classes"]["gemm"] == {"count": 1, "ms_per_step": 0.3, "share_of_step": pytest.approx(0.3)}
    assert table["kernel_ms_per_step"] == pytest.approx(0.36) and table["gap_ms_profiled"] == pytest.approx(0.64)
    assert table["kernels"][0] == {"name": "nvjet_tst_128x256", "class": "gemm", "count": 2, "total_us": 600.0}
    assert "| gemm | 1 | 0.30 | 30.0% |" in check.profile_md("none", table)


def test_a_compiled_suffix_compiles_the_blocks_and_keeps_the_ac_setting():
    check = gpu_check()
    eager = check.build_config("selective", "cpu", "llama3_debug", 2, 32, 2)
    compiled = check.build_config("selective" + check.COMPILED, "cpu", "llama3_debug", 2, 32, 2)
    assert (eager.ac, eager.compile.enabled) == (compiled.ac, None) and compiled.compile.enabled is True
    assert check.build_config("0.5", "cpu", "llama3_debug", 2, 32, 2).compile.enabled is None  # compiled by rule


def test_sections_run_in_the_order_asked_and_an_unknown_one_is_refused(tmp_path, capsys):
    check = gpu_check()
    data = check.main(["--device", "cpu", "--sections", "micro,env", "--out", str(tmp_path), "--budget-s", "0"])
    assert list(data["sections"]) == ["micro", "env"]  # skipped (no budget), but in this order
    log = (tmp_path / "gpu_check.log").read_text()
    with pytest.raises(SystemExit):
        check.main(["--device", "cpu", "--sections", "env,kernels", "--out", str(tmp_path)])
    assert "--sections=env,kernels: no section kernels; choose from env, micro" in capsys.readouterr().err
    assert log and (tmp_path / "gpu_check.log").read_text() == log  # the earlier results are kept


def test_a_failing_section_is_recorded_and_the_rest_still_run_and_write_json(tmp_path):
    check = gpu_check()
    report, ran = check.Report(tmp_path), []

    def broken():
        raise ValueError("no such kernel\nsecond line")

    check.run_sections([("a", lambda: ran.append("a")), ("b", broken), ("c", lambda: report.set("c", [1]))],
                       report, budget_s=60, start=time.perf_counter())
    check.run_sections([("late", lambda: ran.append("late"))], report, budget_s=0, start=time.perf_counter() - 1)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert ran == ["a"] and data["c"] == [1]
    assert {k: (v["status"], v["error"]) for k, v in data["sections"].items()} == {
        "a": ("ok", ""), "b": ("error", "ValueError: no such kernel"), "c": ("ok", ""),
        "late": ("skipped", "out of --budget-s 0")}
    assert "| b | error: ValueError: no such kernel |" in (tmp_path / "gpu_check.md").read_text()


def test_the_microbenchmarks_and_a_profiled_step_run_on_the_cpu(tmp_path, monkeypatch):
    check = gpu_check()
    monkeypatch.setattr(check, "BENCH_MS", 1.0)
    monkeypatch.setattr(check, "TINY", check.Shapes(dim=64, heads=2, kv_heads=1, head_dim=32, ffn=128, vocab=256,
                                                     tokens=64, layers=1, square=128, copy_bytes=1 << 20,
                                                     seqs=(64,), elementwise=1 << 14))
    data = check.main(["--device", "cpu", "--sections", "env,micro", "--out", str(tmp_path)])
    assert data["sections"] == {"env": {"status": "ok", "error": "", "seconds": pytest.approx(0, abs=60)},
                                "micro": {"status": "ok", "error": "", "seconds": pytest.approx(0, abs=60)}}
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["micro"]["rows"]
    assert [r for r in rows if "error" in r] == []
    assert {r["class"] for r in rows} == {"ceiling", "gemm", "attention fwd", "attention bwd", "copy/cast",
                                          "elementwise", "reduction/norm", "softmax/CE", "optimizer", "host"}
    assert all(r["ms"] > 0 for r in rows) and rows[1]["op"] == "mm" and rows[1]["of_peak_flops"] == 1.0

    a = torch.randn(64, 64)
    table = check.profile_steps_table(lambda: (a @ a).relu().sum(), torch.device("cpu"), 2, 1e-3)
    assert table["source"] == "key_averages cpu self" and table["classes"]["gemm"]["count"] == 1


# --- fsdp_expandable: FSDP2 over one rank, under each allocator ---------------------------------------------------


@pytest.mark.slow
def test_fsdp_over_one_rank_plans_exactly_what_its_cpu_steps_hold():
    """The section's run (FSDP2 over a real 1-rank gloo group, the trainer's model) against the planner's plan of the
    same program (FSDP2 over a 1-rank fake group): equal on the CPU. Without the kept 1-rank dimension neither has
    FSDP2 (no all-gather buffers): a different peak."""
    check = gpu_check()
    cfg = check.fsdp_config("selective", "cpu", "llama3_debug", 2, 32, 2, expandable=False)
    result = check.fsdp_one_rank(cfg, torch.device("cpu"), steps=2)
    plan, measured = result["plan"], result["measured"]
    assert plan["max_allocated"] == pytest.approx(measured["max_allocated"], abs=1024)
    assert plan["reserved"] is None and measured["max_reserved"] is None and result["record"] == {}
    plain = check.plan_setting(check.fsdp_config("selective", "cpu", "llama3_debug", 2, 32, 2, False), world_size=1)
    assert plain.max_allocated < plan["max_allocated"]


def test_the_allocator_model_replays_the_allocators_own_trace_on_its_streams():
    """replay_trace on a hand-written trace as torch.cuda.memory._snapshot() records it: two 30 MiB blocks freed,
    a 50 MiB one (default: a third segment; expandable: the freed pages), then on another stream a 3 MiB block
    whose free completes only after the next allocation (an event on another stream pending)."""
    check = gpu_check()

    def event(action, addr, size, stream=7):
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    events = [event("free_completed", 99, 8),  # freed before the trace began: no block of its own
              event("alloc", 1, 30 * MiB), event("alloc", 2, 30 * MiB),
              event("free_requested", 1, 30 * MiB), event("free_completed", 1, 30 * MiB),
              event("free_requested", 2, 30 * MiB), event("free_completed", 2, 30 * MiB),
              event("alloc", 3, 50 * MiB), event("alloc", 4, 3 * MiB, stream=9),
              event("free_requested", 4, 3 * MiB, stream=9), event("alloc", 5, MiB, stream=9),
              event("free_completed", 4, 3 * MiB, stream=9)]
    assert check.replay_trace(events) == {
        "streams": 2, "late_frees": 1, "most_pending_bytes": 3 * MiB,
        # default: 30 + 30 + 50 MiB segments, a 20 MiB one for 3 MiB and a small 2 MiB one on stream 9;
        # expandable: three 20 MiB pages hold a and b, then c; stream 9 maps a 20 MiB and a 2 MiB page
        "default_reserved": 132 * MiB, "expandable_reserved": 82 * MiB,
        "default_allocated": 60 * MiB, "expandable_allocated": 60 * MiB}


def test_the_allocator_record_sums_segments_by_stream_and_pool_and_keeps_the_trace():
    check = gpu_check()
    snapshot = {
        "segments": [{"stream": 0, "segment_type": "large", "total_size": 40 * MiB, "allocated_size": 30 * MiB,
                      "is_expandable": True},
                     {"stream": 0, "segment_type": "large", "total_size": 20 * MiB, "allocated_size": 0,
                      "is_expandable": True},
                     {"stream": 0, "segment_type": "small", "total_size": 2 * MiB, "allocated_size": 512,
                      "is_expandable": True},
                     {"stream": 5, "segment_type": "large", "total_size": 20 * MiB, "allocated_size": 20 * MiB,
                      "is_expandable": True}],
        "device_traces": [[{"action": "segment_map", "addr": 0, "size": 20 * MiB, "stream": 0},
                           {"action": "alloc", "addr": 1, "size": 30 * MiB, "stream": 0},
                           {"action": "alloc", "addr": 2, "size": 512, "stream": 0}]]}
    record = check.allocator_record(snapshot, {"reserved_bytes.all.peak": 82 * MiB, "segment.large_pool.peak": 0})
    assert record["streams"] == {
        "0/large": {"segments": 2, "bytes": 60 * MiB, "allocated": 30 * MiB, "expandable": True},
        "0/small": {"segments": 1, "bytes": 2 * MiB, "allocated": 512, "expandable": True},
        "5/large": {"segments": 1, "bytes": 20 * MiB, "allocated": 20 * MiB, "expandable": True}}
    assert record["stats"]["reserved_bytes.all.peak"] == 82 * MiB and record["stats"]["num_ooms"] is None
    assert record["events"] == 2 and record["trace"] == [[0, 1, 30 * MiB, 0], [0, 2, 512, 0]]
    assert record["replay"]["expandable_reserved"] == 42 * MiB and record["replay"]["default_reserved"] == 32 * MiB


@pytest.mark.slow
def test_the_fsdp_expandable_section_runs_each_allocator_in_a_fresh_process(tmp_path):
    check = gpu_check()
    data = check.main(["--device", "cpu", "--sections", "fsdp_expandable", "--out", str(tmp_path), "--steps", "2"])
    assert data["sections"]["fsdp_expandable"]["status"] == "ok", data["sections"]
    results = json.loads((tmp_path / "gpu_check.json").read_text())["fsdp_expandable"]["results"]
    assert [(r["setting"], r["allocator"]) for r in results] == [("selective", "default"),
                                                                  ("selective", "expandable segments")]
    for r in results:
        assert r["plan"]["max_allocated"] == pytest.approx(r["measured"]["max_allocated"], abs=1024)
    assert "| expandable segments | selective | " in (tmp_path / "gpu_check.md").read_text()
