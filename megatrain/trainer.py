"""The :class:`Trainer`: the running object that ``megatrain.compile`` and ``megatrain.materialize``
build (:mod:`megatrain.product`, the floor above), whose ``step`` executes the planned schedules over
host tiles, a backend and an executor it is given. It imports nothing that builds it.
``PlannedModel`` and ``Schedules`` (:mod:`megatrain.planner.front`) stay importable from here.

Here are the step, the evaluation and the stories a failed run leaves (deferred updates included).
The rest of the running object is one concern to a module, on the floor below: the batch checks
and the micro-batch cut (:mod:`megatrain.batches`), the state as views of the host rows and its
restore (:mod:`megatrain.training_state`), and checkpoints across data-parallel ranks
(:mod:`megatrain.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from megatrain.optim import AdamW, Lion, spec_of
from megatrain.errors import BatchError, CollectiveError, ConfigError, StepError
# PlannedModel and Schedules are re-exported: `from megatrain.trainer import PlannedModel` stays.
from megatrain.planner.front import PlannedModel, Schedules
from megatrain.ir.graph import LayerGraph
from megatrain.batches import MicroBatches, no_targets, real_tokens
from megatrain import training_state
from megatrain.planner.lower import lower
from megatrain.ir.plan import OptimizerPlacement, Plan
from megatrain.ir.schedule import Schedule
from megatrain.planner.verify import verify
from megatrain.runtime.backend import Backend
from megatrain.runtime.distributed import collective
from megatrain.runtime.executor import Executor, StepOutput
from megatrain.runtime.loss import loss_weights, micro_batch_means
from megatrain.runtime.host import HostState

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
        # The SliceReader while rank 0 saves a host state sharded across nodes (host_state "shard"):
        # the sharded rows of state_dict read through it.
        self.slice_reader = None
        self.batches = MicroBatches(self.model, self.graph, self.options.input_names, self.options.micro_batch_size)

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

    def run_schedule(self, schedule: Schedule, parts, what: str, targets: list[int | None], **run) -> StepOutput:
        """Run a train or eval schedule over ``parts`` (``self.batches.split``'s micro-batches),
        whose supervised tokens are ``targets`` (``Executor.targets``); ``what`` names the run in
        errors ("step 3", "evaluate"); ``run``: ``Executor.run``'s ``head`` and ``weights``.

        Raises:
            StepError: the schedule raised. The trainer's state is then made to match one of two
                stories and the error says which: with deferred updates (NEXT_FORWARD), the
                previous step's update was applied in full (or not at all, and is still pending)
                and nothing of this batch was; with updates during backward, the layers listed in
                ``StepError.updated_layers`` took this batch's update once and the rest are
                untouched. The executor has closed the backend's run (``Backend.abort``) and taken
                the carried updates that ran off the pending ones.
            CollectiveError: another rank failed (no story holds across ranks).
        """
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
        Data parallel: every rank calls it; every rank holds the same state, rank 0 writes it and
        the others wait for it (``megatrain.checkpoint.save_on_ranks``)."""
        from megatrain.checkpoint import save_on_ranks

        return save_on_ranks(self, path, **kwargs)

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
        return training_state.state_dict(self)

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
        training_state.load_state_dict(self, state)

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
        parts = self.batches.split(batch, o.micro_batches)
        tokens = sum(real_tokens(p) for p in parts)
        targets = self.executor.targets(parts)
        head = None
        if loss is not None:
            from megatrain.rl.logprobs import loss_head

            head = loss_head(self, parts, extra, loss)  # BatchError on every rank before anything runs
        elif self.plan.data_parallel == 1 and None not in targets and sum(targets) == 0:
            raise BatchError(no_targets("the global batch", 1))
        t0 = time.perf_counter()
        if self.plan.data_parallel > 1:
            from megatrain.runtime.distributed import Heartbeat

            Heartbeat.step(f"step {self.step_count + 1}")  # a collective that fails names a rank not there
        rest = ()  # the previous update's layers a failure left pending, applied alone first
        if self._pending_layers and self.schedule is self.schedules.first:
            rest = self._apply_pending(None)  # a failure left part of the update pending
        out = self.run_schedule(self.schedule, parts, f"step {self.step_count + 1}", targets, head=head)
        seconds = time.perf_counter() - t0
        if out.supervised_tokens == 0 and head is None:  # data parallel: the ranks learned it from the COUNT_REDUCE
            raise BatchError(no_targets("the global batch", self.plan.data_parallel)
                             + " Nothing of it was applied")
        self.step_count += 1
        deferred, skipped = self._keep_update(out)
        return self._result(out, tokens, seconds, head is not None, rest + tuple(out.nonfinite_updates),
                            deferred, skipped)

    def _keep_update(self, out: StepOutput) -> tuple[bool, tuple[int, ...]]:
        """The step's update, once its schedule ran: with NEXT_FORWARD it waits for the next
        schedule, with this step's clipping scale and optimizer settings (a later ``set_lr`` is
        for the next step's update), or is dropped when anything was not finite. Returns whether
        it is deferred, and the layers whose update was skipped."""
        if self.plan.optimizer is not OptimizerPlacement.NEXT_FORWARD:
            return False, tuple(out.updates_skipped)
        max_norm = self.options.max_grad_norm
        # torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1.
        clip_scale = None if max_norm is None else min(1.0, max_norm / (out.grad_norm + 1e-6))
        self.executor.defer(frozenset(self.schedules.tiles) if out.finite else frozenset(), clip_scale,
                            self.optimizer)
        return True, () if out.finite else tuple(self.schedules.tiles)

    def _result(self, out: StepOutput, tokens: int, seconds: float, own_loss: bool, nonfinite: tuple[int, ...],
                deferred: bool, skipped: tuple[int, ...]) -> StepResult:
        """The :class:`StepResult` of a step that ran: every rank's micro-batch losses (gathered
        under data parallel) weighted into the global batch's loss; ``own_loss``: a
        ``TokenLoss``'s, whose micro-batch losses are already its terms of the global batch's."""
        losses, targets = tuple(out.losses), tuple(out.targets)
        if self.plan.data_parallel > 1:
            losses, targets, tokens = _gather_losses(losses, targets, tokens, self.host.data_parallel.groups.world)
        if not own_loss:
            weights = loss_weights(targets, out.supervised_tokens, len(losses), per_token=self.options.per_token_loss)
            means = tuple(micro_batch_means(losses, targets))
        else:  # each micro-batch's loss is its term of the global batch's
            weights, means = [1.0] * len(losses), losses
        return StepResult(step=self.step_count, loss=sum(w * x for w, x in zip(weights, losses)),
                          micro_batch_losses=means, tokens=tokens,
                          supervised_tokens=out.supervised_tokens, seconds=seconds,
                          grad_norm=out.grad_norm, applied=out.finite and (deferred or not out.nonfinite_updates),
                          skipped_layers=skipped, updated_layers=() if deferred else tuple(self.executor.updated),
                          nonfinite_weights=nonfinite)

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
        rows = self.batches.rows(batch)
        mbs = self.options.micro_batch_size
        if rows % mbs:
            raise BatchError(f"evaluate got {rows} sequences; it needs a multiple of micro_batch_size={mbs}")
        k = rows // mbs
        parts = self.batches.split(batch, k)
        targets = self.executor.targets(parts)
        self.flush()
        out = self.run_schedule(self.eval_schedule(k), parts, "evaluate", targets)
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
            raise BatchError(no_targets("the evaluated batch", world))
        return total / supervised if self.options.per_token_loss else mean_sum / micro_batches

    def eval_schedule(self, micro_batches: int) -> Schedule:
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
