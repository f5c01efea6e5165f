"""What a megatrain checkpoint directory holds, and the checks that one is complete and intact.

The names here are the files of the layout :mod:`megatrain.checkpoint` writes (its docstring draws
it). ``manifest.json`` records the sha256 and size of every other file and is written last, through
a rename, once every other file is durable: a directory without it is an interrupted save and is
never loaded, and a file that differs from it is truncated or corrupt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

from megatrain.errors import CheckpointError
from megatrain.files import file_sha256
from megatrain.safetensors_io import INDEX_FILE, SINGLE_FILE, Written

__all__ = ["EXTRA_TENSORS_FILE", "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "RNG_FILE", "STATE_DIR", "TRAINER_STATE",
           "describe_incomplete", "is_complete", "manifest_of", "read_json", "read_manifest", "verify_files",
           "verify_model_files"]

FORMAT_NAME = "megatrain-checkpoint"
FORMAT_VERSION = 1
STATE_DIR = "megatrain_state"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RNG_FILE = "rng.safetensors"
EXTRA_TENSORS_FILE = "extra.safetensors"
"""The caller's ``extra_tensors`` (``save_checkpoint``), where a save was given any."""


def read_json(file: Path) -> Any:
    """The JSON value in ``file``.

    Raises:
        CheckpointError: ``file`` is missing or not valid JSON (naming it).
    """
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def is_complete(d: Path) -> bool:
    """Whether ``d`` is a complete checkpoint: its manifest, which a save writes last, is there."""
    return (d / STATE_DIR / MANIFEST).is_file()


def describe_incomplete(path: Path) -> str:
    """What the checkpoint directory ``path`` lacks (it has no manifest), for the error that keeps
    it: the files a complete one holds that are not there, or the interrupted save it looks like."""
    state = path / STATE_DIR
    want = ["config.json", f"{STATE_DIR}/{TRAINER_STATE}", f"{STATE_DIR}/{RNG_FILE}", f"{STATE_DIR}/{MANIFEST}"]
    if (path / INDEX_FILE).is_file():
        try:
            want += sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            want.append(f"readable {INDEX_FILE}")
    else:
        want.append(SINGLE_FILE)
    try:
        want += [f"{STATE_DIR}/{f}" for f in json.loads((state / TRAINER_STATE).read_text())["optimizer_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    missing = [f for f in want if not (path / f).is_file()]
    return (f"it lacks {', '.join(missing)}" if missing != [f"{STATE_DIR}/{MANIFEST}"] else
            f"it lacks only {STATE_DIR}/{MANIFEST} (the sha256 of every file, which a save writes last: a "
            "partial copy, or a lost file)")


def manifest_of(files: Mapping[str, Written]) -> dict:
    """The manifest of a checkpoint whose files (by their path under its directory) were written
    as ``files``: the format, its version, the time of writing (Unix seconds) and each file's
    sha256 and size in bytes, by path."""
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "created_unix": time.time(),
            "files": {k: {"sha256": w.sha256, "bytes": w.bytes} for k, w in sorted(files.items())}}


def read_manifest(path: Path, missing: str) -> dict:
    """The checkpoint's manifest, checked to be one this megatrain reads; ``missing``: the error's
    words when there is none.

    Raises:
        CheckpointError: no manifest (``missing``), not valid JSON, not a megatrain manifest, or of a
            newer format version than this megatrain reads.
    """
    state = path / STATE_DIR
    if not (state / MANIFEST).is_file():
        raise CheckpointError(f"{path}: {missing}")
    manifest = read_json(state / MANIFEST)
    if manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{state / MANIFEST}: not a megatrain manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{state / MANIFEST}: format version {manifest['format_version']} is newer than "
                              f"this megatrain reads ({FORMAT_VERSION}); upgrade megatrain")
    return manifest


def verify_files(root: Path, manifest: dict) -> None:
    """Check every file ``manifest`` lists (by its path under ``root``) against the size in bytes
    and the sha256 it records; reads each file once.

    Raises:
        CheckpointError: a file is missing, has another size, or another sha256 (naming it).
    """
    for rel, rec in manifest["files"].items():
        file = root / rel
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in the manifest but missing; the checkpoint is incomplete")
        size = file.stat().st_size
        if size != rec["bytes"]:
            raise CheckpointError(f"{file}: has {size} bytes but the manifest records {rec['bytes']}; the "
                                  "file is truncated or was changed after saving")
        if file_sha256(file) != rec["sha256"]:
            raise CheckpointError(f"{file}: sha256 differs from the manifest's; the file is corrupt")


def verify_model_files(path: Path) -> None:
    """For a megatrain checkpoint (``megatrain_state/`` beside the weights), check what loading its
    weights reads (``config.json``, the model shards and their index) against the sizes and sha256
    its manifest records. A plain Hugging Face directory has no manifest: nothing to check.

    Raises:
        CheckpointError: a file is missing, truncated or differs (naming it); ``megatrain_state/``
            without a manifest (an incomplete checkpoint, saying what it lacks).
    """
    if not (path / STATE_DIR).is_dir():
        return
    manifest = read_manifest(path, f"a megatrain checkpoint without {STATE_DIR}/{MANIFEST} "
                                   f"({describe_incomplete(path)}), so its files cannot be checked; copy the "
                                   "checkpoint again from where it was saved")
    verify_files(path, {"files": {k: v for k, v in manifest["files"].items() if not k.startswith(f"{STATE_DIR}/")}})
