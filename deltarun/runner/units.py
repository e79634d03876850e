"""Human-readable sizes, counts and tables, one spelling for every command's output."""

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


def format_table(cols: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    """Lines of a text table: columns separated by at least two spaces (cells may hold single
    spaces), each line indented, the last column ragged."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]

    def line(cells: list[str]) -> str:
        return indent + "  ".join(c.ljust(widths[i]) if i < len(cells) - 1 else c for i, c in enumerate(cells)).rstrip()

    return [line(cols)] + [line(r) for r in rows]
