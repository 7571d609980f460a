"""`HardwareProfile`: what the planner needs to know about one accelerator and its host, as plain data (JSON round
trip, validated on construction), with the rates derived from it.

The symbols (``M_gpu``, ``P``, ``eta``, ``BW_h2d`` ...) are listed in `lazytrain_hf.planner.hardware`'s docstring, and
so is Note: [Serial lanes on the CPU device] (`HardwareProfile.serial_lanes`). Bundled profiles: `bundled`;
measuring one: `probes.measure`.
"""

from __future__ import annotations

import dataclasses
import json
import math
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
        net_gbps: ``BW_net`` in GB/s, host-to-host bandwidth between two nodes of a data-parallel world, one
            direction, as the gradient reduces and compute-copy gathers see it (`lazytrain_hf.planner.world`).
            Default 5: gloo's TCP transport on a 100 Gb/s link (12.5 GB/s on the wire) with one connection per peer
            and CPU-bound framing; assumed (a run with ``planner_hardware="auto"`` times its own world's links:
            `lazytrain_hf.training.world_links`, the same for the two figures below).
        shm_gbps: ``BW_shm`` in GB/s, host-to-host bandwidth between two ranks of one node (a copy through shared
            memory). Default 10: one core's memcpy between two processes' pages on a server (its memory bandwidth
            is shared with the optimizer); assumed.
        device_net_gbps: ``BW_dev_net`` in GB/s, the bandwidth of a reduce between the devices of one node (NCCL over
            NVLink or PCIe; on the CPU device gloo over host memory), as a unit's gradient reduced to its owner on the
            device sees it (``Plan.dp_reduce == "device"``, `lazytrain_hf.planner.worldcost`). Default 12: two PCIe
            Gen4 GPUs without peer-to-peer, through host memory; assumed.
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
    net_gbps: float = 5.0
    shm_gbps: float = 10.0
    device_net_gbps: float = 12.0

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
            "net_gbps",
            "shm_gbps",
            "device_net_gbps",
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

    @property
    def net_bytes_per_s(self) -> float:
        return self.net_gbps * GB

    @property
    def shm_bytes_per_s(self) -> float:
        return self.shm_gbps * GB

    @property
    def device_net_bytes_per_s(self) -> float:
        return self.device_net_gbps * GB

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


_OPTIONAL_KEYS = (
    "layer_times",
    "layer_times_shape",
    "memory_gbps",
    "kernel_overhead_s",
    "efficiency",
    "net_gbps",
    "shm_gbps",
    "device_net_gbps",
)
