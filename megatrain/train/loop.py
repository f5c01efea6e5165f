"""The run: :func:`train` holds the ranks and locks of a
:class:`~megatrain.train.config.TrainConfig`'s run and takes it through :class:`Run`'s stages (those
of the package docstring), which step, evaluate, checkpoint and write metrics until ``max_steps``, a
signal or a non-finite step. What the DPO/GRPO run shares with it is :mod:`megatrain.train.stages`'
and this module's :func:`_plan` and :func:`_materialize_and_load`."""

from __future__ import annotations

import hashlib
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
from megatrain.files import DirectoryLock
from megatrain.ir.plan import OptimizerPlacement
from megatrain.runtime.threads import oversubscription
from megatrain.train.guard import Guard, Verdict, decay_hint
from megatrain.train.metrics import MetricsLog, finite, fmt, read_metrics, run_rates, save_loss_plot, step_row
from megatrain.train.model import ModelSource, load_weights, model_label, resolve_model
from megatrain.train.preflight import (BUILT_BYTES_PER_PARAMETER, data_pipeline_bytes, largest_safetensors,
                                       preflight_cpu_build, preflight_disk, preflight_host_memory)
from megatrain.train.rundir import (CHECKPOINT_DIR, LOCK_FILE, METRICS_FILE, PLOT_FILE, STATE_KEY, check_output_dir,
                                    check_resume, train_state)
from megatrain.train.stages import (Checkpoint, held_locks, model_source, nvme_dir_lock,
                                    plot_or_note, set_threads, write_run_files)
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
    from megatrain.planner.trace.vlm import family

    if (fam := family(config)) is None and cfg.images_per_row != 1:
        raise ConfigError(f"images_per_row={cfg.images_per_row}: model_type {config.model_type!r} takes no images; "
                          "images_per_row is the image count of each row of a vision-language model (LLaVA, "
                          "Qwen2-VL): leave it at 1 (--images-per-row 1)")
    grid = fam is not None and fam.takes_grid
    if cfg.image_size is not None and not grid:
        raise ConfigError(f"image_size={cfg.image_size}: model_type {config.model_type!r} takes no image size; it is "
                          "the size every image of a Qwen2-VL or Qwen2.5-VL run is resized to (one patch grid), "
                          + ("and LLaVA's processor resizes every image to its own size" if fam is not None else
                             "and this model reads text only") + ": drop --image-size")
    if cfg.image_max_pixels is not None and not grid:
        raise ConfigError(f"image_max_pixels={cfg.image_max_pixels}: model_type {config.model_type!r} takes no image "
                          "sizes; it keeps each image of a Qwen2-VL or Qwen2.5-VL run at its own size, up to that many "
                          "pixels, " + ("and LLaVA's processor resizes every image to its own size" if fam is not None
                                        else "and this model reads text only") + ": drop --image-max-pixels")
    if fam is not None:
        if cfg.task != "sft":
            raise ConfigError(f"model_type {config.model_type!r} is a vision-language model: it trains on SFT data "
                              "with images (task: sft, --data with an images column); task lm reads text only")
        return ("input_ids", "attention_mask", *fam.batch_inputs, "labels")
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
    ``hw`` gives the prediction; on CUDA the solver's for ``hw``, at the solver's micro-batch size
    and count with ``micro_batch_size: auto``. ``image_grid_thw``: Qwen2-VL's
    grids of a row's images (:func:`megatrain.train.corpus.image_grid_thw`). With ``nvme_dir`` and
    ``host_memory``, the placement leaves room in ``host_memory`` for :func:`host_beside_plan`
    (of ``source``, the run's model resolved when None) on each rank of a node."""
    from megatrain.product.planning import plan_request as request

    cfg = resolve_device(cfg, planning=True)[0]  # device auto: the device this run would take
    auto = cfg.micro_batch_size == "auto"
    if auto and cfg.device == "cpu":
        raise ConfigError("micro_batch_size: auto asks the solver to choose the micro-batch size and count, but on the "
                          "CPU backend (device: cpu) the run trains the default plan, which chooses no split; give "
                          "micro_batch_size a number (rows per micro-batch), or train on device cuda")
    names = batch_names(cfg, model.config)
    reserved = 0
    if cfg.nvme_dir is not None and cfg.host_memory is not None:
        ranks = 1 if topology is None else topology.ranks_per_node
        reserved = ranks * host_beside_plan(cfg, source or resolve_model(cfg.model), model).total
    return request(model, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                   micro_batch_size=None if auto else cfg.micro_batch_size,
                   plan="default" if cfg.device == "cpu" else None, hardware=hw, device=cfg.device,
                   input_names=names, images_per_row=1 if image_grid_thw else cfg.images_per_row,
                   image_grid_thw=image_grid_thw, max_grad_norm=cfg.max_grad_norm, optimizer_name=cfg.optimizer,
                   topology=topology, nvme_dir=cfg.nvme_dir, host_memory=cfg.host_memory,
                   reference=rl_reference(cfg), host_reserved=reserved, templates=cfg.templates,
                   cuda_graphs=cfg.cuda_graphs)


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


def planned_config(cfg: TrainConfig, planned: PlannedModel) -> TrainConfig:
    """``cfg`` with ``micro_batch_size: auto`` made the micro-batch size the solver chose (what the
    validation batches, the data checks and the sample prompt are cut by); else ``cfg``."""
    if cfg.micro_batch_size != "auto":
        return cfg
    return cfg.model_copy(update={"micro_batch_size": planned.options.micro_batch_size})


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
        with held_locks(lock, nvme_lock), InterruptOnTerm():
            return _train(cfg, echo if ranks.rank == 0 else (lambda _line: None), ranks, lock, device, given)
    finally:
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

    def rows(self, batch: dict, config: Any = None) -> dict:
        """This rank's rows of a global batch: the ``rank``-th of ``world`` equal slices of
        ``input_ids``' rows, and of every input the same share: an input of ``m`` entries a row
        (LLaVA's ``images_per_row`` image slots; Qwen2-VL's patches and grids of one size, each
        row's a contiguous block of ``pixel_values`` and ``image_grid_thw``) is cut at ``m`` times
        the row. With ``config`` (the model's), a Qwen2-VL batch is cut by its rows' own images
        and patches instead (rows of any grids: :func:`megatrain.planner.trace.qwen_vl.batch_rows`)."""
        if self.world == 1:
            return batch
        total = batch["input_ids"].shape[0]
        n = total // self.world
        if config is not None and "image_grid_thw" in batch:
            from megatrain.planner.trace.qwen_vl import batch_rows

            return batch_rows(config, batch, self.rank * n, (self.rank + 1) * n)
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
    """Refuse, before training, a processor that does not fit the model: its family's
    :meth:`~megatrain.planner.trace.vlm_family.VisionFamily.check_processor`. LLaVA: its image
    token is not the model's, or it writes another number of image tokens per image than the
    model's projector writes features (a processor of another model or resolution): a row's image
    count is read from its image tokens (``vlm.place_images``), so its tokens would not match its
    images. Qwen2-VL: another patch grid, patch or image-token count than ``grid``, the traced
    one, in the first training row (what the first step would refuse: ``prepare_images``)."""
    from megatrain.planner.trace.vlm import family

    family(model.config).check_processor(model, dataset, images, grid)


def _train(cfg: TrainConfig, echo: Callable[[str], None], ranks: _Ranks, lock: DirectoryLock | None,
           device: str, given: TrainConfig) -> TrainResult:
    """The stages of :class:`Run`, in order; a finished run in ``output_dir`` is not run again."""
    run = Run(cfg, echo, ranks, lock, given)
    finished = run.start(device)
    if finished is not None:
        return finished
    run.plan()
    run.prepare_data()
    run.open_outputs(run.materialize())
    run.train_loop()
    return run.finish()


class Run:
    """One ``megatrain train`` run of task lm or sft (:func:`train` holds its ranks and locks),
    as stages each reading the run's config, in the order ``_train`` calls them:
    :meth:`start` (device, threads, the model, ``output_dir``), :meth:`plan`, :meth:`prepare_data`,
    :meth:`materialize`, :meth:`open_outputs`, :meth:`train_loop` (one :meth:`train_step` at a
    time, with :meth:`evaluate` and :meth:`save`, the checkpoint) and :meth:`finish`. The
    components are :mod:`megatrain.train.stages`' (shared with the DPO/GRPO run), the
    :class:`~megatrain.train.guard.Guard` and the :class:`~megatrain.train.metrics.MetricsLog`.

    ``lock``: output_dir's lock (rank 0's; None on the others); ``given``: the config as given
    (``device: auto`` kept), what ``train_config.json`` holds."""

    def __init__(self, cfg: TrainConfig, echo: Callable[[str], None], ranks: _Ranks, lock: DirectoryLock | None,
                 given: TrainConfig):
        self.cfg, self.echo, self.ranks, self.lock, self.given = cfg, echo, ranks, lock, given
        self.out = Path(cfg.output_dir)
        self.writes = ranks.rank == 0  # one writer of every output; trainer.save coordinates the ranks itself
        self.metrics_path = self.out / METRICS_FILE
        self.ckpt_path = self.out / CHECKPOINT_DIR

    # -- preparing ------------------------------------------------------------------------------

    def start(self, device: str) -> TrainResult | None:
        """The device line, the threads, the hardware spec and the model to start from, and
        ``output_dir``: this run again (resume or start over) or refused. Returns the result of a
        run already at ``max_steps`` there (nothing to do), else None."""
        cfg = self.cfg
        self.echo(device)
        set_threads(cfg, self.echo)
        self.hw = load_hardware(cfg.hardware) if cfg.hardware else None
        source = model_source(cfg, self.out)
        self.resuming_here, self.source, finished = check_output_dir(self.out, source, cfg, self.echo, self.lock)
        return None if finished is None else _finished(cfg, self.out, finished, self.echo)

    def plan(self) -> None:
        """Trace and plan once, with the host-memory preflight (:func:`_plan`), and the disk's.
        With ``micro_batch_size: auto`` the stages after it read the planned size
        (:func:`planned_config`); ``train_config.json`` keeps ``auto``."""
        self.planned = _plan(self.cfg, self.source, self.hw, self.echo, self.ranks.world)
        self.cfg = planned_config(self.cfg, self.planned)
        if self.ranks.rank == 0:
            preflight_disk(self.out, self.planned.graph)

    def prepare_data(self) -> None:
        """The tokenizer and the token or SFT store (rank by rank: :meth:`_Ranks.in_turn`), and a
        vision-language run's processor checked against the planned model."""
        cfg, source, echo = self.cfg, self.source, self.echo
        self.tokenizer, self.dataset, self.eot = self.ranks.in_turn(lambda: prepare_data(cfg, source, echo,
                                                                                         store_dir(cfg)))
        self.images = getattr(self.dataset, "images", None)  # a vision-language run's ChatProcessor
        if self.images is not None:
            _check_processor(self.planned.model, self.dataset, self.images,
                             self.planned.graph.meta.get("image_grid_thw"))
        self.fingerprint = self.dataset.fingerprint()

    def materialize(self) -> dict:
        """The host tiles, weights or the resumed state (:func:`_materialize_and_load`), the rates
        MFU divides by, and the tokenizer's special tokens matched to the model. Returns the
        checkpoint's train state ({} for a new run)."""
        cfg = self.cfg
        cpu_peak = measure_matmul_flops("cpu") if cfg.device == "cpu" else None
        self.trainer, self.start_step, self.skipped, state = _materialize_and_load(cfg, self.planned, self.source,
                                                                                   self.fingerprint, self.echo)
        self.rates = run_rates(cfg, self.planned, self.hw, cpu_peak, self.echo)
        self.tokenizer_config = match_special_tokens(self.trainer.model, self.tokenizer, self.eot, cfg.seq_len,
                                                     getattr(self.dataset, "chat_template", None))
        return state

    def open_outputs(self, state: dict) -> None:
        """``output_dir``'s files (rank 0: its lock, the config, schedule and tokenizer), the
        metrics log without the rows a crashed run wrote after its last checkpoint, the checkpoint
        and the guard, from ``state`` (the resumed train state)."""
        cfg, start = self.cfg, self.start_step
        tokenizer_json = self.tokenizer.to_str()
        if self.writes:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.lock is not None and not self.lock.held:  # output_dir did not exist when the run began
                self.lock.acquire()
            write_run_files(self.out, self.given, tokenizer_json, self.planned.schedules.steady.to_json())
        self.metrics = MetricsLog(self.metrics_path if self.writes else None)
        # Rows a crashed run wrote after its last checkpoint are run again: drop them.
        resuming_here = self.resuming_here
        self.metrics.keep(lambda r: resuming_here and r["step"] <= start)
        self.checkpoint = Checkpoint(self.trainer, self.ckpt_path, tokenizer_json, self.tokenizer_config,
                                     processor=None if self.images is None else self.images.processor,
                                     writes=self.writes, last_saved=start if resuming_here else None)
        self.tokenizer_sha = hashlib.sha256(tokenizer_json.encode()).hexdigest()
        self.guard = Guard(deferred=self.trainer.plan.optimizer is OptimizerPlacement.NEXT_FORWARD,
                           loss_spike=cfg.loss_spike, decay=decay_hint(cfg.lr, cfg.weight_decay))
        self.guard.restore(state, start)

    # -- the checkpoint and the evaluation ------------------------------------------------------

    @property
    def last_saved(self) -> int | None:
        return self.checkpoint.last_saved

    def save(self, step: int) -> None:
        """The checkpoint of ``step``, with the data position and the guard's state to resume from.

        Raises:
            CheckpointError: the save failed; the message says what the same command does then.
        """
        try:
            self.checkpoint.save(step, train_state(self.cfg, step, self.skipped, self.fingerprint, self.tokenizer_sha,
                                                   self.guard.state()))
        except CheckpointError as e:
            after = (f"the same command resumes from step {self.last_saved}" if self.last_saved is not None
                     else "the same command starts the run again")
            raise CheckpointError(f"step {step}: {e}; then {after}") from e.__cause__

    def evaluate(self) -> float:
        """The validation loss (:func:`_evaluate`)."""
        return _evaluate(self.trainer, self.dataset, self.cfg)

    # -- the loop -------------------------------------------------------------------------------

    def train_loop(self) -> None:
        """Step to ``max_steps``, or until a stop request (SIGINT/SIGTERM on any rank: the step
        finishes, a checkpoint is saved); the progress bar on rank 0. Sets ``step``, ``loss``,
        ``val_loss`` and ``stopped`` (the signal's name, or None)."""
        from tqdm import tqdm

        cfg, start = self.cfg, self.start_step
        self.step, self.loss, self.val_loss, self.row = start, None, None, {}
        self.batches = self.dataset.batches(cfg.global_batch, seed=cfg.seed, start=start)
        self.layers = self.trainer.graph.layers
        self.groups = self.trainer.host.data_parallel.groups if self.ranks.world > 1 else None
        self.replay_until = start  # steps up to here ran before a rollback: no rows, evaluations or messages again
        self.held: dict[int, dict] = {}  # the row of a step a rollback left out, written when the replay reaches it
        try:
            with _StopOnSignal() as stop, tqdm(total=cfg.max_steps, initial=start, desc="train", unit="step",
                                               file=sys.stderr, disable=not self.writes, dynamic_ncols=True,
                                               mininterval=0.5 if sys.stderr.isatty() else 10.0) as self.bar:
                # tqdm.write prints even where the bar is disabled: only rank 0 speaks.
                self.say = self.bar.write if self.writes else (lambda _line: None)
                # What the executor compiles or captures later (an eval template, CUDA graphs).
                self.trainer.executor.echo = self.say
                if self.last_saved is None and cfg.nonfinite == "skip":
                    self.save(self.step)  # the state a rollback goes back to
                    self.say(f"step {self.step}: saved {self.ckpt_path} (nonfinite: skip rolls back to the last "
                             "checkpoint)")
                self.stopped = self.ranks.any_stopped(stop.name, self.groups)
                while self.step < cfg.max_steps and self.stopped is None:
                    if self.train_step():
                        self.stopped = self.ranks.any_stopped(stop.name, self.groups)
                if self.stopped is not None:
                    if self.last_saved != self.step and self.flushed(self.row):
                        self.save(self.step)
                    self.bar.write(f"{self.stopped}: stopped after step {self.step}; saved {self.ckpt_path}. The same "
                                   "command resumes from it")
        finally:
            self.metrics.close()

    def train_step(self) -> bool:
        """The next step: run (or, replaying after a rollback, leave out a step not kept), judge,
        then evaluate, log and checkpoint it. Returns False where a deferred update left
        non-finite weights before an evaluation or a save (the run rolled back): the ranks then
        skip this step's poll of stop requests."""
        cfg = self.cfg
        lr = lr_at(self.step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                   min_lr_ratio=cfg.min_lr_ratio)
        batch = next(self.batches)
        self.step += 1
        step = self.step
        if step in self.guard.not_kept:  # after a rollback: a step not kept stays out of the replay
            if step > self.replay_until:
                self.metrics.append(self.held.pop(step, {"step": step, "applied": False}))
            self.count_skip(self.guard.not_kept[step])
            self.bar.update(1)
            return True
        self.trainer.set_lr(lr)
        res = self.trainer.step(self.ranks.rows(batch, getattr(self.trainer.model, "config", None)))
        self.loss = res.loss
        self.row = row = step_row(step, res, lr, self.rates, applied=bool(res.applied), ranks=self.ranks.world,
                                  trimmed=getattr(self.dataset, "num_trimmed", None),
                                  dropped=getattr(self.dataset, "num_dropped", None))
        mfu = row["mfu"]
        verdict = self.guard.judge(step, res, self.ranks.any_of(res.nonfinite_weights, len(self.layers), self.groups),
                                   self.layers)
        if verdict.action != "keep":
            self.not_kept(verdict, row)
            if verdict.action == "skip":
                self.bar.update(1)
            return True
        self.guard.keep(res.loss)
        return self._kept(step, row, res, mfu)

    def _kept(self, step: int, row: dict, res, mfu: float) -> bool:
        """A step kept: its evaluation, metrics row and checkpoint where due, and the progress bar.
        False: a deferred update's flush rolled the run back (:meth:`flushed`)."""
        cfg = self.cfg
        replaying = step <= self.replay_until
        if not replaying and (cfg.eval_interval and step % cfg.eval_interval == 0 or step == cfg.max_steps):
            if not self.flushed(row):
                return False
            self.val_loss = self.evaluate()
            row["val_loss"] = finite(self.val_loss)
            self.say(f"step {step}: validation loss {self.val_loss:.4f}")
        rss = host_rss_bytes()
        row["host_rss_mib"] = rss / MiB if rss is not None else None
        if not replaying:
            self.metrics.append(row)
        if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 or step == cfg.max_steps:
            if not self.flushed(row):
                return False
            self.save(step)
            self.say(f"step {step}: saved {self.ckpt_path}")
        busy = oversubscription() if cfg.device == "cpu" else None
        self.bar.set_postfix_str(f"loss {res.loss:.4f}, {res.tokens_per_second:,.0f} tok/s, MFU {mfu:.2%}"
                                 + (f", {busy}" if busy else ""), refresh=False)
        self.bar.update(1)
        return True

    def kept(self) -> str:
        """What the last checkpoint holds, for an error that stops the run."""
        return (f"The last checkpoint, {self.ckpt_path}, holds step {self.last_saved}: the same command resumes from "
                "it" if self.last_saved is not None else "No checkpoint was saved: the same command starts the run "
                "again")

    def count_skip(self, why: str) -> None:
        """Count a step not kept.

        Raises:
            MegatrainError: ``max_consecutive_skips`` steps in a row were not kept (nothing saved).
        """
        cfg, guard = self.cfg, self.guard
        self.skipped += 1
        guard.in_a_row += 1
        if guard.in_a_row >= cfg.max_consecutive_skips:
            raise MegatrainError(
                f"{guard.in_a_row} steps in a row were not kept (the last: {why}): the run diverged; stopping "
                f"without saving (max_consecutive_skips={cfg.max_consecutive_skips}). {self.kept()}; lower --lr"
                + (" or set --max-grad-norm" if cfg.max_grad_norm is None else ""))

    def not_kept(self, verdict: Verdict, row: dict) -> None:
        """Skip or roll back ``verdict.blame`` (``row``: the step just run); stop under
        ``nonfinite: stop`` or past ``max_consecutive_skips``.

        Raises:
            MegatrainError: ``nonfinite: stop``, or too many steps in a row not kept.
        """
        cfg, guard, metrics = self.cfg, self.guard, self.metrics
        fresh = row["step"] > self.replay_until  # not a step that a replay runs again
        if cfg.nonfinite == "stop":
            metrics.append({**row, "applied": False})
            raise MegatrainError(f"{verdict.why}; stopping without saving (nonfinite: stop). {self.kept()}; add a "
                                 "lower --lr or --max-grad-norm, or --nonfinite skip")
        if verdict.action == "skip":
            self.trainer.drop_pending_updates()  # a spiking step's deferred update is never applied
            guard.not_kept[verdict.blame] = verdict.why
            if fresh:
                metrics.append({**row, "applied": False})
                self.say(f"warning: {verdict.why}; skipped: nothing of it was applied (nonfinite: skip)")
            self.count_skip(verdict.why)
            return
        # Roll back: the checkpoint, then the steps since it again, without those not kept.
        if self.writes:
            self.held[verdict.blame] = {**(row if verdict.blame == row["step"] else metrics.row(verdict.blame)),
                                        "applied": False}
        loaded = self.trainer.load(self.ckpt_path)[STATE_KEY]
        self.step, self.skipped = int(loaded["step"]), int(loaded["skipped_steps"])
        self.replay_until = verdict.blame - 1
        guard.restore(loaded, self.step)
        guard.not_kept[verdict.blame] = verdict.why
        self.batches = self.dataset.batches(cfg.global_batch, seed=cfg.seed, start=self.step)
        metrics.keep(lambda r: r["step"] < verdict.blame)
        self.bar.n = self.step
        self.say(f"warning: {verdict.why}; rolled back to the checkpoint of step {self.step} to run the steps since "
                 "without it (nonfinite: skip)")

    def flushed(self, row: dict) -> bool:
        """Apply a deferred update before an evaluation or a save reads it; False when it left
        non-finite weights (the run rolled back)."""
        bad = self.ranks.any_of(self.trainer.flush(), len(self.layers), self.groups)
        if bad:
            self.not_kept(self.guard.diverged(self.step, bad, self.layers), row)
        return not bad

    # -- the end ----------------------------------------------------------------------------------

    def finish(self) -> TrainResult:
        """The sample, the data closed, the loss plot, the closing lines, and the result."""
        sample = self._sample()
        self.dataset.close()
        # The ranks' results are the same (losses are gathered): rank 0's rows tell the run's.
        rows = (read_metrics(self.metrics_path) if self.writes
                else [{"loss": finite(self.loss), "applied": self.loss is not None}])
        cfg, step = self.cfg, self.step
        if self.writes:
            plot_or_note(lambda: save_loss_plot(rows, self.out / PLOT_FILE, title=(
                f"{model_label(cfg)}: {step} steps, seq_len {cfg.seq_len} x global batch {cfg.global_batch}")),
                self.echo)
        self.echo(f"done: step {step}, train loss {fmt(self.loss)}, validation loss {fmt(self.val_loss)}, "
                  f"{self.skipped} skipped steps; {self.out}")
        if self.writes:
            self._say_outputs(sample)
        applied = [r for r in rows if r["applied"]]
        return TrainResult(step=step, skipped_steps=self.skipped, stopped_by=self.stopped,
                           loss=applied[-1]["loss"] if applied else None, val_loss=finite(self.val_loss),
                           checkpoint=self.ckpt_path if self.last_saved is not None else None, output_dir=self.out)

    def _sample(self) -> tuple[str, str] | None:
        """A greedy continuation of a validation prompt, generated on the CPU from the module whose
        parameters are the host tiles (not after a signal, which asks to stop; not where a
        parameter lives elsewhere, such as masters on NVMe). Not for rows with images: the
        prompt's image tokens need the image's features."""
        cfg, trainer = self.cfg, self.trainer
        if not (self.writes and cfg.sample_tokens and self.stopped is None and cfg.device == "cpu"
                and self.images is None and all(p.device.type == "cpu" for p in trainer.model.parameters())):
            return None
        from megatrain.train.sample import generate_sample, sample_prompt

        trainer.flush()  # the model's parameters are the host tiles: the last deferred update applied
        prompt = sample_prompt(self.dataset, cfg.task, cfg.micro_batch_size, self.tokenizer)
        completion = generate_sample(trainer.model, self.tokenizer, prompt, cfg.sample_tokens)
        return None if completion is None else (prompt, completion)

    def _say_outputs(self, sample: tuple[str, str] | None) -> None:
        """Where the model directory, the metrics and the loss curve are, and the sample."""
        images, echo = self.images, self.echo
        if self.last_saved is not None:
            echo(f"model directory: {self.ckpt_path} (Hugging Face layout with its tokenizer: "
                 + ("AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained load it)" if images is None
                    else "AutoModelForImageTextToText.from_pretrained and AutoProcessor.from_pretrained load it"
                    + ("; Qwen2-VL's AutoProcessor needs torchvision, megatrain.data.sft_qwen_vl.load_processor "
                       "does without)" if images.grid_images else ")")))
        plot = self.out / PLOT_FILE
        echo(f"metrics: {self.metrics_path}" + (f"; loss curve: {plot}" if plot.is_file() else ""))
        if sample is not None:
            from megatrain.train.sample import sample_line

            echo(sample_line(*sample))
