"""Hugging Face weights into a compiled trainer's host tiles.

``load_hf_weights`` streams a directory of (sharded) safetensors files into the FP32 master tiles
one tensor at a time, so host memory grows by about one shard (the memory-mapped file) plus one
tensor, never by a second copy of the model.

The trainer is reached through its ``state_dict()`` (views of the master tiles, the persistent
buffers, the optimizer rows) and ``host.batched_nvme_writes()``, never through the runtime's
modules. The steps (:func:`state_targets`, :func:`scan`, :func:`check_against`, :func:`copy_in`) are also
``megatrain.checkpoint.load_checkpoint``'s, which reads its model shards and optimizer rows the same way.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from megatrain.checkpoint_format import verify_model_files
from megatrain.errors import CheckpointError
from megatrain.safetensors_io import INDEX_FILE, SINGLE_FILE, StoredTensor, open_safetensors

__all__ = ["LoadedWeights", "Target", "check_against", "copy_in", "load_hf_weights", "refuse_legacy_weights",
           "scan", "state_targets", "weight_files"]


@dataclass(frozen=True, slots=True)
class LoadedWeights:
    """What ``load_hf_weights`` did: the files read, the number of tensors copied into the model,
    and (only with ``strict=False``) the model tensors left as they were and the file tensors
    skipped."""

    files: tuple[str, ...]
    tensors: int
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Where each named tensor of the model lives
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Target:
    """One tensor of the trainer's state: a view into a master tile (``param``), a persistent
    buffer, or an optimizer-state row."""

    name: str
    shape: tuple[int, ...]
    tensor: torch.Tensor
    param: bool


def state_targets(state: Mapping[str, Any]) -> dict[str, Target]:
    """Every tensor of the model's state_dict by its name (Hugging Face naming), from
    ``Trainer.state_dict()``, in graph order: parameters (views of the master tiles), then
    persistent buffers."""
    out = {n: Target(n, tuple(t.shape), t, True) for n, t in state["model"].items()}
    out.update({n: Target(n, tuple(t.shape), t, False) for n, t in state["buffers"].items() if n not in out})
    return out


def _ignored(patterns: Iterable[str] | None, name: str) -> bool:
    return any(re.search(p, name) for p in (patterns or ()))


# ---------------------------------------------------------------------------------------------
# Reading safetensors
# ---------------------------------------------------------------------------------------------

def weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files of a Hugging Face weights directory (or a single .safetensors file), and the
    index's weight map when there is one.

    Raises:
        CheckpointError: no such path; an index that is not one; PyTorch pickles instead of
            safetensors (:func:`refuse_legacy_weights`); neither ``model.safetensors`` nor an index.
    """
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e!r}); it needs a 'weight_map' "
                                  "object from tensor name to shard file") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        return [path / f for f in sorted(set(weight_map.values()))], weight_map
    single = path / SINGLE_FILE
    if single.is_file():
        return [single], None
    refuse_legacy_weights(path)
    raise CheckpointError(f"{path}: has neither {SINGLE_FILE} nor {INDEX_FILE}; point at a directory "
                          "holding Hugging Face safetensors weights")


_LEGACY_SUFFIXES = (".bin", ".pt", ".pth", ".bin.index.json", ".ckpt")


def refuse_legacy_weights(path: Path) -> None:
    """Refuse a model directory whose weights are PyTorch pickles (``pytorch_model.bin`` and its
    shards, ``*.pt``): loading one unpickles it, which can run code it holds, so megatrain reads
    safetensors only. Nothing where there are none.

    Raises:
        CheckpointError: naming the files and the one-time conversion.
    """
    legacy = sorted(p.name for p in path.iterdir() if p.name.endswith(_LEGACY_SUFFIXES)) if path.is_dir() else []
    if legacy:
        raise CheckpointError(
            f"{path}: its weights are PyTorch pickles ({', '.join(legacy[:3])}{' ...' if len(legacy) > 3 else ''}), "
            "which megatrain does not load (unpickling can run code a file holds); it reads safetensors. Convert "
            "them once, if you trust the files: python -c \"from transformers import AutoModelForCausalLM as M; "
            f"M.from_pretrained('{path}').save_pretrained('{path}-safetensors')\" and give {path}-safetensors")


def scan(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, StoredTensor]:
    """Headers of every shard (cheap: no tensor data is read); duplicates and index disagreements
    are errors.

    Raises:
        CheckpointError: a file is missing or not safetensors; a tensor stored twice; ``weight_map``
            naming a shard that does not hold the tensor.
    """
    stored: dict[str, StoredTensor] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if name in stored:
                    raise CheckpointError(f"{file.name}: tensor {name!r} is also in {stored[name].file.name}; "
                                          "each tensor must be stored once")
                stored[name] = StoredTensor(file, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in stored or stored[name].file.name != fname:
                raise CheckpointError(f"{INDEX_FILE}: lists tensor {name!r} in {fname}, but {fname} does not "
                                      "hold it; the index and the shards disagree: write the checkpoint again")
    return stored


_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}


def check_against(stored: Mapping[str, StoredTensor], targets: Mapping[str, Target], where: Path, *,
                  ignore_missing=(), ignore_unexpected=(), strict: bool = True) -> tuple[list[str], list[str]]:
    """Shapes, dtypes, missing and unexpected names, all checked before anything is written, so a
    refused checkpoint leaves the model as it was. Returns the names missing from ``stored`` and
    those ``targets`` lacks (less the ``ignore_*`` regular expressions).

    Raises:
        CheckpointError: every problem at once: a shape that differs, a non-float dtype for a float
            tensor, and with ``strict`` the missing and unexpected names.
    """
    problems: list[str] = []
    for name, s in stored.items():
        t = targets.get(name)
        if t is None:
            continue
        if s.shape != t.shape:
            problems.append(f"{s.file.name}: tensor {name!r} has shape {list(s.shape)} but the model "
                            f"expects {list(t.shape)}")
        elif t.tensor.is_floating_point() and s.dtype not in _FLOAT_CODES:
            problems.append(f"{s.file.name}: tensor {name!r} has dtype {s.dtype} but the model expects a "
                            "floating-point tensor")
    missing = [n for n in targets if n not in stored and not _ignored(ignore_missing, n)]
    unexpected = [n for n in stored if n not in targets and not _ignored(ignore_unexpected, n)]
    if strict and missing:
        problems.append(f"{where}: lacks {len(missing)} tensor(s) the model needs: {_few(missing)}; names "
                        "must be the model's own state_dict names (Hugging Face naming)")
    if strict and unexpected:
        problems.append(f"{where}: has {len(unexpected)} tensor(s) the model does not have: "
                        + ", ".join(f"{stored[n].file.name}: {n!r}" for n in unexpected[:8])
                        + (" ..." if len(unexpected) > 8 else "")
                        + "; is this a checkpoint of another model? (strict=False skips them)")
    if problems:
        raise CheckpointError("cannot load weights: " + "; ".join(problems))
    return missing, unexpected


def _few(names: list[str], k: int = 8) -> str:
    return ", ".join(repr(n) for n in names[:k]) + (f" ... ({len(names) - k} more)" if len(names) > k else "")


def copy_in(stored: Mapping[str, StoredTensor], targets: Mapping[str, Target]) -> int:
    """Copy file tensors into their targets, one file open and one tensor in memory at a time;
    the number copied. Any float dtype converts to the target's (BF16/F16 to FP32 exactly).

    Raises:
        CheckpointError: a tensor that cannot be read, or holds NaN or infinite values (the tensors
            before it were copied already).
    """
    by_file: dict[Path, list[str]] = {}
    for name, s in stored.items():
        if name in targets:
            by_file.setdefault(s.file, []).append(name)
    n = 0
    with torch.no_grad():
        for file, names in by_file.items():
            with open_safetensors(file) as f:
                for name in names:
                    try:
                        src = f.get_tensor(name)
                    except Exception as e:
                        raise CheckpointError(f"{file.name}: cannot read tensor {name!r} ({e})") from None
                    # In chunks of 4 M values: a mask the size of the tensor would add a quarter of
                    # it to the load's peak host memory.
                    if src.is_floating_point() and not all(bool(torch.isfinite(c).all())
                                                           for c in src.reshape(-1).split(1 << 22)):
                        bad = int((~torch.isfinite(src)).sum())
                        raise CheckpointError(f"{file}: tensor {name!r} holds {bad:,} NaN or infinite values of "
                                              f"{src.numel():,}; the weights are corrupt (a training run never "
                                              "saves them so): load them from where they were saved again, or "
                                              "from an earlier checkpoint")
                    targets[name].tensor.copy_(src)  # converts BF16/F16 to the tile's FP32 exactly
                    del src
                    n += 1
    return n


def _tied_names(stored: dict[str, StoredTensor], model, targets: Mapping[str, Target]) -> dict[str, StoredTensor]:
    """A tied parameter is one tensor under its first name (``model.embed_tokens.weight``), as
    transformers saves it; a file that also (or only) stores it under another of its names
    (``lm_head.weight``) loads that tensor once, under the first name."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    out = dict(stored)
    for name, p in model.named_parameters(remove_duplicate=False):
        main = first[id(p)]
        if name != main and name in out and name not in targets:
            s = out.pop(name)
            out.setdefault(main, s)
    return out


def load_hf_weights(trainer, path: str | os.PathLike, *, strict: bool = True, verify: bool = True) -> LoadedWeights:
    """Copy Hugging Face safetensors weights into a compiled trainer's FP32 master tiles.

    ``path`` is a directory holding ``model.safetensors`` or ``model.safetensors.index.json`` with
    its shards (what ``save_pretrained`` and ``save_checkpoint`` write), or one ``.safetensors``
    file. Tensor names are the model's own ``state_dict`` names (Hugging Face naming); any floating
    dtype is converted to FP32. Every header is checked before any tensor is copied, so a refused
    checkpoint leaves the weights as they were. Tensors are then read one at a time, one shard open
    at a time: host memory grows by about the largest shard (its pages are memory-mapped) plus the
    largest tensor. Adam moments and steps are left as they are (zero on a fresh trainer).
    Persistent buffers in the file are copied into the module's buffers.

    Args:
        trainer: a ``megatrain.Trainer`` from ``megatrain.compile``.
        path: the weights directory or file.
        strict: with False, tensors the model lacks are skipped and model tensors the files lack are
            left as they are, and both are listed in the result instead of raising.
        verify: a megatrain checkpoint's weight files (``megatrain_state/`` beside them) are
            checked against the sizes and sha256 of its manifest before anything is copied
            (:func:`verify_model_files`, as ``load_checkpoint`` and ``megatrain.from_pretrained``
            check them); False skips that, for a caller that just did.

    Returns:
        ``LoadedWeights``: the files read and the number of tensors copied.

    Raises:
        CheckpointError: no weights at ``path``; a megatrain checkpoint whose files differ from its
            manifest (naming the file); a file that is not valid safetensors (truncated or corrupt);
            a tensor whose shape differs from the model's (naming the file and tensor); with
            ``strict``, tensors missing from the files or not in the model; a tensor with NaN or
            infinite values (naming it; the tensors before it in the files were copied already).
    """
    path = Path(path)
    if verify and path.is_dir():
        verify_model_files(path)
    files, weight_map = weight_files(path)
    stored = scan(files, weight_map)
    # The views to load into; a deferred update stays pending (these weights replace what it was for).
    targets = state_targets(trainer.state_dict(flush=False))
    model = trainer.model
    stored = _tied_names(stored, model, targets)
    missing, unexpected = check_against(
        stored, targets, path, strict=strict,
        ignore_missing=getattr(model, "_keys_to_ignore_on_load_missing", None),
        ignore_unexpected=getattr(model, "_keys_to_ignore_on_load_unexpected", None))
    with trainer.host.batched_nvme_writes():  # a layer's rows on NVMe: one read and one write of its file
        n = copy_in(stored, targets)
    return LoadedWeights(files=tuple(str(f) for f in files), tensors=n, missing=tuple(missing),
                         unexpected=tuple(unexpected))
