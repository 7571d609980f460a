"""Hardware profiles: what the planner needs to know about a machine, bundled from datasheets or measured live.

A `HardwareProfile` is plain data (JSON round trip). Bundled profiles are written from public datasheet facts and
typical measured link speeds; `measure()` fills one on the machine it runs on (copy bandwidths, NVMe through a temp
file, CPU optimizer rate, matmul rate) in a few seconds and can cache it as JSON for `lazytrain plan --hardware`.

Symbols used across the planner (bytes, seconds, FLOP):

- ``M_gpu``  device memory of one accelerator (on the CPU profile: the host memory the "device" tensors live in);
- ``P``      dense bf16 peak FLOP/s, ``eta`` the fraction of it a decoder layer's GEMMs reach (MFU of one layer);
- ``BW_h2d`` / ``BW_d2h``  pinned host <-> device copy bandwidth, one direction each (PCIe is full duplex);
- ``BW_nvme_r`` / ``BW_nvme_w``  NVMe read / write bandwidth, ``M_nvme`` its free capacity;
- ``M_host`` host RAM, ``R_opt`` CPU optimizer rate in parameters per second (Hybrid 8-bit AdamW step incl. clip);
- ``BW_mem`` device memory bandwidth reached by memory-bound passes (norms, activations, softmax, casts);
- ``eta_k`` per compute class ``k`` (`COMPUTE_CLASSES`: dense GEMMs, attention core forward / backward,
  gated-delta-rule core, MoE expert GEMMs) the fraction of ``P`` its kernels reach; ``t_kernel`` the fixed cost of
  one kernel (dispatch + launch).

Note: [Serial lanes on the CPU device]
On a ``device_type == "cpu"`` profile the "device" is host memory and the executor's copies are synchronous memcpy
on the cores that compute, and the CPU optimizer competes for the same cores: nothing overlaps. Such a profile has
``serial_lanes`` true (and so does every `CostModel` built from it); a stage time is then the sum of its lanes
(``compute + h2d / BW_h2d + d2h / BW_d2h + nvme``), not their maximum, and the optimizer tail is never hidden behind
the next forward.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

GB = 10**9
GiB = 2**30
TiB = 2**40
# Compute classes of the cost model, each with its own fraction of peak (``HardwareProfile.efficiency``):
#   gemm                dense projection / MLP GEMMs (and lm_head): ``achievable_fraction``
#   gemm_bwd            their backward (dX = dY W and dW = dY^T X; default: the forward rate)
#   attention           attention core forward (SDPA flash / efficient kernels, QK^T and AV)
#   attention_bwd       attention core backward
#   linear_attention    gated-delta-rule core (chunked delta rule: small batched matmuls, fp32 in the torch path)
#   moe                 routed expert GEMMs (grouped GEMMs over sorted tokens)
COMPUTE_CLASSES: tuple[str, ...] = ("gemm", "gemm_bwd", "attention", "attention_bwd", "linear_attention", "moe")


def _finite(value: Any) -> bool:
    """A real number (not a bool), neither NaN nor infinite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class HardwareProfile:
    """One accelerator plus its host, as the planner sees it.

    Args:
        name: profile name (``"h800"``, ``"measured"``, ...).
        device_memory_bytes: ``M_gpu``, total memory of the device.
        peak_tflops: ``P``, dense bf16 tensor-core peak in TFLOP/s (no sparsity).
        achievable_fraction: ``eta``, fraction of ``peak_tflops`` a decoder layer reaches.
        h2d_gbps: ``BW_h2d`` in GB/s (10**9 bytes/s), pinned host to device.
        d2h_gbps: ``BW_d2h`` in GB/s, device to pinned host.
        nvme_read_gbps: ``BW_nvme_r`` in GB/s.
        nvme_write_gbps: ``BW_nvme_w`` in GB/s.
        nvme_capacity_bytes: ``M_nvme``, free NVMe space for activation spill files.
        host_memory_bytes: ``M_host``, host RAM.
        cpu_optimizer_params_per_s: ``R_opt``, parameters per second of the CPU optimizer step (Hybrid 8-bit AdamW
            with fused clipping, all cores).
        device_type: ``"cuda"`` or ``"cpu"`` (the CPU executor: "device" tensors live in host memory).
        source: where the numbers come from (datasheet, measurement).
        layer_times: optional measured per-kind layer times ``{kind: [fwd_s, bwd_s]}`` with the batch shape they were
            taken at under ``layer_times_shape`` (``[micro_batch_size, seq_len]``).
        memory_gbps: ``BW_mem`` in GB/s, device memory bandwidth that memory-bound passes reach (0: not modelled).
        kernel_overhead_s: ``t_kernel``, fixed seconds per kernel (framework dispatch + launch; 0: not modelled).
        efficiency: ``{class: eta}`` for the classes of `COMPUTE_CLASSES` other than ``gemm``, as fractions of
            ``peak_tflops``; a missing class runs at ``achievable_fraction``.
    """

    name: str
    device_memory_bytes: int
    peak_tflops: float
    achievable_fraction: float
    h2d_gbps: float
    d2h_gbps: float
    nvme_read_gbps: float
    nvme_write_gbps: float
    nvme_capacity_bytes: int
    host_memory_bytes: int
    cpu_optimizer_params_per_s: float
    device_type: str = "cuda"
    source: str = ""
    layer_times: dict[str, list[float]] = field(default_factory=dict)
    layer_times_shape: list[int] = field(default_factory=list)
    memory_gbps: float = 0.0
    kernel_overhead_s: float = 0.0
    efficiency: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # json.load reads NaN and Infinity; a NaN rate would reach the solver as a NaN coefficient
        fix = "fix the profile or re-run `measure()`"
        for name in (
            "device_memory_bytes",
            "peak_tflops",
            "h2d_gbps",
            "d2h_gbps",
            "nvme_read_gbps",
            "nvme_write_gbps",
            "host_memory_bytes",
            "cpu_optimizer_params_per_s",
        ):
            value = getattr(self, name)
            if not _finite(value) or value <= 0:
                raise ValueError(
                    f"HardwareProfile {self.name!r}: {name}={value!r} must be a positive finite number; {fix}."
                )
        if not _finite(self.achievable_fraction) or not 0 < self.achievable_fraction <= 1:
            raise ValueError(
                f"HardwareProfile {self.name!r}: achievable_fraction={self.achievable_fraction!r} must be in (0, 1]; "
                f"{fix}."
            )
        if not _finite(self.nvme_capacity_bytes) or self.nvme_capacity_bytes < 0:
            raise ValueError(
                f"HardwareProfile {self.name!r}: nvme_capacity_bytes={self.nvme_capacity_bytes!r} must be a finite "
                f"number >= 0; {fix}."
            )
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"HardwareProfile {self.name!r}: device_type={self.device_type!r} must be cuda or cpu.")
        if not isinstance(self.layer_times, dict) or not all(
            isinstance(t, list | tuple) and len(t) == 2 and all(_finite(x) and x >= 0 for x in t)
            for t in self.layer_times.values()
        ):
            raise ValueError(
                f"HardwareProfile {self.name!r}: layer_times={self.layer_times!r} must map each layer kind to "
                f"[forward_s, backward_s] (finite numbers >= 0); {fix}."
            )
        for name in ("memory_gbps", "kernel_overhead_s"):
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                raise ValueError(
                    f"HardwareProfile {self.name!r}: {name}={value!r} must be a finite number >= 0; {fix}."
                )
        if not isinstance(self.efficiency, dict):
            raise ValueError(f"HardwareProfile {self.name!r}: efficiency={self.efficiency!r} must be a dict; {fix}.")
        for key, value in self.efficiency.items():
            if key not in COMPUTE_CLASSES or key == "gemm":
                raise ValueError(
                    f"HardwareProfile {self.name!r}: efficiency key {key!r} is not one of "
                    f"{COMPUTE_CLASSES[1:]} (dense forward GEMMs use achievable_fraction); {fix}."
                )
            if not _finite(value) or not 0 < value <= 1:
                raise ValueError(
                    f"HardwareProfile {self.name!r}: efficiency[{key!r}]={value!r} must be in (0, 1]; {fix}."
                )

    # ------------------------------------------------------------------ derived rates
    @property
    def flops_per_s(self) -> float:
        """Sustained FLOP/s of a decoder layer: ``P * eta``."""
        return self.peak_tflops * 1e12 * self.achievable_fraction

    def rate(self, compute_class: str) -> float:
        """Sustained FLOP/s of one compute class (`COMPUTE_CLASSES`): ``P * eta_class``."""
        if compute_class not in COMPUTE_CLASSES:
            raise ValueError(f"compute_class={compute_class!r} is not one of {COMPUTE_CLASSES}.")
        eta = self.achievable_fraction if compute_class == "gemm" else self.efficiency.get(compute_class)
        if eta is None:
            eta = self.achievable_fraction
        return self.peak_tflops * 1e12 * eta

    @property
    def memory_bytes_per_s(self) -> float:
        """``BW_mem`` in bytes/s (0 when the profile does not model memory-bound passes)."""
        return self.memory_gbps * GB

    @property
    def serial_lanes(self) -> bool:
        """Copies, compute and the optimizer share the same cores (Note: [Serial lanes on the CPU device])."""
        return self.device_type == "cpu"

    @property
    def h2d_bytes_per_s(self) -> float:
        return self.h2d_gbps * GB

    @property
    def d2h_bytes_per_s(self) -> float:
        return self.d2h_gbps * GB

    @property
    def nvme_read_bytes_per_s(self) -> float:
        return self.nvme_read_gbps * GB

    @property
    def nvme_write_bytes_per_s(self) -> float:
        return self.nvme_write_gbps * GB

    def default_gpu_budget(self) -> int:
        """Device memory the planner may use when no budget is given: ``M_gpu`` minus a 10% reserve (allocator
        fragmentation, CUDA context, kernels' own workspaces)."""
        return int(self.device_memory_bytes * 0.9)

    def default_host_budget(self) -> int:
        """Pinned host memory for offloaded activations when no budget is given: half of ``M_host``."""
        return int(self.host_memory_bytes // 2)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        if not isinstance(data, dict):
            raise ValueError(
                f"a hardware profile is a JSON object of its fields, not {type(data).__name__}; re-run `measure()`."
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown hardware profile keys {sorted(unknown)}; known keys are {sorted(known)}.")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.default is dataclasses.MISSING]
        missing = [m for m in missing if m not in _OPTIONAL_KEYS]
        if missing:
            raise ValueError(f"hardware profile is missing keys {missing}; write them or re-run `measure()`.")
        return cls(**data)

    def to_json(self, path: str | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    @classmethod
    def from_json(cls, path: str) -> HardwareProfile:
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except json.JSONDecodeError as e:
            raise ValueError(f"hardware profile {path} is not valid JSON ({e}); re-run `measure()`.") from e
        except ValueError as e:
            raise ValueError(f"hardware profile {path}: {e}") from e

    def summary(self) -> str:
        return (
            f"{self.name}: {self.device_memory_bytes / GiB:.0f} GiB device, {self.peak_tflops:.0f} TFLOPS x "
            f"{self.achievable_fraction:.2f}, H2D {self.h2d_gbps:.1f} GB/s, D2H {self.d2h_gbps:.1f} GB/s, NVMe "
            f"{self.nvme_read_gbps:.1f}/{self.nvme_write_gbps:.1f} GB/s, host {self.host_memory_bytes / GiB:.0f} GiB, "
            f"optimizer {self.cpu_optimizer_params_per_s / 1e9:.2f} Gparam/s"
        )


_OPTIONAL_KEYS = ("layer_times", "layer_times_shape", "memory_gbps", "kernel_overhead_s", "efficiency")


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
        source="measured facts of a 2-core AMD EPYC (AVX2) development machine, 24 GiB, no GPU",
    ),
}

# H100 SXM5: the same datasheet figures as the H800 but for NVLink, which a single-device run does not use
_H100 = {
    **_BUNDLED["h800"],
    "efficiency": dict(_HOPPER_EFFICIENCY),
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


# ---------------------------------------------------------------------------------------------------- measure()
# The clock of the compute and copy probes: wall time by default; `measure(timer=time.process_time)` counts only
# this process's CPU time (with one thread on a shared machine, what its work costs whatever the other tenants do).
_clock = time.perf_counter


@contextlib.contextmanager
def _timed_with(timer) -> Iterator[None]:
    global _clock
    prev, _clock = _clock, timer or time.perf_counter
    try:
        yield
    finally:
        _clock = prev


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    times.sort()
    return times[len(times) // 2]


def _measure_copy(device: str, nbytes: int, repeats: int) -> tuple[float, float]:
    import torch

    from .. import pinned

    n = nbytes // 2
    if device == "cpu":
        # The CPU executor copies between host buffers; both directions are memcpy.
        a = torch.empty(n, dtype=torch.bfloat16).fill_(1)
        b = torch.empty_like(a)
        b.copy_(a)
        t = _median_time(lambda: b.copy_(a), repeats)
        return nbytes / t / GB, nbytes / t / GB
    # an exact-size registered probe, unregistered and freed when it goes (the caching host allocator would keep a
    # power-of-two block page-locked for the life of the process: Note: [The caching host allocator rounds and keeps])
    probe = pinned.PinnedBlock(n * 2, True, "the host bandwidth probe")
    host = probe.tensor.view(torch.bfloat16).fill_(1)
    dev = torch.empty(n, dtype=torch.bfloat16, device=device)

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize(device)

    h2d()
    d2h()
    return nbytes / _median_time(h2d, repeats) / GB, nbytes / _median_time(d2h, repeats) / GB


def _measure_nvme(directory: str | None, nbytes: int) -> tuple[float, float, int]:
    """Write ``nbytes`` to a temp file with fsync, drop it from the page cache, read it back."""
    import shutil

    directory = directory or tempfile.gettempdir()
    data = os.urandom(1 << 20) * max(1, nbytes >> 20)
    fd, path = tempfile.mkstemp(dir=directory, prefix="lazytrain_nvme_probe_")
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.write(data)
            os.fsync(f.fileno())
        t_write = time.perf_counter() - t0
        with open(path, "rb", buffering=0) as f:
            # Without dropping the pages the read would measure the page cache, not the drive.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while f.read(1 << 24):
                pass
            t_read = time.perf_counter() - t0
        free = shutil.disk_usage(directory).free
    finally:
        os.unlink(path)
    return len(data) / t_read / GB, len(data) / t_write / GB, int(free)


def _measure_optimizer(num_params: int, repeats: int, optimizer: str) -> tuple[float, str]:
    import torch

    p = torch.nn.Parameter(torch.zeros(num_params))
    p.grad = torch.randn(num_params) * 1e-3
    opt = None
    used = "torch.optim.AdamW(fused=True), fp32 moments"
    if optimizer in ("auto", "hybrid8bit"):
        try:
            from lazytrain_hf.optim import HybridAdamW8bit  # optional: the package's own CPU optimizer

            opt = HybridAdamW8bit([p], lr=1e-5)
            used = "HybridAdamW8bit"
        except (ImportError, AttributeError, TypeError) as e:
            if optimizer == "hybrid8bit":
                raise ImportError(f"measure(optimizer='hybrid8bit'): HybridAdamW8bit is not available ({e}).") from e
    if opt is None:
        try:
            opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW([p], lr=1e-5, foreach=True)
            used = "torch.optim.AdamW(foreach=True), fp32 moments"
    opt.step()  # first step allocates state (and compiles kernels); not timed
    return num_params / _median_time(opt.step, repeats), used


def _measure_matmul(device: str, n: int, repeats: int) -> float:
    import torch

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)

    def mm() -> None:
        a @ b
        if device != "cpu":
            torch.cuda.synchronize(device)

    mm()
    return 2 * n**3 / _median_time(mm, repeats) / 1e12


def _cpu_shapes(config: Any, micro_batch_size: int, seq_len: int) -> dict[str, int]:
    """Layer-like shapes for the CPU probes: the config's when given, else a ~100M-parameter Qwen3 layer."""
    if config is None:
        return dict(rows=1024, d=768, inner=2048, H=12, hd=64, T=256)
    d = int(config.hidden_size)
    H = int(config.num_attention_heads)
    hd = int(getattr(config, "head_dim", None) or d // H)
    inner = int(getattr(config, "intermediate_size", None) or 4 * d)
    rows = max(256, min(4096, micro_batch_size * seq_len))
    return dict(rows=rows, d=d, inner=inner, H=H, hd=hd, T=max(64, min(1024, seq_len)))


def _measure_cpu_compute(shapes: dict[str, int], repeats: int) -> dict[str, float]:
    """Rates of the CPU "device" at layer shapes (fp32, what the CPU executor computes in).

    - ``gemm``: FLOP/s of ``linear`` at a decoder layer's projection shapes (tokens x d -> inner, inner -> d,
      d -> d), total FLOPs over total time (not one square matmul: small-K and skinny shapes run slower);
      ``gemm_bwd``: the input and weight gradients of the up projection;
    - ``attention`` / ``attention_bwd``: SDPA, causal, FLOPs counted as the cost model does (halved by the mask);
    - ``linear_attention`` / ``moe``: batched matmuls of the chunked delta rule ([B*H, 64, 128] x [128, 64]) and of
      grouped experts ([E, rows/E, d] x [E, d, inner/4]);
    - ``memory_bytes_per_s``: an RMSNorm + SiLU * up block forward and backward, bytes counted the cost model's way
      (``MEMORY_PASSES_FWD + MEMORY_PASSES_BWD`` times the bytes it saves for backward);
    - ``kernel_s``: one tiny op with autograd (a chain of scalar multiplies, forward + backward, per kernel).
    """
    import torch

    t = shapes
    rows, d, inner = t["rows"], t["d"], t["inner"]
    x = torch.randn(rows, d)
    w_up, w_down, w_sq = torch.randn(inner, d), torch.randn(d, inner), torch.randn(d, d)
    h = torch.randn(rows, inner)
    F = torch.nn.functional

    def gemms() -> None:
        F.linear(x, w_up)
        F.linear(h, w_down)
        F.linear(x, w_sq)

    gemms()
    gemm = 2 * rows * d * (2 * inner + d) / _median_time(gemms, repeats)
    gy = torch.randn(rows, inner)

    def gemms_bwd() -> None:
        # the up projection's input gradient and weight gradient (the weight gradient's transposed operand is what
        # makes backward GEMMs slower than forward ones on CPUs)
        gy @ w_up
        gy.t() @ x

    gemms_bwd()
    gemm_bwd = 2 * 2 * rows * d * inner / _median_time(gemms_bwd, repeats)

    B = max(1, rows // t["T"])
    q = torch.randn(B, t["H"], t["T"], t["hd"], requires_grad=True)
    attn_flops = 2 * B * t["H"] * t["T"] ** 2 * t["hd"]

    def sdpa():
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    sdpa()
    attention = attn_flops / _median_time(sdpa, repeats)
    out = sdpa()
    go = torch.randn_like(out)

    def sdpa_bwd() -> None:
        sdpa().backward(go)

    sdpa_bwd()
    t_fb = _median_time(sdpa_bwd, repeats)
    attention_bwd = 2 * attn_flops / max(t_fb - attn_flops / attention, 1e-9)

    bh = max(1, rows // 64) * 4  # (token chunks) x heads
    a, b = torch.randn(bh, 64, 128), torch.randn(bh, 128, 64)
    linear = 2 * bh * 64 * 128 * 64 / _median_time(lambda: torch.bmm(a, b), repeats)
    E = 8
    ea, eb = torch.randn(E, max(1, rows // E), d), torch.randn(E, d, max(1, inner // 4))
    moe = 2 * E * max(1, rows // E) * d * max(1, inner // 4) / _median_time(lambda: torch.bmm(ea, eb), repeats)

    xr = torch.randn(rows, inner, requires_grad=True)
    up = torch.randn(rows, inner, requires_grad=True)
    nw = torch.ones(inner, requires_grad=True)
    gz = torch.randn(rows, inner)

    def elementwise() -> None:
        # Qwen3RMSNorm then SiLU(gate) * up: fp32 upcast, pow/mean/rsqrt, weight, silu, product
        h32 = xr.float()
        var = h32.pow(2).mean(-1, keepdim=True)
        normed = nw * (h32 * torch.rsqrt(var + 1e-6))
        (F.silu(normed) * up).backward(gz)

    elementwise()
    from .costmodel import MEMORY_PASSES_BWD, MEMORY_PASSES_FWD, _rmsnorm_saved

    # saved: the RMSNorm's (fp32 in, rsqrt, normed), silu input, silu output and up (the product's operands)
    saved = _rmsnorm_saved(rows, inner, 4, False) + 3 * rows * inner * 4
    memory = (MEMORY_PASSES_FWD + MEMORY_PASSES_BWD) * saved / _median_time(elementwise, repeats)

    z = torch.ones(1, requires_grad=True)
    n_ops = 200

    def tiny() -> None:
        y = z
        for _ in range(n_ops):
            y = y * 1.0
        y.backward()

    tiny()
    kernel = _median_time(tiny, repeats) / (3 * n_ops)  # the model counts a forward kernel once, backward twice
    return dict(
        gemm=gemm,
        gemm_bwd=gemm_bwd,
        attention=attention,
        attention_bwd=attention_bwd,
        linear_attention=linear,
        moe=moe,
        memory_bytes_per_s=memory,
        kernel_s=kernel,
    )


def measure(
    cache_path: str | None = None,
    device: str | None = None,
    *,
    nvme_dir: str | None = None,
    copy_bytes: int = 128 * 2**20,
    nvme_bytes: int = 64 * 2**20,
    optimizer_params: int = 4_000_000,
    optimizer: str = "auto",
    matmul_size: int | None = None,
    repeats: int = 3,
    config: Any = None,
    micro_batch_size: int = 1,
    seq_len: int = 128,
    use_cache: bool = True,
    timer: Any = None,
) -> HardwareProfile:
    """Measure this machine and return a `HardwareProfile` (a few seconds on CPU).

    Measures pinned copy bandwidth both ways (host memcpy on CPU), NVMe read/write through a temp file in
    ``nvme_dir`` (fsync, page cache dropped before the read), the CPU optimizer rate (``HybridAdamW8bit`` when the
    package provides it, else torch fused AdamW; named in ``source``), the compute rates and, when ``config`` is
    given, per-kind forward/backward times of one decoder layer at ``micro_batch_size`` x ``seq_len``.

    Compute rates: on CUDA one ``matmul_size``-square bf16 matmul (taken as ``peak_tflops`` with
    ``achievable_fraction`` 1, since it is already what kernels reach). On the CPU (fp32, the CPU executor's dtype)
    every compute class at layer shapes (``config``'s when given, else a ~100M-parameter Qwen3 layer): the GEMM rate
    of a layer's projections is ``peak_tflops`` (``achievable_fraction`` 1), SDPA forward / backward, the delta
    rule's and the experts' batched matmuls become ``efficiency`` relative to it, the memory-bound passes of an
    RMSNorm + SwiGLU block ``memory_gbps`` and one tiny autograd op ``kernel_overhead_s`` (`_measure_cpu_compute`).
    The profile has ``serial_lanes`` (Note: [Serial lanes on the CPU device]).

    Args:
        cache_path: JSON path. When it exists and ``use_cache`` is true it is loaded instead of measuring; otherwise
            the new profile is written there.
        device: ``"cpu"`` or a CUDA device (default: ``"cuda"`` when available, else ``"cpu"``).
        config: an HF config (or zoo config) whose decoder layers are timed, one per layer kind.
        timer: the clock of the compute, copy and optimizer probes (default ``time.perf_counter``); with one torch
            thread on a shared machine ``time.process_time`` counts only this process's work. NVMe is timed by the
            wall clock always (its time is spent waiting).
    """
    if cache_path and use_cache and os.path.isfile(cache_path):
        return HardwareProfile.from_json(cache_path)
    import psutil  # shipped with accelerate
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = str(device)
    if device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"measure(device={device!r}): CUDA is not available here; pass device='cpu'.")
    if repeats < 1:
        raise ValueError(f"measure(repeats={repeats}) must be >= 1.")

    nvme_r, nvme_w, nvme_free = _measure_nvme(nvme_dir, nvme_bytes)
    with _timed_with(timer):
        h2d, d2h = _measure_copy(device, copy_bytes, repeats)
        opt_rate, opt_used = _measure_optimizer(optimizer_params, repeats, optimizer)
        efficiency: dict[str, float] = {}
        memory_gbps = kernel_s = 0.0
        if device == "cpu":
            # the CPU "device" at layer shapes: every class as a fraction of the layer-shape GEMM rate
            rates = _measure_cpu_compute(_cpu_shapes(config, micro_batch_size, seq_len), repeats)
            tflops = rates["gemm"] / 1e12
            efficiency = {
                k: min(1.0, max(1e-4, rates[k] / rates["gemm"]))
                for k in ("gemm_bwd", "attention", "attention_bwd", "linear_attention", "moe")
            }
            memory_gbps = rates["memory_bytes_per_s"] / GB
            kernel_s = rates["kernel_s"]
        else:
            tflops = _measure_matmul(device, matmul_size or 8192, repeats)
    host = int(psutil.virtual_memory().total)
    if device == "cpu":
        dev_mem = host
        name = "measured-cpu"
    else:
        dev_mem = int(torch.cuda.get_device_properties(device).total_memory)
        name = "measured-" + torch.cuda.get_device_name(device).lower().replace(" ", "-")
    profile = HardwareProfile(
        name=name,
        device_memory_bytes=dev_mem,
        peak_tflops=tflops,
        achievable_fraction=1.0,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        nvme_read_gbps=nvme_r,
        nvme_write_gbps=nvme_w,
        nvme_capacity_bytes=nvme_free,
        host_memory_bytes=host,
        cpu_optimizer_params_per_s=opt_rate,
        device_type="cpu" if device == "cpu" else "cuda",
        memory_gbps=memory_gbps,
        kernel_overhead_s=kernel_s,
        efficiency=efficiency,
        source=f"measured by lazytrain_hf.planner.hardware.measure() on {device} at {time.strftime('%Y-%m-%d')}; "
        f"optimizer: {opt_used}",
    )
    if config is not None:
        with _timed_with(timer):
            profile.layer_times = measure_layer_times(config, device, micro_batch_size, seq_len, repeats)
        profile.layer_times_shape = [micro_batch_size, seq_len]
    if cache_path:
        profile.to_json(cache_path)
    return profile


def measure_layer_times(
    config: Any, device: str, micro_batch_size: int, seq_len: int, repeats: int = 3
) -> dict[str, list[float]]:
    """Forward and backward seconds of one decoder layer per layer kind of ``config`` (timed, median)."""
    import torch

    from ..models import layer_kinds
    from .zoo import as_hf_config

    hf_config = as_hf_config(config)
    kinds = layer_kinds(hf_config)
    first_of_kind: dict[str, int] = {}
    for i, k in enumerate(kinds):
        first_of_kind.setdefault(k, i)
    from transformers import AutoModelForCausalLM

    # Build only as many layers as needed to reach one of every kind, so large configs stay cheap to time.
    n_build = max(first_of_kind.values()) + 1
    fields = {**hf_config.to_dict(), "num_hidden_layers": n_build, "use_cache": False}
    if getattr(hf_config, "layer_types", None) is not None:
        fields["layer_types"] = list(hf_config.layer_types[:n_build])  # validated against num_hidden_layers
    small = hf_config.__class__(**fields)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    model = AutoModelForCausalLM.from_config(small).to(device=device, dtype=dtype)
    model.train()
    inner = model.model
    ids = torch.randint(0, small.vocab_size, (micro_batch_size, seq_len), device=device)
    with torch.no_grad():
        x0 = inner.embed_tokens(ids)
    pos = torch.arange(seq_len, device=device).unsqueeze(0).expand(micro_batch_size, -1)
    pos_emb = inner.rotary_emb(x0, pos)

    def sync() -> None:
        if device != "cpu":
            torch.cuda.synchronize(device)

    out: dict[str, list[float]] = {}
    for kind, idx in first_of_kind.items():
        layer = inner.layers[idx]

        def fwd(layer=layer):
            x = x0.detach().requires_grad_(True)
            y = layer(x, attention_mask=None, position_embeddings=pos_emb, position_ids=pos)
            y = y[0] if isinstance(y, tuple) else y
            sync()
            return x, y

        fwd()
        t_f = _median_time(fwd, repeats)
        times_b = []
        for _ in range(repeats):
            _, y = fwd()
            g = torch.ones_like(y)
            t0 = _clock()
            y.backward(g)
            sync()
            times_b.append(_clock() - t0)
        times_b.sort()
        out[kind] = [t_f, times_b[len(times_b) // 2]]
    return out
