"""Errors raised by megatrain. Each message names the object, the rule it broke and the fix."""

from __future__ import annotations


class MegatrainError(Exception):
    """Base class of every error megatrain raises on purpose."""


class ConfigError(MegatrainError, ValueError):
    """A compile or optimizer setting is out of range or inconsistent."""


class TraceError(MegatrainError):
    """The model cannot be traced into a layer graph (names the module and the failing op)."""


class UnsupportedModelError(TraceError):
    """The model traced, but uses something megatrain does not support yet (names what)."""


class PlanError(MegatrainError):
    """No plan fits the requested hardware and batch."""


class ScheduleError(MegatrainError):
    """A schedule breaks one of the verifier's invariants (names the op and the rule)."""


class BatchError(MegatrainError, ValueError):
    """A batch does not match the shapes and dtypes the trainer was compiled for."""


class StepError(MegatrainError):
    """A training step raised while its schedule ran (a failing op, out of memory, an interrupt of a
    kernel). The message says what of the trainer's state changed; ``updated_layers`` lists the
    layers whose update from the failed batch was applied (only without ``max_grad_norm``, where
    each layer is updated as its gradients arrive; empty otherwise). ``unsaved_layers``: layers
    whose update ran on NVMe state (``Plan.nvme_moments``) that its NVME_WRITE did not save, so
    their files are behind their Adam step counts (and staging tiles): load the last checkpoint.
    The original exception is the ``__cause__``."""

    def __init__(self, message: str, updated_layers: tuple[int, ...] = (), unsaved_layers: tuple[int, ...] = ()):
        super().__init__(message)
        self.updated_layers = updated_layers
        # Layers whose optimizer step ran in their NVMe I/O buffer but whose NVME_WRITE did not
        # complete: their files hold the state from before the step (load the last checkpoint).
        self.unsaved_layers = unsaved_layers


class CollectiveError(StepError):
    """Data parallel: a collective (or the barrier around a save or load) failed on this rank,
    because another rank died, hung past the process group's timeout or failed on its own. The
    ranks' states may differ from then on, so every rank stops; the message names the collective,
    the rank and the timeout, and says to restart every rank from the last checkpoint (saves are
    atomic: it is complete). The original exception is the ``__cause__``."""


class CheckpointError(MegatrainError):
    """A checkpoint cannot be written or read: missing, corrupt, interrupted, or made for another
    model. The message names the file and, where there is one, the tensor."""
