"""Loading from a model directory with transformers, running none of the directory's code.

A Hugging Face directory may name its own Python classes (``auto_map`` in ``config.json``,
``processor_config.json``, ``preprocessor_config.json`` or ``tokenizer_config.json``, with the
``*.py`` files beside them). transformers runs such a file when ``trust_remote_code`` is True, and,
when it is left unset, asks on the terminal whether to (one ``y`` runs it; a processor saved after
that copies the file into the output checkpoint). megatrain never runs code from a model
directory: every transformers call that can load a class from one passes
``trust_remote_code=False`` and ``local_files_only=True`` (``tests/test_no_remote_code.py`` walks
the package source and fails on a call that does not), and the calls that load from a directory
the user names go through the functions here, which turn transformers' refusal into one error
that says why and what to use instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatrain.errors import ConfigError

__all__ = ["NO_CODE", "code_files", "load_processor"]

NO_CODE = {"trust_remote_code": False, "local_files_only": True}
"""The keyword arguments every transformers loading call of megatrain passes: run no code from the
directory, download nothing."""

_FILES = ("config.json", "processor_config.json", "preprocessor_config.json", "tokenizer_config.json",
          "video_preprocessor_config.json")


def code_files(directory: str | os.PathLike) -> dict[str, str]:
    """``{settings file: the classes its auto_map names}`` for the files of ``directory`` that name
    Python code of the directory's own (empty when none does). Unreadable files count as none:
    transformers reports them when it reads them."""
    out = {}
    for name in _FILES:
        try:
            auto_map = json.loads((Path(directory) / name).read_bytes()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue
        if auto_map:
            values = auto_map.values() if isinstance(auto_map, dict) else auto_map
            out[name] = ", ".join(str(v) for v in values)[:200]
    return out


def load_processor(directory: str | os.PathLike, cls=None):
    """``cls.from_pretrained(directory)`` (default ``transformers.AutoProcessor``) with
    :data:`NO_CODE`.

    Raises:
        ConfigError: the processor is defined only by the directory's own code (``auto_map``): the
            message names the file and the class, and that megatrain runs no code from a directory.
        OSError, ValueError, KeyError: ``directory`` holds no such processor (transformers' errors).
    """
    if cls is None:
        from transformers import AutoProcessor as cls
    try:
        return cls.from_pretrained(directory, **NO_CODE)
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise _refused(directory, "processor") from None


def _refused(directory: str | os.PathLike, what: str) -> ConfigError:
    named = code_files(directory)
    where = "; ".join(f"{f}: {v}" for f, v in named.items()) or "auto_map"
    return ConfigError(f"{directory}: its {what} is defined only by the directory's own Python code ({where}), and "
                       "megatrain runs no code from a model directory (trust_remote_code=False); use a "
                       f"{what} class transformers ships (its processor_class / image_processor_type), or "
                       "save one without auto_map")
