"""Byte counts for people: the largest binary unit that keeps a number readable (never "0.00 GiB")."""

from __future__ import annotations

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))


def human_bytes(n: int) -> str:
    """1536 -> "1.50 KiB", 3 << 30 -> "3.00 GiB", 512 -> "512 B"; negative counts keep their sign."""
    size = abs(n)
    for unit, name in _UNITS:
        if size >= unit:
            return f"{'-' if n < 0 else ''}{size / unit:,.2f} {name}"
    return f"{n} B"
