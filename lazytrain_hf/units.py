"""Byte sizes as users write them ("70GiB", "512MB", 1_000_000) -> int bytes. No heavy imports here."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str | None, option: str = "size") -> int | None:
    """Parse a byte size. ``None`` stays ``None``. Raises ValueError naming ``option`` on bad input.

    Decimal units (KB, MB, GB, TB) are powers of 10; binary units (KiB, MiB, GiB, TiB) and the bare letters
    K, M, G, T are powers of 2, as in ``nvidia-smi`` and PyTorch's memory summaries.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{option}={value!r} is not a byte size; pass an int or a string like '70GiB'.")
    if isinstance(value, int | float):
        n = int(value)
    else:
        m = _RE.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{option}={value!r} is not a byte size; write an int number of bytes or a number with a unit "
                "(KB, MB, GB, KiB, MiB, GiB, TiB), e.g. '70GiB'."
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"{option}={value!r} must be a positive number of bytes (e.g. '24GiB').")
    return n


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.2f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.2f}TiB"
