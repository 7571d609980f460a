"""Hardware profiles: what the planner needs to know about a machine, bundled from datasheets or measured live.

A `HardwareProfile` is plain data (JSON round trip). Bundled profiles are written from public datasheet facts and
typical measured link speeds; `measure()` fills one on the machine it runs on (copy bandwidths, NVMe through a temp
file, CPU optimizer rate, matmul rate) in a few seconds and can cache it as JSON for `lazytrain plan --hardware`.

This module is the planner's one import point for hardware; each concept lives in its own module:

- `hwprofile`: `HardwareProfile` (fields, validation, derived rates, JSON), the units and `COMPUTE_CLASSES`;
- `bundled`: the bundled profiles, the source of every figure, and `get_profile`;
- `probes`: `measure()` and its probes (copies, NVMe, the CPU optimizer, compute rates at layer shapes);
- `layertimes`: `measure_layer_times`, which builds a model of the config's layer kinds to time them;
- `timing`: the probes' clock; `memterms`: the memory-bound traffic terms the probes share with the cost model.

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

from .bundled import BUNDLED_PROFILES, get_profile
from .hwprofile import COMPUTE_CLASSES, GB, GiB, HardwareProfile, TiB
from .layertimes import measure_layer_times
from .probes import measure, measure_nvme

__all__ = [
    "BUNDLED_PROFILES",
    "COMPUTE_CLASSES",
    "GB",
    "GiB",
    "HardwareProfile",
    "TiB",
    "get_profile",
    "measure",
    "measure_layer_times",
    "measure_nvme",
]
