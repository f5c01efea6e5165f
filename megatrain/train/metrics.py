"""A run's metrics: the rows of ``metrics.jsonl`` (:class:`MetricsLog`), the MFU and
predicted-step rates, and the loss plot."""

from __future__ import annotations

import io
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatrain.errors import ConfigError
from megatrain.files import raise_if_full, write_atomic
from megatrain.runtime.measure import measure_matmul_flops

if TYPE_CHECKING:
    from megatrain.train.config import TrainConfig
    from megatrain.trainer import PlannedModel

METRIC_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "supervised_tokens", "tokens_per_s", "mfu",
                 "predicted_step_s", "measured_step_s", "applied", "val_loss", "host_rss_mib",
                 "examples_trimmed", "examples_dropped")
"""Keys of every ``metrics.jsonl`` row. ``step`` is 1-based; ``loss`` the loss of the global batch,
the mean over its supervised tokens (``StepResult.loss``); ``lr`` the learning rate the step used;
``grad_norm`` the global L2 norm of the gradients before clipping; ``tokens`` the global batch's
tokens that are not padding (``StepResult.tokens``: prompts included) and ``supervised_tokens`` those
the loss is the mean over (labels not -100 after the shift, ``StepResult.supervised_tokens``);
``tokens_per_s`` is ``tokens`` (not ``supervised_tokens``) over ``measured_step_s``, the step's
wall time in seconds; ``mfu`` model FLOPs utilisation (module docstring); ``predicted_step_s``
the simulator's step time on the ``hardware`` spec, seconds, or null; ``applied`` false when the
step was not kept (a non-finite loss, gradient or updated weight, or a loss spike:
:mod:`megatrain.train.guard`); ``val_loss`` the validation loss when this step evaluated, else null;
``host_rss_mib`` this process's resident set size in MiB; ``examples_trimmed`` and
``examples_dropped`` (``task: sft``; null otherwise) the fine-tuning examples whose oldest context
was cut to fit ``seq_len`` and those left out (the run's ``data:`` line gives the same counts).
Non-finite floats are written as null (JSON has no NaN)."""


def finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def step_row(step: int, res: Any, lr: float, rates: Rates, *, applied: bool, ranks: int = 1,
             trimmed: int | None = None, dropped: int | None = None) -> dict:
    """The :data:`METRIC_FIELDS` row of step ``step`` from its ``StepResult`` ``res`` (``lr``: the
    learning rate it used; ``applied``: whether it was kept; ``ranks``: the processes whose tokens
    ``res.tokens_per_second`` counts, MFU being per GPU), ``val_loss`` and ``host_rss_mib`` null
    until the run fills them in."""
    return {"step": step, "loss": finite(res.loss), "lr": lr, "grad_norm": finite(res.grad_norm),
            "tokens": res.tokens, "supervised_tokens": res.supervised_tokens, "tokens_per_s": res.tokens_per_second,
            "mfu": rates.mfu(res.tokens_per_second / ranks), "predicted_step_s": rates.predicted_step_s,
            "measured_step_s": res.seconds, "applied": applied, "val_loss": None, "host_rss_mib": None,
            "examples_trimmed": trimmed, "examples_dropped": dropped}


def read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl``. A run killed while writing leaves a partial last line: it is
    dropped (its step runs again on resume). A bad line elsewhere is a ConfigError."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_bytes().decode("utf-8", errors="replace").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break  # the partial last line of a killed run
            raise ConfigError(f"{path}: line {i + 1} is not JSON ({line[:60]!r}); the file was changed after "
                              "the run wrote it: fix or delete that line") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ConfigError(f"{path}: line {i + 1} is not a metrics row with a 'step'; fix or delete it")
        rows.append(row)
    return rows


class MetricsLog:
    """A run's ``metrics.jsonl``, one row a line: appended (a kill leaves at most a partial last
    line, which :func:`read_metrics` drops) and, to drop rows, rewritten atomically (a kill leaves
    the old file). ``path`` None (a rank that writes no outputs): nothing is written.

    Raises (from every method that writes):
        DiskFullError: the disk is full, naming the file and the space left (``megatrain.files``).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self._f = None

    def _write(self, write) -> None:
        try:
            write()
        except OSError as e:
            raise_if_full(e, self.path, self.path.name)
            raise

    def append(self, row: dict) -> None:
        if self.path is None:
            return
        if self._f is None:
            self._write(lambda: setattr(self, "_f", open(self.path, "a", buffering=1, encoding="utf-8")))
        self._write(lambda: self._f.write(json.dumps(row) + "\n"))

    def keep(self, keep) -> None:
        """Keep only the rows ``keep(row)`` is true for."""
        if self.path is None:
            return
        self.close()
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in read_metrics(self.path) if keep(r)))

    def row(self, step: int) -> dict:
        """The row of ``step`` (the last written for it), or a bare one."""
        rows = read_metrics(self.path) if self.path is not None else []
        return next((r for r in reversed(rows) if r["step"] == step), {"step": step, "loss": None})

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def save_loss_plot(rows: list[dict], path: str | os.PathLike, *, title: str = "") -> None:
    """Draw training loss (applied steps) and validation loss against the step as a PNG.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    fig = new_figure((8, 4.5))
    ax = fig.subplots()
    train = [(r["step"], r["loss"]) for r in rows if r.get("applied") and r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    skipped = [r["step"] for r in rows if not r.get("applied")]
    for s in skipped:
        ax.axvline(s, color="tab:red", alpha=0.3, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title + (f" ({len(skipped)} skipped steps in red)" if skipped else ""), fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)


def new_figure(figsize: tuple[float, float]):
    """A matplotlib ``Figure`` of ``figsize`` inches on the Agg canvas: no pyplot, so no global
    backend switch and no GUI.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("the loss plot needs matplotlib: pip install 'megatrain[plot]'") from e
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | os.PathLike) -> None:
    """Write ``fig`` to ``path`` as a PNG at 100 dpi, atomically (a kill leaves the last plot, not
    half of this one)."""
    png = io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    write_atomic(path, png.getvalue())


@dataclass(frozen=True, slots=True)
class Rates:
    """What turns a step's measured time into MFU, and the simulator's prediction (seconds or None)."""

    flops_per_token: float
    peak_flops: float
    predicted_step_s: float | None

    def mfu(self, tokens_per_s: float) -> float:
        return self.flops_per_token * tokens_per_s / self.peak_flops


def run_rates(cfg: TrainConfig, planned: PlannedModel, hw, cpu_peak: float | None, echo) -> Rates:
    """MFU's FLOPs per token and peak, and the predicted step on ``hw`` (the config's
    ``hardware`` spec, or None): ``planned.timeline``, the prediction made when the model was
    planned on that spec (nothing is simulated here)."""
    import torch

    from megatrain.planner import cost

    dtype = planned.plan.compute_dtype
    if cpu_peak is not None:
        peak, what = cpu_peak, f"this CPU's measured FP32 matmul rate, {cpu_peak / 1e9:,.1f} GFLOP/s"
    elif hw is not None and hw.peak_flops(dtype) > 0:
        peak, what = hw.peak_flops(dtype), f"{hw.name}'s {dtype} peak"
    else:
        peak = measure_matmul_flops(cfg.device, getattr(torch, dtype))
        what = f"this GPU's measured {dtype} matmul rate, {peak / 1e12:,.1f} TFLOP/s"
    predicted = None
    if hw is not None and planned.timeline is not None:
        # The steady-state step: with clipping it also runs the previous step's deferred updates.
        predicted = planned.timeline.step_time_s
        echo(f"predicted step on {hw.name}: {predicted:.4g} s (simulated)")
    elif hw is not None:
        plan = planned.plan
        why = ("no NVMe tier to time the plan's NVMe reads and writes (a HardwareSpec JSON with "
               "nvme_capacity_bytes, nvme_read_bytes_per_s and nvme_write_bytes_per_s has one)"
               if (plan.nvme_moments or plan.nvme_gradients or plan.nvme_masters) and not hw.has_nvme
               else "no GPU rates")
        echo(f"note: {hw.name} has {why}; predicted_step_s is null")
    rates = Rates(cost.model_flops_per_token(planned.graph), peak, predicted)
    echo(f"MFU peak: {what}; {rates.flops_per_token / 1e6:,.2f} MFLOPs per token")
    return rates


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
