"""Model presets as Hugging Face config dicts, and the meta-device models the planner traces.

Nothing is downloaded: each preset is the architecture part of the model's published
``config.json`` (tokenizer ids and generation settings dropped), with its source. The planner
needs shapes only, so :func:`build_meta_model` builds the causal LM on the ``meta`` device, where
parameters cost no memory, and :func:`megatrain.planner.trace.trace` exports it on fake tensors.

Tied embeddings: a config.json that ties its input and output embeddings stays tied (the shared
matrix has one owner layer, the prologue; the LM head reads a copy of it through the schedule).
Each preset keeps its original's choice: the large ones are untied, the small ones tied.

:data:`SMALL_PRESETS` (30 M to 1.24 B parameters) train on a CPU with ``megatrain train --model
NAME`` (from scratch: a byte-level BPE of the preset's vocabulary size is trained on the data);
the others are for planning GPU runs.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

from megatrain.bounds import check_model_size
from megatrain.errors import ConfigError

_LLAMA_COMMON = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                     attention_bias=False, attention_dropout=0.0, mlp_bias=False, initializer_range=0.02,
                     tie_word_embeddings=False, use_cache=False)

_QWEN2_COMMON = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", rope_theta=1000000.0,
                     use_sliding_window=False, attention_dropout=0.0, initializer_range=0.02, use_cache=False)
_SMOLLM2 = dict(_LLAMA_COMMON, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=100000.0, tie_word_embeddings=True)

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-30m": dict(
        _LLAMA_COMMON, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=8192, max_position_embeddings=2048, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(
        _SMOLLM2, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, initializer_range=0.041666666666666664),
    "smollm2-360m": dict(
        _SMOLLM2, hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
        num_key_value_heads=5),
    "qwen2.5-0.5b": dict(
        _QWEN2_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        sliding_window=32768, max_window_layers=24, tie_word_embeddings=True),
    "llama-3.2-1b": dict(
        _LLAMA_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192)),
    "llama-2-7b": dict(
        _LLAMA_COMMON, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-3-8b": dict(
        _LLAMA_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0),
    "qwen2.5-7b": dict(
        _QWEN2_COMMON, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-6,
        sliding_window=131072, max_window_layers=28, tie_word_embeddings=False),
    "qwen2.5-14b": dict(
        _QWEN2_COMMON, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=131072, rms_norm_eps=1e-5,
        sliding_window=131072, max_window_layers=48, tie_word_embeddings=False),
    "llama-3-70b": dict(
        _LLAMA_COMMON, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0),
    "dense-120b": dict(
        _LLAMA_COMMON, hidden_size=12288, intermediate_size=24576, num_hidden_layers=96,
        num_attention_heads=96, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=500000.0),
}
"""Hugging Face config dicts by preset name.

Small (:data:`SMALL_PRESETS`; tied input and output embeddings, counted once):

- ``llama-30m``: not a released model. A Llama-3-architecture decoder small enough to train on a
  laptop CPU: 8 layers, hidden 512, 8 query heads of 64 and 4 KV heads, SwiGLU width 3 x hidden,
  an 8192-token vocabulary. Per block: attention ``2·h² + 2·h·256`` = 786,432, MLP ``3·h·1536`` =
  2,359,296, two norms ``2·h``; 8 blocks = 25.17 M; embedding ``8192·h`` = 4.19 M; final norm
  ``h``. Total 29.36 M.
- ``smollm2-135m``: HuggingFaceTB/SmolLM2-135M config.json (Allal et al. 2025, arXiv:2502.02737):
  30 layers, hidden 576, 9 query / 3 KV heads, 1536 SwiGLU width, 49152 vocabulary; 134.52 M
  parameters.
- ``smollm2-360m``: HuggingFaceTB/SmolLM2-360M config.json: 32 layers, hidden 960, 15 query / 5
  KV heads, 2560 SwiGLU width; 361.82 M parameters.
- ``qwen2.5-0.5b``: Qwen/Qwen2.5-0.5B config.json (arXiv:2412.15115): 24 layers, hidden 896, 14
  query / 2 KV heads, QKV biases, 151936 vocabulary; 494.03 M parameters.
- ``llama-3.2-1b``: meta-llama/Llama-3.2-1B config.json: 16 layers, hidden 2048, 32 query / 8 KV
  heads, 8192 SwiGLU width, 128256 vocabulary, Llama 3's RoPE scaling; 1.24 B parameters.

Large (for planning GPU runs; untied, as the originals):

- ``llama-2-7b``: meta-llama/Llama-2-7b-hf config.json (Touvron et al. 2023, arXiv:2307.09288):
  MHA with 32 heads, 11008 SwiGLU width, 32k vocabulary; 6.74B parameters.
- ``llama-3-8b``: meta-llama/Meta-Llama-3-8B config.json: GQA with 8 KV heads, 14336 SwiGLU width,
  128256 vocabulary, rope_theta 5e5; 8.03B parameters.
- ``qwen2.5-7b``: Qwen/Qwen2.5-7B config.json (arXiv:2412.15115): 28 layers, hidden 3584, 28
  query / 4 KV heads, 18944 SwiGLU width, QKV biases, 152064 vocabulary, untied embeddings; 7.62B
  parameters (the report's 7.61B). The 7B shape of MegaTrain's public throughput figures.
- ``qwen2.5-14b``: Qwen/Qwen2.5-14B config.json (Qwen2.5 technical report, arXiv:2412.15115): 48
  layers, 40 query / 8 KV heads, QKV biases (implied by model_type qwen2), untied embeddings;
  14.77B parameters.
- ``llama-3-70b``: meta-llama/Meta-Llama-3-70B config.json: 80 layers, hidden 8192, 64 query / 8
  KV heads, 28672 SwiGLU width; 70.55B parameters.
- ``dense-120b``: not a released model. A Llama-3-architecture decoder sized like the largest
  model in the MegaTrain paper (arXiv 2604.05091, "up to 120B"): GPT-3 175B's depth and width
  (96 layers, hidden 12288; Brown et al. 2020, table 2.1) with Llama 3's GQA (96 query heads of
  128, 8 KV heads) and a SwiGLU width of 2 x hidden. Per block: attention
  ``2·h² + 2·h·(8·128)`` = 327.2M, MLP ``3·h·24576`` = 905.97M, two norms ``2·h``; 96 blocks =
  118.39B; embedding and LM head ``2·128256·h`` = 3.15B; final norm ``h``. Total 121.54B
  (:func:`dense_decoder_param_count`). A width of 4·h would give 150B, 8/3·h 130B.
"""


SMALL_PRESETS = ("llama-30m", "smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "llama-3.2-1b")
"""The presets that train on a CPU (30 M to 1.24 B parameters), smallest first."""


def preset_names() -> str:
    """The preset names for a help text: the small ones (CPU) first, then the rest."""
    large = [n for n in MODEL_PRESETS if n not in SMALL_PRESETS]
    return f"{', '.join(SMALL_PRESETS)} (train on a CPU); {', '.join(large)}"


def dense_decoder_param_count(config: dict[str, Any] | Any) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config arithmetic (no model built).

    Counts the embedding, per block the Q/K/V/O projections (with biases when ``model_type`` is
    ``qwen2`` or ``attention_bias`` is set), the gated MLP and two RMSNorms, the final norm and an
    untied LM head. ``config`` is a dict or a transformers config object.
    """
    c = config if isinstance(config, dict) else config.to_dict()
    h = c["hidden_size"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or h // heads
    q, kvd = heads * head_dim, kv * head_dim
    attn = h * q + 2 * h * kvd + q * h
    if c.get("model_type") == "qwen2" or c.get("attention_bias"):
        attn += q + 2 * kvd
    mlp = 3 * h * c["intermediate_size"] + (2 * c["intermediate_size"] + h if c.get("mlp_bias") else 0)
    block = attn + mlp + 2 * h
    head = 0 if c.get("tie_word_embeddings") else c["vocab_size"] * h
    return c["vocab_size"] * h + c["num_hidden_layers"] * block + h + head


def load_model_config(name_or_path: str | os.PathLike):
    """A transformers config object for a preset name (``MODEL_PRESETS``) or a config.json path.

    The result has ``use_cache=False`` (a KV cache has no use in training); a config.json's
    ``tie_word_embeddings`` is kept (tied embeddings train as one matrix).

    Raises:
        ConfigError: the name is neither a preset nor an existing file, the file is not JSON, it
            has no ``model_type`` transformers knows (one that only its own code defines, through
            ``auto_map``, says so: megatrain runs no code from a model directory), or a value
            cannot describe a model (:func:`megatrain.models.check_config_values`).
    """
    from transformers import AutoConfig

    from megatrain.models import check_config_values, config_errors, refuse_remote_code

    d, source = read_model_config(name_or_path)
    model_type = d.pop("model_type")
    refuse_remote_code(model_type, d, source)
    given = set(d)
    d.update(use_cache=False)
    for k in ("transformers_version", "_name_or_path"):
        d.pop(k, None)
    with config_errors(source):
        try:
            config = AutoConfig.for_model(model_type, **d)
        except (ValueError, KeyError) as e:
            # transformers' message lists every model type it knows (about 12,000 characters): keep its
            # first sentence.
            first = str(e).split(". ")[0].split("\n")[0][:200]
            raise ConfigError(f"{source}: transformers cannot build a config of model_type "
                              f"{model_type!r} ({first}); use a causal decoder's model_type such as "
                              "llama, mistral, qwen2 or gpt2") from None
    check_config_values(config, source, given)
    return config


def read_model_config(name_or_path: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """``(the config's fields, where they came from)`` for a preset name or a config.json path (a
    directory: its config.json), read with :mod:`json` alone: what :func:`load_model_config` gives
    transformers, and the check ``megatrain train`` makes before it imports torch.

    Raises:
        ConfigError: no such preset or file; not UTF-8 JSON; not an object; no ``model_type``;
            more layers or parameters than megatrain plans (:func:`megatrain.bounds.check_model_size`).
    """
    key = str(name_or_path)
    if key in MODEL_PRESETS:
        d = copy.deepcopy(MODEL_PRESETS[key])
        source = f"preset {key!r}"
    else:
        path = Path(name_or_path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"model {key!r} is neither a preset ({sorted(MODEL_PRESETS)}) nor a "
                              "config.json file: pass a preset name or the path of a Hugging Face "
                              "config.json")
        try:
            d = json.loads(path.read_bytes().decode("utf-8"))  # JSON is UTF-8 whatever the locale
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path} is not UTF-8 text ({e}); save it as UTF-8 (JSON files are)") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); pass a Hugging Face config.json") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} holds a JSON {type(d).__name__}, not an object; pass a Hugging Face "
                              "config.json")
        source = str(path)
    if not d.get("model_type"):
        raise ConfigError(f"{source} has no 'model_type'; a Hugging Face config.json names its "
                          "architecture there (e.g. \"llama\")")
    check_model_size(d, source)
    return d, source


def build_meta_model(config, dtype=None):
    """The causal LM for ``config`` on the ``meta`` device (no parameter memory is allocated); for
    a vision-language family megatrain trains (:data:`megatrain.planner.trace.vlm.FAMILIES`), its
    image-text-to-text model (LLaVA: ``LlavaForConditionalGeneration``).

    ``dtype`` (a ``torch.dtype``; default: the config's, else float32) is the dtype the model
    computes in, which sets the bytes of the activations a trace records. The presets have no
    dropout; a config.json with dropout traces too (the executor replays each random layer's
    draws in its recompute).
    """
    import torch

    kwargs = {} if dtype is None else {"dtype": dtype}
    with torch.device("meta"):
        return auto_model_class(config).from_config(config, trust_remote_code=False, **kwargs)


def auto_model_class(config):
    """The transformers auto class megatrain builds ``config``'s model with: ``AutoModelForCausalLM``,
    or ``AutoModelForImageTextToText`` for a vision-language family megatrain trains."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from megatrain.planner.trace.vlm import family

    return AutoModelForCausalLM if family(config) is None else AutoModelForImageTextToText


def trace_preset(config, *, seq_len: int, compute_dtype: str, micro_batch_size: int = 1):
    """The traced model (``TracedModel``) ``megatrain plan`` plans for ``config``: the causal LM built on
    the ``meta`` device in FP32, as a model is built for training, and traced in ``compute_dtype``
    (``trace(..., param_dtype=...)``), which is what ``megatrain.compile`` traces for a model of this
    config with that compute dtype (a vision-language model with ``pixel_values``: LLaVA one image
    per row, Qwen2-VL one 448x448 image per row).
    Raises ConfigError for a dtype other than float32/bfloat16."""
    import torch

    from megatrain.errors import ConfigError
    from megatrain.planner.trace import trace
    from megatrain.planner.trace.vlm import batch_names

    if compute_dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"compute_dtype={compute_dtype!r}: use 'float32' or 'bfloat16'")
    # A vision-language model is planned with its images through its vision tower (LLaVA: one per
    # row; Qwen2-VL: one 448x448 image per row).
    return trace(build_meta_model(config, dtype=torch.float32), micro_batch_size=micro_batch_size, seq_len=seq_len,
                 input_names=batch_names(config), param_dtype=getattr(torch, compute_dtype))


__all__ = ["MODEL_PRESETS", "SMALL_PRESETS", "dense_decoder_param_count", "preset_names", "load_model_config",
           "build_meta_model", "trace_preset"]
