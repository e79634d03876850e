"""Human-readable sizes and counts, one spelling for every command's output."""

from __future__ import annotations


def format_bytes(n: int | float) -> str:
    """1536 -> '1.50 KiB' (binary units, as llama.cpp and llama-bench print them)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover


def format_count(n: int) -> str:
    """1234567 -> '1.23 M' (parameter counts, as llama-bench prints them)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
