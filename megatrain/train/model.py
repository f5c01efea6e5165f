"""What ``TrainConfig.model`` names (a config, a weights directory or a checkpoint), and loading
a weights directory into a trainer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatrain.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What ``TrainConfig.model`` names.

    ``kind``: ``"config"`` (train from scratch), ``"weights"`` (a Hugging Face safetensors
    directory) or ``"checkpoint"`` (a megatrain checkpoint to resume). ``directory``: the model
    directory, None for a bare config file or preset. ``config``: the transformers config (tied embeddings stay tied: one matrix, one
    owner tile); ``tied``: whether the config ties them.
    """

    kind: Literal["config", "weights", "checkpoint"]
    directory: Path | None
    config: Any
    tied: bool


def resolve_model(spec: str) -> ModelSource:
    """Classify and load ``TrainConfig.model``.

    Raises:
        ConfigError: no such file, directory or preset; a directory without config.json; a
            config.json transformers cannot read (not UTF-8, not JSON, an unknown model_type).
        UnsupportedModelError: not a causal decoder (``megatrain.models.check_causal_decoder``, which
            lets the vision-language families megatrain traces through: LLaVA trains on SFT data
            with images, :func:`megatrain.train.corpus.prepare_data`).
        CheckpointError: a directory whose weights are PyTorch pickles (``pytorch_model.bin``),
            which megatrain does not load (the message says how to convert them).
    """
    from megatrain.checkpoint_format import STATE_DIR
    from megatrain.hf_weights import refuse_legacy_weights
    from megatrain.planner.presets import MODEL_PRESETS, load_model_config
    from megatrain.safetensors_io import INDEX_FILE

    p = Path(spec)
    directory = None
    if p.is_dir():
        directory = p
        config_file = p / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"model directory {p} has no config.json; point model at a Hugging Face "
                              "config.json, a weights directory or a megatrain checkpoint")
        if (p / STATE_DIR).is_dir():
            kind = "checkpoint"
        elif (p / INDEX_FILE).is_file() or any(p.glob("*.safetensors")):
            kind = "weights"
        else:
            refuse_legacy_weights(p)  # it trained from random weights without a word
            kind = "config"
    elif p.is_file():
        config_file, kind = p, "config"
    elif spec in MODEL_PRESETS:
        config_file, kind = None, "config"
    else:
        raise ConfigError(f"model {spec!r} is neither a file, a directory nor a preset "
                          f"({sorted(MODEL_PRESETS)}); give a Hugging Face config.json, a weights directory "
                          "or a megatrain checkpoint")
    config = load_model_config(spec if config_file is None else config_file)
    from megatrain.models import check_causal_decoder

    check_causal_decoder(config, str(config_file or spec))
    tied = False
    if config_file is not None:
        raw = json.loads(config_file.read_bytes().decode("utf-8"))  # load_model_config parsed it already
        if "tie_word_embeddings" in raw:
            tied = bool(raw["tie_word_embeddings"])
        else:
            from transformers import AutoConfig

            tied = bool(AutoConfig.for_model(raw["model_type"]).tie_word_embeddings)
    return ModelSource(kind=kind, directory=directory, config=config, tied=tied)


def model_label(cfg) -> str:
    """A short name of the run's model for titles (the loss plot's): a preset's name; for a file
    (a ``config.json``) its directory's name; for a directory its name, with its parent's where the
    name alone says nothing (a run's ``checkpoint``); ``init_from``'s label for a new run from a
    checkpoint's weights. ``cfg``: a :class:`~megatrain.train.config.TrainConfig`."""
    from megatrain.train.names import CHECKPOINT_DIR

    def label(spec: str) -> str:
        p = Path(spec)
        if not p.exists():
            return spec  # a preset
        p = p.resolve()
        if p.is_file():
            return p.parent.name
        return f"{p.parent.name}/{p.name}" if p.name == CHECKPOINT_DIR else p.name

    return f"{label(cfg.init_from)} (init_from)" if cfg.init_from else label(cfg.model)


def is_run_checkpoint(source: ModelSource, output_dir: Path) -> bool:
    """Whether ``source`` is the checkpoint of the run in ``output_dir`` (``output_dir/checkpoint``):
    naming it as the model resumes that run, whatever ``init_from`` says."""
    from megatrain.train.names import CHECKPOINT_DIR

    return source.kind == "checkpoint" and source.directory.resolve() == (output_dir / CHECKPOINT_DIR).resolve()


def init_source(init_from: str, model: ModelSource) -> ModelSource:
    """``TrainConfig.init_from``: the weights of ``init_from`` (a megatrain checkpoint, whose
    ``megatrain_state/`` is ignored, or a Hugging Face weights directory) for the architecture of
    ``model``, as a ``"weights"`` source: a new run starts from them, nothing is resumed. Shapes are
    checked when the weights load (:meth:`megatrain.Trainer.load_hf_weights`, strict by name).

    Raises:
        ConfigError: ``init_from`` is not a directory with a config.json and safetensors weights.
    """
    if not Path(init_from).is_dir():
        raise ConfigError(f"init_from {init_from} is not a directory; give a megatrain checkpoint (a run's "
                          "output_dir/checkpoint) or a Hugging Face weights directory")
    weights = resolve_model(init_from)
    if weights.kind == "config":
        raise ConfigError(f"init_from {init_from} holds no safetensors weights; give a megatrain checkpoint (a "
                          "run's output_dir/checkpoint) or a Hugging Face weights directory")
    return ModelSource(kind="weights", directory=weights.directory, config=model.config, tied=model.tied)


def load_weights(trainer, source: ModelSource, echo) -> None:
    """Copy the weights of a ``"weights"`` source into the trainer (strict: every tensor by name).
    A tied model's shared matrix loads from the one tensor its checkpoint stores."""
    trainer.load_hf_weights(source.directory)
