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

import contextlib
from typing import Any, Iterator

from megatrain.errors import ConfigError, UnsupportedModelError

__all__ = ["check_causal_decoder", "check_config_values", "check_positions", "check_model", "refuse_remote_code"]

_EXAMPLES = "llama, mistral, qwen2, gemma, phi3, gpt2"

VISION_LANGUAGE = ("llava", "qwen2_vl", "qwen2_5_vl")
"""The vision-language model types megatrain trains with their images; their tracing recipes
are :data:`megatrain.planner.trace.vlm.FAMILIES` (above this module, which the planner imports),
which must name the same ones (it checks so when imported)."""

DEFAULT_IMAGE_PIXELS = 448
"""The side of the image each row carries by default (Qwen2-VL's processor keeps a 448x448 image
at that size: 32x32 patches of 14 pixels, 256 image tokens): what the planner's patch-grid families
(``megatrain.planner.trace.qwen_vl``) and the data's processors (``megatrain.data.sft_qwen_vl``) both read."""

REFUSED: dict[str, str] = {
    "qwen3_vl": "deepstack features (intermediate vision blocks' outputs added inside the decoder's first "
                "layers) and its interpolated vision position embeddings; Qwen2-VL and Qwen2.5-VL train",
    "llava_next": "AnyRes tiling (a variable number of tiles per image, image_sizes, and the unpadding of "
                  "the feature grid)",
    "llava_onevision": "AnyRes tiling (a variable number of tiles per image and image_sizes)",
    "internvl": "dynamic tiling (a variable number of 448x448 tiles per image) and its pixel-shuffle projector",
    "glm4v": "variable image sizes (image_grid_thw) and 3D rotary position ids",
    "idefics3": "image splitting into a variable number of sub-images",
    "smolvlm": "image splitting into a variable number of sub-images",
    "paligemma": "a prefix-LM attention mask (bidirectional over the image and prompt)",
}
"""Vision-language families megatrain refuses, by ``model_type``, with what it does not support yet."""


def refuse_vision_language(config: Any, source: str) -> None:
    """Refuse a vision-language ``config`` megatrain does not trace; nothing for other configs.

    Called for a ``model_type`` with no causal-LM class in transformers (Gemma 3, Llama 4 and
    Mllama have one, and train on text alone through it).

    Raises:
        UnsupportedModelError: a vision-language family (one of :data:`REFUSED`, an image-text-to-text
            class of transformers, or a config with a ``vision_config``) not in :data:`VISION_LANGUAGE`; the
            message names what megatrain lacks for it and the families it trains.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    mt = getattr(config, "model_type", None)
    if mt in VISION_LANGUAGE or not (mt in REFUSED or mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
                              or getattr(config, "vision_config", None) is not None):
        return
    missing = REFUSED.get(mt, "its vision tower and the way its image features join the text (no tracing "
                              "recipe for this family yet)")
    raise UnsupportedModelError(
        f"{source}: model_type {mt!r} is a vision-language model that megatrain does not train yet: it lacks "
        f"support for {missing}. Vision-language families megatrain trains: {', '.join(sorted(VISION_LANGUAGE))} "
        "(LLaVA: images of one size, up to a fixed number a row; Qwen2-VL and Qwen2.5-VL: any images within "
        "a fixed number of patches a row)")


def check_causal_decoder(config: Any, source: str) -> None:
    """Refuse a transformers ``config`` that is not a causal decoder-only language model.

    Args:
        config: a ``transformers.PretrainedConfig``.
        source: where it came from, for the message (a file name or ``"the model"``).

    A vision-language family of :data:`VISION_LANGUAGE` (LLaVA, Qwen2-VL,
    Qwen2.5-VL) passes: it trains its decoder on the text with the image features written in.

    Raises:
        UnsupportedModelError: an encoder-decoder, an encoder family, or a ``model_type`` with no
            causal-LM class; the message names the type and the models to use instead (for a
            vision-language family megatrain does not trace, what it lacks).
    """
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES)

    mt = getattr(config, "model_type", None)
    if mt in VISION_LANGUAGE:
        return  # a vision-language model megatrain trains with its images (LLaVA, Qwen2-VL)
    what = None
    if getattr(config, "is_encoder_decoder", False):
        what = "an encoder-decoder model"
    elif mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        refuse_vision_language(config, source)
        what = "not a causal language model (transformers has no causal-LM class for it)"
    elif mt in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        what = "an encoder family with bidirectional attention (its causal-LM class would train a model " \
               "that sees the tokens it predicts)"
    if what is not None:
        raise UnsupportedModelError(f"{source}: model_type {mt!r} is {what}; megatrain trains causal "
                                    f"decoder-only language models ({_EXAMPLES}, ...): use a config of one")


@contextlib.contextmanager
def config_errors(source: str) -> Iterator[None]:
    """Turn transformers' own validation of a config (recent versions raise huggingface_hub's
    ``StrictDataclass*ValidationError``, which is not a ``ValueError``) into one ConfigError naming
    ``source``."""
    try:
        yield
    except Exception as e:
        if not type(e).__module__.startswith("huggingface_hub"):
            raise
        raise ConfigError(f"{source}: {' '.join(str(e).split()).rstrip('.')}; fix it in the config") from None


def refuse_remote_code(model_type: str, raw: dict, source: str) -> None:
    """Refuse a config whose ``model_type`` transformers does not know but whose ``auto_map``
    names Python code in the model directory: megatrain never runs it (every transformers call
    passes ``trust_remote_code=False``), so say that, rather than that the type is unknown. A
    config with an ``auto_map`` and a type transformers ships (many hub checkpoints keep theirs)
    is built from transformers' own class.

    Raises:
        ConfigError: naming the code the config wants run and what to use instead.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    auto_map = raw.get("auto_map")
    if auto_map and model_type not in CONFIG_MAPPING_NAMES:
        wanted = ", ".join(sorted({str(v if isinstance(v, str) else v[0]).split(".")[0] + ".py"
                                   for v in (auto_map.values() if isinstance(auto_map, dict) else [])}))
        raise ConfigError(f"{source}: model_type {model_type!r} is defined only by the model directory's own Python "
                          f"code ({wanted or 'auto_map'}), and megatrain never runs code from a model directory "
                          "(trust_remote_code=False); use a model whose model_type transformers ships (llama, mistral, "
                          "qwen2, gemma, phi3, gpt2, ...), converting the weights if needed")


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")
_POSITIVE_REALS = ("rope_theta", "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def check_config_values(config: Any, source: str, given: Any = ()) -> None:
    """Refuse a transformers ``config`` whose sizes and constants cannot describe a model, before
    anything is built: each a single error rather than a traceback from deep in transformers or
    the trace (recent transformers validate some of these themselves, older ones none), and a
    model without blocks rather than a run that trains only its embeddings.

    Args:
        config: a ``transformers.PretrainedConfig``.
        source: where it came from, for the message.
        given: the keys the file set (``head_dim`` given makes the hidden size free of the heads).

    Raises:
        ConfigError: a size (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ...;
            named as the config spells it, e.g. GPT-2's ``n_layer``) that is not a positive
            integer (a string, a fraction, a bool, null where the model needs one, 0 or less); a
            rotary base or norm epsilon that is not a positive number; attention heads that do not
            divide the hidden size, or key/value heads that do not divide the heads; a ``hidden_act``
            transformers does not know.
    """
    default = None
    values: dict[str, Any] = {}
    for name in _SIZES:
        try:
            v = getattr(config, name)
        except AttributeError:
            continue
        key = getattr(config, "attribute_map", {}).get(name, name)  # as the file spells it (GPT-2: n_layer)
        if v is None:
            if default is None:
                default = type(config)()
            if getattr(default, name, None) is None:
                continue  # the model derives it (GPT-2's n_inner, Llama's num_key_value_heads)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            what = ("must be at least 1: a model without blocks trains only its embeddings and head"
                    if name == "num_hidden_layers" and isinstance(v, int) and not isinstance(v, bool)
                    else "must be a positive integer (a number without quotes or a fraction)")
            raise ConfigError(f"{source}: {key}={v!r} {what}; fix it in the config")
        values[name] = v
    rope = getattr(config, "rope_parameters", None)
    reals = {k: getattr(config, k) for k in _POSITIVE_REALS if getattr(config, k, None) is not None}
    if isinstance(rope, dict) and rope.get("rope_theta") is not None:
        reals["rope_theta"] = rope["rope_theta"]
    for k, v in reals.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ConfigError(f"{source}: {k}={v!r} must be a positive number (without quotes); fix it in the config")
    heads, hidden, kv = values.get("num_attention_heads"), values.get("hidden_size"), values.get("num_key_value_heads")
    if heads and hidden and hidden % heads and "head_dim" not in given:
        raise ConfigError(f"{source}: num_attention_heads={heads} does not divide hidden_size={hidden} (each head takes "
                          "hidden_size / heads dimensions); change one of them, or give head_dim")
    if heads and kv and heads % kv:
        raise ConfigError(f"{source}: num_key_value_heads={kv} does not divide num_attention_heads={heads} (each "
                          "key/value head serves heads / kv_heads query heads); change one of them")
    from transformers.activations import ACT2CLS

    for key in ("hidden_act", "activation_function"):  # (GPT-2 names it activation_function)
        act = getattr(config, key, None)
        if isinstance(act, str) and act not in ACT2CLS:  # a KeyError deep in the model's construction
            raise ConfigError(f"{source}: {key}={act!r} is not an activation transformers knows; use one of "
                              f"{', '.join(sorted(ACT2CLS))} (llama: silu)")


def check_positions(config: Any, seq_len: int, source: str) -> None:
    """Refuse ``seq_len`` beyond the config's ``max_position_embeddings`` (GPT-2: ``n_positions``).

    Raises:
        ConfigError: naming both numbers and the two fixes (lower ``seq_len``; or raise the config's
            position count: for a rotary model that is the way to train at a longer context, for a
            learned table it only works from scratch, since its saved weights have fewer rows).
    """
    if hasattr(config, "get_text_config"):  # a vision-language config keeps its positions in text_config
        config = config.get_text_config()
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
