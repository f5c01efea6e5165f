"""Checkpoints: Hugging Face weights into the host tiles, and checkpoints out that both Hugging Face
and megatrain can load.

``load_hf_weights`` streams a directory of (sharded) safetensors files into the FP32 master tiles
one tensor at a time, so host memory grows by about one shard (the memory-mapped file) plus one
tensor, never by a second copy of the model.

``save_checkpoint`` writes::

    path/
      config.json, generation_config.json    when the model has a Hugging Face config
      model.safetensors                      one shard, or
      model-00001-of-0000n.safetensors ...   several, with model.safetensors.index.json
      megatrain_state/
        trainer_state.json                   format version, step count, optimizer step per layer,
                                             optimizer settings (and "optimizer_name" but for AdamW),
                                             tile layout, RNG states of Python and NumPy, the
                                             caller's extra_state
        optimizer.safetensors or             per layer a "<layer>.<state>" row per state of the
                                             optimizer (megatrain.optim; AdamW "<layer>.exp_avg",
                                             "<layer>.exp_avg_sq", Lion "<layer>.exp_avg") of
        optimizer-0000k-of-0000n.safetensors the tile (and "<layer>.master" when the model shards are
                                             not FP32, so that resuming stays exact)
        rng.safetensors                      torch CPU (and CUDA) generator states
        manifest.json                        sha256 and size of every other file; written last

The model shards are what ``transformers.AutoModelForCausalLM.from_pretrained(path)`` reads; the
state directory is what ``load_checkpoint`` adds to resume training bit for bit.

Atomicity. Everything is written into a hidden temporary directory beside ``path`` (same file
system), every file and directory is fsynced, and only then does the directory move into place:
by ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system offer it (one atomic swap with
the previous checkpoint), otherwise by renaming the old checkpoint away and the new one in. A crash
between those two renames leaves no directory at ``path`` but two complete ones beside it; the next
``load_checkpoint`` or ``save_checkpoint`` moves the newer one into place. ``manifest.json`` is
written (through a rename) after every other file is durable, so a directory without it is an
interrupted save and is never loaded. Concurrent saves to one path are not supported.

The checkpoint boundary is the trainer's ``state_dict()`` (as torchtitan's checkpointer works on its
components' ``state_dict``/``load_state_dict``): saving reads the tensors and counters it returns,
loading checks every file against it, copies the file tensors into its views (in place, one tensor
at a time) and hands it back to ``Trainer.load_state_dict``. The model's Hugging Face config and
generation config are the only other things read from the trainer.

Shards are written by ``safetensors.torch.save_file``, one shard in memory at a time (bounded by
``max_shard_bytes``), then hashed and fsynced; JSON files are hashed as they are written.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

import numpy as np
import torch

from megatrain.optim import ADAMW, spec_of
from megatrain.errors import CheckpointError
from megatrain.files import exchange_paths, file_sha256, fsync_dir, replace_directory
from megatrain.runtime.host import as_tensor

__all__ = ["CheckpointError", "LoadedWeights", "load_checkpoint", "load_hf_weights", "save_checkpoint"]

FORMAT_NAME = "megatrain-checkpoint"
FORMAT_VERSION = 1
STATE_DIR = "megatrain_state"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
RNG_FILE = "rng.safetensors"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_TMP_TAG, _OLD_TAG = "megatrain-tmp", "megatrain-old"


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
class _Target:
    """One tensor of the trainer's state: a view into a master tile (``param``), a persistent
    buffer, or an optimizer-state row."""

    name: str
    shape: tuple[int, ...]
    tensor: torch.Tensor
    param: bool


def _targets(state: Mapping[str, Any]) -> dict[str, _Target]:
    """Every tensor of the model's state_dict by its name (Hugging Face naming), from
    ``Trainer.state_dict()``, in graph order: parameters (views of the master tiles), then
    persistent buffers."""
    out = {n: _Target(n, tuple(t.shape), t, True) for n, t in state["model"].items()}
    out.update({n: _Target(n, tuple(t.shape), t, False) for n, t in state["buffers"].items() if n not in out})
    return out


def _ignored(patterns: Iterable[str] | None, name: str) -> bool:
    return any(re.search(p, name) for p in (patterns or ()))


# ---------------------------------------------------------------------------------------------
# Reading safetensors
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Stored:
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors code: F32, BF16, ...


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found") from None
    except Exception as e:  # safetensors raises its own SafetensorError for a bad header or length
        raise CheckpointError(f"{file}: not a readable safetensors file ({e}); it may be truncated or "
                              "corrupt: write it again") from None


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The shard files of a Hugging Face weights directory (or a single .safetensors file), and the
    index's weight map when there is one."""
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


def _scan(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, _Stored]:
    """Headers of every shard (cheap: no tensor data is read); duplicates and index disagreements
    are errors."""
    stored: dict[str, _Stored] = {}
    for file in files:
        with _open(file) as f:
            for name in f.keys():
                sl = f.get_slice(name)
                if name in stored:
                    raise CheckpointError(f"{file.name}: tensor {name!r} is also in {stored[name].file.name}; "
                                          "each tensor must be stored once")
                stored[name] = _Stored(file, tuple(sl.get_shape()), sl.get_dtype())
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in stored or stored[name].file.name != fname:
                raise CheckpointError(f"{INDEX_FILE}: lists tensor {name!r} in {fname}, but {fname} does not "
                                      "hold it; the index and the shards disagree: write the checkpoint again")
    return stored


_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}


def _check_against(stored: Mapping[str, _Stored], targets: Mapping[str, _Target], where: Path, *,
                   ignore_missing=(), ignore_unexpected=(), strict: bool = True) -> tuple[list[str], list[str]]:
    """Shapes, dtypes, missing and unexpected names, all checked before anything is written, so a
    refused checkpoint leaves the model as it was."""
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


def _copy_in(stored: Mapping[str, _Stored], targets: Mapping[str, _Target]) -> int:
    """Copy file tensors into their targets, one file open and one tensor in memory at a time."""
    by_file: dict[Path, list[str]] = {}
    for name, s in stored.items():
        if name in targets:
            by_file.setdefault(s.file, []).append(name)
    n = 0
    with torch.no_grad():
        for file, names in by_file.items():
            with _open(file) as f:
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


def _tied_names(stored: dict[str, _Stored], model, targets: Mapping[str, _Target]) -> dict[str, _Stored]:
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
    files, weight_map = _weight_files(path)
    stored = _scan(files, weight_map)
    # The views to load into; a deferred update stays pending (these weights replace what it was for).
    targets = _targets(trainer.state_dict(flush=False))
    model = trainer.model
    stored = _tied_names(stored, model, targets)
    missing, unexpected = _check_against(
        stored, targets, path, strict=strict,
        ignore_missing=getattr(model, "_keys_to_ignore_on_load_missing", None),
        ignore_unexpected=getattr(model, "_keys_to_ignore_on_load_unexpected", None))
    with trainer.host.batched_nvme_writes():  # a layer's rows on NVMe: one read and one write of its file
        n = _copy_in(stored, targets)
    return LoadedWeights(files=tuple(str(f) for f in files), tensors=n, missing=tuple(missing),
                         unexpected=tuple(unexpected))


# ---------------------------------------------------------------------------------------------
# Writing files durably
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    """A tensor to write: its header fields, and how to produce its data when its shard is written
    (so only that shard is converted and held)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class _Written:
    sha256: str
    bytes: int


class _HashingFile:
    """A file opened for exclusive creation whose bytes are hashed as written, and fsynced on close."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "xb")
        self._h = hashlib.sha256()
        self._n = 0

    def write(self, data) -> None:
        self._h.update(data)
        self._f.write(data)
        self._n += memoryview(data).nbytes

    def close(self) -> _Written:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return _Written(self._h.hexdigest(), self._n)


def _write_bytes(path: Path, data: bytes) -> _Written:
    f = _HashingFile(path)
    f.write(data)
    return f.close()


def _write_json(path: Path, obj: Any) -> _Written:
    return _write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _write_safetensors(path: Path, entries: list[_Entry], metadata: dict[str, str] | None = None) -> _Written:
    """Write ``entries`` as one safetensors file through the ``safetensors`` library.

    The tensors of a shard are views of the same tiles, which ``safetensors`` refuses to store
    (shared storage), so each is copied once; the file is then hashed and fsynced. Transient host
    memory is about one shard (bounded by ``max_shard_bytes``).
    """
    from safetensors.torch import save_file

    tensors = {}
    for e in entries:
        t = e.source()
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            raise CheckpointError(f"{path.name}: tensor {e.name!r} is {t.dtype} {list(t.shape)} but was "
                                  f"announced as {e.dtype} {list(e.shape)}")
        tensors[e.name] = t.detach().cpu().clone()
    if path.exists():  # the writer below would overwrite; a shard is only ever written once
        raise CheckpointError(f"{path}: refusing to overwrite an existing file")
    save_file(tensors, str(path), metadata=dict(metadata or {"format": "pt"}))
    del tensors
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return _Written(h.hexdigest(), path.stat().st_size)


def _plan_shards(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Greedy in order: a new shard starts when the next tensor would overflow the current one; a
    tensor larger than ``max_bytes`` gets a shard of its own (as Hugging Face does)."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _shard_name(stem: str, k: int, n: int) -> str:
    return f"{stem}.safetensors" if n == 1 else f"{stem}-{k + 1:05d}-of-{n:05d}.safetensors"


# ---------------------------------------------------------------------------------------------
# Moving a finished checkpoint into place, and recovering from a crash while doing so
# ---------------------------------------------------------------------------------------------

_exchange = exchange_paths
"""How :func:`_place` swaps a new checkpoint with the previous one (a global here, so that a test can
take the swap away, as on a file system without ``RENAME_EXCHANGE``)."""


def _siblings(path: Path, tag: str) -> list[Path]:
    prefix = f".{path.name}.{tag}-"
    if not path.parent.is_dir():
        return []
    return sorted((p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.is_dir()),
                  key=lambda p: p.stat().st_mtime)


def is_complete(d: Path) -> bool:
    """Whether ``d`` is a complete checkpoint: its manifest, which a save writes last, is there."""
    return (d / STATE_DIR / MANIFEST).is_file()


def is_save_leftover(name: str, checkpoint_name: str) -> bool:
    """Whether the file name ``name`` is what an interrupted save of the checkpoint named
    ``checkpoint_name`` left beside it: its temporary directory, or the previous checkpoint moved aside."""
    return name.startswith(f".{checkpoint_name}.") and (_TMP_TAG in name or _OLD_TAG in name)


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


def recover_checkpoint(path: Path) -> None:
    """If a crash interrupted the two-rename fallback (no directory at ``path``), move the newest
    complete checkpoint beside it into place: the new one if it was complete, else the old one."""
    if path.exists():
        return
    for candidate in [*reversed(_siblings(path, _TMP_TAG)), *reversed(_siblings(path, _OLD_TAG))]:
        if is_complete(candidate):
            os.rename(candidate, path)
            fsync_dir(path.parent)
            return


def _place(tmp: Path, path: Path) -> None:
    replace_directory(tmp, path, aside_tag=_OLD_TAG, exchange=_exchange)


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------

_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _rng_state() -> tuple[list[_Entry], dict]:
    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = s
    entries = [_Entry(k, tuple(v.shape), v.dtype, (lambda v=v: v)) for k, v in tensors.items()]
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return entries, {"numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
                     "python": [version, list(state), gauss_next]}


def save_checkpoint(trainer, path: str | os.PathLike, *, dtype: Literal["float32", "bfloat16"] = "float32",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    extra_state: Mapping[str, Any] | None = None) -> Path:
    """Write the trainer's model in Hugging Face layout plus its resumable training state, atomically.

    ``path`` afterwards holds ``config.json`` (when the model has a Hugging Face config), the weights
    as ``model.safetensors`` or as ``model-0000k-of-0000n.safetensors`` shards with
    ``model.safetensors.index.json``, which ``transformers.AutoModelForCausalLM.from_pretrained``
    loads, and ``megatrain_state/`` with the optimizer's moments and steps, the step count, the optimizer
    settings, the torch / NumPy / Python RNG states, ``extra_state`` and a manifest holding the
    sha256 of every file (see the module docstring for the layout). What is saved is
    ``trainer.state_dict()``; host memory grows by about one shard (``max_shard_bytes``).

    The checkpoint is built in a hidden directory beside ``path`` and moved into place only when
    complete and fsynced; an existing checkpoint at ``path`` is replaced, and a crash at any moment
    leaves the old or the new one loadable.

    Args:
        trainer: a ``megatrain.Trainer``.
        path: the checkpoint directory; its parent is created if needed.
        dtype: the weights' dtype in the model shards. With ``"bfloat16"`` the FP32 master weights
            are also kept in ``megatrain_state/`` so that resuming is exact.
        max_shard_bytes: largest shard in bytes (a single larger tensor gets a shard of its own);
            the same limit applies to the optimizer-state shards. Loading needs about one shard of
            extra host memory.
        extra_state: JSON-serialisable dict saved as is and returned by ``load_checkpoint``: the
            learning-rate schedule's state, the data loader's position, and so on.

    Returns:
        The checkpoint directory, as an absolute path.

    Raises:
        CheckpointError: ``dtype`` or ``max_shard_bytes`` out of range, ``extra_state`` not
            JSON-serialisable, or ``path`` an existing file or a non-empty directory that is not a
            megatrain checkpoint (it is never overwritten).
        CheckpointError: also when the file system refused a write (a full disk: ``OSError`` or
            safetensors' ``SafetensorError`` is the cause), or a parameter holds NaN or infinite
            values (naming it); ``path`` is then left as it was.
    """
    if dtype not in _SAVE_DTYPES:
        raise CheckpointError(f"dtype={dtype!r} is not supported; use one of {sorted(_SAVE_DTYPES)}")
    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes!r} must be a positive number of bytes")
    extra = dict(extra_state or {})
    state_dict = trainer.state_dict()  # flushes: a deferred update of the last step belongs in the weights
    try:
        json.dumps(extra, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"extra_state is not JSON-serialisable ({e}); store tensors and arrays as "
                              "lists or numbers") from None
    path = Path(path).absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(path)
    if path.exists() and not (path.is_dir() and (is_complete(path) or not any(path.iterdir()))):
        raise CheckpointError(f"{path}: exists and is not a megatrain checkpoint; save_checkpoint replaces "
                              "only its own checkpoints: remove it or choose another path")
    # Leftovers of saves that crashed before their rename are never loadable; clear them.
    for stale in _siblings(path, _TMP_TAG) + _siblings(path, _OLD_TAG):
        shutil.rmtree(stale, ignore_errors=True)

    tmp = path.parent / f".{path.name}.{_TMP_TAG}-{os.getpid()}-{secrets.token_hex(4)}"
    had = is_complete(path)
    try:
        tmp.mkdir()
        manifest = _write_all(trainer.model, state_dict, tmp, _SAVE_DTYPES[dtype], max_shard_bytes, extra)
        state = tmp / STATE_DIR
        # The manifest marks the directory complete, so it appears (by rename) only once every
        # other file and both directories are durable.
        fsync_dir(state)
        fsync_dir(tmp)
        _write_json(state / (MANIFEST + ".part"), manifest)
        os.rename(state / (MANIFEST + ".part"), state / MANIFEST)
        fsync_dir(state)
        _place(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        # safetensors reports a failed write (a full disk, a file size limit) as its own
        # SafetensorError, not as an OSError.
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            kept = (f"the previous checkpoint at {path} is intact" if had and is_complete(path)
                    else f"nothing was written to {path}")
            raise CheckpointError(f"{path}: could not write the checkpoint ({type(e).__name__}: {e}); {kept}. "
                                  "Free disk space (or fix the file system's error) and save again") from e
        raise
    return path


def _finite(t: _Target, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s tensor in ``dtype``; a parameter with a NaN or infinite value is refused (buffers,
    causal masks say, may hold -inf), so no checkpoint ever holds diverged weights."""
    out = t.tensor.to(dtype)
    if t.param and out.is_floating_point() and not bool(torch.isfinite(out).all()):
        raise CheckpointError(f"parameter {t.name!r} holds NaN or infinite values: the weights diverged, and "
                              "they are not saved (a checkpoint already at the path is left as it was)")
    return out


def _write_all(model, sd: Mapping[str, Any], root: Path, dtype: torch.dtype, max_shard_bytes: int,
               extra: dict) -> dict:
    """Write ``sd`` (``Trainer.state_dict()``) and ``model``'s Hugging Face configs under ``root``;
    return the manifest."""
    files: dict[str, _Written] = {}
    state = root / STATE_DIR
    state.mkdir()

    # Model shards, Hugging Face layout.
    targets = _targets(sd)
    entries = []
    for t in targets.values():
        # Buffers keep their own dtype: they are not trained, and resuming must restore them exactly.
        want = dtype if t.param else t.tensor.dtype
        entries.append(_Entry(t.name, t.shape, want, (lambda t=t, want=want: _finite(t, want))))
    shards = _plan_shards(entries, max_shard_bytes)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = _shard_name("model", k, len(shards))
        files[name] = _write_safetensors(root / name, shard, {"format": "pt"})
        weight_map.update({e.name: name for e in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        files[INDEX_FILE] = _write_json(root / INDEX_FILE, index)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        cfg = copy.deepcopy(cfg)
        cfg.architectures = [type(model).__name__]
        if hasattr(cfg, "dtype"):
            cfg.dtype = dtype
        files["config.json"] = _write_bytes(root / "config.json", cfg.to_json_string(use_diff=True).encode())
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "to_json_string"):
        files["generation_config.json"] = _write_bytes(root / "generation_config.json",
                                                       gen.to_json_string(use_diff=True).encode())

    # Optimizer state: the moment rows of each tile (and the master row when the shards are lossy).
    rows = []
    spec = spec_of(sd["optimizer_settings"])
    for layer in sd["layers"]:
        kinds = [("optimizer", kind) for kind in spec.states]
        if dtype != torch.float32:
            kinds.insert(0, ("masters", "master"))
        for group, kind in kinds:
            key = f"{layer['name']}.{kind}"
            numel = layer["numel"] if group == "masters" else layer["trainable_numel"]  # frozen: no moments
            # A row on the NVMe tier is read from its file only when its shard is written.
            rows.append(_Entry(key, (numel,), torch.float32, (lambda t=sd[group][key]: as_tensor(t))))
    opt_shards = _plan_shards(rows, max_shard_bytes)
    for k, shard in enumerate(opt_shards):
        name = f"{STATE_DIR}/{_shard_name('optimizer', k, len(opt_shards))}"
        files[name] = _write_safetensors(root / name, shard, {"format": "pt"})

    rng_entries, rng_json = _rng_state()
    files[f"{STATE_DIR}/{RNG_FILE}"] = _write_safetensors(state / RNG_FILE, rng_entries, {"format": "pt"})
    trainer_state = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step_count": sd["step_count"],
        "adam_steps": dict(sd["adam_steps"]),
        "optimizer": sd["optimizer_settings"].model_dump(mode="json"),
        **({} if spec is ADAMW else {"optimizer_name": spec.name}),  # absent: AdamW, as before Lion
        "model_dtype": str(dtype).removeprefix("torch."),
        "master_weights": "model" if dtype == torch.float32 else "state",
        "optimizer_files": [_shard_name("optimizer", k, len(opt_shards)) for k in range(len(opt_shards))],
        "layers": sd["layers"],
        "rng": rng_json,
        "extra_state": extra,
    }
    files[f"{STATE_DIR}/{TRAINER_STATE}"] = _write_json(state / TRAINER_STATE, trainer_state)
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "created_unix": time.time(),
            "files": {k: {"sha256": w.sha256, "bytes": w.bytes} for k, w in sorted(files.items())}}


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: file not found") from None
    except ValueError as e:
        raise CheckpointError(f"{file}: not valid JSON ({e})") from None


def _verify_files(root: Path, manifest: dict) -> None:
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
    manifest = _manifest(path, f"a megatrain checkpoint without {STATE_DIR}/{MANIFEST} ({describe_incomplete(path)}), "
                               "so its files cannot be checked; copy the checkpoint again from where it was saved")
    _verify_files(path, {"files": {k: v for k, v in manifest["files"].items() if not k.startswith(f"{STATE_DIR}/")}})


def _manifest(path: Path, missing: str) -> dict:
    """The checkpoint's manifest, checked to be one this megatrain reads; ``missing``: the error's
    words when there is none."""
    state = path / STATE_DIR
    if not (state / MANIFEST).is_file():
        raise CheckpointError(f"{path}: {missing}")
    manifest = _read_json(state / MANIFEST)
    if manifest.get("format") != FORMAT_NAME or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{state / MANIFEST}: not a megatrain manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{state / MANIFEST}: format version {manifest['format_version']} is newer than "
                              f"this megatrain reads ({FORMAT_VERSION}); upgrade megatrain")
    return manifest


def _check_layers(saved: list[dict], now: list[dict], where: Path) -> None:
    if len(saved) != len(now):
        raise CheckpointError(f"{where}: the checkpoint has {len(saved)} layers but the model has {len(now)}; "
                              "it was saved from another model")
    for s, n in zip(saved, now):
        if s != n:
            what = ("name" if s["name"] != n["name"] else "tile size" if s["numel"] != n["numel"]
                    else "parameter layout")
            detail = ""
            for sp, np_ in zip(s["params"], n["params"]):
                if sp != np_:
                    detail = f": parameter {sp[0]!r} has shape {sp[1]} at offset {sp[2]} in the checkpoint " \
                             f"but {np_[0]!r} has shape {np_[1]} at offset {np_[2]} in the model"
                    break
            raise CheckpointError(f"{where}: layer {n['name']!r} differs in {what} from the checkpoint's layer "
                                  f"{s['name']!r}{detail}; load a checkpoint of this model")


def load_checkpoint(trainer, path: str | os.PathLike, *, verify: bool = True) -> dict:
    """Restore a ``save_checkpoint`` checkpoint into a compiled trainer and return its ``extra_state``.

    Restores the FP32 master weights, both Adam moments and the Adam step of every layer, the
    trainer's ``step_count``, its optimizer settings (learning rate included) and the torch CPU (and
    CUDA, where saved and available), NumPy and Python RNG states, so that training continues bit
    for bit as if it had not stopped. The trainer must be compiled from the same model
    architecture; its current weights (a meta-device model's initialisation, say) are overwritten.
    If a crash interrupted a save's final renames, the complete checkpoint beside ``path`` is first
    moved into place.

    Args:
        trainer: a ``megatrain.Trainer``.
        path: the checkpoint directory.
        verify: check every file's size and sha256 against the manifest before touching the trainer
            (reads the whole checkpoint once more; turn off for speed when the storage is trusted).

    Returns:
        The ``extra_state`` dict given to ``save_checkpoint`` (empty when none was).

    Raises:
        CheckpointError: no complete checkpoint at ``path`` (an interrupted save, or plain Hugging
            Face weights: use ``load_hf_weights``); a newer format version; a file missing,
            truncated or corrupt (naming the file); a checkpoint of another model (naming the layer,
            or the file and tensor). These are all detected before the trainer is changed. A tensor
            with NaN or infinite values (possible only with ``verify=False`` or a manifest written
            for them), naming the file and tensor, found while copying: load another checkpoint.
    """
    path = Path(path).absolute()
    recover_checkpoint(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint there")
    state = path / STATE_DIR
    manifest = _manifest(path, f"not a complete megatrain checkpoint ({STATE_DIR}/{MANIFEST} is missing); it is an "
                               "interrupted save or plain weights: use load_hf_weights for weights only")
    if verify:
        _verify_files(path, manifest)
    ts = _read_json(state / TRAINER_STATE)
    # The trainer's state as views: files are checked against it, then copied into it in place.
    sd = trainer.state_dict(flush=False)
    _check_layers(ts["layers"], sd["layers"], state / TRAINER_STATE)
    name, mine = ts.get("optimizer_name", "adamw"), trainer.host.optimizer
    if name != mine.name:
        raise CheckpointError(f"{state / TRAINER_STATE}: the checkpoint holds {name}'s optimizer state but the trainer "
                              f"runs {mine.name} (rows {mine.states}); compile with "
                              f"optimizer={{'name': {name!r}, ...}} to resume it")
    try:
        optimizer = mine.settings(**ts["optimizer"])
    except Exception as e:
        raise CheckpointError(f"{state / TRAINER_STATE}: optimizer settings are invalid ({e})") from None

    # Check every tensor header before changing anything.
    rows_stored = _scan([state / f for f in ts["optimizer_files"]], None)
    rows = {**sd["optimizer"], **(sd["masters"] if ts["master_weights"] == "state" else {})}
    row_targets = {k: _Target(k, tuple(t.shape), t, False) for k, t in rows.items()}
    _check_against(rows_stored, row_targets, state)
    for name, s in rows_stored.items():
        if s.dtype != "F32":
            raise CheckpointError(f"{s.file.name}: tensor {name!r} has dtype {s.dtype}; optimizer state is F32")
    weight_targets = _targets(sd)
    files, weight_map = _weight_files(path)
    weights_stored = _scan(files, weight_map)
    _check_against(weights_stored, weight_targets, path)
    if ts["master_weights"] == "state":
        # Masters come from the FP32 rows; the lossy model shards give only the buffers.
        weight_targets = {k: t for k, t in weight_targets.items() if not t.param}
    rng_stored = _scan([state / RNG_FILE], None)

    # Now restore: the tensors into the state's views, then the state into the trainer (which
    # copies nothing more, sets the counters and settings, and drops a deferred update: its
    # gradients were of the weights before the load).
    with trainer.host.batched_nvme_writes():  # a layer's rows on NVMe: one read and one write of its file
        _copy_in(weights_stored, weight_targets)
        _copy_in(rows_stored, row_targets)
    trainer.load_state_dict({**sd, "adam_steps": {k: float(v) for k, v in ts["adam_steps"].items()},
                             "step_count": int(ts["step_count"]), "optimizer_settings": optimizer})
    _restore_rng(rng_stored, ts["rng"])
    return dict(ts.get("extra_state") or {})


def _restore_rng(stored: Mapping[str, _Stored], js: dict) -> None:
    with _open(stored["torch.cpu"].file) as f:
        torch.set_rng_state(f.get_tensor("torch.cpu"))
        cuda = sorted((k for k in stored if k.startswith("torch.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([f.get_tensor(k) for k in cuda])
    kind, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, state, gauss_next = js["python"]
    random.setstate((version, tuple(state), gauss_next))
