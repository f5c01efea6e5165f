"""Page-aligned host memory, the runtime's lowest floor: what the host tiles
(:mod:`megatrain.runtime.host`), the pinned arena and the NVMe store's O_DIRECT buffers
(:mod:`megatrain.runtime.nvme`) are carved from.

Host memory that may be pinned is an anonymous mapping of whole pages (of the larger of the
planner's page and the system's): it starts on a page, its storage starts there too (so
``Tensor.is_pinned`` sees the registration), and no other allocation shares its pages (two
registrations of one page would collide).
"""

from __future__ import annotations

import mmap

import torch

from megatrain.ir.layout import HOST_PAGE_BYTES

PAGE_ALIGN = max(HOST_PAGE_BYTES, mmap.PAGESIZE)
"""The mapping's page: the larger of the planner's page (``HOST_PAGE_BYTES``) and the system's."""


def page_aligned_empty(nbytes: int) -> torch.Tensor:
    """Zero-filled pageable ``uint8[nbytes]`` host memory that starts on a page boundary: an
    anonymous ``mmap`` of ``nbytes`` rounded up to whole pages, whose pages no other allocation uses."""
    return torch.frombuffer(mmap.mmap(-1, whole_pages(nbytes)), dtype=torch.uint8)[:nbytes]


def whole_pages(nbytes: int) -> int:
    """``nbytes`` (at least 1) rounded up to whole pages of the mapping (:data:`PAGE_ALIGN`)."""
    return -(-max(nbytes, 1) // PAGE_ALIGN) * PAGE_ALIGN
