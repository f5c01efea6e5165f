"""``materialize``: a :class:`~megatrain.planner.front.PlannedModel` made real. Host tiles (or a
node's shared or sliced ones) -> bind the module -> backend -> executor, into a
:class:`megatrain.trainer.Trainer`. Decides nothing: the plan, its data parallel fields, shared
casts and NVMe layers come from the planning front door (:func:`megatrain.planner.front.plan`);
this module allocates what they say.
"""

from __future__ import annotations

from typing import Callable, Mapping

from megatrain.optim import AdamW
from megatrain.errors import ConfigError
from megatrain.optim import Lion, optimizer_settings, spec_of
from megatrain.planner import cost
from megatrain.ir.layout import buffer_layout
from megatrain.planner.front import PlannedModel
from megatrain.runtime.backend import Backend, CPUBackend, make_backend
from megatrain.runtime.executor import Executor
from megatrain.runtime.graphs import check_backend
from megatrain.runtime.host import HostState, NvmeShards, bind_module, unbind_spilled
from megatrain.runtime.measure import host_cores
from megatrain.trainer import Trainer


def materialize(planned: PlannedModel, optimizer: AdamW | Lion | Mapping | None = None, *,
                backend: Backend | None = None, nvme_dir: str | None = None,
                host: HostState | None = None, echo: Callable[[str], None] | None = None) -> Trainer:
    """Allocate what ``planned`` runs on and return the :class:`Trainer`: the host tiles (FP32
    master weights and the optimizer's state rows, ``megatrain.optim``: 12 bytes per parameter with
    AdamW, 8 with Lion; 4 for a layer of
    ``Plan.nvme_moments``, whose moments are files in ``nvme_dir``, made here; none for a layer of
    ``Plan.nvme_masters``, whose initialised master is written to its file here), the module's
    parameters bound to them (a meta-device model is initialised there by its own initialisation), the backend and
    the executor. On ``device="cuda"`` the train schedule's GPU slots and pinned buffers are
    allocated here too, so that running out of memory is a compile error, not a first-step one;
    the CPU backend makes its (host) buffers at the first step. ``backend``: the one to run on
    (default ``make_backend(planned.options.device)`` with its host workers' threads,
    ``cost.host_worker_threads`` of this machine's cores; tests pass a CUDA backend over FakeCuda).
    ``host``: the host tiles of another trainer of the same model (the module already bound to
    them), shared instead of allocated: how a shape-free trainer (:mod:`megatrain.product.shapes`) runs one
    set of weights and moments under the schedules of several batch shapes.

    With ``Plan.templates == "compiled"`` the train schedules' templates are compiled here
    (``Executor.compile_templates``), each once, with a line before saying what and why and one
    after with the seconds it took, through ``echo`` (default: stderr); the executor keeps
    ``echo`` for what it compiles or captures later (an eval template, CUDA graphs).

    Raises:
        ConfigError: an optimizer setting out of range, or an optimizer object rather than settings;
            an optimizer other than the plan's ``optimizer_name``; ``device="cuda"`` without CUDA;
            ``Plan.cuda_graphs`` on a backend without CUDA graphs.
        UnsupportedModelError: a meta-device parameter its module's initialisation does not set; a
            template that cannot be compiled (``Plan.templates == "compiled"``; names it and the node).
        Nothing is bound to the model unless the optimizer settings and the backend are valid.
    """
    opt = optimizer_settings(optimizer)
    spec = spec_of(opt)
    if planned.plan.optimizer_name != spec.name:
        raise ConfigError(f"the plan sizes {planned.plan.optimizer_name}'s optimizer state (Plan.optimizer_name) but "
                          f"the optimizer is {spec.name}; plan with plan_model(..., optimizer_name={spec.name!r})")
    if host is not None and planned.plan.shared_cast and not host.staging:
        raise ConfigError("this plan shares the node's BF16 staging tiles (Plan.shared_cast), and the shared host "
                          "state was made without them; plan it with shared_staging=False "
                          "(megatrain.planner.front.Storage), as a shape-free trainer does")
    if planned.traced.graph.micro_batch_size != planned.options.micro_batch_size:
        # The front door traces again at a size the solver chose; a PlannedModel put together by
        # hand may not have.
        raise ConfigError(f"this plan is for micro-batches of {planned.options.micro_batch_size}, but its templates "
                          f"were traced at {planned.traced.graph.micro_batch_size}; plan it with "
                          "megatrain.planner.front.plan (or plan_model), which traces at the size that runs")
    on_nvme, grads_on_nvme = planned.plan.nvme_moments, planned.plan.nvme_gradients
    if on_nvme and nvme_dir is None:
        raise ConfigError(f"the plan keeps the Adam moments of layers {sorted(on_nvme)} on NVMe "
                          "(Plan.nvme_moments) but no NVMe directory was given: pass nvme_dir= (an existing "
                          "directory on an NVMe drive)")
    if grads_on_nvme and nvme_dir is None:
        raise ConfigError(f"the plan keeps the deferred gradient tiles of layers {sorted(grads_on_nvme)} on NVMe "
                          "(Plan.nvme_gradients) but no NVMe directory was given: pass nvme_dir= (an existing "
                          "directory on an NVMe drive)")
    if backend is None:
        # The host workers' thread budget: this rank's share of the cores it runs on (not the
        # spec's, which may describe another machine).
        threads = cost.host_worker_threads(host_cores(), planned.plan.gpus_per_node)
        backend = make_backend(planned.options.device, host_threads=threads)
    if planned.plan.cuda_graphs:
        check_backend(backend)  # before anything is bound to the model
    traced, model = planned.traced, planned.model
    if host is None and planned.plan.data_parallel > 1 and planned.plan.host_state == "shard":
        if on_nvme:
            raise ConfigError(f"the plan keeps the Adam moments of layers {sorted(on_nvme)} on NVMe and shards the "
                              "host state across nodes (host_state='shard'): not supported: a save reads whole "
                              "moment rows from one node's files, and with the state sharded no node's files hold "
                              "them all (a gather of the NVMe rows across nodes is not written); keep the moments "
                              "in host memory, or use host_state='replicate' (moments on NVMe run under it)")
        host = _sharded_host(planned)
    elif host is None and planned.plan.data_parallel > 1:
        from megatrain.runtime.distributed import broadcast_masters, data_parallel_host

        staging = planned.plan.shared_cast
        dp = data_parallel_host(HostState.shared_nbytes(traced.graph, staging=staging, nvme_moments=on_nvme,
                                                        optimizer=spec),
                                planned.plan.data_parallel, planned.plan.optimizer_shards)
        # Each rank's NVMe files hold the moments of what its OPTs step (its optimizer shard, the
        # whole tile where each rank has a copy), named by its global rank (HostState, NvmeShards).
        shards = NvmeShards(rank=dp.topo.rank, ways=planned.plan.update_shards, index=dp.shard_index,
                            first=dp.topo.rank - dp.topo.local_rank) if on_nvme else None
        host = HostState(traced.graph, on_nvme, None if nvme_dir is None else str(nvme_dir), shared=dp.shared,
                         writer=dp.writer, staging=staging, nvme_shards=shards, optimizer=spec)
        host.data_parallel = dp
        bind_module(model, host, writer=dp.writer)
        broadcast_masters([host.master(i) for i in range(len(traced.graph.layers))], dp)
    elif host is None:
        # The NVMe files are made here (zeros, like fresh moments): a missing directory or a full
        # disk fails at compile, before the model is bound.
        host = HostState(traced.graph, on_nvme, None if nvme_dir is None else str(nvme_dir),
                         nvme_gradients=grads_on_nvme, gradient_itemsize=planned.plan.gradient_itemsize,
                         nvme_masters=planned.plan.nvme_masters, optimizer=spec)
        bind_module(model, host)
        if host.nvme_masters:
            # The initialised masters go to their files (the executor casts its staging tiles from
            # them before the first run), and the module stops viewing the rows that are dropped.
            host.spill_masters()
            unbind_spilled(model, host)
    elif [lay.params for lay in host.graph.layers] != [lay.params for lay in traced.graph.layers]:
        raise ConfigError("this plan's layers hold other parameters than the shared host tiles' (the model "
                          "traced differently at this shape); compile the shape with its own trainer")
    elif host.nvme_masters != planned.plan.nvme_masters:
        raise ConfigError(f"this plan keeps the masters of layers {sorted(planned.plan.nvme_masters)} on NVMe, the "
                          f"shared host state those of layers {sorted(host.nvme_masters)}; give every shape's plan "
                          "the same nvme_masters")
    elif host.nvme_moments != on_nvme:
        raise ConfigError(f"this plan keeps the Adam moments of layers {sorted(on_nvme)} on NVMe, the shared host "
                          f"state those of layers {sorted(host.nvme_moments)}; give every shape's plan the same "
                          "nvme_moments")
    elif not grads_on_nvme <= host.nvme_gradients:
        raise ConfigError(f"this plan keeps the gradient tiles of layers {sorted(grads_on_nvme)} on NVMe, the shared "
                          f"host state has files for those of layers {sorted(host.nvme_gradients)}; give every "
                          "shape's plan the same nvme_gradients")
    buffers = {}
    for name, (kind, src) in traced.buffer_sources.items():
        buffers[name] = model.get_buffer(src) if kind == "buffer" else src
    executor = Executor(traced, host, backend, opt, buffers, per_token_loss=planned.options.per_token_loss)
    if echo is not None:
        executor.echo = echo
    if host.data_parallel is not None:
        executor.groups, executor.shard_index = host.data_parallel.groups, host.data_parallel.shard_index
    if not isinstance(backend, CPUBackend):
        # Commit the GPU slots and the pinned arena now. The CPU backend's buffers are host memory
        # made at the first run (tests that swap a fake CUDA backend in after compile rely on it).
        executor.allocate(planned.schedules.first)
    for sched in (planned.schedules.first, planned.schedules.carrying):
        if sched is not None:
            executor.compile_templates(sched, why="(the plan's templates='compiled'), before the first step")
    return Trainer(planned, opt, host, backend, executor)


def _sharded_host(planned: PlannedModel) -> HostState:
    """The host state of a plan with ``host_state == "shard"``: this node's slice of every layer
    (``Schedule.layout``'s node slices) and its gather tiles, in the node's shared memory; global rank 0
    initialises the module's weights into whole rows of its own and broadcasts them into every
    node's slice, one layer at a time; then no rank's module keeps its parameters (they are left
    on the ``meta`` device: the weights live in the slices only). Collective."""
    from megatrain.runtime.distributed import broadcast_slices, data_parallel_host, topology
    from megatrain.runtime.host import FullMasters, materialize_buffers, unbind_parameters

    plan, graph, model = planned.plan, planned.traced.graph, planned.model
    node = topology().node
    steady = planned.schedules.steady  # its layout is what lowering decided: the slices, gather tiles, scratch
    layout = steady.layout if steady.layout is not None else buffer_layout(graph, plan)
    slices = [span.node_slices[node] for span in layout.layers]
    gather_bytes, scratch = layout.gather_buffers[1], layout.gather_scratch_bytes
    spec = plan.optimizer_spec
    dp = data_parallel_host(HostState.shared_nbytes(graph, slices, gather_bytes, scratch_bytes=scratch, optimizer=spec),
                            plan.data_parallel, plan.optimizer_shards, plan.nodes, sharded=True)
    host = HostState(graph, shared=dp.shared, writer=dp.writer, slices=slices, gather_bytes=gather_bytes,
                     scratch_bytes=scratch, optimizer=spec)
    host.data_parallel = dp
    rows = None
    if dp.topo.rank == 0:
        rows = FullMasters(graph)
        bind_module(model, rows)
    else:
        materialize_buffers(model)
    broadcast_slices(None if rows is None else rows.rows, host, dp)
    unbind_parameters(model)
    return host

