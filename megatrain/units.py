"""Byte units and their formatting, defined once for the whole package.

``KiB``, ``MiB``, ``GiB``: binary units in bytes (2**10, 2**20, 2**30). ``gib(n)`` formats a byte
count as GiB with two decimals (``"1.50 GiB"``), the unit every message and report uses.
"""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def gib(nbytes: float) -> str:
    """``nbytes`` (bytes) as ``"{:,.2f} GiB"``, e.g. ``gib(3 << 29) == "1.50 GiB"``."""
    return f"{nbytes / GiB:,.2f} GiB"
