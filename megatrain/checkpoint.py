"""Checkpoints out that both Hugging Face and megatrain can load, and back in to resume training.

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
        extra.safetensors                    the caller's extra_tensors, where given
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

Beside save and load, this module holds the directory's swap into place and the recovery after a
crash, and the RNG states. The rest is below it, one concern to a module:
:mod:`megatrain.checkpoint_format` (the files' names, the manifest and the checks against it),
:mod:`megatrain.hf_weights` (Hugging Face weights into the tiles: ``load_hf_weights``, re-exported
here, and the header checks and copies loading shares with it) and :mod:`megatrain.safetensors_io`
(safetensors read, and written hashed and fsynced, in shards).
"""

from __future__ import annotations

import copy
import json
import os
import random
import secrets
import shutil
from pathlib import Path
from typing import Any, Literal, Mapping

import numpy as np
import torch

from megatrain.checkpoint_format import (EXTRA_TENSORS_FILE, FORMAT_NAME, FORMAT_VERSION, MANIFEST, RNG_FILE, STATE_DIR,
                                         TRAINER_STATE, is_complete, manifest_of, read_json, read_manifest,
                                         verify_files)
from megatrain.errors import CheckpointError
from megatrain.files import exchange_paths, fsync_dir, replace_directory
from megatrain.hf_weights import (LoadedWeights, Target, check_against, copy_in, load_hf_weights, scan, state_targets,
                                  weight_files)
from megatrain.optim import ADAMW, OptimizerSpec, spec_of
from megatrain.runtime.host import as_tensor
from megatrain.safetensors_io import (INDEX_FILE, Entry, StoredTensor, Written, open_safetensors, plan_shards,
                                      shard_name, write_bytes, write_json, write_safetensors)

__all__ = ["CheckpointError", "LoadedWeights", "load_checkpoint", "load_extra_tensors", "load_hf_weights",
           "save_checkpoint"]

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
_TMP_TAG, _OLD_TAG = "megatrain-tmp", "megatrain-old"


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


def is_save_leftover(name: str, checkpoint_name: str) -> bool:
    """Whether the file name ``name`` is what an interrupted save of the checkpoint named
    ``checkpoint_name`` left beside it: its temporary directory, or the previous checkpoint moved aside."""
    return name.startswith(f".{checkpoint_name}.") and (_TMP_TAG in name or _OLD_TAG in name)


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
# RNG states: the torch ones as tensors (rng.safetensors), NumPy's and Python's as JSON
# ---------------------------------------------------------------------------------------------

def _rng_state() -> tuple[list[Entry], dict]:
    tensors = {"torch.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch.cuda.{i}"] = s
    entries = [Entry(k, tuple(v.shape), v.dtype, (lambda v=v: v)) for k, v in tensors.items()]
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    return entries, {"numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
                     "python": [version, list(state), gauss_next]}


def _restore_rng(stored: Mapping[str, StoredTensor], js: dict) -> None:
    with open_safetensors(stored["torch.cpu"].file) as f:
        torch.set_rng_state(f.get_tensor("torch.cpu"))
        cuda = sorted((k for k in stored if k.startswith("torch.cuda.")), key=lambda k: int(k.rsplit(".", 1)[1]))
        if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([f.get_tensor(k) for k in cuda])
    kind, keys, pos, has_gauss, cached = js["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, state, gauss_next = js["python"]
    random.setstate((version, tuple(state), gauss_next))


# ---------------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------------

_write_safetensors = write_safetensors
"""How a save writes each safetensors file (a global here, as :data:`_exchange` is, so that a test
can stop a save between two shards)."""

_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save_checkpoint(trainer, path: str | os.PathLike, *, dtype: Literal["float32", "bfloat16"] = "float32",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    extra_state: Mapping[str, Any] | None = None,
                    extra_tensors: Mapping[str, torch.Tensor] | None = None) -> Path:
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
        extra_tensors: named CPU tensors saved as they are (any dtype and shape, an empty one
            included) in ``megatrain_state/extra.safetensors``, inside the same atomic save and
            manifest, and read back by :func:`load_extra_tensors`: what a run needs to resume
            besides the trainer (a sampler's generator state, a frozen reference's weights).

    Returns:
        The checkpoint directory, as an absolute path.

    Raises:
        CheckpointError: ``dtype`` or ``max_shard_bytes`` out of range, ``extra_state`` not
            JSON-serialisable, an ``extra_tensors`` value that is not a CPU tensor, or ``path`` an
            existing file or a non-empty directory that is not a megatrain checkpoint (it is never
            overwritten).
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
                              "lists or numbers, or tensors in extra_tensors") from None
    tensors = dict(extra_tensors or {})
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise CheckpointError(f"extra_tensors[{name!r}] is {type(t).__name__}"
                                  f"{'' if not isinstance(t, torch.Tensor) else ' on ' + str(t.device)}: give CPU "
                                  "tensors (.cpu())")
    path = Path(path).absolute()
    _make_room(path)
    tmp = path.parent / f".{path.name}.{_TMP_TAG}-{os.getpid()}-{secrets.token_hex(4)}"
    had = is_complete(path)
    try:
        tmp.mkdir()
        manifest = _write_all(trainer.model, state_dict, tmp, _SAVE_DTYPES[dtype], max_shard_bytes, extra, tensors)
        _write_manifest_last(tmp, manifest)
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


def _make_room(path: Path) -> None:
    """Make ``path`` ready for a save to replace: its parent created, a checkpoint a crash left
    beside it moved into place, anything there but a megatrain checkpoint (or an empty directory)
    refused, and the leftovers of crashed saves removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_checkpoint(path)
    if path.exists() and not (path.is_dir() and (is_complete(path) or not any(path.iterdir()))):
        raise CheckpointError(f"{path}: exists and is not a megatrain checkpoint; save_checkpoint replaces "
                              "only its own checkpoints: remove it or choose another path")
    # Leftovers of saves that crashed before their rename are never loadable; clear them.
    for stale in _siblings(path, _TMP_TAG) + _siblings(path, _OLD_TAG):
        shutil.rmtree(stale, ignore_errors=True)


def _write_manifest_last(tmp: Path, manifest: dict) -> None:
    """Write the manifest into the finished ``tmp``, last: it marks the directory complete, so it
    appears (by rename) only once every other file and both directories are durable."""
    state = tmp / STATE_DIR
    fsync_dir(state)
    fsync_dir(tmp)
    write_json(state / (MANIFEST + ".part"), manifest)
    os.rename(state / (MANIFEST + ".part"), state / MANIFEST)
    fsync_dir(state)


def _finite(t: Target, dtype: torch.dtype) -> torch.Tensor:
    """``t``'s tensor in ``dtype``; a parameter with a NaN or infinite value is refused (buffers,
    causal masks say, may hold -inf), so no checkpoint ever holds diverged weights."""
    out = t.tensor.to(dtype)
    if t.param and out.is_floating_point() and not bool(torch.isfinite(out).all()):
        raise CheckpointError(f"parameter {t.name!r} holds NaN or infinite values: the weights diverged, and "
                              "they are not saved (a checkpoint already at the path is left as it was)")
    return out


def _write_all(model, sd: Mapping[str, Any], root: Path, dtype: torch.dtype, max_shard_bytes: int,
               extra: dict, tensors: Mapping[str, torch.Tensor]) -> dict:
    """Write ``sd`` (``Trainer.state_dict()``), ``model``'s Hugging Face configs and the caller's
    ``tensors`` under ``root``; return the manifest."""
    state = root / STATE_DIR
    state.mkdir()
    files = _write_model(model, sd, root, dtype, max_shard_bytes)
    spec = spec_of(sd["optimizer_settings"])
    optimizer_files = _write_optimizer(sd, spec, state, dtype, max_shard_bytes)
    files.update({f"{STATE_DIR}/{name}": w for name, w in optimizer_files.items()})
    rng_entries, rng_json = _rng_state()
    files[f"{STATE_DIR}/{RNG_FILE}"] = _write_safetensors(state / RNG_FILE, rng_entries, {"format": "pt"})
    if tensors:
        entries = [Entry(k, tuple(v.shape), v.dtype, (lambda v=v: v.contiguous())) for k, v in tensors.items()]
        files[f"{STATE_DIR}/{EXTRA_TENSORS_FILE}"] = _write_safetensors(state / EXTRA_TENSORS_FILE, entries,
                                                                        {"format": "pt"})
    trainer_state = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "step_count": sd["step_count"],
        "adam_steps": dict(sd["adam_steps"]),
        "optimizer": sd["optimizer_settings"].model_dump(mode="json"),
        **({} if spec is ADAMW else {"optimizer_name": spec.name}),  # absent: AdamW, as before Lion
        "model_dtype": str(dtype).removeprefix("torch."),
        "master_weights": "model" if dtype == torch.float32 else "state",
        "optimizer_files": list(optimizer_files),
        "layers": sd["layers"],
        "rng": rng_json,
        "extra_state": extra,
    }
    files[f"{STATE_DIR}/{TRAINER_STATE}"] = write_json(state / TRAINER_STATE, trainer_state)
    return manifest_of(files)


def _write_model(model, sd: Mapping[str, Any], root: Path, dtype: torch.dtype,
                 max_shard_bytes: int) -> dict[str, Written]:
    """The model shards in Hugging Face layout (with their index when there are several) and the
    model's configs, under ``root``; each file written by its name."""
    files: dict[str, Written] = {}
    entries = []
    for t in state_targets(sd).values():
        # Buffers keep their own dtype: they are not trained, and resuming must restore them exactly.
        want = dtype if t.param else t.tensor.dtype
        entries.append(Entry(t.name, t.shape, want, (lambda t=t, want=want: _finite(t, want))))
    shards = plan_shards(entries, max_shard_bytes)
    weight_map = {}
    for k, shard in enumerate(shards):
        name = shard_name("model", k, len(shards))
        files[name] = _write_safetensors(root / name, shard, {"format": "pt"})
        weight_map.update({e.name: name for e in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        files[INDEX_FILE] = write_json(root / INDEX_FILE, index)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        cfg = copy.deepcopy(cfg)
        cfg.architectures = [type(model).__name__]
        if hasattr(cfg, "dtype"):
            cfg.dtype = dtype
        files["config.json"] = write_bytes(root / "config.json", cfg.to_json_string(use_diff=True).encode())
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "to_json_string"):
        files["generation_config.json"] = write_bytes(root / "generation_config.json",
                                                      gen.to_json_string(use_diff=True).encode())
    return files


def _write_optimizer(sd: Mapping[str, Any], spec: OptimizerSpec, state: Path, dtype: torch.dtype,
                     max_shard_bytes: int) -> dict[str, Written]:
    """The optimizer state, in shards under ``state``: the moment rows of each tile (and the master
    row when the shards are lossy); each shard written by its name, in order."""
    rows = []
    for layer in sd["layers"]:
        kinds = [("optimizer", kind) for kind in spec.states]
        if dtype != torch.float32:
            kinds.insert(0, ("masters", "master"))
        for group, kind in kinds:
            key = f"{layer['name']}.{kind}"
            numel = layer["numel"] if group == "masters" else layer["trainable_numel"]  # frozen: no moments
            # A row on the NVMe tier is read from its file only when its shard is written.
            rows.append(Entry(key, (numel,), torch.float32, (lambda t=sd[group][key]: as_tensor(t))))
    shards = plan_shards(rows, max_shard_bytes)
    files: dict[str, Written] = {}
    for k, shard in enumerate(shards):
        name = shard_name("optimizer", k, len(shards))
        files[name] = _write_safetensors(state / name, shard, {"format": "pt"})
    return files


# ---------------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------------

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
    manifest = read_manifest(path, f"not a complete megatrain checkpoint ({STATE_DIR}/{MANIFEST} is missing); it is "
                                   "an interrupted save or plain weights: use load_hf_weights for weights only")
    if verify:
        verify_files(path, manifest)
    ts = read_json(state / TRAINER_STATE)
    # The trainer's state as views: files are checked against it, then copied into it in place.
    sd = trainer.state_dict(flush=False)
    _check_layers(ts["layers"], sd["layers"], state / TRAINER_STATE)
    optimizer = _optimizer_settings(ts, trainer.host.optimizer, state / TRAINER_STATE)

    # Check every tensor header before changing anything.
    rows_stored, row_targets = _scan_rows(ts, sd, state)
    weights_stored, weight_targets = _scan_weights(ts, sd, path)
    rng_stored = scan([state / RNG_FILE], None)

    # Now restore: the tensors into the state's views, then the state into the trainer (which
    # copies nothing more, sets the counters and settings, and drops a deferred update: its
    # gradients were of the weights before the load).
    with trainer.host.batched_nvme_writes():  # a layer's rows on NVMe: one read and one write of its file
        copy_in(weights_stored, weight_targets)
        copy_in(rows_stored, row_targets)
    trainer.load_state_dict({**sd, "adam_steps": {k: float(v) for k, v in ts["adam_steps"].items()},
                             "step_count": int(ts["step_count"]), "optimizer_settings": optimizer})
    _restore_rng(rng_stored, ts["rng"])
    return dict(ts.get("extra_state") or {})


def load_extra_tensors(path: str | os.PathLike, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The ``extra_tensors`` a :func:`save_checkpoint` checkpoint at ``path`` was given, as new CPU
    tensors (``{}`` where it was given none). Loads nothing into a trainer.

    Args:
        verify: check the file's size and sha256 against the manifest first.

    Raises:
        CheckpointError: no complete checkpoint at ``path``; the file missing, truncated or corrupt
            (naming it).
    """
    path = Path(path).absolute()
    recover_checkpoint(path)
    manifest = read_manifest(path, f"not a complete megatrain checkpoint ({STATE_DIR}/{MANIFEST} is missing)")
    name = f"{STATE_DIR}/{EXTRA_TENSORS_FILE}"
    if name not in manifest["files"]:
        return {}
    if verify:
        verify_files(path, {"files": {name: manifest["files"][name]}})
    with open_safetensors(path / name) as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


def _optimizer_settings(ts: dict, mine, where: Path):
    """The checkpoint's optimizer settings for the trainer's optimizer ``mine``, refused when the
    checkpoint holds another optimizer's state."""
    name = ts.get("optimizer_name", "adamw")
    if name != mine.name:
        raise CheckpointError(f"{where}: the checkpoint holds {name}'s optimizer state but the trainer "
                              f"runs {mine.name} (rows {mine.states}); compile with "
                              f"optimizer={{'name': {name!r}, ...}} to resume it")
    try:
        return mine.settings(**ts["optimizer"])
    except Exception as e:
        raise CheckpointError(f"{where}: optimizer settings are invalid ({e})") from None


def _scan_rows(ts: dict, sd: Mapping[str, Any], state: Path) -> tuple[dict[str, StoredTensor], dict[str, Target]]:
    """The optimizer rows the checkpoint stores (and the FP32 masters, when its model shards are
    lossy), checked against the trainer's: the same names and shapes, all F32."""
    stored = scan([state / f for f in ts["optimizer_files"]], None)
    rows = {**sd["optimizer"], **(sd["masters"] if ts["master_weights"] == "state" else {})}
    targets = {k: Target(k, tuple(t.shape), t, False) for k, t in rows.items()}
    check_against(stored, targets, state)
    for name, s in stored.items():
        if s.dtype != "F32":
            raise CheckpointError(f"{s.file.name}: tensor {name!r} has dtype {s.dtype}; optimizer state is F32")
    return stored, targets


def _scan_weights(ts: dict, sd: Mapping[str, Any], path: Path) -> tuple[dict[str, StoredTensor], dict[str, Target]]:
    """The model shards' tensors, checked against the trainer's, and the targets to copy them into."""
    targets = state_targets(sd)
    files, weight_map = weight_files(path)
    stored = scan(files, weight_map)
    check_against(stored, targets, path)
    if ts["master_weights"] == "state":
        # Masters come from the FP32 rows; the lossy model shards give only the buffers.
        targets = {k: t for k, t in targets.items() if not t.param}
    return stored, targets


# -- across data-parallel ranks -----------------------------------------------------------------
def save_on_ranks(trainer, path: str | os.PathLike, **kwargs) -> Path | None:
    """``Trainer.save``: :func:`save_checkpoint`, called by every rank under data parallel.

    Every rank holds the same state, so global rank 0 writes it and the others wait for it. A host
    state on NVMe is read by rank 0 from its node's files, after a barrier that has every rank's
    last NVME_WRITE done. A host state sharded across nodes (``Plan.host_state == "shard"``) is
    read whole by rank 0 from the node leaders' slices as it goes
    (``runtime.distributed.SliceReader``, a layer at a time), while the other leaders serve those
    reads. One process: :func:`save_checkpoint` itself.

    Args:
        trainer: a ``megatrain.Trainer``.
        path, kwargs: as :func:`save_checkpoint`.

    Returns:
        The checkpoint directory on global rank 0 (and in one process); None on the other ranks.

    Raises:
        CheckpointError: as :func:`save_checkpoint`, on rank 0; the other ranks' wait then fails
            too, naming rank 0's failure.
        CollectiveError: a rank that did not arrive at a barrier.
    """
    if trainer.plan.data_parallel == 1:
        return save_checkpoint(trainer, path, **kwargs)
    from megatrain.runtime.distributed import SliceReader, patient_barrier

    trainer.flush()
    dp = trainer.host.data_parallel
    if trainer.host.sliced:
        dp.barrier("the barrier before a sharded save")  # every rank's shards of the last update are in place
        reader = SliceReader(trainer.host, dp, trainer.plan)
        out = None
        if dp.topo.rank == 0:
            trainer.slice_reader = reader
            try:
                out = save_checkpoint(trainer, path, **kwargs)
            finally:
                trainer.slice_reader = None
                reader.close()
        elif dp.writer:
            reader.serve()
        dp.barrier("the barrier after rank 0's save")
        return out
    if trainer.host.nvme_shards is not None:
        # Every node holds the whole state, so the files of node 0's ranks hold every shard
        # (NvmeTier.read_moment): each rank's last NVME_WRITE must be done first.
        dp.barrier("the barrier before rank 0 reads the ranks' NVMe files for a save")
    try:
        out = save_checkpoint(trainer, path, **kwargs) if dp.topo.rank == 0 else None
    except BaseException as e:
        patient_barrier("the wait for rank 0's save", failed=e)
        raise
    # A save takes as long as the disk needs, longer than a collective should wait: the other
    # ranks wait while rank 0's heartbeat goes on.
    patient_barrier("the wait for rank 0's save")
    return out
