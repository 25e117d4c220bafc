"""Units of memory, and how membudget shows bytes and seconds: three significant digits, so that values 1 % apart
read apart."""

from __future__ import annotations

import math
from typing import Optional

KiB, MiB, GiB = 2**10, 2**20, 2**30
GB = 10**9  # decimal, as data sheets and the config's GB/s (checkpoint.write_gbps) count


def _sig3(x: float) -> str:
    """Three significant digits, trailing zeros kept (9.10, 69.2, 123)."""
    if x == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def fmt_bytes(n: Optional[float]) -> str:
    """Bytes for a reader: GiB, MiB or KiB ("-" for None)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{_sig3(n / scale)} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float) -> str:
    return f"{_sig3(s)} s" if s >= 1 else f"{_sig3(s * 1e3)} ms"
