"""`SafetensorsWriter`: a safetensors file written tensor by tensor from a declared header, never held in memory.

Owns the file format side of Note: [Checkpoints are streamed from the host store] (in `training/weight_files.py`):
`SAFETENSORS_DTYPES`, `SafetensorsWriter` and `write_safetensors` (tensors or `LazyTensor`s, each read when written).
Used for the model weights, the fp32 masters and the optimizer state of units on NVMe.
"""

from __future__ import annotations

import json
import math

import torch

from .lazytensor import LazyTensor

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class SafetensorsWriter:
    """Write a safetensors file tensor by tensor, in a declared order, without holding the file in memory.

    Args:
        path: the file to write.
        specs: ``[(name, dtype, shape)]`` in the order the tensors will be written (their data offsets follow it).
        metadata: the header's ``__metadata__`` (string values).
    """

    def __init__(
        self, path: str, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None
    ) -> None:
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self._order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dtype, shape in specs:
            if dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store.")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            self._order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self.path = path
        self._f = open(path, "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (it must be the next one declared, with its dtype and shape)."""
        if self._next >= len(self._order):
            raise ValueError(f"{self.path}: tensor {name!r} written after every declared tensor.")
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{self.path}: expected tensor {want!r} ({dtype}, {shape}) next, got {name!r} "
                f"({tensor.dtype}, {tuple(tensor.shape)})."
            )
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous()  # a view of the host store is contiguous already: no copy
        if nbytes:
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        missing = [n for n, *_ in self._order[self._next :]]
        self._f.close()
        if missing:
            raise ValueError(f"{self.path}: {len(missing)} declared tensor(s) never written: {missing[:5]}.")


def write_safetensors(path: str, tensors: list[tuple[str, torch.Tensor]], metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file`` without building the file in memory: each tensor written from its storage
    (a `LazyTensor` read right before it is written)."""
    w = SafetensorsWriter(path, [(n, t.dtype, tuple(t.shape)) for n, t in tensors], metadata or {"format": "pt"})
    try:
        for n, t in tensors:
            w.write(n, t.read() if isinstance(t, LazyTensor) else t)
    finally:
        w._f.close()
    w.close()
