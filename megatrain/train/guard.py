"""The guard of ``megatrain train``: which steps keep their update, which are skipped, and when
the run rolls back to its last checkpoint.

A step is not kept when its loss or a gradient is NaN or infinite, when its update left a NaN or
infinite FP32 master (``StepResult.nonfinite_weights``: finite gradients can still diverge, as
with ``lr x weight_decay > 2``), or, with ``loss_spike``, when its loss exceeds ``loss_spike``
times the mean of the last :data:`SPIKE_WINDOW` kept steps' losses (PaLM, Chowdhery et al. 2022,
section 5.1, met loss spikes by restarting from a checkpoint before the spike and skipping the
batches around it; the guard does that one step at a time). How nothing of such a step is kept
depends on when the plan updates:

- deferred updates (``OptimizerPlacement.NEXT_FORWARD``, with ``max_grad_norm``): every gradient
  and the loss are known before any layer is updated, so the step's update is dropped (the
  trainer never applies it): a *skip*.
- updates during backward (no clipping): each layer is updated as its gradients arrive, so a
  gradient found non-finite later, or a spike known only at the end, comes after some layers took
  the update. Then, as with an update that left non-finite weights under either placement, the
  run *rolls back*: it loads its last checkpoint and runs the steps since then again on the same
  batches (the data order is a function of the step, and a resume is exact), leaving out the
  steps that were not kept. The result is the run that never took those batches; the cost is the
  steps replayed (at most ``checkpoint_interval``).

``nonfinite: stop`` stops at the first such step instead (nothing is saved), and
``max_consecutive_skips`` steps in a row not kept stop the run too: the last checkpoint, whose
weights are finite (``save_checkpoint`` refuses others), is kept.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

SPIKE_WINDOW = 20
"""Kept steps whose mean loss a spike is measured against; the check starts once there are this many."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a step: ``keep`` it; ``skip`` it (nothing of it was applied, or a deferred
    update that can still be dropped); ``rollback`` to the last checkpoint and replay without step
    ``blame`` (a layer took its update). ``why`` says what was wrong, for the log."""

    action: Literal["keep", "skip", "rollback"]
    blame: int = 0
    why: str = ""


@dataclass(slots=True)
class Guard:
    """The state the verdicts depend on: the kept losses of the last :data:`SPIKE_WINDOW` steps,
    the skipped steps in a row, and the steps since the last checkpoint that were not kept (a
    replay after a rollback leaves them out again, as the run that had them did)."""

    deferred: bool
    loss_spike: float | None
    window: deque = field(default_factory=lambda: deque(maxlen=SPIKE_WINDOW))
    in_a_row: int = 0
    not_kept: dict[int, str] = field(default_factory=dict)  # step -> why
    decay: str = ""  # decay_hint(lr, weight_decay): said with each non-finite step

    def judge(self, step: int, res, bad_weights: tuple[int, ...], layer_names) -> Verdict:
        """The verdict on ``step``'s ``StepResult``. ``bad_weights``: the layers (on any rank) whose
        update in the step's run left a non-finite master; ``layer_names``: ``graph.layers``."""
        if bad_weights:
            # Deferred: the updates that run at the start of this step are the previous step's.
            return self.diverged(step - 1 if self.deferred else step, bad_weights, layer_names)
        if not res.applied:
            what = "loss" if not math.isfinite(res.loss) else "gradient"
            why = f"step {step}: the {what} is not finite (loss {res.loss}, gradient norm {res.grad_norm}){self.decay}"
            return Verdict("rollback" if res.updated_layers else "skip", step, why)
        if self.loss_spike is not None and len(self.window) == SPIKE_WINDOW:
            mean = sum(self.window) / len(self.window)
            if res.loss > self.loss_spike * mean:
                why = (f"step {step}: the loss, {res.loss:.4f}, is {res.loss / mean:.1f}x the mean of the last "
                       f"{SPIKE_WINDOW} kept steps ({mean:.4f}), above loss_spike={self.loss_spike:g}")
                return Verdict("skip" if self.deferred else "rollback", step, why)
        return Verdict("keep", step)

    def diverged(self, blame: int, bad_weights: tuple[int, ...], layer_names) -> Verdict:
        """Step ``blame``'s update left the masters of ``bad_weights`` NaN or infinite: roll back."""
        names = ", ".join(layer_names[i].name for i in sorted(bad_weights)[:3])
        more = f" and {len(bad_weights) - 3} more" if len(bad_weights) > 3 else ""
        return Verdict("rollback", blame, f"step {blame}: its update made the weights of {names}{more} NaN or "
                                          "infinite (from finite gradients: too high a learning rate or weight "
                                          f"decay){self.decay}")

    def keep(self, loss: float) -> None:
        """A kept step: its loss joins the window, and the run of skipped steps ends."""
        self.in_a_row = 0
        self.window.append(loss)

    def state(self) -> dict:
        """What a checkpoint keeps, so that a resumed run (or a rollback) judges as this one does."""
        return {"skipped_in_a_row": self.in_a_row, "loss_window": list(self.window)}

    def restore(self, state: dict, step: int) -> None:
        """Back to a checkpoint's :meth:`state` at ``step``; the steps after it not kept stay known."""
        self.in_a_row = int(state.get("skipped_in_a_row", 0))
        self.window = deque(state.get("loss_window", ()), maxlen=SPIKE_WINDOW)
        self.not_kept = {s: why for s, why in self.not_kept.items() if s > step}


def decay_hint(lr: float, weight_decay: float) -> str:
    """What a non-finite step's message adds when the decay alone makes the weights diverge: decoupled
    weight decay multiplies every weight by ``1 - lr x weight_decay`` each step, which at
    ``lr x weight_decay >= 1`` zeroes or flips it whatever the gradients (``weight_decay: 1e30`` was
    reported as a non-finite gradient and nothing more); empty otherwise."""
    if lr * weight_decay < 1:
        return ""
    return (f"; lr {lr:g} x weight_decay {weight_decay:g} = {lr * weight_decay:g} >= 1, so each step multiplies every "
            f"weight by 1 - lr x weight_decay <= 0 whatever the gradients: use weight_decay < {1 / lr:g} (1 / lr)")
