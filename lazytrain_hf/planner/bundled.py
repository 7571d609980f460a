"""The bundled hardware profiles (H800, H100, H200, A100 80 GB, RTX 3090 / 4090, the 2-core CPU development machine):
their figures, where each comes from, and `get_profile` (a bundled name or a measured profile JSON)."""

from __future__ import annotations

import copy
import os
from typing import Any

from .hwprofile import GB, GiB, HardwareProfile, TiB

# Bundled profiles. Sources: NVIDIA datasheets for memory, memory bandwidth and dense bf16 tensor peak (no
# sparsity); pinned-copy bandwidths are typical measured values (PCIe Gen5 x16 ~ 50 GB/s of 64, Gen4 x16 ~ 25 GB/s of
# 32); NVMe: one PCIe Gen4 SSD (7/5 GB/s) on workstations, a 4-drive RAID-0 on servers. R_opt: a
# memory-bandwidth-bound fused AdamW over ~20 B/param (fp32 master r/w, grad r, 8-bit m/v r/w, bf16 copy w): server
# DDR5 ~ 200 GB/s -> ~8e9 param/s, workstation ~ 60 GB/s -> ~2.5e9 param/s.
#
# Efficiencies (fractions of the dense bf16 peak) and fixed costs of the GPU profiles; the cost model's terms are
# listed in costmodel.py (`layer_compute_terms`):
# - gemm (``achievable_fraction``) on Hopper: fitted to MegaTrain's published Qwen2.5-7B run on one H100 (272
#   TFLOPS in its 6*N*tokens convention, batch 158 x 1024; calibration.json), a run whose step is dense GEMMs (3
#   forwards + 1 backward per layer) plus its serial CPU optimizer, with MegaTrain's executor as
#   `baselines.evaluate_megatrain` models it: 0.52 (`calibration.fit_bundled_hopper()` refits it). Other GPUs keep
#   their earlier typical layer MFU (Megatron-LM / nanoGPT reports).
# - attention / attention_bwd: FlashAttention-2 (PyTorch SDPA's flash backend) on H100 SXM reaches ~ 330-370
#   TFLOPS forward and ~ 250-300 TFLOPS backward at head dim 128, causal, 2k-16k tokens (FlashAttention-3 paper,
#   Shah et al. 2024, Figs. 5-6 FA2 curves): 0.35 / 0.28 of 989.5; Ampere: FA2 paper (Dao 2023) fwd up to 73%,
#   bwd up to 63% of A100 peak at long sequences, ~50% / 40% at 1-2k tokens.
# - linear_attention on Hopper: fitted to the LazyTrain paper's Qwen3.6-27B on one H800 (219.95 TFLOPS, 1361
#   tokens/s at batch 72; 48 of its 64 layers are Gated DeltaNet) with the GEMM efficiency above held fixed:
#   0.0084 = 8.3 TFLOPS for the chunked delta rule's FLOPs. transformers runs it without the fla kernels as
#   `torch_chunk_gated_delta_rule`: q/k/v cast to fp32, small batched matmuls ([B*H, 64, 128]) in fp32 without
#   TF32 (torch's default), whose SIMT peak is 67 TFLOPS on H100 SXM (datasheet), and a 63-step Python loop of tiny
#   kernels per chunk for the triangular solve: the fit is 1/8 of that fp32 peak. Ampere, argued the same way
#   (19.5 fp32 / 312 bf16, 1/8): 0.008; GeForce (fp32 peak = the bf16 tensor peak without sparsity): 0.12.
# - moe: transformers 5 runs the experts as grouped GEMMs over sorted tokens (`torch._grouped_mm`); with ~S/E rows
#   per expert they reach ~ 70% of a dense GEMM's rate (no published point to fit; a plain ratio).
# - memory_gbps: ~85% of the datasheet HBM bandwidth, what STREAM-like elementwise kernels reach (H100/H800 SXM
#   3.35 TB/s -> 2850 GB/s, H200 4.8 -> 4080, A100 80 GB 2.04 -> 1730, RTX 3090 0.936 -> 800, RTX 4090 1.008 -> 860).
# - net_gbps / shm_gbps (a data-parallel world's gradient reduces and compute-copy gathers, host to host): every
#   GPU profile keeps `HardwareProfile`'s defaults (5 GB/s between nodes: gloo over TCP on 100 Gb/s; 10 GB/s between
#   the ranks of a node through shared memory), assumed figures until measured; the CPU machine: its memcpy.
# - device_net_gbps (a unit's gradient reduced to its owner on the devices by NCCL, `Plan.dp_reduce == "device"`):
#   ~80% of one direction of the node's device interconnect, what NCCL's bus bandwidth reaches on large messages
#   (nccl-tests): H100 / H200 NVLink 4, 900 GB/s both ways -> 360; H800 NVLink cut to 400 GB/s both ways -> 160;
#   A100 NVLink 3, 600 GB/s -> 240; RTX 3090 / 4090 without NVLink or peer-to-peer (4090), PCIe Gen4 through host
#   memory -> 12 (`HardwareProfile`'s default); the CPU machine: gloo over host memory, its memcpy. Assumed
#   figures, like net_gbps, until measured on the cluster.
# - kernel_overhead_s: 5 us per kernel, PyTorch eager dispatch + CUDA launch of one op (only what a short kernel
#   cannot hide; negligible at layer shapes of billions of parameters, visible on tiny ones).
_HOPPER_GEMM = 0.52
_HOPPER_EFFICIENCY = {"attention": 0.35, "attention_bwd": 0.28, "linear_attention": 0.0084, "moe": 0.7 * _HOPPER_GEMM}
_AMPERE_EFFICIENCY = {"attention": 0.5, "attention_bwd": 0.4, "linear_attention": 0.008, "moe": 0.7 * 0.6}
_GEFORCE_EFFICIENCY = {"attention": 0.5, "attention_bwd": 0.4, "linear_attention": 0.12, "moe": 0.7 * 0.7}
_GPU_KERNEL_S = 5e-6
_BUNDLED: dict[str, dict[str, Any]] = {
    "h800": dict(
        device_memory_bytes=80 * GiB,
        peak_tflops=989.5,
        achievable_fraction=_HOPPER_GEMM,
        h2d_gbps=50.0,
        d2h_gbps=50.0,
        nvme_read_gbps=24.0,
        nvme_write_gbps=16.0,
        nvme_capacity_bytes=8 * TiB,
        host_memory_bytes=1 * TiB,
        cpu_optimizer_params_per_s=8e9,
        memory_gbps=2850.0,
        kernel_overhead_s=_GPU_KERNEL_S,
        efficiency=dict(_HOPPER_EFFICIENCY),
        device_net_gbps=160.0,
        source="datasheet: H800 SXM5 80 GB HBM3 3.35 TB/s, 989.5 TFLOPS dense bf16, PCIe Gen5 x16",
    ),
    "h200": dict(
        device_memory_bytes=141 * GB,
        peak_tflops=989.5,
        achievable_fraction=_HOPPER_GEMM,
        h2d_gbps=50.0,
        d2h_gbps=50.0,
        nvme_read_gbps=24.0,
        nvme_write_gbps=16.0,
        nvme_capacity_bytes=8 * TiB,
        host_memory_bytes=3 * TiB // 2,
        cpu_optimizer_params_per_s=8e9,
        memory_gbps=4080.0,
        kernel_overhead_s=_GPU_KERNEL_S,
        efficiency=dict(_HOPPER_EFFICIENCY),
        device_net_gbps=360.0,
        source="datasheet: H200 SXM 141 GB HBM3e 4.8 TB/s, 989.5 TFLOPS dense bf16, PCIe Gen5 x16",
    ),
    "a100-80g": dict(
        device_memory_bytes=80 * GiB,
        peak_tflops=312.0,
        achievable_fraction=0.6,
        h2d_gbps=25.0,
        d2h_gbps=25.0,
        nvme_read_gbps=24.0,
        nvme_write_gbps=16.0,
        nvme_capacity_bytes=8 * TiB,
        host_memory_bytes=1 * TiB,
        cpu_optimizer_params_per_s=6e9,
        memory_gbps=1730.0,
        kernel_overhead_s=_GPU_KERNEL_S,
        efficiency=dict(_AMPERE_EFFICIENCY),
        device_net_gbps=240.0,
        source="datasheet: A100 SXM4 80 GB HBM2e 2.04 TB/s, 312 TFLOPS dense bf16, PCIe Gen4 x16",
    ),
    "rtx3090": dict(
        device_memory_bytes=24 * GiB,
        peak_tflops=71.0,
        achievable_fraction=0.7,
        h2d_gbps=24.0,
        d2h_gbps=24.0,
        nvme_read_gbps=7.0,
        nvme_write_gbps=5.0,
        nvme_capacity_bytes=2 * TiB,
        host_memory_bytes=512 * GiB,
        cpu_optimizer_params_per_s=2.5e9,
        memory_gbps=800.0,
        kernel_overhead_s=_GPU_KERNEL_S,
        efficiency=dict(_GEFORCE_EFFICIENCY),
        source="datasheet: RTX 3090 24 GB GDDR6X 936 GB/s, 71 TFLOPS bf16 with fp32 accumulate, PCIe Gen4 x16",
    ),
    "rtx4090": dict(
        device_memory_bytes=24 * GiB,
        peak_tflops=165.2,
        achievable_fraction=0.65,
        h2d_gbps=24.0,
        d2h_gbps=24.0,
        nvme_read_gbps=7.0,
        nvme_write_gbps=5.0,
        nvme_capacity_bytes=2 * TiB,
        host_memory_bytes=512 * GiB,
        cpu_optimizer_params_per_s=2.5e9,
        memory_gbps=860.0,
        kernel_overhead_s=_GPU_KERNEL_S,
        efficiency=dict(_GEFORCE_EFFICIENCY),
        source="datasheet: RTX 4090 24 GB GDDR6X 1008 GB/s, 165.2 TFLOPS bf16 with fp32 accumulate, PCIe Gen4 x16",
    ),
    # This kind of development machine: 2 AMD EPYC cores (AVX2/FMA), 24 GiB, no GPU. The CPU executor's "device"
    # is host memory, so "H2D"/"D2H" are memcpy (1 GiB copy 18-21 GB/s). Peak: 2 cores x 2 FMA x 8 fp32 lanes x
    # 2 FLOP x ~2.5 GHz = 160 GFLOP/s; eta 0.35 as measured for torch GEMMs of layer size. R_opt: torch fused AdamW
    # runs 50M fp32 params in 44 ms (1.1e9 param/s); the 8-bit step does more work per element. BW_mem: in-place
    # add with 2 threads 28-31 GB/s; an eager op with autograd costs a few microseconds on top of its work.
    "cpu": dict(
        device_memory_bytes=24 * GiB,
        peak_tflops=0.16,
        achievable_fraction=0.35,
        h2d_gbps=19.0,
        d2h_gbps=19.0,
        nvme_read_gbps=1.0,
        nvme_write_gbps=0.5,
        nvme_capacity_bytes=20 * GiB,
        host_memory_bytes=24 * GiB,
        cpu_optimizer_params_per_s=0.8e9,
        device_type="cpu",
        memory_gbps=29.0,
        kernel_overhead_s=5e-6,
        efficiency={"attention": 0.5, "attention_bwd": 0.4, "linear_attention": 0.5, "moe": 0.5},
        shm_gbps=19.0,
        device_net_gbps=19.0,
        source="measured facts of a 2-core AMD EPYC (AVX2) development machine, 24 GiB, no GPU",
    ),
}

# H100 SXM5: the same datasheet figures as the H800 but for NVLink (full NVLink 4: the device reduce of data parallel)
_H100 = {
    **_BUNDLED["h800"],
    "efficiency": dict(_HOPPER_EFFICIENCY),
    "device_net_gbps": 360.0,
    "source": "datasheet: H100 SXM5 80 GB HBM3 3.35 TB/s, 989.5 TFLOPS dense bf16, PCIe Gen5 x16",
}
_BUNDLED = {"h800": _BUNDLED["h800"], "h100": _H100, **{k: v for k, v in _BUNDLED.items() if k != "h800"}}
BUNDLED_PROFILES: tuple[str, ...] = tuple(_BUNDLED)


def get_profile(name_or_path: str | HardwareProfile) -> HardwareProfile:
    """A bundled profile by name (``h800``, ``h100``, ``h200``, ``a100-80g``, ``rtx3090``, ``rtx4090``, ``cpu``) or a profile
    JSON written by `measure()` / `HardwareProfile.to_json`.

    Raises:
        ValueError: unknown name (the message lists the bundled names) or a malformed file.
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    if not isinstance(name_or_path, str) or not name_or_path:
        raise TypeError(f"hardware={name_or_path!r} must be a profile name or a JSON path.")
    key = name_or_path.lower()
    if key in _BUNDLED:
        return HardwareProfile(name=key, **copy.deepcopy(_BUNDLED[key]))
    if name_or_path.endswith(".json") or os.path.sep in name_or_path:
        if not os.path.isfile(name_or_path):
            raise ValueError(
                f"hardware profile file {name_or_path!r} does not exist; write one with "
                "`lazytrain_hf.planner.hardware.measure(cache_path=...)` or use a bundled name "
                f"({', '.join(BUNDLED_PROFILES)})."
            )
        return HardwareProfile.from_json(name_or_path)
    raise ValueError(
        f"hardware={name_or_path!r} is not a bundled profile; use one of {', '.join(BUNDLED_PROFILES)} or a path to "
        "a profile JSON written by `measure()`."
    )
