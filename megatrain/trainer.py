"""The :class:`Trainer`: the running object that ``megatrain.compile`` and ``megatrain.materialize``
build (:mod:`megatrain.product`, the floor above), whose ``step`` executes the planned schedules over
host tiles, a backend and an executor it is given. It imports nothing that builds it.
``PlannedModel`` and ``Schedules`` (:mod:`megatrain.planner.front`) stay importable from here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from megatrain.optim import AdamW
from megatrain.data.packing import IGNORE_INDEX
from megatrain.optim import Lion, spec_of
from megatrain.errors import BatchError, CheckpointError, CollectiveError, ConfigError, StepError
# PlannedModel and Schedules are re-exported: `from megatrain.trainer import PlannedModel` stays.
from megatrain.planner.front import PlannedModel, Schedules
from megatrain.ir.graph import LayerGraph
from megatrain.planner.lower import lower
from megatrain.ir.plan import OptimizerPlacement, Plan
from megatrain.ir.schedule import Schedule
from megatrain.planner.trace.vlm import IMAGE_INPUT, prepare_images
from megatrain.planner.verify import verify
from megatrain.runtime.backend import Backend
from megatrain.runtime.distributed import collective
from megatrain.runtime.executor import Executor, StepOutput
from megatrain.runtime.loss import loss_weights, micro_batch_means
from megatrain.runtime.host import MASTER, HostState, NvmeRow, SlicedRow, as_tensor

if TYPE_CHECKING:
    from megatrain.rl.losses import TokenLoss


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one ``Trainer.step`` did.

    ``loss`` is the loss of the global batch (a float): the mean of its token losses over its
    supervised tokens, every label that is not -100 after the model's shift in every micro-batch
    and on every data-parallel rank, as eager PyTorch computes it on the whole batch (with
    ``per_token_loss=False``, the mean of the micro-batch means: :mod:`megatrain.runtime.loss`).
    ``micro_batch_losses``: each micro-batch's own mean loss, every rank's in rank order (the
    global batch's micro-batches as one process would list them; NaN for a micro-batch without a
    target, which adds nothing to ``loss``). ``tokens``: the input tokens of the global batch that
    are not padding (``attention_mask == 1`` when the batch has an ``attention_mask``, else every
    token); ``supervised_tokens``: the tokens ``loss`` is the mean over (None where the model's
    loss is not counted); ``seconds`` the wall time of the step; ``tokens_per_second`` is
    ``tokens / seconds``, the throughput in tokens read, padding excluded (the usual meaning, which
    MFU counts), not in supervised tokens. ``grad_norm`` is the global L2 norm of the step's
    gradients before clipping (FP32, as ``torch.nn.utils.clip_grad_norm_`` returns it; NaN or inf
    when a gradient was not finite).

    ``applied`` is False when a loss or a gradient of the step was NaN or infinite: that update is
    not applied. With clipping (optimizer steps deferred to the next step's forward) nothing of it
    is applied -- parameters, Adam moments and Adam step counts stay as they were. Without
    clipping, each layer's step runs as soon as its gradients arrive during backward: a non-finite
    loss is known before any of them (nothing is applied), but a non-finite gradient in layer ``i``
    is found only when it arrives, so the layers after ``i`` (updated before it) keep their
    update, and ``skipped_layers`` lists those that were not updated; ``updated_layers`` lists
    those that took this batch's update during the step (always empty with deferred updates).

    ``nonfinite_weights``: layers whose optimizer step in this step's run left a NaN or infinite
    value in their FP32 master (from finite gradients: ``lr x weight_decay > 2``, say). With
    updates during backward it is this batch's update (the layers after it are then not updated
    and ``applied`` is False); with deferred updates it is the previous step's, which runs at the
    start of this one. Those layers keep the bad values: ``megatrain train`` rolls back to its last
    checkpoint (README, "Failures").

    A step that raises returns no StepResult; see ``Trainer.step`` for what it leaves behind.
    """

    step: int
    loss: float
    micro_batch_losses: tuple[float, ...]
    tokens: int
    seconds: float
    supervised_tokens: int | None = None
    grad_norm: float = float("nan")
    applied: bool = True
    skipped_layers: tuple[int, ...] = ()
    updated_layers: tuple[int, ...] = ()
    nonfinite_weights: tuple[int, ...] = ()

    @property
    def tokens_per_second(self) -> float:
        """Tokens read (``tokens``: padding excluded, every target and prompt token included) per second."""
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


class Trainer:
    """A compiled model: its planned schedules, its host state and an executor. Made by
    ``compile`` (= ``materialize(plan_model(...))``); ``planned`` is what was decided."""

    def __init__(self, planned: "PlannedModel", optimizer: AdamW, host: HostState, backend: Backend,
                 executor: Executor):
        self.planned = planned
        self.model = planned.model
        self.options = planned.options
        self.optimizer = optimizer
        self.traced = planned.traced
        self.plan = planned.plan
        self.host = host
        self.backend = backend
        self.executor = executor
        self.schedules = planned.schedules
        self.step_count = 0
        self._eval_schedules: dict[int, Schedule] = {}
        self._slice_reader = None  # while rank 0 saves a sharded host state (host_state "shard")
        self._token_limits = _token_limits(self.model, self.options.input_names)

    @property
    def _pending_layers(self) -> frozenset[int]:
        """Layers whose update from the last step waits for the next schedule (NEXT_FORWARD): all
        of them after a step, a subset only after a failure stopped a run part-way through them.
        The executor keeps them (``Executor.deferred``), with their clipping and AdamW settings."""
        return self.executor.deferred.layers

    @property
    def schedule(self) -> Schedule:
        """The schedule of a steady-state training step (the one the next step runs)."""
        carries = self._pending_layers and self._pending_layers == frozenset(self.schedules.tiles)
        return self.schedules.carrying if carries else self.schedules.first

    def flush(self) -> tuple[int, ...]:
        """Apply the update the last step deferred (plans whose optimizer steps run in the next
        step's forward, as with ``max_grad_norm``). ``evaluate`` and ``save`` call it; call it
        before reading ``model.state_dict()`` yourself. A no-op when nothing is pending.

        Returns:
            The layers whose update left a NaN or infinite master (``StepResult.nonfinite_weights``);
            empty when nothing was pending.

        Raises:
            StepError: an optimizer step raised; the updates that ran are not pending any more, the
                others still are (a later ``flush`` or ``step`` applies them, each exactly once).
        """
        return self._apply_pending(None) if self._pending_layers else ()

    def drop_pending_updates(self) -> None:
        """Forget a deferred update without applying it (after loading a checkpoint, or for a step
        whose update is not to be kept: ``megatrain train``'s loss-spike check)."""
        self.executor.drop_deferred()

    def _apply_pending(self, cause: BaseException | None) -> tuple[int, ...]:
        """Run the pending layers' optimizer steps alone (an ``"update"`` schedule of just those);
        return the layers whose update left a non-finite master."""
        full = self.schedules.update
        sched = full if self._pending_layers == frozenset(self.schedules.tiles) else full.of_layers(
            self._pending_layers)
        try:
            return tuple(self.executor.run(sched, []).nonfinite_updates)  # takes each update that ran off the pending ones
        except BaseException as e:
            if not isinstance(e, Exception):
                raise
            if self.executor.unsaved:
                raise _unsaved_error("a deferred optimizer step", e, tuple(self.executor.updated),
                                     self.executor.unsaved) from (cause or e)
            raise StepError(
                f"a deferred optimizer step failed ({type(e).__name__}: {e}); the updates of layers "
                f"{sorted(self._pending_layers)} are still pending and the others were applied once: calling "
                "flush() or step() again applies the rest") from (cause or e)

    def _run_step(self, schedule: Schedule, parts, what: str, targets: list[int | None], **run) -> StepOutput:
        """Run a train or eval schedule. When it raises, the trainer's state is made to match one
        of two stories and the error says which: with deferred updates (NEXT_FORWARD), the
        previous step's update was applied in full (or not at all, and is still pending) and
        nothing of this batch was; with updates during backward, the layers listed in
        ``StepError.updated_layers`` took this batch's update once and the rest are untouched.

        The executor has closed the backend's run when it raises (``Backend.abort``), and taken the
        carried updates that ran off the pending ones. ``run``: ``Executor.run``'s ``head`` and ``weights``."""
        try:
            return self.executor.run(schedule, parts, targets, **run)
        except CollectiveError:
            raise  # another rank failed: no story holds across ranks, and applying more would wait on them
        except BaseException as e:
            ran = tuple(self.executor.updated)
            if self.executor.unsaved and isinstance(e, Exception):
                raise _unsaved_error(what, e, ran, self.executor.unsaved) from e
            carried = schedule.carries_updates
            if carried and ran and self._pending_layers:  # part of the previous step's update ran: apply the rest
                self._apply_pending(e)
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: the state is consistent
                raise
            if carried or not ran:
                previous = ("" if not carried else " The previous step's update was applied in full."
                            if not self._pending_layers else " The previous step's update is still pending.")
                state = f"nothing of this batch was applied.{previous} The trainer is as if it never saw the batch"
                updated = ()
            else:
                state = (f"the optimizer steps of layers {list(ran)} had already applied this batch's gradients "
                         "(without max_grad_norm each layer is updated as its gradients arrive); the other layers "
                         "are as before the step and no layer was updated twice. Compile with max_grad_norm to "
                         "have a failed step leave nothing behind")
                updated = ran
            raise StepError(f"{what} failed while running ({type(e).__name__}: {e}); {state}.",
                            updated_layers=updated) from e

    def set_optimizer(self, optimizer: AdamW | Lion) -> None:
        """Use these settings from the next optimizer step on (moments and steps are kept).

        Raises:
            ConfigError: settings of another optimizer than the one the host state is laid out for.
        """
        if spec_of(optimizer) is not self.host.optimizer:
            raise ConfigError(f"set_optimizer: {spec_of(optimizer).name} settings for a trainer whose host state "
                              f"holds {self.host.optimizer.name}'s rows {self.host.optimizer.states}; the optimizer "
                              "is fixed at compile: compile again with optimizer= the one you want")
        self.optimizer = optimizer
        self.executor.optimizer = optimizer

    def save(self, path, **kwargs):
        """Save a Hugging Face-layout checkpoint plus resumable state; see ``megatrain.checkpoint.save_checkpoint``.
        Data parallel: every rank holds the same state, rank 0 writes it and the others wait for it."""
        from megatrain.checkpoint import save_checkpoint

        if self.plan.data_parallel == 1:
            return save_checkpoint(self, path, **kwargs)
        self.flush()
        dp = self.host.data_parallel
        if self.host.sliced:
            return self._save_sliced(path, **kwargs)
        if self.host.nvme_shards is not None:
            # Rank 0 reads the NVMe moments from its node's files (every node holds the whole state,
            # so the files of node 0's ranks hold every shard: HostState.read_moment): each rank's
            # last NVME_WRITE must be done first.
            dp.barrier("the barrier before rank 0 reads the ranks' NVMe files for a save")
        from megatrain.runtime.distributed import patient_barrier

        try:
            out = save_checkpoint(self, path, **kwargs) if dp.topo.rank == 0 else None
        except BaseException as e:
            patient_barrier("the wait for rank 0's save", failed=e)
            raise
        # A save takes as long as the disk needs, longer than a collective should wait: the other
        # ranks wait while rank 0's heartbeat goes on.
        patient_barrier("the wait for rank 0's save")
        return out

    def _save_sliced(self, path, **kwargs):
        """``save`` of a host state sharded across nodes: once every rank's update is in its node's
        slice, global rank 0 writes the checkpoint, reading each row whole from the node leaders'
        slices as it goes (``runtime.distributed.SliceReader``, one layer at a time), while the
        other leaders serve those reads; then every rank waits for the write."""
        from megatrain.checkpoint import save_checkpoint
        from megatrain.runtime.distributed import SliceReader

        dp = self.host.data_parallel
        dp.barrier("the barrier before a sharded save")  # every rank's shards of the last update are in place
        reader = SliceReader(self.host, dp, self.plan)
        out = None
        if dp.topo.rank == 0:
            self._slice_reader = reader
            try:
                out = save_checkpoint(self, path, **kwargs)
            finally:
                self._slice_reader = None
                reader.close()
        elif dp.writer:
            reader.serve()
        dp.barrier("the barrier after rank 0's save")
        return out

    def load(self, path, **kwargs) -> dict:
        """Resume from ``save``'s checkpoint; returns its ``extra_state``. See ``load_checkpoint``.
        Data parallel: every rank reads it and waits for the others, so it loads into any number
        of ranks (the state is the same on every rank)."""
        from megatrain.checkpoint import load_checkpoint

        extra = load_checkpoint(self, path, **kwargs)
        self._loaded_by_every_rank()
        return extra

    def load_hf_weights(self, path, **kwargs):
        """Stream (sharded) safetensors weights into the host tiles; see ``load_hf_weights``.
        Data parallel: as ``load``, every rank reads them and waits for the others."""
        from megatrain.checkpoint import load_hf_weights

        out = load_hf_weights(self, path, **kwargs)
        self._loaded_by_every_rank()
        return out

    def _loaded_by_every_rank(self) -> None:
        """Data parallel: every rank read the same files (the ranks of a node wrote the same bytes
        into their shared tiles); none steps before all have."""
        if self.plan.data_parallel > 1:
            self.host.data_parallel.barrier("the barrier after the ranks' load")

    # -- the checkpoint boundary ------------------------------------------------------------------
    def state_dict(self, *, flush: bool = True) -> dict[str, Any]:
        """The trainer's whole training state, as views of its memory: what a checkpoint saves and
        loads (``megatrain.checkpoint`` reads it and loads into it, as torchtitan's checkpointer
        does with its ``Stateful`` components). A deferred update is applied first (``flush``), so
        the weights are the latest; a loader that only writes into the views passes
        ``flush=False`` (the load drops that update, and a refused load leaves it pending).

        Returns a dict of:
            ``"model"``: ``{name: Tensor}``, each parameter by its ``state_dict`` name (Hugging Face
                naming), an FP32 view into its layer's master tile, in graph order.
            ``"buffers"``: ``{name: Tensor}``, the module's persistent buffers (its own tensors and
                dtypes), except those on the ``meta`` device, and the parameters no layer holds
                (``graph.meta["unused_parameters"]``: the loss never reads them, so they never change).
            ``"masters"``: ``{"<layer>.master": Tensor[numel]}``, each layer's FP32 master row (the
                memory ``"model"`` views, whole, padding included).
            ``"optimizer"``: ``{"<layer>.<state>": Tensor[trainable_numel]}`` for each state of the
                optimizer's spec (``megatrain.optim``; AdamW: ``exp_avg``, ``exp_avg_sq``; Lion:
                ``exp_avg``), the FP32 moment rows of each layer's trainable prefix (frozen parameters,
                laid out after it, have none); for a layer whose moments live on NVMe
                (``Plan.nvme_moments``) an :class:`~megatrain.runtime.host.NvmeMomentRow`, which
                reads the row from its file (``read()``) and writes one into it (``copy_``), so
                the state of such layers is never all in host memory at once. Likewise a layer
                whose master lives on NVMe (``Plan.nvme_masters``) gives
                :class:`~megatrain.runtime.host.NvmeMasterRow` entries in ``"model"`` and
                ``"masters"`` (its module parameters are ``meta`` tensors: read them here).
                With a host state sharded across nodes (``Plan.host_state == "shard"``) the entries
                of ``"model"``, ``"masters"`` and ``"optimizer"`` are
                :class:`~megatrain.runtime.host.SlicedRow` parts of the whole rows: a load writes
                this node's part of each; only :meth:`save` (every rank calling it) reads them.
            ``"adam_steps"``: ``{layer name: float}``, each layer's optimizer step count.
            ``"step_count"``: ``int``, the steps this trainer has taken.
            ``"optimizer_settings"``: the ``AdamW`` or ``Lion`` settings (learning rate included).
            ``"layers"``: the tile layout, one ``{"name", "numel", "trainable_numel", "params":
                [[name, shape, offset], ...]}`` per layer: what makes another trainer's state fit
                this one.

        Raises:
            StepError: as ``flush``.
        """
        if flush:
            self.flush()
        host, layers = self.host, self.graph.layers
        model, masters, optimizer = self._sliced_rows() if host.sliced else (
            {spec.name: host.param_row(li, pi) for li, layer in enumerate(layers)
             for pi, spec in enumerate(layer.params)},
            {f"{layer.name}.master": host.master_row(li) for li, layer in enumerate(layers)},
            {f"{layer.name}.{kind}": host.moment_row(li, k) for li, layer in enumerate(layers)
             for k, kind in enumerate(host.optimizer.states)})
        # state_dict() returns detached tensors sharing the module's storage: copying into one
        # writes the module's buffer.
        # A tied parameter's other names (lm_head.weight) are no buffers: it is saved once, in "model".
        # A parameter the loss never reads (LLaVA's last vision block) is in no layer: it is kept
        # here as the model holds it, so that a checkpoint is the whole model.
        placed = {id(p) for name, p in self.model.named_parameters(remove_duplicate=False) if name in model}
        aliases = {name for name, p in self.model.named_parameters(remove_duplicate=False) if id(p) in placed}
        buffers = {name: t for name, t in self.model.state_dict().items()
                   if name not in model and name not in aliases and isinstance(t, torch.Tensor)
                   and t.device.type != "meta"}
        return {
            "model": model,
            "buffers": buffers,
            "masters": masters,
            "optimizer": optimizer,
            "adam_steps": {layer.name: float(host.steps[li]) for li, layer in enumerate(layers)},
            "step_count": self.step_count,
            "optimizer_settings": self.optimizer,
            "layers": [{"name": layer.name, "numel": layer.numel, "trainable_numel": layer.trainable_numel,
                        "params": [[p.name, list(p.shape), p.offset] for p in layer.params]} for layer in layers],
        }

    def _sliced_rows(self) -> tuple[dict[str, SlicedRow], dict[str, SlicedRow], dict[str, SlicedRow]]:
        """:meth:`state_dict`'s ``"model"``, ``"masters"`` and ``"optimizer"`` of a host state
        sharded across nodes: :class:`~megatrain.runtime.host.SlicedRow` entries (a load writes
        each node's part; only :meth:`save`, on global rank 0, reads them)."""
        host, layers, fetch = self.host, self.graph.layers, self._fetch_row
        return ({spec.name: SlicedRow(host, li, MASTER, spec.offset, spec.shape, fetch)
                 for li, layer in enumerate(layers) for spec in layer.params},
                {f"{layer.name}.master": SlicedRow(host, li, MASTER, 0, (layer.numel,), fetch)
                 for li, layer in enumerate(layers)},
                {f"{layer.name}.{kind}": SlicedRow(host, li, k + 1, 0, (layer.trainable_numel,), fetch)
                 for li, layer in enumerate(layers) for k, kind in enumerate(host.optimizer.states)})

    def _fetch_row(self, layer: int, kind: int) -> torch.Tensor:
        """A whole row of a sharded host state, gathered to global rank 0 while :meth:`save` runs."""
        if self._slice_reader is None:
            raise ConfigError(f"layer {self.graph.layers[layer].name!r}: the host state is sharded across "
                              f"{self.plan.nodes} nodes (Plan.host_state='shard'), so its weights are read only "
                              "by Trainer.save, called on every rank; save a checkpoint and read that")
        return self._slice_reader.row(layer, kind)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`: tensors are copied into the tiles and buffers (a loader that
        already wrote into this trainer's ``state_dict()`` views, as a checkpoint load does, passes
        those same tensors and nothing is copied twice); AdamW steps, the step count and the AdamW
        settings are set; an update deferred from before is dropped (its gradients belong to other
        weights). ``state`` may omit ``"masters"`` (``"model"`` holds the same weights).

        Raises:
            CheckpointError: a layer layout, tensor name or shape that differs from this trainer's
                (the message names it); checked before anything changes.
        """
        mine = self.state_dict(flush=False)  # a pending update is dropped, not applied to what is overwritten
        theirs_spec = spec_of(state["optimizer_settings"])
        if theirs_spec is not self.host.optimizer:
            raise CheckpointError(f"load_state_dict: the state is of a {theirs_spec.name} trainer (rows "
                                  f"{theirs_spec.states}), this trainer runs {self.host.optimizer.name} (rows "
                                  f"{self.host.optimizer.states}); compile with optimizer={{'name': "
                                  f"{theirs_spec.name!r}, ...}} to resume it")
        if state["layers"] != mine["layers"]:
            raise CheckpointError("load_state_dict: the state's layer layout differs from this trainer's; load the "
                                  "state of a trainer compiled from the same model")
        pairs = []
        for group in ("model", "buffers", "masters", "optimizer"):
            if group == "masters" and group not in state:
                continue
            theirs = state[group]
            if set(theirs) != set(mine[group]):
                diff = sorted(set(theirs) ^ set(mine[group]))
                raise CheckpointError(f"load_state_dict: {group} tensors differ from this trainer's: {diff[:8]}")
            for name, dst in mine[group].items():
                src = theirs[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise CheckpointError(f"load_state_dict: {group} tensor {name!r} has shape {list(src.shape)}, "
                                          f"this trainer's {list(dst.shape)}")
                pairs.append((dst, src))
        if set(state["adam_steps"]) != set(mine["adam_steps"]):
            raise CheckpointError("load_state_dict: adam_steps name other layers than this trainer's")
        with torch.no_grad(), self.host.batched_nvme_writes():
            for dst, src in pairs:
                if isinstance(dst, (NvmeRow, SlicedRow)):
                    if not dst.same(src):  # written through to the file
                        dst.copy_(as_tensor(src))
                elif isinstance(src, NvmeRow):
                    dst.copy_(src.read())
                elif not (dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype and dst.shape == src.shape):
                    dst.copy_(src)
        for li, layer in enumerate(self.graph.layers):
            self.host.steps[li].fill_(float(state["adam_steps"][layer.name]))
        self.step_count = int(state["step_count"])
        self.set_optimizer(state["optimizer_settings"])
        self.drop_pending_updates()

    def set_lr(self, lr: float) -> None:
        """Learning rate for the following steps (for a schedule such as warm-up then cosine)."""
        if not lr >= 0:  # also refuses NaN
            raise ConfigError(f"learning rate {lr} must be >= 0")
        self.set_optimizer(self.optimizer.model_copy(update={"lr": float(lr)}))

    @property
    def graph(self) -> LayerGraph:
        return self.traced.graph

    def step(self, batch: Mapping[str, torch.Tensor] | torch.Tensor, loss: "TokenLoss | None" = None) -> StepResult:
        """Forward, backward and AdamW update for one global batch.

        ``batch`` maps each compiled input name to a ``LongTensor[global_batch, seq_len]`` (a plain
        tensor is taken as ``input_ids``, and as ``labels`` too when the model takes labels);
        ``attention_mask`` may also be bool or any integer dtype, 0 (padding) or 1. It is split
        along dim 0 into ``micro_batches`` micro-batches of ``micro_batch_size``. Padding (left or
        right, by ``attention_mask``), ``position_ids`` and packed rows (``position_ids`` that restart
        at 0 for each document: attention does not cross documents) run as the model runs them
        eagerly with ``use_cache=False``; labels of -100 are ignored by the model's loss. The step
        trains on the loss of the whole global batch: the mean over its supervised tokens, whatever
        the split into micro-batches and ranks (:mod:`megatrain.runtime.loss`); they are counted
        from the labels before the step, and a micro-batch without one adds nothing.

        ``loss``: train on this loss of the per-token log-probabilities instead of the model's own
        (a :class:`megatrain.rl.TokenLoss`: ``megatrain.rl.GRPOLoss``, ``megatrain.rl.DPOLoss``);
        ``batch`` then also holds the tensors the loss reads (``loss.inputs``: advantages, old and
        reference log-probabilities, ``[global_batch, seq_len]`` or ``[global_batch]`` float32),
        split with the rows. The loss is that of the whole global batch, whatever the split into
        micro-batches and ranks (:mod:`megatrain.rl.losses`); ``StepResult.loss`` is its value
        and ``micro_batch_losses`` each micro-batch's term of it. Bad input (a row without a
        target, a non-finite advantage, an odd DPO batch, a tensor of the wrong shape) raises
        BatchError before anything runs, on every rank under data parallel.

        Raises:
            BatchError: missing or extra inputs, a shape or dtype other than compiled, an
                ``attention_mask`` with values other than 0 and 1, a token id (``input_ids``) or
                label (``labels``, -100 ignored) outside the model's vocabulary, or a global batch
                without a supervised token (every label -100 after the shift: its loss would be
                the mean over nothing); checked before anything runs, so nothing changes. Under
                data parallel a rank sees the other ranks' labels only in the step's COUNT_REDUCE:
                a global batch without targets then runs, applies nothing of itself (the previous
                step's deferred update, if any, is applied) and raises on every rank.
            StepError: the schedule raised while it ran (the cause is chained). With
                ``max_grad_norm`` (deferred updates) the trainer is then as if the batch had never
                been given: the previous step's update is applied exactly once, in full or still
                pending, and parameters, moments and step counts hold nothing of the failed batch.
                Without it, layers whose update ran before the failure keep it (once; listed in
                ``StepError.updated_layers``) and the others are as before. ``step_count`` does not
                advance. KeyboardInterrupt is re-raised as it is, after the same clean-up.
        """
        o = self.options
        if loss is not None:
            from megatrain.rl.logprobs import loss_inputs

            batch, extra = loss_inputs(self, batch, loss)
        parts = self._split(batch, o.micro_batches)
        tokens = sum(_real_tokens(p) for p in parts)
        targets = self.executor.targets(parts)
        head = None
        if loss is not None:
            from megatrain.rl.logprobs import loss_head

            head = loss_head(self, parts, extra, loss)  # BatchError on every rank before anything runs
        elif self.plan.data_parallel == 1 and None not in targets and sum(targets) == 0:
            raise BatchError(_no_targets("the global batch", 1))
        t0 = time.perf_counter()
        if self.plan.data_parallel > 1:
            from megatrain.runtime.distributed import Heartbeat

            Heartbeat.step(f"step {self.step_count + 1}")  # a collective that fails names a rank not there
        rest = ()  # the previous update's layers a failure left pending, applied alone first
        if self._pending_layers and self.schedule is self.schedules.first:
            rest = self._apply_pending(None)  # a failure left part of the update pending
        out = self._run_step(self.schedule, parts, f"step {self.step_count + 1}", targets, head=head)
        seconds = time.perf_counter() - t0
        if out.supervised_tokens == 0 and head is None:  # data parallel: the ranks learned it from the COUNT_REDUCE
            raise BatchError(_no_targets("the global batch", self.plan.data_parallel)
                             + " Nothing of it was applied")
        self.step_count += 1
        losses, targets = tuple(out.losses), tuple(out.targets)
        deferred = self.plan.optimizer is OptimizerPlacement.NEXT_FORWARD
        if deferred:
            # The update waits for the next schedule; it is dropped here when anything was not finite.
            # It runs with this step's AdamW settings (a later set_lr is for the next step's update).
            max_norm = o.max_grad_norm
            # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
            clip_scale = None if max_norm is None else min(1.0, max_norm / (out.grad_norm + 1e-6))
            self.executor.defer(frozenset(self.schedules.tiles) if out.finite else frozenset(), clip_scale,
                                self.optimizer)
            skipped = () if out.finite else tuple(self.schedules.tiles)
        else:
            skipped = tuple(out.updates_skipped)
        if self.plan.data_parallel > 1:
            losses, targets, tokens = _gather_losses(losses, targets, tokens, self.host.data_parallel.groups.world)
        if head is None:
            weights = loss_weights(targets, out.supervised_tokens, len(losses), per_token=o.per_token_loss)
            means = tuple(micro_batch_means(losses, targets))
        else:  # each micro-batch's loss is its term of the global batch's
            weights, means = [1.0] * len(losses), losses
        return StepResult(step=self.step_count, loss=sum(w * x for w, x in zip(weights, losses)),
                          micro_batch_losses=means, tokens=tokens,
                          supervised_tokens=out.supervised_tokens, seconds=seconds,
                          grad_norm=out.grad_norm, applied=out.finite and (deferred or not out.nonfinite_updates),
                          skipped_layers=skipped, updated_layers=() if deferred else tuple(self.executor.updated),
                          nonfinite_weights=rest + tuple(out.nonfinite_updates))

    def evaluate(self, batch: Mapping[str, torch.Tensor] | torch.Tensor) -> float:
        """The loss of ``batch`` without updating anything: the mean of its token losses over its
        supervised tokens (with ``per_token_loss=False``, the mean of its micro-batch means), as
        ``step`` reports it. Under data parallel every rank calls it with its part of the batch
        (any number of rows on each) and gets the loss of all of them together.

        ``batch`` has any multiple of ``micro_batch_size`` rows, each ``seq_len`` long.

        Raises:
            BatchError: a batch ``step`` would refuse, or one without a supervised token (on every
                rank together, under data parallel).
        """
        rows = self._rows(batch)
        mbs = self.options.micro_batch_size
        if rows % mbs:
            raise BatchError(f"evaluate got {rows} sequences; it needs a multiple of micro_batch_size={mbs}")
        k = rows // mbs
        parts = self._split(batch, k)
        targets = self.executor.targets(parts)
        self.flush()
        out = self._run_step(self._eval_schedule(k), parts, "evaluate", targets)
        counted = None not in targets
        # The sums over this rank's micro-batches of the losses, targets and micro-batch means (a
        # mean over no target adds nothing), and the micro-batches: the ranks' sums give the loss.
        means = micro_batch_means(out.losses, targets)
        sums = [sum(out.losses), sum(targets) if counted else 0, sum(0.0 if math.isnan(m) else m for m in means), k]
        world = self.plan.data_parallel
        if world > 1:
            from megatrain.runtime.distributed import sum_over_ranks

            with collective("the all-reduce of the evaluation's losses"):
                sums = sum_over_ranks(sums, torch.float64, self.host.data_parallel.groups.world).tolist()
        total, supervised, mean_sum, micro_batches = sums
        if counted and supervised == 0:
            raise BatchError(_no_targets("the evaluated batch", world))
        return total / supervised if self.options.per_token_loss else mean_sum / micro_batches

    def _eval_schedule(self, micro_batches: int) -> Schedule:
        """The eval schedule (forward only: no gradient, no optimizer state) of ``micro_batches``
        micro-batches of this plan, lowered and verified once."""
        if micro_batches not in self._eval_schedules:
            sched = lower(self.graph, _with_micro_batches(self.plan, micro_batches), mode="eval")
            verify(sched, self.graph)
            self._eval_schedules[micro_batches] = sched
        return self._eval_schedules[micro_batches]

    def logprobs(self, batch: Mapping[str, torch.Tensor], *, entropy: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The log-probability the model gives each label, forward only: the eval schedule of
        ``batch``'s micro-batches with the LM head computing ``log_softmax(logits)[label]`` a chunk
        of tokens at a time (``[tokens, vocab]`` never exists), as eager
        ``log_softmax(logits.float(), -1).gather(-1, labels)`` on the whole batch. Nothing is
        updated (a deferred update is applied first, as ``evaluate`` does).

        Alignment: ``out[b, t]`` is the log-probability of ``labels[b, t]`` given the tokens
        before it (Hugging Face's shift: the logits at ``t - 1`` predict it), and 0 where there is
        no target (``labels[b, t] == -100``, and ``t == 0``, which nothing predicts):
        ``megatrain.rl.target_mask(labels)`` is where it is defined. Per-token tensors built on
        ``labels`` (advantages, a response mask) line up with it.

        Args:
            batch: a dict of the compiled inputs (``labels`` among them), any multiple of
                ``micro_batch_size`` rows of ``seq_len``; other keys (a loss's tensors) are ignored.
            entropy: also return the entropy of each of those predictive distributions (nats,
                same alignment, 0 where there is no target).

        Returns:
            ``FloatTensor[rows, seq_len]`` float32 on the CPU; with ``entropy``, ``(logprobs, entropy)``.
            Under data parallel each rank gets its own rows (every rank calls it, as ``evaluate``).

        Raises:
            BatchError: a batch ``evaluate`` would refuse (its row count, shapes, dtypes, ids).
            ConfigError: a model without ``labels`` among its inputs, or whose loss is not a
                cross-entropy of its LM head (``megatrain.planner.trace.token_logprobs``).
        """
        from megatrain.rl.logprobs import token_logprobs

        return token_logprobs(self, batch, entropy=entropy)

    # -- batches ---------------------------------------------------------------------------------
    def _as_dict(self, batch) -> dict[str, torch.Tensor]:
        names = self.options.input_names
        if isinstance(batch, torch.Tensor):
            if not set(names) <= {"input_ids", "labels"} or "input_ids" not in names:
                raise BatchError(f"a plain tensor batch is taken as input_ids (and labels), but the model "
                                 f"was compiled with inputs {list(names)}; pass a dict")
            return {n: batch for n in names}
        if not isinstance(batch, Mapping):
            raise BatchError(f"batch must be a dict of tensors or a tensor, not {type(batch).__name__}")
        extra = sorted(set(batch) - set(names))
        if extra:
            raise BatchError(f"batch has inputs {extra} that the model was not compiled with (compiled: "
                             f"{list(names)}); drop them or compile with input_names including them")
        _missing(names, set(batch))
        return dict(batch)

    def _rows(self, batch) -> int:
        d = self._as_dict(batch)
        first = d.get("input_ids", next(iter(d.values())))  # not pixel_values: LLaVA's may hold several per row
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise BatchError("batch tensors must be [batch, seq_len]")
        return first.shape[0]

    def _split(self, batch, k: int) -> list[dict[str, torch.Tensor]]:
        o = self.options
        # A VLM's images as traced: Qwen2-VL's grids checked and each micro-batch's patches, tower
        # inputs and M-RoPE positions made; LLaVA's real images first in each micro-batch, zeros after.
        slots = (self.graph.value_by_name(IMAGE_INPUT).shape[0] // o.micro_batch_size
                 if IMAGE_INPUT in o.input_names else 1)
        d = prepare_images(self.model, self._as_dict(batch), o.input_names, self.graph.meta.get("image_grid_thw"),
                           o.micro_batch_size, slots)
        # Each input's micro-batch is its traced length along dim 0: micro_batch_size rows, or
        # LLaVA's micro_batch_size x images_per_row images.
        per: dict[str, int] = {}
        for name, t in d.items():
            if not isinstance(t, torch.Tensor):
                raise BatchError(f"batch[{name!r}] is a {type(t).__name__}, not a tensor")
            if name == "attention_mask":
                d[name] = t = _mask_as_long(t)
            # The traced shape of one micro-batch: [micro_batch_size, seq_len] token ids, or a
            # vision-language model's images, [micro_batch_size * images_per_row, C, H, W] float32.
            v = self.graph.value_by_name(name)
            per[name] = v.shape[0]
            want = (k * v.shape[0], *v.shape[1:])
            if str(t.dtype).removeprefix("torch.") != v.dtype:
                what = ("token inputs must be torch.long (int64): convert with .long()" if v.dtype == "int64"
                        else f"the model was traced with {v.dtype} {name}: convert with .to(torch.{v.dtype})")
                raise BatchError(f"batch[{name!r}] has dtype {t.dtype}; {what}")
            if tuple(t.shape) != want:
                per_row = ", ".join(map(str, v.shape[1:]))
                rows = f"{k} micro-batches x {o.micro_batch_size}"
                if v.shape[0] != o.micro_batch_size:  # LLaVA's images: images_per_row of them per row
                    rows += f" rows x images_per_row={v.shape[0] // o.micro_batch_size}"
                raise BatchError(f"batch[{name!r}] has shape {tuple(t.shape)}, but the trainer was compiled "
                                 f"for [{rows}, {per_row}] = {list(want)}: "
                                 "pad or crop the batch, or compile again with its shape")
        for name, limit in self._token_limits.items():
            _check_ids(name, d[name], limit)
        return [{n: t[i * per[n]:(i + 1) * per[n]] for n, t in d.items()} for i in range(k)]


def data_parallel_world() -> int:
    """Ranks of the default ``torch.distributed`` process group (1 when none is initialised): how
    many processes train one global batch together (``torchrun --nproc-per-node N``)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _gather_losses(losses: tuple[float, ...], targets: tuple[int | None, ...], tokens: int,
                   group) -> tuple[tuple[float, ...], tuple[int | None, ...], int]:
    """Every rank's micro-batch losses and supervised tokens in rank order (the global batch's
    micro-batches, as one process running them all would list them) and the global token count,
    gathered in ``group`` (the host collectives' gloo group of every rank: the losses are host
    numbers; float64 holds the counts exactly)."""
    import torch.distributed as dist

    world, m = dist.get_world_size(), len(losses)
    mine = torch.tensor([*losses, *(math.nan if n is None else n for n in targets), tokens], dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(world)]
    with collective("the all-gather of the step's losses"):
        dist.all_gather(parts, mine, group=group)
    rows = [p.tolist() for p in parts]
    return (tuple(x for r in rows for x in r[:m]),
            tuple(None if math.isnan(n) else int(n) for r in rows for n in r[m:2 * m]),
            int(sum(r[-1] for r in rows)))


def _no_targets(what: str, world: int) -> str:
    ranks = f" on all {world} ranks" if world > 1 else ""
    return (f"{what} has no supervised token{ranks}: every label is -100 after the model's shift, so its loss "
            "would be the mean over nothing (NaN). Drop the batch, or give it labels (-100 marks only the tokens "
            "the loss skips: padding, prompts, document starts).")


def _mask_as_long(mask: torch.Tensor) -> torch.Tensor:
    """A Hugging Face padding mask as the model was traced with it: ``LongTensor`` of 0/1.

    Accepts bool and integer masks (what tokenizers and collators return); values are checked.

    Raises:
        BatchError: a floating-point mask, or values other than 0 and 1 (an additive mask of
            0/-inf, or a 4D mask, is not a padding mask).
    """
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise BatchError(f"batch['attention_mask'] has dtype {mask.dtype}; pass the 0/1 padding mask (1 = real "
                         "token, 0 = padding) as torch.long or torch.bool, as Hugging Face tokenizers return it")
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = sorted({int(v) for v in mask.unique()} - {0, 1})[:5]
        raise BatchError(f"batch['attention_mask'] holds values {bad}; a padding mask is 0 (padding) or 1 "
                         "(real token)")
    return mask.long() if mask.dtype != torch.long else mask


def _real_tokens(part: Mapping[str, torch.Tensor]) -> int:
    """Tokens of a micro-batch that are not padding: ``attention_mask.sum()``, else every token."""
    mask = part.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    return next(iter(part.values())).numel()


def _missing(names: Sequence[str], have: set[str]) -> None:
    miss = [n for n in names if n not in have]
    if miss:
        raise BatchError(f"batch lacks inputs {miss}; the model was compiled with inputs {list(names)}")


def _token_limits(model: nn.Module, names: Sequence[str]) -> dict[str, int]:
    """The exclusive upper bound of ``input_ids`` (the input embedding's rows) and of ``labels``
    (the output layer's rows), where the model states them: Hugging Face's ``get_input_embeddings``
    and ``get_output_embeddings`` (labels: else the input bound). Other models are not checked: a
    guess (say, their first ``nn.Embedding``, which may be a position table) could refuse good
    batches; an id out of range then fails inside the step, which leaves the trainer as it was."""
    def call(name: str):
        fn = getattr(model, name, None)
        try:
            return fn() if callable(fn) else None
        except (NotImplementedError, AttributeError):  # transformers' base class without embeddings
            return None

    emb = call("get_input_embeddings")
    head = call("get_output_embeddings")
    vocab_in = emb.num_embeddings if isinstance(emb, nn.Embedding) else None
    vocab_out = head.out_features if isinstance(head, nn.Linear) else vocab_in
    limits = {"input_ids": vocab_in, "labels": vocab_out}
    return {n: limits[n] for n in names if limits.get(n) is not None}


def _check_ids(name: str, t: torch.Tensor, limit: int) -> None:
    bad = (t < 0) | (t >= limit)
    if name == "labels":
        bad &= t != IGNORE_INDEX
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        allowed = f"0..{limit - 1}" + (f" or {IGNORE_INDEX} (ignored)" if name == "labels" else "")
        raise BatchError(f"batch[{name!r}] holds {int(t[where])} at {list(where)}, but the model has {limit} "
                         f"{'embedding rows' if name == 'input_ids' else 'output classes'} ({name} must be "
                         f"{allowed}); use a tokenizer that matches the model's vocab_size")


def _with_micro_batches(plan: Plan, k: int) -> Plan:
    return dataclasses.replace(plan, micro_batches=k)


def _unsaved_error(what: str, e: Exception, ran: tuple[int, ...], unsaved: set[int]) -> StepError:
    """The StepError of a run that stepped NVMe state in an I/O buffer and failed before its
    NVME_WRITE saved it: those layers' files hold the state from before the step while their Adam
    step counts (and the BF16 staging tiles of masters on NVMe) advanced, so no story of the
    trainer's state holds; the way on is the last checkpoint."""
    lost = sorted(unsaved)
    return StepError(f"{what} failed while running ({type(e).__name__}: {e}); the optimizer steps of layers "
                     f"{list(ran)} ran, and those of layers {lost} updated masters or Adam moments in their NVMe I/O "
                     "buffers that were never written back: their NVMe files hold the state from before the step "
                     "while their Adam step counts (and BF16 staging tiles) advanced, so the trainer's state is "
                     "inconsistent. Fix the NVMe directory (space, permissions) and load the last checkpoint "
                     "(Trainer.load) before training on", updated_layers=ran, unsaved_layers=tuple(lost))


__all__ = ["StepResult", "Trainer", "PlannedModel", "Schedules", "data_parallel_world"]
