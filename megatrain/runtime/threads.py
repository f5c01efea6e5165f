"""The CPU backend's threads: how many intra-op threads torch uses, OpenMP's wait policy, and
whether the machine is oversubscribed.

Why the wait policy matters more than the count. torch's CPU build runs its intra-op parallel
regions (and MKL's) on GNU OpenMP, whose threads by default spin for a while at the end of each
region before they sleep (``OMP_WAIT_POLICY`` unset: ``GOMP_SPINCOUNT`` iterations). A small
model's step is thousands of short regions; when another process holds one of the cores, a
spinning thread burns the time slice the thread it waits for needs, and the step slows down far
more than the share of the CPU it lost. Measured with ``bench/cpu_threads.py`` (2-core VM,
2026-11-27, the main job's 1.38 M-parameter Llama, seq 128 x 16 rows, the machine shared with other
jobs at load 7 to 12; ``bench/results/2026-11-27-cpu-threads.json``), median step: torch's default
(2 threads, spinning) 7.55 s, and 24.4 s with one busy process beside it; 2 threads with
``OMP_WAIT_POLICY=PASSIVE`` 0.78 s and 0.93 s; one passive thread 1.68 s and 2.07 s. With the
passive policy two threads were faster than one, so the count stays at one per CPU this process
may use and the policy is what changes.

OpenMP reads ``OMP_WAIT_POLICY`` once, when torch loads it: :func:`prefer_passive_wait` must run
before ``import torch``. ``megatrain train`` (and ``make train``) call it first thing; a Python
program that trains on the CPU backend sets the variable itself before importing torch (or calls
:func:`prefer_passive_wait` first). ``OMP_NUM_THREADS``, when set, is the thread count.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

WAIT_POLICY = "PASSIVE"
"""The ``OMP_WAIT_POLICY`` megatrain asks for: threads sleep at the end of a parallel region."""


CPUS_AVAILABLE = "one per CPU this process may use"
""":attr:`ThreadChoice.source` when neither the ``threads`` setting nor ``OMP_NUM_THREADS`` chose."""


def prefer_passive_wait() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy; returns whether
    OpenMP will run with the passive policy (False when torch was imported before with another,
    or the user chose another)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)
    return wait_policy() == WAIT_POLICY


def wait_policy() -> str:
    """The ``OMP_WAIT_POLICY`` of this process's environment, upper-cased (``"unset"`` when none;
    OpenMP read it when torch was imported, so a later change has no effect)."""
    return os.environ.get("OMP_WAIT_POLICY", "unset").strip().upper() or "unset"


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, lowered by a cgroup v2 CPU quota
    (``cpu.max``, a container's ``--cpus``) when one is set, at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """How many intra-op threads the CPU backend uses and why. ``source``: ``"threads setting"``,
    ``"OMP_NUM_THREADS"`` or :data:`CPUS_AVAILABLE`; ``wait_policy``: the ``OMP_WAIT_POLICY`` OpenMP
    runs with; ``cpus``: :func:`available_cpus`."""

    threads: int
    source: str
    wait_policy: str
    cpus: int

    def describe(self) -> str:
        note = ("" if self.wait_policy == WAIT_POLICY else
                f" (threads spin between parallel regions: a busy machine slows the run far more than its share; "
                f"set OMP_WAIT_POLICY={WAIT_POLICY} before starting)")
        why = (self.source if self.source == CPUS_AVAILABLE else
               f"{self.source}; {self.cpus} CPU{'s' if self.cpus != 1 else ''} available")
        return (f"threads: {self.threads} torch intra-op thread{'s' if self.threads != 1 else ''} ({why}), "
                f"OpenMP wait policy {self.wait_policy}{note}")


_TORCH_DEFAULT: list[int] = []


def _torch_default_threads() -> int:
    """torch's own thread count (one per physical core) as this process first saw it, before any
    choice here changed it: a second run in the same process chooses as the first did."""
    import torch

    if not _TORCH_DEFAULT:
        _TORCH_DEFAULT.append(torch.get_num_threads())
    return _TORCH_DEFAULT[0]


def choose_threads(requested: int | None = None) -> ThreadChoice:
    """The CPU backend's intra-op thread count: ``requested`` if given, else ``OMP_NUM_THREADS``
    if set (as torch itself reads it), else torch's default (its physical cores) capped at
    :func:`available_cpus`. Sets it with ``torch.set_num_threads``.

    Raises:
        ConfigError: ``OMP_NUM_THREADS`` is set but not a positive integer.
    """
    import torch

    from megatrain.errors import ConfigError

    cpus = available_cpus()
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if requested is not None:
        threads, source = requested, "threads setting"
    elif env:
        try:
            threads = int(env.split(",")[0])  # OpenMP allows a list per nesting level
        except ValueError:
            threads = 0
        if threads < 1:
            raise ConfigError(f"OMP_NUM_THREADS={env!r} is not a positive number of threads; unset it or set "
                              "a count such as 2")
        source = "OMP_NUM_THREADS"
    else:
        threads, source = max(1, min(_torch_default_threads(), cpus)), CPUS_AVAILABLE
    torch.set_num_threads(threads)
    return ThreadChoice(threads, source, wait_policy(), cpus)


def load_average() -> float | None:
    """The 1-minute load average (runnable and uninterruptible tasks, this process's threads
    included), or None where the system does not give one."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def oversubscription(load: float | None = None, cpus: int | None = None) -> str | None:
    """A short note when the machine has at least one more runnable task than CPUs on average
    over the last minute (so steps slow down for reasons outside the run), else None. ``load``
    defaults to :func:`load_average`, ``cpus`` to the machine's (``os.cpu_count()``: the load
    average counts the whole machine's tasks, not this process's CPUs)."""
    load = load_average() if load is None else load
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    if load is None or load < cpus + 1:
        return None
    return f"load {load:.1f} on {cpus} CPU{'s' if cpus != 1 else ''}: oversubscribed"
