"""``megatrain.from_pretrained``: a Hugging Face checkpoint directory straight into host tiles.

The model is built on the ``meta`` device from the directory's ``config.json`` (no parameter
memory), compiled, and its safetensors are then streamed tensor by tensor into the FP32 master
tiles (:func:`megatrain.hf_weights.load_hf_weights`): host memory holds the tiles, plus about one
shard's pages and one tensor while loading, never a second full copy of the weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatrain.errors import ConfigError
from megatrain.product.build import compile
from megatrain.trainer import Trainer


def from_pretrained(path: str | os.PathLike, *, strict: bool = True, **compile_kwargs: Any) -> Trainer:
    """Compile the causal LM saved in the local directory ``path`` and load its weights.

    Args:
        path: a directory written by ``save_pretrained`` (or ``megatrain``'s ``Trainer.save``):
            ``config.json`` and ``model.safetensors`` or a sharded ``model.safetensors.index.json``.
            Nothing is downloaded: a hub name that is not a local directory is refused.
        strict: as :func:`megatrain.hf_weights.load_hf_weights`: with False, tensors the files lack
            keep the model's own initialisation instead of raising.
        **compile_kwargs: :func:`megatrain.compile`'s arguments (``seq_len`` is required, as there;
            ``micro_batch_size``, ``optimizer``, ``hardware``, ...).

    A model whose config ties its input and output embeddings (``tie_word_embeddings``) stays
    tied: the shared matrix has one owner tile and one optimizer step (see README, "Tied
    embeddings"), loaded from the checkpoint's one tensor.

    Returns:
        The ``Trainer``, its FP32 master tiles holding the checkpoint's weights (any floating dtype
        on disk is widened to FP32) and its AdamW moments zero.

    Raises:
        ConfigError: ``path`` is not a directory or has no ``config.json``; the config needs the
            directory's own Python code (megatrain passes ``trust_remote_code=False`` and runs none)
            or has a value that cannot describe a model (:func:`megatrain.models.check_config_values`);
            ``compile``'s own errors for its arguments.
        UnsupportedModelError / TraceError: as ``compile``.
        CheckpointError: as ``load_hf_weights`` (no weights, legacy pickled ``pytorch_model.bin``
            weights, a corrupt file, a shape that differs); a megatrain checkpoint (with
            ``megatrain_state/``) whose files differ from the sha256 its manifest records, or that
            has no manifest.
    """
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"from_pretrained({str(path)!r}): not a directory; megatrain downloads nothing, so give "
                          "the local directory save_pretrained wrote (config.json and *.safetensors)")
    if not (root / "config.json").is_file():
        raise ConfigError(f"from_pretrained({str(path)!r}): no config.json there; it is what the model is built "
                          "from (save_pretrained writes it beside the weights)")
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain.bounds import check_model_size
    from megatrain.checkpoint_format import verify_model_files
    from megatrain.models import check_config_values, config_errors, refuse_remote_code

    verify_model_files(root)  # a megatrain checkpoint: what is read must match its manifest
    source = str(root / "config.json")
    try:
        raw = json.loads((root / "config.json").read_bytes())
    except ValueError as e:
        raise ConfigError(f"{source} is not valid JSON ({e}); save_pretrained writes a JSON object there") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} holds a JSON {type(raw).__name__}, not an object")
    refuse_remote_code(str(raw.get("model_type")), raw, source)
    check_model_size(raw, source)
    with config_errors(source):
        config = AutoConfig.from_pretrained(root, local_files_only=True, trust_remote_code=False)
    check_config_values(config, source, set(raw))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    trainer = compile(model, **compile_kwargs)
    trainer.load_hf_weights(root, strict=strict, verify=False)  # verified above, before its config was read
    return trainer


__all__ = ["from_pretrained"]
