"""Kernels that layer templates call in place of ops whose intermediates would not fit.

Four kernels, each installed in a template by a pass of :mod:`megatrain.planner.trace`, one module
each (see their docstrings for the method and its sources):

- :mod:`~megatrain.kernels.lm_head`: :func:`linear_cross_entropy`, the LM head fused with its
  loss, a chunk of tokens at a time (installed by ``trace.lm_head``);
- :mod:`~megatrain.kernels.seq_chunk`: :func:`sequence_chunked`, a token-wise region of a layer
  run a chunk of the sequence at a time (installed by ``trace.seq_chunk``);
- :mod:`~megatrain.kernels.autocast`: :func:`without_autocast`, one op that autocast must not
  recast, rotary angle math (installed by ``trace.cleanup``);
- :mod:`~megatrain.kernels.attention`: :func:`grouped_query_attention`, SDPA for fewer key/value
  heads than query heads that never falls back to the math kernel (installed by ``trace.cleanup``).

Each is written with plain PyTorch ops, so it runs on every device, the ``meta`` device included,
where the planner counts FLOPs and shapes. This package must not import ``megatrain.runtime`` or
the planner: the planner imports it to rewrite templates, and the runtime to run them.
"""

from megatrain.kernels.attention import expand_kv_heads, gqa_needs_expansion, grouped_query_attention
from megatrain.kernels.autocast import without_autocast
from megatrain.kernels.lm_head import REDUCTIONS, linear_cross_entropy, linear_cross_entropy_work_bytes
from megatrain.kernels.seq_chunk import chunk_bounds, sequence_chunked

__all__ = ["REDUCTIONS", "chunk_bounds", "expand_kv_heads", "gqa_needs_expansion", "grouped_query_attention",
           "linear_cross_entropy", "linear_cross_entropy_work_bytes", "sequence_chunked", "without_autocast"]
