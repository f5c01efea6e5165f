"""Hugging Face transformers specifics: its configs, and causal attention without a materialised mask.

Under export transformers' ``masking_utils`` builds the ``(B, 1, S, S)`` causal mask as a tensor
(at 512k tokens a 256 GiB boundary value), because the check that would let SDPA use
``is_causal`` instead is disabled while tracing. When the batch has no ``attention_mask`` and no
``position_ids`` every row is one unpadded causal sequence, so for ``sdpa`` models the trace
registers (through transformers' public ``AttentionInterface`` / ``AttentionMaskInterface``) an
implementation that is SDPA itself with a mask function returning ``None`` for exactly the plain
causal mask, and switches the model's configs to it for the duration of the export only
(:func:`causal_attention`). transformers is never imported here unless the model's own modules did.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Any, Sequence

from torch import nn

_CAUSAL_SDPA = "megatrain_causal_sdpa"
"""Name of the attention implementation :func:`causal_attention` registers with transformers."""

# Batch inputs that can make rows something other than one unpadded causal sequence each.
_MASK_INPUTS = frozenset({"attention_mask", "position_ids"})


def _causal_sdpa_mask(*args, **kwargs):
    """transformers' ``sdpa_mask`` without its refusal to skip the causal mask while exporting.

    ``sdpa_mask`` returns ``None`` (so that SDPA runs with ``is_causal``) when its caller allows it
    (``allow_is_causal_skip``: the plain causal pattern, no extra mask functions) and the mask
    would be plain causal: no padding, queries and keys of one length at offset 0, no sliding
    window or chunk reaching across the sequence. Under export it never does, because the padding
    check would read tensor values. Here there is no padding mask by construction (the batch has
    no ``attention_mask``), so the same decision needs no values. Anything else is delegated.

    The arguments are bound to the installed ``sdpa_mask``'s own signature: early 5.x releases
    (5.0) pass ``cache_position`` where later ones pass ``q_length`` and ``q_offset``; in a
    training forward (no KV cache, no ``position_ids``: the only case this mask function is used
    in) it is ``arange(q_length)``, so the offset is 0.
    """
    from transformers import masking_utils as mu

    bound = inspect.signature(mu.sdpa_mask).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if "q_length" in a:
        q_length, q_offset = a["q_length"], a["q_offset"]
    else:
        q_length, q_offset = a["cache_position"].shape[0], 0
    kv_length, kv_offset, local_size = a["kv_length"], a.get("kv_offset", 0), a.get("local_size")
    if (a.get("allow_is_causal_skip", True) and a.get("attention_mask") is None and isinstance(q_offset, int)
            and isinstance(kv_offset, int) and q_offset == kv_offset == 0 and q_length == kv_length
            and (local_size is None or kv_length < local_size)):
        return None
    if a.get("mask_function") is None:
        a["mask_function"] = mu.causal_mask_function
    return mu.sdpa_mask(*bound.args, **bound.kwargs)


def _no_packed_sequences(position_ids):
    """``find_packed_sequence_indices`` for the default positions: one sequence per row (None)."""
    return None


def hf_configs(model: nn.Module) -> list:
    """Every transformers config a module of ``model`` holds, sub-configs included, once each."""
    transformers = sys.modules.get("transformers")
    if transformers is None:  # not imported, so no module of the model is a transformers model
        return []
    PretrainedConfig = transformers.PretrainedConfig
    seen: dict[int, Any] = {}

    def visit(cfg) -> None:
        if isinstance(cfg, PretrainedConfig) and id(cfg) not in seen:
            seen[id(cfg)] = cfg
            for key in getattr(cfg, "sub_configs", {}) or {}:
                visit(getattr(cfg, key, None))

    for mod in model.modules():
        visit(getattr(mod, "config", None))
    return list(seen.values())


@contextlib.contextmanager
def causal_attention(model: nn.Module, input_names: Sequence[str]):
    """Within the block, ``sdpa`` models skip the plain causal mask as they do eagerly; yields whether.

    Applies only when the batch has neither ``attention_mask`` nor ``position_ids``, so every row is
    one unpadded sequence at positions ``0..S-1``. Two of transformers' decisions read tensor
    values, and under export both are answered conservatively; the trace knows the answers:

    - whether the positions pack several sequences into a row (``find_packed_sequence_indices``;
      with the default positions they do not, so it is replaced by one returning None for the
      export), which otherwise forbids the skip for every causal mask;
    - whether the padding mask is all ones (there is none; :func:`_causal_sdpa_mask`).

    The second is a mask function registered through transformers' ``AttentionMaskInterface``
    under :data:`_CAUSAL_SDPA`, beside ``AttentionInterface``'s own ``sdpa`` attention function
    under the same name, so the kernels are unchanged. The ``sdpa`` configs of ``model`` name it
    for the export only. Every change is undone on exit, whatever happens.
    """
    configs = [] if _MASK_INPUTS & set(input_names) else [c for c in hf_configs(model)
                                                          if getattr(c, "_attn_implementation", None) == "sdpa"]
    if not configs:
        yield False
        return
    from transformers import AttentionInterface
    from transformers import masking_utils as mu

    AttentionInterface.register(_CAUSAL_SDPA, AttentionInterface._global_mapping["sdpa"])
    mu.AttentionMaskInterface.register(_CAUSAL_SDPA, _causal_sdpa_mask)
    packed = getattr(mu, "find_packed_sequence_indices", None)
    try:
        if packed is not None:
            mu.find_packed_sequence_indices = _no_packed_sequences
        for c in configs:
            # A dict sets this config only; the plain setter would recurse into sub-configs.
            c._attn_implementation = {"": _CAUSAL_SDPA}
        yield True
    finally:
        for c in configs:
            c._attn_implementation = {"": "sdpa"}
        if packed is not None:
            mu.find_packed_sequence_indices = packed


__all__ = ["causal_attention", "hf_configs"]
