"""The run: :func:`train` takes a :class:`~megatrain.train.config.TrainConfig` through the stages
of the package docstring, then steps, evaluates, checkpoints and writes metrics until
``max_steps``, a signal or a non-finite step."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from megatrain.errors import CheckpointError, ConfigError, MegatrainError
from megatrain.train.config import TrainConfig, check_batch_split, resolve_device, rl_reference
from megatrain.train.corpus import (image_grid_thw, match_special_tokens, prepare_data, store_dir,
                                    tokenizer_sample_bytes, trains_tokenizer)
from megatrain.train.lr import lr_at
from megatrain.ir.hardware import load_hardware
from megatrain.runtime.measure import available_host_memory, host_rss_bytes, measure_matmul_flops
from megatrain.files import DirectoryLock, write_atomic
from megatrain.ir.plan import OptimizerPlacement
from megatrain.runtime.threads import choose_threads, oversubscription
from megatrain.train.guard import Guard, Verdict, decay_hint
from megatrain.train.metrics import MetricsLog, finite, fmt, read_metrics, run_rates, save_loss_plot
from megatrain.train.model import (ModelSource, init_source, is_run_checkpoint, load_weights, model_label,
                                   resolve_model)
from megatrain.train.preflight import (BUILT_BYTES_PER_PARAMETER, data_pipeline_bytes, largest_safetensors,
                                       preflight_cpu_build, preflight_disk, preflight_host_memory)
from megatrain.train.rundir import (CHECKPOINT_DIR, CONFIG_FILE, LOCK_FILE, METRICS_FILE, NVME_LOCK_FILE, PLOT_FILE,
                                    SCHEDULE_FILE, STATE_KEY, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, check_output_dir,
                                    check_resume, train_state)
from megatrain.units import MiB

if TYPE_CHECKING:
    from megatrain.trainer import PlannedModel


class _StopOnSignal:
    """While active, SIGINT and SIGTERM only record a request to stop after the current step; a
    second signal interrupts at once (KeyboardInterrupt). Only the main thread can install
    handlers; elsewhere signals keep their handlers."""

    def __init__(self) -> None:
        self.name: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum, _frame) -> None:
        if self.name is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}")
        self.name = signal.Signals(signum).name

    def __enter__(self) -> "_StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TrainResult:
    """How a run ended. ``step``: the last step taken (1-based; the resumed-from step if none was);
    ``skipped_steps``: steps not applied (non-finite), over the whole run; ``stopped_by``: the
    signal's name when SIGINT/SIGTERM ended it early, else None; ``loss`` / ``val_loss``: the last
    ones (None when not finite or never evaluated); ``checkpoint``: the last checkpoint written."""

    step: int
    skipped_steps: int
    stopped_by: str | None
    loss: float | None
    val_loss: float | None
    checkpoint: Path | None
    output_dir: Path


def _evaluate(trainer, dataset, cfg: TrainConfig) -> float:
    """The validation loss: the mean token loss over every supervised token of the ``eval_batches``
    validation micro-batches, evaluated as one batch (so an SFT micro-batch with few answer tokens
    weighs as little as it holds, as in a training step; the mean of per-batch means would not)."""
    return trainer.evaluate(concat_batches(list(dataset.eval_batches(cfg.micro_batch_size, cfg.eval_batches))))


def concat_batches(batches: list) -> Any:
    """``batches`` (tensors of rows, or mappings of name to tensor of rows) as one batch, rows in order."""
    import torch

    if isinstance(batches[0], Mapping):
        return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    return torch.cat(batches)


def planning_model(cfg: TrainConfig, source: ModelSource, check: Callable[[Any], None] | None = None):
    """The model ``megatrain train`` (and ``megatrain plan --config``) plans: on ``device="cuda"``
    built on the meta device (``materialize`` initialises it in the host tiles); on the CPU
    backend built on the CPU, because models branch on the device type while they are traced
    (Mixtral's expert histogram takes an int32 input except on the CPU, where histc has no
    integer kernel), so a model on the meta device would be traced for a GPU. ``check`` sees the
    meta model before a CPU build (``megatrain train``'s preflight of the build's 4 bytes a
    parameter)."""
    import torch

    from megatrain.planner.presets import auto_model_class, build_meta_model

    cfg = resolve_device(cfg, planning=True)[0]  # device auto: the device this run would take
    torch.manual_seed(cfg.seed)
    model = build_meta_model(source.config, dtype=torch.float32)
    if cfg.device == "cpu":
        if check is not None:
            check(model)
        model = auto_model_class(source.config).from_config(source.config, dtype=torch.float32,
                                                            trust_remote_code=False)
    return model


def batch_names(cfg: TrainConfig, config) -> tuple[str, ...]:
    """The inputs of a run's batches, in ``megatrain.compile(input_names=...)`` order. Packed LM
    windows and packed SFT rows carry position_ids that restart per document (per-document
    attention). Padded SFT rows carry a mask, so tokens/s counts the examples' tokens only. A
    vision-language model's SFT rows are padded, one example and up to ``images_per_row`` images
    each (``images_per_row`` slots; Qwen2-VL: exactly ``images_per_row``), and carry the image
    inputs (``pixel_values``, and Qwen2-VL's ``image_grid_thw``;
    :class:`megatrain.data.SftDataset` with images).

    Raises:
        ConfigError: a vision-language model with ``task: lm`` (its data is SFT data with images);
            ``images_per_row`` other than 1 for a model without images; ``image_size`` for a model
            other than Qwen2-VL and Qwen2.5-VL.
    """
    from megatrain.planner.trace.qwen_vl import GRID_INPUT, PatchGridFamily
    from megatrain.planner.trace.vlm import IMAGE_INPUT, family

    if (fam := family(config)) is None and cfg.images_per_row != 1:
        raise ConfigError(f"images_per_row={cfg.images_per_row}: model_type {config.model_type!r} takes no images; "
                          "images_per_row is the image count of each row of a vision-language model (LLaVA, "
                          "Qwen2-VL): leave it at 1 (--images-per-row 1)")
    grid = isinstance(fam, PatchGridFamily)
    if cfg.image_size is not None and not grid:
        raise ConfigError(f"image_size={cfg.image_size}: model_type {config.model_type!r} takes no image size; it is "
                          "the size every image of a Qwen2-VL or Qwen2.5-VL run is resized to (one patch grid), "
                          + ("and LLaVA's processor resizes every image to its own size" if fam is not None else
                             "and this model reads text only") + ": drop --image-size")
    if fam is not None:
        if cfg.task != "sft":
            raise ConfigError(f"model_type {config.model_type!r} is a vision-language model: it trains on SFT data "
                              "with images (task: sft, --data with an images column); task lm reads text only")
        return ("input_ids", "attention_mask", IMAGE_INPUT, *((GRID_INPUT,) if grid else ()), "labels")
    if cfg.task in ("dpo", "grpo"):  # right-padded rows: a causal model's padding after a row changes nothing in it
        return ("input_ids", "labels")
    packed = cfg.sft_packing if cfg.task == "sft" else cfg.document_attention
    return ("input_ids", "attention_mask", "labels") if cfg.task == "sft" and not packed else \
        ("input_ids", "position_ids", "labels") if packed else ("input_ids", "labels")


@dataclass(frozen=True, slots=True)
class HostBeside:
    """Host bytes one rank of a run holds beside its plan's state (``cost.memory_breakdown``)."""

    data: int
    """The data pipeline: :func:`megatrain.train.preflight.data_pipeline_bytes`."""
    checkpoint: int
    """The largest safetensors file of the model's directory, mapped while it is read."""
    built: int
    """A model built on the CPU (to be traced there), until ``materialize`` moves it into the tiles."""

    @property
    def total(self) -> int:
        return self.data + self.checkpoint + self.built


def host_beside_plan(cfg: TrainConfig, source: ModelSource, model=None) -> HostBeside:
    """What the host must hold beyond the plan's state, for the preflight
    (``preflight_host_memory``) and for the planner's NVMe placement under ``host_memory``
    (``Storage.host_reserved``), so that the two agree: a ``host_memory`` the plan fits only
    without these used to be accepted. ``model``: the planning model (:func:`planning_model`; its
    parameters count as built unless on the meta device), None before it exists.

    Raises:
        ConfigError: the data path does not exist or holds no corpus file.
    """
    data = data_pipeline_bytes(cfg, tokenizer_sample_bytes(cfg) if trains_tokenizer(cfg, source) else 0)
    return HostBeside(data, largest_safetensors(source.directory), _built_bytes(model))


def _built_bytes(model) -> int:
    params = [] if model is None else list(model.parameters())
    if not params or params[0].device.type == "meta":
        return 0
    return sum(p.numel() for p in params) * BUILT_BYTES_PER_PARAMETER


def plan_request(cfg: TrainConfig, model, hw, topology, image_grid_thw=None, source: ModelSource | None = None):
    """The :class:`megatrain.planner.front.PlanRequest` of a run's settings: what ``megatrain
    train`` plans and ``megatrain plan --config`` reports, for ``topology`` (a
    ``megatrain.planner.front.Topology``). On the CPU backend the plan is the default one and
    ``hw`` gives the prediction; on CUDA the solver's for ``hw``. ``image_grid_thw``: Qwen2-VL's
    grids of a row's images (:func:`megatrain.train.corpus.image_grid_thw`). With ``nvme_dir`` and
    ``host_memory``, the placement leaves room in ``host_memory`` for :func:`host_beside_plan`
    (of ``source``, the run's model resolved when None) on each rank of a node."""
    from megatrain.product.planning import plan_request as request

    cfg = resolve_device(cfg, planning=True)[0]  # device auto: the device this run would take
    names = batch_names(cfg, model.config)
    reserved = 0
    if cfg.nvme_dir is not None and cfg.host_memory is not None:
        ranks = 1 if topology is None else topology.ranks_per_node
        reserved = ranks * host_beside_plan(cfg, source or resolve_model(cfg.model), model).total
    return request(model, seq_len=cfg.seq_len, global_batch=cfg.global_batch, micro_batch_size=cfg.micro_batch_size,
                   plan="default" if cfg.device == "cpu" else None, hardware=hw, device=cfg.device,
                   input_names=names, images_per_row=1 if image_grid_thw else cfg.images_per_row,
                   image_grid_thw=image_grid_thw, max_grad_norm=cfg.max_grad_norm, optimizer_name=cfg.optimizer,
                   topology=topology, nvme_dir=cfg.nvme_dir, host_memory=cfg.host_memory,
                   reference=rl_reference(cfg), host_reserved=reserved, templates=cfg.templates, cuda_graphs=cfg.cuda_graphs)


def _plan(cfg: TrainConfig, source: ModelSource, hw, echo, world: int = 1) -> PlannedModel:
    """The model, traced and planned once (the planning front door,
    :func:`megatrain.planner.front.plan`, with :func:`plan_request`), and the host-memory
    preflight of that planned model: PlanError before anything large exists when the run cannot
    fit. On the CPU backend a bound from the meta model's parameter count is checked before the
    model is built (``preflight_cpu_build``; :func:`planning_model`). Several nodes with
    ``host_state: auto``: a full copy per node where every node passes the preflight with it
    (the ranks agree by an all-reduce), else sharded (the front door's decision; said).
    """
    from megatrain.errors import PlanError
    from megatrain.planner import front
    from megatrain.product import process_topology
    from megatrain.units import human_bytes

    machine = available = available_host_memory()  # before the build: what the run may use
    if cfg.nvme_dir is not None and cfg.host_memory is not None:
        # The budget the NVMe placement fitted the plan and host_beside_plan into (its own error
        # gives the least that fits); the preflight of the planned run checks it too.
        from megatrain.planner.nvme import parse_bytes

        budget = parse_bytes(cfg.host_memory)
        if available is None or budget < available[0]:
            available = (budget, f"host_memory {cfg.host_memory}")
    beside = host_beside_plan(cfg, source)
    clip = cfg.max_grad_norm is not None

    def check_build(meta) -> None:  # the machine's memory: the placement checks the budget
        preflight_cpu_build(meta, clip=clip, data_bytes=beside.data, checkpoint_bytes=beside.checkpoint,
                            available=machine, optimizer=cfg.optimizer, nvme=cfg.nvme_dir is not None)

    def preflight(planned: PlannedModel) -> int:
        b = HostBeside(beside.data, beside.checkpoint, _built_bytes(model))  # host_beside_plan(cfg, source, model)
        return preflight_host_memory(planned, data_bytes=b.data, checkpoint_bytes=b.checkpoint, built_bytes=b.built,
                                     available=available)

    def fits(planned: PlannedModel) -> bool:
        """A full copy of the host state fits every node (collective: the ranks agree)."""
        import torch
        import torch.distributed as dist

        from megatrain.runtime.distributed import collective

        try:
            preflight(planned)
            short = 0
        except PlanError:
            short = 1
        flag = torch.tensor([short])
        with collective("the all-reduce of whether every node holds a full copy of the host state"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) == 0

    model = planning_model(cfg, source, check_build)
    if cfg.device == "cuda" and hw is None:  # the solver plans for this GPU, measured (a few seconds)
        from megatrain.runtime.measure import measure_hardware

        hw = measure_hardware()
    topology = process_topology(host_state=cfg.host_state, fits=fits) if world > 1 else process_topology()
    planned = front.plan(plan_request(cfg, model, hw, topology, image_grid_thw(cfg, source), source))
    for line in planned.decisions:
        echo(line)
    needed = preflight(planned)
    graph = planned.graph
    echo(f"model: {type(model).__name__}, {graph.param_count / 1e6:,.2f} M parameters in {len(graph.layers)} "
         f"layers; host memory needed about {human_bytes(needed)}")
    return planned


def _materialize_and_load(cfg: TrainConfig, planned: PlannedModel, source: ModelSource, fingerprint: str,
                          echo):
    """Materialize the planned model (allocating and initialising the host tiles), then load
    weights or resume. Returns ``(trainer, start step, skipped steps so far, the checkpoint's
    train state or {})``."""
    import megatrain

    optimizer = cfg.optimizer_settings()
    trainer = megatrain.materialize(planned, optimizer, nvme_dir=cfg.nvme_dir, echo=echo)
    if trainer.host.nvme is not None:
        trainer.host.nvme.checksums = cfg.nvme_checksums
    if source.kind == "weights":
        load_weights(trainer, source, echo)
        echo(f"weights: loaded from {source.directory}" + (
            f" (init_from: a new run from step 0 with fresh {type(optimizer).__name__} state; not a resume)"
            if cfg.init_from else ""))
        return trainer, 0, 0, {}
    if source.kind == "config":
        return trainer, 0, 0, {}
    state = trainer.load(source.directory).get(STATE_KEY)
    if state is None:
        raise CheckpointError(f"{source.directory}: a megatrain checkpoint without `megatrain train` state "
                              "(no data position to resume from); copy its config.json and model*.safetensors "
                              "into a new directory to start from its weights")
    try:
        check_resume(state, cfg, source.directory, fingerprint)
    except ConfigError as e:
        raise ConfigError(f"{e}; or, to start a new run from this checkpoint's weights instead of resuming it, "
                          f"give --init-from {source.directory} with another output_dir") from None
    now = {"lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "max_steps": cfg.max_steps,
           "min_lr_ratio": cfg.min_lr_ratio}
    changed = [f"{k}={now[k]} (was {v})" for k, v in state["lr_schedule"].items() if now.get(k) != v]
    if changed:
        echo(f"warning: resuming with {', '.join(changed)}: the learning-rate schedule differs from the run's "
             f"from step {state['step'] + 1} on (a resume needs only --model and --output-dir; the run's other "
             "settings come from its train_config.json)")
    saved = trainer.optimizer.model_copy(update={"lr": optimizer.lr})
    if saved != optimizer:
        echo(f"note: the checkpoint's {type(optimizer).__name__} settings were {saved.model_dump()}; going on with "
             f"this config's {optimizer.model_dump()}")
    trainer.set_optimizer(optimizer)  # the schedule sets lr before every step
    echo(f"resume: step {state['step']} of {source.directory}")
    return trainer, int(state["step"]), int(state["skipped_steps"]), state


def nvme_dir_lock(cfg: TrainConfig) -> DirectoryLock | None:
    """The lock of ``cfg.nvme_dir`` (None without one), not yet acquired. Two runs on one nvme_dir
    would share its tile files by name (each run's moments overwriting the other's): one run at a
    time, as for output_dir."""
    return DirectoryLock(Path(cfg.nvme_dir) / NVME_LOCK_FILE, f"nvme_dir {cfg.nvme_dir}") \
        if cfg.nvme_dir is not None else None


def train(cfg: TrainConfig, *, echo: Callable[[str], None] = print) -> TrainResult:
    """Run ``cfg`` to ``max_steps``, or until SIGINT/SIGTERM or a non-finite step with
    ``nonfinite="stop"``.

    ``echo`` prints one line (the progress bar goes to stderr). SIGINT and SIGTERM finish the
    current step, save ``output_dir/checkpoint`` and return normally (``stopped_by`` says which);
    a second signal interrupts at once (KeyboardInterrupt).

    Raises:
        ConfigError: a bad setting, model, data or tokenizer; an output_dir holding another run; a
            checkpoint whose data or shapes differ from this run's.
        PlanError: the run does not fit in the host memory available (before anything large is
            allocated).
        TraceError / UnsupportedModelError: the model cannot be traced, or uses what megatrain does
            not support (named in the message).
        CheckpointError: a corrupt, incomplete or mismatched checkpoint or weights (naming the file
            and tensor).
        MegatrainError: with ``nonfinite="stop"``, a step whose loss or gradient was not finite
            (naming the step); nothing is saved.
    """
    given = cfg  # train_config.json keeps device: auto as auto, so a resume on another machine chooses again
    cfg, device = resolve_device(cfg)
    if cfg.task in ("dpo", "grpo"):
        raise ConfigError(f"task {cfg.task} is megatrain.train.rl_tasks' run: call megatrain.train.train, which "
                          "dispatches by task")
    ranks = _Ranks.start(cfg)
    # Rank 0 writes every output: it holds output_dir's lock for the run.
    lock = DirectoryLock(Path(cfg.output_dir) / LOCK_FILE, f"output_dir {cfg.output_dir}") if ranks.rank == 0 else None
    nvme_lock = nvme_dir_lock(cfg) if ranks.rank == 0 else None
    try:
        if nvme_lock is not None:
            nvme_lock.acquire()
        with InterruptOnTerm():
            return _train(cfg, echo if ranks.rank == 0 else (lambda _line: None), ranks, lock, device, given)
    finally:
        for held in (lock, nvme_lock):
            if held is not None:
                held.release()
        ranks.close()


class InterruptOnTerm:
    """Outside the training loop (which finishes its step and saves, ``_StopOnSignal``), SIGTERM
    interrupts as SIGINT does, with ``KeyboardInterrupt("SIGTERM")``: what is being prepared then
    cleans up after itself (a token store build removes its temporary directory and stops its
    workers) instead of the process ending at once, and the CLI exits 143 (128 + SIGTERM)."""

    def __enter__(self) -> "InterruptOnTerm":
        self._old = None
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._raise)
        return self

    @staticmethod
    def _raise(signum, _frame) -> None:
        raise KeyboardInterrupt("SIGTERM")

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


@dataclass(slots=True)
class _Ranks:
    """``megatrain train`` under torchrun (``WORLD_SIZE`` > 1): this process is rank ``rank`` of
    ``world``, ``local_rank`` on its node. The process group is made here (gloo on the CPU;
    ``cpu:gloo,cuda:nccl`` on GPUs) with ``collective_timeout``, unless the caller made one.
    Rank 0 writes every output; each rank trains on its rows of every global batch."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    owns_group: bool = False

    @classmethod
    def start(cls, cfg: TrainConfig) -> "_Ranks":
        import datetime

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return cls()
        check_batch_split(cfg.global_batch, cfg.micro_batch_size, world)
        import torch
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cfg.device == "cuda":
            torch.cuda.set_device(local_rank)
        owns = not dist.is_initialized()
        if owns:
            dist.init_process_group("cpu:gloo,cuda:nccl" if cfg.device == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=cfg.collective_timeout))
        from megatrain.runtime.distributed import Heartbeat

        Heartbeat.start(interval=min(10.0, cfg.collective_timeout / 10))
        return cls(dist.get_rank(), dist.get_world_size(), local_rank, owns)

    def rows(self, batch: dict) -> dict:
        """This rank's rows of a global batch: the ``rank``-th of ``world`` equal slices of
        ``input_ids``' rows, and of every input the same share: an input of ``m`` entries a row
        (LLaVA's ``images_per_row`` image slots; Qwen2-VL's patches and grids, each row's a
        contiguous block of ``pixel_values`` and ``image_grid_thw``) is cut at ``m`` times the row."""
        if self.world == 1:
            return batch
        total = batch["input_ids"].shape[0]
        n = total // self.world
        out = {}
        for k, t in batch.items():
            m = t.shape[0] // total  # every row holds as many: the run traces one layout a row
            out[k] = t[self.rank * n * m:(self.rank + 1) * n * m]
        return out

    def in_turn(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0 first, then on the other nodes' first ranks, then on the rest, so the
        data store and tokenizer are built once per file system and the others reuse them."""
        if self.world == 1:
            return fn()
        from megatrain.runtime.distributed import patient_barrier

        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        out = None
        for turn in (self.rank == 0, self.rank != 0 and self.rank % local == 0, self.rank % local != 0):
            # Preparing the data may take hours (tokenising a large corpus): the others wait for it
            # while the preparing ranks' heartbeats go on, not for a collective's timeout.
            try:
                if turn:
                    out = fn()
            except BaseException as e:
                patient_barrier("the wait while the ranks prepare the data", failed=e)
                raise
            patient_barrier("the wait while the ranks prepare the data")
        return out

    def any_stopped(self, name: str | None, groups) -> str | None:
        """The signal that stopped any rank after this step (every rank stops after the same step:
        one stopping alone would leave the others waiting in the next step's collectives)."""
        if self.world == 1:
            return name
        import torch
        import torch.distributed as dist

        from megatrain.runtime.distributed import collective

        flag = torch.tensor([0 if name is None else 1 + ["SIGINT", "SIGTERM"].index(name)])
        with collective("the all-reduce of the ranks' stop requests"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.world)
        return None if int(flag) == 0 else ["SIGINT", "SIGTERM"][int(flag) - 1]

    def any_of(self, layers: tuple[int, ...], n: int, groups) -> tuple[int, ...]:
        """The layers of ``n`` that any rank lists in ``layers`` (with sharded updates each rank
        checks its shard of every layer), the same on every rank."""
        if self.world == 1:
            return tuple(layers)
        import torch
        import torch.distributed as dist

        from megatrain.runtime.distributed import collective

        flags = torch.zeros(n, dtype=torch.int32)
        flags[list(layers)] = 1
        with collective("the all-reduce of the layers whose update left non-finite weights"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=groups.world)
        return tuple(int(i) for i in flags.nonzero().flatten())

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _finished(cfg: TrainConfig, out: Path, state: dict, echo) -> TrainResult:
    """The run in ``out`` is at ``max_steps`` already: nothing to do (a scheduler that re-runs a
    finished job gets exit 0), and its last losses as the result."""
    rows = read_metrics(out / METRICS_FILE)
    applied = [r for r in rows if r.get("applied")]
    val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
    echo(f"note: {out} holds this run, finished at step {state['step']} (max_steps {cfg.max_steps}): nothing to do; "
         "raise max_steps to train on")
    return TrainResult(step=int(state["step"]), skipped_steps=int(state.get("skipped_steps", 0)), stopped_by=None,
                       loss=applied[-1]["loss"] if applied else None, val_loss=val[-1] if val else None,
                       checkpoint=out / CHECKPOINT_DIR, output_dir=out)


def _check_processor(model, dataset, images, grid=None) -> None:
    """Refuse, before training, a processor that does not fit the model. LLaVA: its image token is
    not the model's, or it writes another number of image tokens per image than the model's
    projector writes features (a processor of another model or resolution): a row's image count is
    read from its image tokens (``vlm.place_images``), so its tokens would not match its images.
    Qwen2-VL: another patch grid, patch or image-token count than ``grid``, the traced one, in the
    first training row (what the first step would refuse: ``prepare_images``)."""
    from megatrain.errors import BatchError
    from megatrain.planner.trace.qwen_vl import PatchGridFamily
    from megatrain.planner.trace.vlm import family, prepare_images

    fam = family(model.config)
    if isinstance(fam, PatchGridFamily):
        try:
            prepare_images(model, dataset.rows([0]), dataset.input_names, grid, 1)
        except BatchError as e:
            raise ConfigError(f"the processor ({type(images.processor).__name__}) does not fit the model: the "
                              f"first training row: {e}. Use the model's own processor (its patch_size, "
                              "merge_size and image size)") from None
        return
    token, per_image = fam.image_tokens(model)
    path = next((p for paths in dataset.store.images or () for p in paths), None)
    n = None if path is None else images.image_tokens(path)
    if images.image_token_id != token or n not in (None, per_image):
        wrote = f"its image token is id {images.image_token_id}" if n is None else \
            f"it writes {n} image tokens (id {images.image_token_id}) for the image {path!r}"
        raise ConfigError(f"the processor ({type(images.processor).__name__}) does not fit the model: {wrote}, and "
                          f"the model reads {per_image} an image (id {token}, one per feature its projector writes). "
                          "Use the model's own processor (its image token, patch_size, image size and "
                          "vision_feature_select_strategy)")


def _train(cfg: TrainConfig, echo: Callable[[str], None], ranks: _Ranks, lock: DirectoryLock | None,
           device: str, given: TrainConfig) -> TrainResult:
    import torch

    echo(device)
    if cfg.device == "cpu":  # the CPU backend's intra-op threads (megatrain.runtime.threads)
        threads = choose_threads(cfg.threads)
        busy = oversubscription()
        echo(threads.describe() + (f"; {busy}: steps slow down by the CPU share other work takes" if busy else ""))
    elif cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    hw = load_hardware(cfg.hardware) if cfg.hardware else None
    source = resolve_model(cfg.model)
    from megatrain.models import check_positions

    check_positions(source.config, cfg.seq_len, cfg.model)
    if cfg.init_from is not None and not is_run_checkpoint(source, out):
        source = init_source(cfg.init_from, source)
    resuming_here, source, finished = check_output_dir(out, source, cfg, echo, lock)
    if finished is not None:
        return _finished(cfg, out, finished, echo)
    planned = _plan(cfg, source, hw, echo, ranks.world)
    if ranks.rank == 0:
        preflight_disk(out, planned.graph)
    tokenizer, dataset, eot = ranks.in_turn(lambda: prepare_data(cfg, source, echo, store_dir(cfg)))
    images = getattr(dataset, "images", None)  # a vision-language run's ChatProcessor
    if images is not None:
        _check_processor(planned.model, dataset, images, planned.graph.meta.get("image_grid_thw"))
    fingerprint = dataset.fingerprint()
    cpu_peak = measure_matmul_flops("cpu") if cfg.device == "cpu" else None
    trainer, start, skipped, state = _materialize_and_load(cfg, planned, source, fingerprint, echo)
    rates = run_rates(cfg, planned, hw, cpu_peak, echo)
    tokenizer_config = match_special_tokens(trainer.model, tokenizer, eot, cfg.seq_len,
                                            getattr(dataset, "chat_template", None))

    writes = ranks.rank == 0  # one writer of every output; trainer.save coordinates the ranks itself
    tokenizer_json = tokenizer.to_str()
    metrics_path = out / METRICS_FILE
    if writes:
        out.mkdir(parents=True, exist_ok=True)
        if lock is not None and not lock.held:  # output_dir did not exist when the run began
            lock.acquire()
        write_atomic(out / CONFIG_FILE, given.model_dump_json(indent=1) + "\n")
        write_atomic(out / SCHEDULE_FILE, planned.schedules.steady.to_json())
        write_atomic(out / TOKENIZER_FILE, tokenizer_json)
    metrics = MetricsLog(metrics_path if writes else None)
    # Rows a crashed run wrote after its last checkpoint are run again: drop them.
    metrics.keep(lambda r: resuming_here and r["step"] <= start)
    ckpt_path = out / CHECKPOINT_DIR
    last_saved: int | None = start if resuming_here else None
    tokenizer_sha = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    guard = Guard(deferred=trainer.plan.optimizer is OptimizerPlacement.NEXT_FORWARD, loss_spike=cfg.loss_spike,
                  decay=decay_hint(cfg.lr, cfg.weight_decay))
    guard.restore(state, start)

    def save(step: int) -> None:
        nonlocal last_saved
        try:
            trainer.save(ckpt_path, extra_state=train_state(cfg, step, skipped, fingerprint, tokenizer_sha,
                                                            guard.state()))
        except CheckpointError as e:
            after = (f"the same command resumes from step {last_saved}" if last_saved is not None
                     else "the same command starts the run again")
            raise CheckpointError(f"step {step}: {e}; then {after}") from e.__cause__
        # Outside the atomic save, so it may be missing after a crash; the resume then trains the same
        # BPE again (deterministic) and the data fingerprint check catches any difference.
        if writes and images is not None:  # its tokenizer, image processor and template: AutoProcessor loads them
            images.processor.save_pretrained(ckpt_path)
        elif writes:
            write_atomic(ckpt_path / TOKENIZER_FILE, tokenizer_json)
            write_atomic(ckpt_path / TOKENIZER_CONFIG_FILE, json.dumps(tokenizer_config, indent=1) + "\n")
        last_saved = step

    from tqdm import tqdm

    step, loss, val_loss = start, None, None
    batches = dataset.batches(cfg.global_batch, seed=cfg.seed, start=start)
    layers = trainer.graph.layers
    groups = trainer.host.data_parallel.groups if ranks.world > 1 else None
    replay_until = start  # steps up to here ran before a rollback: no rows, evaluations or messages again
    held: dict[int, dict] = {}  # the row of a step a rollback left out, written when the replay reaches it
    try:
        with _StopOnSignal() as stop, tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step",
                                           file=sys.stderr, disable=not writes, dynamic_ncols=True,
                                           mininterval=0.5 if sys.stderr.isatty() else 10.0) as bar:
            # tqdm.write prints even where the bar is disabled: only rank 0 speaks.
            say = bar.write if writes else (lambda _line: None)
            trainer.executor.echo = say  # what it compiles or captures later (an eval template, CUDA graphs)

            def count_skip(why: str) -> None:
                nonlocal skipped
                skipped += 1
                guard.in_a_row += 1
                if guard.in_a_row >= cfg.max_consecutive_skips:
                    raise MegatrainError(
                        f"{guard.in_a_row} steps in a row were not kept (the last: {why}): the run diverged; stopping "
                        f"without saving (max_consecutive_skips={cfg.max_consecutive_skips}). {kept()}; lower --lr"
                        + (" or set --max-grad-norm" if cfg.max_grad_norm is None else ""))

            def kept() -> str:
                return (f"The last checkpoint, {ckpt_path}, holds step {last_saved}: the same command resumes from it"
                        if last_saved is not None else "No checkpoint was saved: the same command starts the run again")

            def not_kept(verdict: Verdict, row: dict) -> None:
                """Skip or roll back ``verdict.blame`` (``row``: the step just run); stop under
                ``nonfinite: stop`` or past ``max_consecutive_skips``."""
                nonlocal step, skipped, batches, replay_until
                fresh = row["step"] > replay_until  # not a step that a replay runs again
                if cfg.nonfinite == "stop":
                    metrics.append({**row, "applied": False})
                    raise MegatrainError(f"{verdict.why}; stopping without saving (nonfinite: stop). {kept()}; add a "
                                         "lower --lr or --max-grad-norm, or --nonfinite skip")
                if verdict.action == "skip":
                    trainer.drop_pending_updates()  # a spiking step's deferred update is never applied
                    guard.not_kept[verdict.blame] = verdict.why
                    if fresh:
                        metrics.append({**row, "applied": False})
                        say(f"warning: {verdict.why}; skipped: nothing of it was applied (nonfinite: skip)")
                    count_skip(verdict.why)
                    return
                # Roll back: the checkpoint, then the steps since it again, without those not kept.
                if writes:
                    held[verdict.blame] = {**(row if verdict.blame == row["step"] else metrics.row(verdict.blame)),
                                           "applied": False}
                loaded = trainer.load(ckpt_path)[STATE_KEY]
                step, skipped, replay_until = int(loaded["step"]), int(loaded["skipped_steps"]), verdict.blame - 1
                guard.restore(loaded, step)
                guard.not_kept[verdict.blame] = verdict.why
                batches = dataset.batches(cfg.global_batch, seed=cfg.seed, start=step)
                metrics.keep(lambda r: r["step"] < verdict.blame)
                bar.n = step
                say(f"warning: {verdict.why}; rolled back to the checkpoint of step {step} to run the steps since "
                    "without it (nonfinite: skip)")

            def flushed(row: dict) -> bool:
                """Apply a deferred update before an evaluation or a save reads it; False when it left
                non-finite weights (the run rolled back)."""
                bad = ranks.any_of(trainer.flush(), len(layers), groups)
                if bad:
                    not_kept(guard.diverged(step, bad, layers), row)
                return not bad

            if last_saved is None and cfg.nonfinite == "skip":
                save(step)  # the state a rollback goes back to
                say(f"step {step}: saved {ckpt_path} (nonfinite: skip rolls back to the last checkpoint)")
            stopped = ranks.any_stopped(stop.name, groups)
            row: dict = {}
            while step < cfg.max_steps and stopped is None:
                lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                           min_lr_ratio=cfg.min_lr_ratio)
                batch = next(batches)
                step += 1
                if step in guard.not_kept:  # after a rollback: a step not kept stays out of the replay
                    if step > replay_until:
                        metrics.append(held.pop(step, {"step": step, "applied": False}))
                    count_skip(guard.not_kept[step])
                    bar.update(1)
                    stopped = ranks.any_stopped(stop.name, groups)
                    continue
                trainer.set_lr(lr)
                res = trainer.step(ranks.rows(batch))
                loss = res.loss
                mfu = rates.mfu(res.tokens_per_second / ranks.world)  # per GPU: tokens/s counts every rank's
                row = {"step": step, "loss": finite(res.loss), "lr": lr, "grad_norm": finite(res.grad_norm),
                       "tokens": res.tokens, "supervised_tokens": res.supervised_tokens,
                       "tokens_per_s": res.tokens_per_second, "mfu": mfu, "predicted_step_s": rates.predicted_step_s,
                       "measured_step_s": res.seconds, "applied": bool(res.applied), "val_loss": None,
                       "host_rss_mib": None, "examples_trimmed": getattr(dataset, "num_trimmed", None),
                       "examples_dropped": getattr(dataset, "num_dropped", None)}
                verdict = guard.judge(step, res, ranks.any_of(res.nonfinite_weights, len(layers), groups), layers)
                if verdict.action != "keep":
                    not_kept(verdict, row)
                    if verdict.action == "skip":
                        bar.update(1)
                    stopped = ranks.any_stopped(stop.name, groups)
                    continue
                guard.keep(res.loss)
                replaying = step <= replay_until
                if not replaying and (cfg.eval_interval and step % cfg.eval_interval == 0 or step == cfg.max_steps):
                    if not flushed(row):
                        continue
                    val_loss = _evaluate(trainer, dataset, cfg)
                    row["val_loss"] = finite(val_loss)
                    say(f"step {step}: validation loss {val_loss:.4f}")
                rss = host_rss_bytes()
                row["host_rss_mib"] = rss / MiB if rss is not None else None
                if not replaying:
                    metrics.append(row)
                if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
                    if not flushed(row):
                        continue
                    save(step)
                    say(f"step {step}: saved {ckpt_path}")
                busy = oversubscription() if cfg.device == "cpu" else None
                bar.set_postfix_str(f"loss {res.loss:.4f}, {res.tokens_per_second:,.0f} tok/s, MFU {mfu:.2%}"
                                    + (f", {busy}" if busy else ""), refresh=False)
                bar.update(1)
                stopped = ranks.any_stopped(stop.name, groups)
            if stopped is not None:
                if last_saved != step and flushed(row):
                    save(step)
                bar.write(f"{stopped}: stopped after step {step}; saved {ckpt_path}. The same command resumes "
                          "from it")
    finally:
        metrics.close()

    sample = None
    # Generated on the CPU from the module whose parameters are the host tiles (not after a signal,
    # which asks to stop; not where a parameter lives elsewhere, such as masters on NVMe).
    # Not for rows with images: the prompt's image tokens need the image's features.
    if writes and cfg.sample_tokens and stopped is None and cfg.device == "cpu" and images is None and all(
            p.device.type == "cpu" for p in trainer.model.parameters()):
        from megatrain.train.sample import generate_sample, sample_prompt

        trainer.flush()  # the model's parameters are the host tiles: the last deferred update applied
        prompt = sample_prompt(dataset, cfg.task, cfg.micro_batch_size, tokenizer)
        completion = generate_sample(trainer.model, tokenizer, prompt, cfg.sample_tokens)
        sample = None if completion is None else (prompt, completion)
    dataset.close()
    # The ranks' results are the same (losses are gathered): rank 0's rows tell the run's.
    rows = read_metrics(metrics_path) if writes else [{"loss": finite(loss), "applied": loss is not None}]
    if writes:
        try:
            save_loss_plot(rows, out / PLOT_FILE, title=f"{model_label(cfg)}: {step} steps, "
                                                        f"seq_len {cfg.seq_len} x global batch {cfg.global_batch}")
        except ImportError as e:
            echo(f"note: no {PLOT_FILE}: {e}")
    echo(f"done: step {step}, train loss {fmt(loss)}, validation loss {fmt(val_loss)}, {skipped} skipped "
         f"steps; {out}")
    if writes:
        if last_saved is not None:
            echo(f"model directory: {ckpt_path} (Hugging Face layout with its tokenizer: "
                 + ("AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it)" if images is None
                    else "AutoModelForImageTextToText.from_pretrained and AutoProcessor.from_pretrained load it"
                    + ("; Qwen2-VL's AutoProcessor needs torchvision, megatrain.data.sft_qwen_vl.load_processor "
                       "does without)" if images.image_size is not None else ")")))
        plot = out / PLOT_FILE
        echo(f"metrics: {metrics_path}" + (f"; loss curve: {plot}" if plot.is_file() else ""))
        if sample is not None:
            from megatrain.train.sample import sample_line

            echo(sample_line(*sample))
    applied = [r for r in rows if r["applied"]]
    return TrainResult(step=step, skipped_steps=skipped, stopped_by=stopped,
                       loss=applied[-1]["loss"] if applied else None, val_loss=finite(val_loss),
                       checkpoint=ckpt_path if last_saved is not None else None, output_dir=out)
