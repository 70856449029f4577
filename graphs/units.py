"""Byte and count formatting shared by every report."""

from __future__ import annotations

import math

__all__ = ["GiB", "MiB", "format_bytes", "format_count"]

MiB = 1024**2
GiB = 1024**3


def format_bytes(n: float) -> str:
    """Human-readable bytes.

    Examples
    --------
    >>> format_bytes(3 * 1024**2)
    '3.0 MiB'
    """
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def format_count(n: float) -> str:
    """Counts with K/M/G/T/P suffixes.

    Examples
    --------
    >>> format_count(2.5e9)
    '2.5G'
    """
    if n == 0:
        return "0"
    exp = max(0, min(int(math.floor(math.log10(abs(n)) / 3)), 5))
    return f"{n / 10 ** (3 * exp):.3g}{['', 'K', 'M', 'G', 'T', 'P'][exp]}"
