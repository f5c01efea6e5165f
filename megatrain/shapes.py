"""``megatrain.shapes``, the documented path of shape-free compile: :mod:`megatrain.product.shapes`
(where it lives, beside the rest of the product) re-exported."""

from megatrain.product.shapes import DEFAULT_MAX_SHAPES, PROBE_SEQ_LEN, ShapeFreeTrainer, pad_to_bucket

__all__ = ["ShapeFreeTrainer", "pad_to_bucket"]
