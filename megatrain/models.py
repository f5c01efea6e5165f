"""Which Hugging Face models megatrain trains: causal decoders, at sequence lengths within their positions.

megatrain trains next-token prediction with the model's own forward. A model whose attention is
not causal still computes a loss through its causal-LM class (transformers maps BERT-like encoders
onto ``*LMHeadModel`` classes that shift the labels), so nothing fails: the run trains a model that
sees the tokens it predicts, and the saved config describes a bidirectional model. These checks
refuse such models by their config, before anything is built, traced or allocated:

- an encoder-decoder (T5, BART) or a ``model_type`` with no causal-LM class in transformers;
- an encoder family (BERT, RoBERTa, ELECTRA, ...: the ``model_type`` has a masked-LM class too);
- ``seq_len`` beyond ``max_position_embeddings``: a learned position table (GPT-2) has no row for
  the later positions (an ``IndexError`` deep in the step); a rotary (RoPE) model trains silently
  on positions its config says it does not have. Raising ``max_position_embeddings`` in the
  config is the documented override, for RoPE models that are meant to train at a longer context.

Models that are not Hugging Face ``PreTrainedModel`` instances (no ``config.model_type``) are the
caller's responsibility: their ``forward`` returns the loss they mean.
"""

from __future__ import annotations

from typing import Any

from megatrain.errors import ConfigError, UnsupportedModelError

__all__ = ["check_causal_decoder", "check_positions", "check_model"]

_EXAMPLES = "llama, mistral, qwen2, gemma, phi3, gpt2"


def check_causal_decoder(config: Any, source: str) -> None:
    """Refuse a transformers ``config`` that is not a causal decoder-only language model.

    Args:
        config: a ``transformers.PretrainedConfig``.
        source: where it came from, for the message (a file name or ``"the model"``).

    Raises:
        UnsupportedModelError: an encoder-decoder, an encoder family, or a ``model_type`` with no
            causal-LM class; the message names the type and the models to use instead.
    """
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    mt = getattr(config, "model_type", None)
    what = None
    if getattr(config, "is_encoder_decoder", False):
        what = "an encoder-decoder model"
    elif mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        what = "not a causal language model (transformers has no causal-LM class for it)"
    elif mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        what = "an encoder family with bidirectional attention (its causal-LM class would train a model " \
               "that sees the tokens it predicts)"
    if what is not None:
        raise UnsupportedModelError(f"{source}: model_type {mt!r} is {what}; megatrain trains causal "
                                    f"decoder-only language models ({_EXAMPLES}, ...): use a config of one")


def check_positions(config: Any, seq_len: int, source: str) -> None:
    """Refuse ``seq_len`` beyond the config's ``max_position_embeddings`` (GPT-2: ``n_positions``).

    Raises:
        ConfigError: naming both numbers and the two fixes (lower ``seq_len``; or raise the config's
            position count: for a rotary model that is the way to train at a longer context, for a
            learned table it only works from scratch, since its saved weights have fewer rows).
    """
    n = getattr(config, "max_position_embeddings", None)
    if not isinstance(n, int) or seq_len <= n:
        return
    key = getattr(config, "attribute_map", {}).get("max_position_embeddings", "max_position_embeddings")
    rope = any(getattr(config, a, None) for a in ("rope_parameters", "rope_theta", "rope_scaling"))
    if rope:
        fix = (f"or, to train at the longer context on purpose (rotary positions are computed, not looked "
               f"up), set {key} to at least {seq_len} in the config")
        why = "the model would train silently on positions beyond the ones its config declares"
    else:
        fix = (f"or set {key} to at least {seq_len} in the config (from scratch only: saved weights have a "
               f"position table of {n} rows)")
        why = f"its learned position table has {n} rows"
    raise ConfigError(f"seq_len={seq_len} exceeds {source}'s {key}={n}: {why}; lower seq_len to {n} {fix}")


def check_model(model: Any, seq_len: int) -> None:
    """Both checks for a Hugging Face model (one with ``config.model_type``); nothing for others."""
    config = getattr(model, "config", None)
    if not isinstance(getattr(config, "model_type", None), str):
        return
    source = f"the model ({type(model).__name__})"
    check_causal_decoder(config, source)
    check_positions(config, seq_len, source)
