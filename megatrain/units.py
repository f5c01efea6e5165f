"""Byte units and their formatting, defined once for the whole package.

``KiB``, ``MiB``, ``GiB``, ``TiB``: binary units in bytes (2**10, 2**20, 2**30, 2**40). ``gib(n)``
formats a byte count as GiB with two decimals (``"1.50 GiB"``), the unit every message and report
uses; ``human_bytes(n)`` picks the largest unit that fits, for tables of mixed sizes.
"""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def gib(nbytes: float) -> str:
    """``nbytes`` (bytes) as ``"{:,.2f} GiB"``, e.g. ``gib(3 << 29) == "1.50 GiB"``."""
    return f"{nbytes / GiB:,.2f} GiB"


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units with two decimals (``"1.50 GiB"``), for tables and messages."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
