"""``plan_model``: a model and this process's data-parallel topology into the planning front door
(:func:`megatrain.planner.front.plan`: trace -> plan -> lower -> verify, once), a frozen
:class:`~megatrain.planner.front.PlannedModel` (the schedules that will run, their memory and
predicted step) that allocates nothing."""

from __future__ import annotations

from typing import Literal, Sequence

from torch import nn

from megatrain.errors import ConfigError
from megatrain.planner import front
from megatrain.planner.front import PlannedModel, PlanRequest, Storage, Topology, compile_options
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.plan import Plan
from megatrain.runtime.backend import make_backend
from megatrain.runtime.measure import measure_hardware
from megatrain.trainer import data_parallel_world


def plan_model(model: nn.Module, *, seq_len: int, micro_batch_size: int | None = None,
               micro_batches: int | None = None, global_batch: int | None = None,
               plan: Plan | Literal["default"] | None = None, device: str = "cpu",
               input_names: Sequence[str] = ("input_ids", "labels"), max_grad_norm: float | None = None,
               hardware: HardwareSpec | str | None = None, compute_dtype: str | None = None,
               share_host_memory: bool = True, host_state: str | None = None,
               per_token_loss: bool = True, optimizer_name: str | None = None,
               shared_staging: bool | None = None,
               image_grid_thw: Sequence[Sequence[int]] | None = None, images_per_row: int = 1,
               templates: str | None = None, cuda_graphs: bool | str | None = None,
               reference: Literal["bfloat16"] | None = None) -> PlannedModel:
    """Plan ``model`` for training, once, through the planning front door
    (:func:`megatrain.planner.front.plan`), with this process's data-parallel topology (the
    default ``torch.distributed`` process group and torchrun's ``LOCAL_WORLD_SIZE``): trace it (on
    whatever device it is on, ``meta`` included) into a LayerGraph; take ``plan``, the default
    plan or the solver's; decide data parallel; ``lower`` the train schedules and ``verify`` them.
    Allocates nothing and touches no parameter memory; the result is frozen and
    :func:`materialize` runs exactly its schedules.

    Args:
        model, seq_len, device, input_names, max_grad_norm, compute_dtype, per_token_loss,
        image_grid_thw, images_per_row, templates, cuda_graphs: as for :func:`compile`.
        micro_batch_size, micro_batches, global_batch: the split of a step, as for :func:`compile`
            (:func:`split_global_batch`): ``micro_batches`` per rank, ``global_batch`` over every
            rank; with ``global_batch`` alone the solver chooses the micro-batch size and count.
        plan: a ``Plan``; ``"default"`` for the default plan (two slots, prefetch distance one,
            every checkpoint kept), with ``hardware`` used only for the prediction; None: the
            solver's plan for ``hardware`` (or, on ``device="cuda"`` without one, for the measured
            GPU: ``measure_hardware()``, a few seconds), and the default plan on
            ``device="cpu"`` without one.
        hardware: a ``HardwareSpec``, a preset name or a spec JSON file: what the solver plans
            for, and what ``timeline`` predicts the step on.
        share_host_memory: data parallel (a ``torch.distributed`` process group of several
            ranks): the ranks of a node (torchrun's ``LOCAL_WORLD_SIZE``) keep one copy of the
            masters and moments in shared memory (``/dev/shm``) and each steps its shard of every
            layer (``Plan.optimizer_shards``); False: each rank keeps a copy of its own and steps
            all of it.
        host_state: data parallel over several nodes: ``"replicate"`` (a full copy of the masters
            and moments on every node) or ``"shard"`` (each node holds ``1 / nodes`` of it and the
            ranks gather each layer's weights before use, ZeRO-3 style: ``Plan.host_state``);
            None keeps the plan's (``"replicate"`` for the default and solved plans).
        optimizer_name: the host optimizer the plan is for (``Plan.optimizer_name``, a name in
            :data:`megatrain.optim.OPTIMIZERS`): its state bytes per parameter are what the solver
            and ``memory`` count. None keeps a given plan's, else ``"adamw"``.
        shared_staging: ``megatrain.planner.front.Storage.shared_staging`` (a shape-free
            trainer's host state made without the node's shared staging tiles: False).
        reference: ``"bfloat16"``: plan a frozen BF16 copy of the weights for a reference model
            beside the training state (``megatrain.planner.front.Storage.reference``; 2 bytes per
            parameter of host memory, counted in ``memory.reference_weights``), which
            ``megatrain.rl.Reference(trainer)`` then holds.

    Returns:
        The :class:`PlannedModel`. With a solved plan its ``schedules.steady`` is the solver's own
        schedule and ``timeline`` the solver's simulation of it (nothing is lowered or simulated
        twice); with another plan and a spec with GPU rates the steady schedule is simulated once.

    Raises:
        ConfigError: an option out of range; ``seq_len`` beyond a Hugging Face model's
            ``max_position_embeddings``; a plan inconsistent with the options; ``per_token_loss``
            for a model whose loss is not a mean cross-entropy megatrain can count;
            ``device="cuda"`` without CUDA; a ``global_batch`` :func:`split_global_batch` refuses.
        TraceError / UnsupportedModelError: the model cannot be traced or is not supported.
        PlanError, ScheduleError: the plan does not fit the model.
    """
    options = compile_options(seq_len, _or_one(micro_batch_size), _or_one(micro_batches), input_names, device,
                              max_grad_norm, per_token_loss)
    if options.device == "cuda":
        make_backend("cuda")  # ConfigError now, before tracing, where CUDA is missing (creates nothing CUDA)
    topo = process_topology(share_host_memory, host_state)
    rows, micro_batch_size = split_global_batch(global_batch, micro_batch_size, micro_batches, ranks=topo.ranks,
                                                plan=plan, hardware=hardware, device=options.device)
    if plan is None and hardware is None and options.device == "cuda":
        hardware = measure_hardware()
    return front.plan(plan_request(model, seq_len=seq_len, global_batch=rows,
                                   micro_batch_size=micro_batch_size, plan=plan, hardware=hardware, device=device,
                                   compute_dtype=compute_dtype, input_names=input_names, max_grad_norm=max_grad_norm,
                                   per_token_loss=per_token_loss, optimizer_name=optimizer_name, topology=topo,
                                   shared_staging=shared_staging, reference=reference, image_grid_thw=image_grid_thw,
                                   images_per_row=images_per_row, templates=templates, cuda_graphs=cuda_graphs))


def split_global_batch(global_batch: int | None, micro_batch_size: int | None, micro_batches: int | None, *,
                       ranks: int = 1, plan: Plan | Literal["default"] | None = None,
                       hardware: HardwareSpec | str | None = None, device: str = "cpu") -> tuple[int, int | None]:
    """``(global_batch, micro_batch_size)`` of compile's batch settings for ``ranks`` data-parallel
    ranks: the rows a step over every rank, and the micro-batch size, None where the solver is to
    choose it (``PlanRequest.micro_batch_size``). The rules, one place for ``compile`` and
    ``plan_model``:

    - no ``global_batch``: ``micro_batch_size`` (default 1) x ``micro_batches`` (default 1) per
      rank, as before there was a ``global_batch``;
    - ``global_batch`` with both: they must multiply to it (x ``ranks``);
    - ``global_batch`` with one of them: the other is what divides it (it must divide);
    - ``global_batch`` alone: the solver's size and count, for ``hardware`` (on ``device="cuda"``
      without one, the measured GPU); with a given ``Plan``, the plan's ``micro_batches`` and the
      size that fills the global batch. ``plan="default"``, or ``device="cpu"`` without
      ``hardware``, chooses no split: ConfigError.

    Raises:
        ConfigError: each rule broken, naming the setting to give or change.
    """
    if global_batch is None:
        return _or_one(micro_batch_size) * _or_one(micro_batches) * ranks, _or_one(micro_batch_size)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ConfigError(f"global_batch={global_batch!r}: give the rows of a step over every rank, an integer >= 1")
    over = f" x {ranks} data-parallel ranks" if ranks > 1 else ""
    if micro_batch_size is not None and micro_batches is not None:
        if micro_batch_size * micro_batches * ranks != global_batch:
            raise ConfigError(f"global_batch={global_batch}, but micro_batch_size={micro_batch_size} x micro_batches="
                              f"{micro_batches}{over} is {micro_batch_size * micro_batches * ranks} rows; give "
                              "global_batch alone (the solver chooses the split), or a split that multiplies to it")
        return global_batch, micro_batch_size
    if micro_batch_size is None and micro_batches is None:
        if isinstance(plan, Plan):
            micro_batches = plan.micro_batches
        elif plan == "default":
            raise ConfigError(f"global_batch={global_batch} with plan='default': the default plan does not choose a "
                              "micro-batch size; give micro_batch_size= (or micro_batches=), or plan=None and "
                              "hardware= for the solver's split")
        elif hardware is None and device != "cuda":
            raise ConfigError(f"global_batch={global_batch} without micro_batch_size asks the solver to choose the "
                              f"micro-batch size and count, but on device={device!r} there is no GPU to plan for; "
                              "give hardware= (a preset such as 'H100_SXM', a HardwareSpec or a spec JSON file), or "
                              "micro_batch_size=")
        else:
            return global_batch, None
    if micro_batch_size is None:
        count = micro_batches * ranks
        if global_batch % count:
            whose = "the plan's " if isinstance(plan, Plan) else ""
            raise ConfigError(f"global_batch={global_batch} does not split into {whose}micro_batches={micro_batches}"
                              f"{over}; give a global_batch that is a multiple of {count}")
        return global_batch, global_batch // count
    if global_batch % (micro_batch_size * ranks):
        raise ConfigError(f"global_batch={global_batch} does not split into micro-batches of micro_batch_size="
                          f"{micro_batch_size}{over}; give a global_batch that is a multiple of "
                          f"{micro_batch_size * ranks}, or a micro_batch_size that divides it (or none: the "
                          "solver's)")
    return global_batch, micro_batch_size


def plan_request(model: nn.Module, *, seq_len: int, global_batch: int, micro_batch_size: int | None = 1,
                 plan: Plan | Literal["default"] | None = None, hardware: HardwareSpec | str | None = None,
                 device: str = "cpu", compute_dtype: str | None = None,
                 input_names: Sequence[str] = ("input_ids", "labels"), max_grad_norm: float | None = None,
                 per_token_loss: bool = True, optimizer_name: str | None = None, topology: Topology = Topology(),
                 nvme_dir: str | None = None, host_memory: int | str | None = None, host_reserved: int = 0,
                 shared_staging: bool | None = None, reference: Literal["bfloat16"] | None = None,
                 image_grid_thw: Sequence[Sequence[int]] | None = None, images_per_row: int = 1,
                 solver: Literal["milp", "enumerate"] = "milp", templates: str | None = None,
                 cuda_graphs: bool | str | None = None) -> PlanRequest:
    """The :class:`~megatrain.planner.front.PlanRequest` of compile's flat settings: the one place a
    request is made, for :func:`plan_model` (and so ``compile``), ``megatrain train``
    (``megatrain.train.loop.plan_request``, from a run's config) and ``megatrain plan`` (from its
    flags). ``global_batch``: rows a step over every rank of ``topology``; ``nvme_dir``,
    ``host_memory``, ``host_reserved`` (bytes), ``shared_staging`` and ``reference`` make its
    :class:`~megatrain.planner.front.Storage`; the rest are ``PlanRequest``'s fields. Validates
    nothing: :func:`megatrain.planner.front.plan` does."""
    return PlanRequest(model, seq_len, global_batch, micro_batch_size, plan=plan, hardware=hardware, device=device,
                       compute_dtype=compute_dtype, input_names=tuple(input_names), max_grad_norm=max_grad_norm,
                       per_token_loss=per_token_loss, image_grid_thw=image_grid_thw, images_per_row=images_per_row,
                       optimizer_name=optimizer_name, topology=topology,
                       storage=Storage(nvme_dir, host_memory, shared_staging=shared_staging, reference=reference,
                                       host_reserved=host_reserved),
                       solver=solver, templates=templates, cuda_graphs=cuda_graphs)


def _or_one(n: int | None) -> int:
    """A micro-batch size or count not given (None) as its default, 1; a given one as it is (0
    stays 0, for ``compile_options`` to refuse)."""
    return 1 if n is None else n


def process_topology(share_host_memory: bool = True, host_state: str | None = None, fits=None) -> Topology:
    """This process's data-parallel :class:`~megatrain.planner.front.Topology`: the default
    ``torch.distributed`` process group's ranks (1 without one) and torchrun's
    ``LOCAL_WORLD_SIZE`` ranks per node."""
    world = data_parallel_world()
    if world == 1:
        return Topology(1, 1, share_host_memory, host_state, fits)
    from megatrain.runtime.distributed import topology

    return Topology(world, topology().local_world, share_host_memory, host_state, fits)


__all__ = ["plan_model", "plan_request", "process_topology", "split_global_batch"]
