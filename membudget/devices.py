"""The GPUs membudget knows: one table for the trainer's MFU and the planner's memory and time models.

Each entry is a data sheet (dense figures, without sparsity; fp32 without TF32, which torch's default matmul
precision does not use), the power limit it ran at, and the efficiency its kernels achieve, by architecture:
docs/planner/sources.md names the source of every figure. Memory is what torch.cuda reports as total_memory,
a little under the data sheet's GB (the 80 GB parts report 79.1-79.2 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from membudget.units import GiB


@dataclass(frozen=True)
class Efficiency:
    """What a GPU architecture's kernels achieve, as shares of the data sheet's rates; docs/planner/sources.md
    names each figure's source. The time model (plan/timing.py) applies them per kind of kernel."""

    gemm: float  # cuBLAS bf16 GEMM at its best shape (sources.md: mle-acc's achievable-matmul table)
    gemm_tile: tuple[int, int]  # the output tile one multiprocessor computes at a time: wave quantisation
    gemm_k_half: int  # K at which a GEMM reaches half its large-K rate (a tile's prologue and epilogue)
    attention: dict  # SDPA kernel -> (forward, backward) share at long causal sequences, head dim 128
    attention_s_half: int  # sequence length at which attention reaches half its long-sequence share
    memory: float  # elementwise kernels' share of HBM bandwidth
    kernel_floor: float  # seconds: no kernel is shorter (launch latency and tail)
    host_op: float  # seconds of host time per eager op that launches a kernel (Python, dispatcher, launch)
    host_view: float  # per eager op that launches none (views, metadata)
    host_graph: float  # per compiled graph call (guards, wrapper), plus host_kernel per kernel it launches
    host_kernel: float
    nccl_bus_nvlink: float  # NCCL's achieved bus bandwidth, share of the link's: inside a node
    nccl_bus_network: float  # across nodes, per GPU's NIC
    nccl_latency: float  # seconds per collective (start-up, as PyTorch sees it)
    nccl_sm_share: float  # share of the multiprocessors NCCL's kernels hold while they overlap compute
    # pinned host<->device copies' share of the host link, each way: below PCIe's ~0.89 protocol ceiling; not yet
    # measured (sources.md 5b: gpu_check.py --sections offload measures it)
    host_link: float = 0.80


# Hopper's attention and elementwise shares are this project's own measurement of PyTorch's kernels on an H200
# (torch 2.11, `python scripts/gpu_check.py`, 2026-12-04, docs/gpu_check.md): causal SDPA at head dim 128 and
# sequences 2048 and 8192 give each kernel's long-sequence share and the half-rate length; an add of 117M bf16
# elements moves 4.31 TB/s (0.90 of 4.8).
HOPPER = Efficiency(
    gemm=0.80, gemm_tile=(128, 256), gemm_k_half=128,
    attention={"flash": (0.40, 0.35), "efficient": (0.21, 0.16), "cudnn": (0.78, 0.65)}, attention_s_half=2000,
    memory=0.90, kernel_floor=3e-6, host_op=8e-6, host_view=2e-6, host_graph=30e-6, host_kernel=4e-6,
    nccl_bus_nvlink=0.80, nccl_bus_network=0.94, nccl_latency=40e-6, nccl_sm_share=16 / 132)
# Ampere's attention: FA2 forward+backward on an A100 (the flash-attention README's figures, sources.md) at 2k-16k
# give a long-sequence share of 0.62 and a half-rate length of ~576, split 1.25 : 1 between the directions as
# FA2's paper measures them
AMPERE = replace(HOPPER, gemm=0.87, gemm_tile=(128, 128),
                 attention={"flash": (0.70, 0.60), "efficient": (0.45, 0.35), "cudnn": (0.60, 0.50)},
                 attention_s_half=576, nccl_sm_share=16 / 108)
BLACKWELL = replace(HOPPER, gemm=0.78, nccl_sm_share=16 / 148)



@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes the run can use on it
    peak_flops: Optional[float] = None  # bf16/fp16 tensor cores, FLOP/s; None: no time model (a CPU)
    peak_flops_fp32: Optional[float] = None
    hbm_bandwidth: float = 0.0  # bytes/s
    intra_node_bandwidth: float = 0.0  # NVLink (or PCIe), bytes/s each way per GPU
    inter_node_bandwidth: float = 50e9  # 400 Gb/s InfiniBand/RoCE per GPU, the common H100/A100 cluster fabric
    # the GPU's link to host memory, bytes/s each way: PCIe 5.0 x16 (64 GB/s) on Hopper and on HGX B200, whose
    # hosts are PCIe 5.0; PCIe 4.0 x16 (32 GB/s) on Ampere and Ada (data sheets, docs/planner/sources.md)
    host_link_bandwidth: float = 64e9
    gpus_per_node: int = 8
    capability: tuple[int, int] = (0, 0)
    sms: int = 0  # streaming multiprocessors
    tdp_w: Optional[int] = None
    power_limit_w: Optional[int] = None  # the limit it ran at; None: its TDP
    # the tensor-core rate a part sustains as run, a share of the data sheet's times `efficiency`'s (a power cap,
    # clocks, the software of its day); 1.0 unless fitted, see FITTED
    compute_scale: float = 1.0
    efficiency: Efficiency = field(default=HOPPER, repr=False)
    cuda_names: tuple[str, ...] = ()  # torch.cuda.get_device_name of this part
    reason: str = ""  # why this device was assumed

    @property
    def is_gpu(self) -> bool:
        return self.peak_flops is not None


GPUS = {
    "H100": Device("H100 80GB (SXM)", int(79.1 * GiB), 989e12, 67e12, 3.35e12, 450e9, capability=(9, 0), sms=132,
                   tdp_w=700, cuda_names=("NVIDIA H100 80GB HBM3",)),
    "H100-96GB": Device("H100 96GB HBM2e (SXM)", int(94.9 * GiB), 989e12, 67e12, 2.4e12, 450e9, capability=(9, 0),
                        sms=132, tdp_w=700),
    "H100-PCIe": Device("H100 PCIe 80GB", int(79.1 * GiB), 756e12, 51e12, 2.0e12, 64e9, capability=(9, 0),
                        sms=114, tdp_w=350, cuda_names=("NVIDIA H100 PCIe",)),
    "H100-NVL": Device("H100 NVL 94GB", int(93.1 * GiB), 835e12, 60e12, 3.9e12, 64e9, capability=(9, 0),
                       sms=132, tdp_w=400, cuda_names=("NVIDIA H100 NVL",)),
    "H800": Device("H800 80GB (SXM)", int(79.1 * GiB), 989e12, 67e12, 3.35e12, 200e9, capability=(9, 0), sms=132,
                   tdp_w=700, cuda_names=("NVIDIA H800",)),
    "H200": Device("H200 141GB (SXM)", int(139.8 * GiB), 989e12, 67e12, 4.8e12, 450e9, capability=(9, 0), sms=132,
                   tdp_w=700, cuda_names=("NVIDIA H200",)),
    "B200": Device("B200 180GB (HGX)", int(167.6 * GiB), 2250e12, 80e12, 8.0e12, 900e9, capability=(10, 0),
                   sms=148, tdp_w=1000, efficiency=BLACKWELL, cuda_names=("NVIDIA B200",)),
    "A100-80GB": Device("A100 80GB (SXM)", int(79.2 * GiB), 312e12, 19.5e12, 2.04e12, 300e9, capability=(8, 0),
                        sms=108, tdp_w=400, efficiency=AMPERE,
                        host_link_bandwidth=32e9, cuda_names=("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe")),
    "A100-40GB": Device("A100 40GB (SXM)", int(39.4 * GiB), 312e12, 19.5e12, 1.56e12, 300e9, capability=(8, 0),
                        sms=108, tdp_w=400, efficiency=AMPERE,
                        host_link_bandwidth=32e9, cuda_names=("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB")),
    "H800-PCIe": Device("H800 PCIe 80GB", int(79.1 * GiB), 756e12, 51e12, 2.0e12, 64e9, capability=(9, 0),
                        sms=114, tdp_w=350, cuda_names=("NVIDIA H800 PCIe",)),
    "L40S": Device("L40S 48GB", int(44.4 * GiB), 362e12, 91.6e12, 0.864e12, 64e9, capability=(8, 9), sms=142,
                   tdp_w=350, efficiency=AMPERE, host_link_bandwidth=32e9, cuda_names=("NVIDIA L40S",)),
    "A10": Device("A10 24GB", int(22.1 * GiB), 125e12, 31.2e12, 0.6e12, 32e9, capability=(8, 6), sms=72,
                  tdp_w=150, efficiency=AMPERE, host_link_bandwidth=32e9, cuda_names=("NVIDIA A10",)),
}

# Entries at a power limit below TDP: the data sheet's part, with the tensor-core rate that limit sustains.
# FITTED names, per entry, each scalar fitted and the one public row it was fitted to (docs/planner/evidence.csv);
# that row is then not evidence, every other row is held out.
GPUS["H100-96GB@500W"] = replace(GPUS["H100-96GB"], name="H100 96GB HBM2e (SXM) at 500 W", power_limit_w=500,
                                 compute_scale=0.738)
GPUS["A100-80GB"] = replace(GPUS["A100-80GB"], compute_scale=0.895)
FITTED = {"H100-96GB@500W": {"compute_scale": "tt2412-t1-compile"}, "A100-80GB": {"compute_scale": "tt2404-l3-8b-op"}}


def by_cuda_name(name: str) -> Optional[str]:
    """The table's key for the name torch.cuda reports, exactly (None: not a GPU in the table)."""
    return next((key for key, d in GPUS.items() if name in d.cuda_names), None)
