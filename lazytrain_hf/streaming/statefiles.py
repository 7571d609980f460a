"""The state on NVMe's files as data, independent of a running executor: bytes a unit's optimizer step moves
(`update_bytes`, what the planner predicts) and the committed state of a state directory (`read_committed`, what a
crash leaves). The layout itself is written by `lazytrain_hf.streaming.nvmestate` (Note: [The state on NVMe commits
per optimizer step] there)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch

from ..optim.quant import num_blocks

MANIFEST = "manifest.json"


def gather_scales(region: torch.Tensor, chunks: list[tuple[int, int]], slot: int, block_size: int) -> torch.Tensor:
    """The block scales of a tensor from its per-chunk slots (uint8 ``region``) as one fp32 tensor."""
    parts = []
    for a, b in chunks:
        nb = num_blocks(b, block_size) - a // block_size
        start = (a // (chunks[0][1] - chunks[0][0])) * slot if chunks else 0
        parts.append(region.narrow(0, start, 4 * nb).view(torch.float32))
    return torch.cat(parts).clone() if parts else torch.zeros(0)


def read_committed(path: str) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """The committed state in a state directory (`NvmeState.path`), independent of any process: per unit key, per
    parameter, ``{"master", "m_codes", "m_abs", "v_codes", "v_abs"}`` (8-bit tensors; ``master`` only for the
    others, whose moments live in RAM) and ``"step"`` (a 0-dim int64). Note: [The state on NVMe commits per
    optimizer step]."""
    with open(os.path.join(path, MANIFEST)) as f:
        man = json.load(f)
    out: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
    for key, unit in man["units"].items():
        g = unit["gen"]
        with open(os.path.join(path, unit["file"]), "rb") as f:
            per: dict[str, dict[str, torch.Tensor]] = {}
            for p in unit["params"]:
                arrays: dict[str, torch.Tensor] = {"step": torch.tensor(p["step"])}
                spec = [("master", 4 * p["numel"], torch.float32)]
                if p["q8"]:
                    spec += [("m_codes", p["numel"], torch.uint8), ("v_codes", p["numel"], torch.uint8)]
                for name, n, dt in spec:
                    f.seek(p[name][g])
                    arrays[name] = torch.frombuffer(bytearray(f.read(n)), dtype=torch.uint8).view(dt)
                if p["q8"]:
                    chunks = [(a, min(p["numel"], a + p["chunk"])) for a in range(0, p["numel"], p["chunk"])]
                    for name in ("m_abs", "v_abs"):
                        f.seek(p[name][g])
                        raw = torch.frombuffer(bytearray(f.read(len(chunks) * p["abs_slot"])), dtype=torch.uint8)
                        arrays[name] = gather_scales(raw, chunks, p["abs_slot"], man["block_size"])
                per[p["name"]] = arrays
        out[int(key)] = per
    return out


def update_bytes(
    tensors: list[tuple[int, Any, bool]],
    compute_bytes: int,
    block_size: int = 256,
    min_8bit_size: int = 4096,
) -> tuple[int, int]:
    """``(bytes read, bytes written)`` of one `NvmeState.update_unit` of a unit whose streamed tensors are
    ``[(numel, dtype, trainable)]``: per trainable tensor its master and gradient (and 8-bit codes and scales) in, its
    master (and moments) out; the compute copy out, and in first when the unit has frozen tensors."""
    read = write = 0
    for n, _, t in tensors:
        if not t:
            continue
        q = 2 * n + 8 * math.ceil(n / block_size) if n >= min_8bit_size else 0
        read += 8 * n + q
        write += 4 * n + q
    write += compute_bytes
    if any(not t for _, _, t in tensors):
        read += compute_bytes
    return read, write
