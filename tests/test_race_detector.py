"""The race detector: the real CUDA backend on an asynchronous fake CUDA layer (streams as threads,
events as cross-thread signals, random delays before every op) trains every plan kind exactly like
the CPU backend, and dropping any one of a schedule's necessary cross-stream waits makes a step
fail or go wrong.

The core (``run_steps``, ``necessary_waits``, ``check_dropped_waits``) takes the CUDA adapter as a
parameter: on a machine with a GPU the same tests run on real CUDA streams
(:class:`megatrain.testing.SlowTorchCuda`, a GPU-side sleep before the delayed op), marked ``cuda``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import pytest
import torch

import megatrain
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan
from megatrain.ir.schedule import COMPUTE_KINDS, OpKind, Schedule
from megatrain.planner.verify import happens_before
from megatrain.runtime.backend import CPUBackend
from megatrain.runtime.cuda import CUDABackend
from megatrain.testing import AsyncFakeCuda, SlowTorchCuda

from conftest import BackendWrapper, random_batch, requires_cuda, tiny_llama

ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SEQ, MBS, VOCAB, M = 16, 2, 96, 2
STEPS = 2  # a NEXT_FORWARD step's update runs in the second step's schedule

SLOW_S = 0.15
"""Delay of the producer whose wait was dropped. Every other op runs without delay, so the consumer
runs as soon as its other dependencies are done, which (the wait being necessary) do not depend on
the producer: it is ahead by about SLOW_S, orders of magnitude above the thread wake-up jitter of
a loaded CPU (milliseconds). The race shows once the consumer *and the ops after it that touch the
same memory* ran within that time; at a load average of 10 on 2 cores they once did not."""
SLOW_RETRY_S = 2.0
"""The producer's delay when a run at SLOW_S showed nothing: tried once more before the wait counts
as missed, so a loaded machine does not read as a detector that misses a race."""

_K, _OFF, _RE = ActivationPolicy.KEEP, ActivationPolicy.OFFLOAD, ActivationPolicy.RECOMPUTE
NEXT = OptimizerPlacement.NEXT_FORWARD
# (plan, max_grad_norm): every plan kind the runtime has. tiny_llama(2) has four layers.
PLANS = {
    "slots-prefetch": (Plan(micro_batches=M, slots=3, prefetch_distance=2, grad_ring=2), None),
    "one-slot-one-tile": (Plan(micro_batches=M, slots=1, prefetch_distance=0, grad_ring=1), None),
    "resident": (Plan(micro_batches=M, slots=2, prefetch_distance=1, resident=frozenset({0, 3})), None),
    "offload-recompute-next-forward-clip": (
        Plan(micro_batches=M, slots=2, prefetch_distance=1, activations=(_OFF, _RE, _OFF, _K), optimizer=NEXT,
             grad_ring=4), 0.5),
    "per-micro-batch": (Plan(micro_batches=M, layer_by_layer=False, slots=2, prefetch_distance=1, grad_ring=1,
                             activations=(_OFF, _RE, _K, _K)), None),
    "bf16-cast-next-forward": (Plan(micro_batches=M, slots=2, prefetch_distance=1, compute_dtype="bfloat16",
                                    staging_ring=1, optimizer=NEXT, grad_ring=4), 1.0),
    "bf16-cast": (Plan(micro_batches=M, slots=1, prefetch_distance=0, compute_dtype="bfloat16", staging_ring=1,
                       grad_ring=1), None),
}


class DropWait(BackendWrapper):
    """A backend wrapper for the executor: names each launch ``<op>@<run>.<index>`` (so a delay can
    target one op), and in run ``victim[0]`` leaves op ``victim[2]``'s handle out of op
    ``victim[1]``'s waits."""

    def __init__(self, inner: Any, victim: tuple[int, int, int] | None = None):
        super().__init__(inner)
        self.victim = victim
        self.record = False
        self.run, self.k = 0, 0
        self.dropped = False

    def launch(self, stream, fn, wait_for, label="", after=()):
        k = self.k
        self.k += 1
        if self.victim is not None and (self.run, k) == self.victim[:2]:
            kept = [h for h in wait_for if h is None or h.index != self.victim[2]]
            self.dropped = len(kept) < len(wait_for)
            wait_for = kept
        return self.inner.launch(stream, fn, wait_for, label=f"{label}@{self.run}.{k}", after=after)

    def synchronize(self):
        self.k = 0
        self.run += 1
        self.inner.synchronize()

    def abort(self):
        self.k = 0
        self.run += 1
        self.inner.abort()


def compile_plan(name: str, seed: int = 0, device: str = "cpu"):
    plan, clip = PLANS[name]
    torch.manual_seed(seed)
    return megatrain.compile(tiny_llama(layers=2), seq_len=SEQ, micro_batch_size=MBS, micro_batches=M,
                             optimizer=ADAMW, plan=plan, max_grad_norm=clip, device=device)


def batches(seed: int = 0):
    return [random_batch(MBS * M, SEQ, VOCAB, seed=100 * seed + s) for s in range(STEPS)]


@functools.lru_cache(maxsize=None)
def compiled(name: str, device: str = "cpu"):
    """One trainer per plan for the whole file (tracing dominates the file's time) and its
    compiled host state; every test ``restore``s it first."""
    trainer = compile_plan(name, device=device)
    return trainer, snapshot(trainer)


def snapshot(trainer) -> list[torch.Tensor]:
    return [b.clone() for b in trainer.host.blocks] + [s.clone() for s in trainer.host.steps]


def restore(trainer, snap: list[torch.Tensor], backend) -> None:
    """Back to the compiled state on a fresh backend: host state copied back, and the executor's
    buffers dropped so that the next step allocates them anew through ``backend`` (poisoned: a
    race then cannot read a previous run's identical values)."""
    for dst, src in zip(list(trainer.host.blocks) + list(trainer.host.steps), snap):
        dst.copy_(src)
    ex = trainer.executor
    ex._buffers, ex._buffer_key, ex._host_acts = None, None, {}
    trainer._pending, trainer.step_count = False, 0
    if backend is not None:
        trainer.backend = ex.backend = backend


def run_steps(trainer, backend, seed: int = 0) -> tuple[list[tuple[float, ...]], list[torch.Tensor]]:
    """Losses of each step and the final host state (the last update applied: ``flush``)."""
    trainer.backend = trainer.executor.backend = backend
    losses = [trainer.step(b).micro_batch_losses for b in batches(seed)]
    trainer.flush()
    return losses, [b.clone() for b in trainer.host.blocks]


def schedules_run(trainer) -> list[Schedule]:
    """The schedule of each run ``run_steps`` makes (step, step, flush)."""
    s = trainer.schedules
    if trainer.plan.optimizer is NEXT:
        return [s.first, s.carrying, s.update]
    return [s.first] * STEPS


def memory_edge(schedule: Schedule, d: int, i: int) -> bool:
    """Edges that bound GPU memory, not data: an H2D waiting for a compute op on another slot (the
    prefetch window: copies may not run further ahead), and a compute op waiting for an OFFLOAD
    (the checkpoint's device copy may be freed by then). Dropping one lets a run use more memory
    than planned, with the same values, so no result can show it."""
    p, c = schedule.ops[d], schedule.ops[i]
    if c.kind is OpKind.H2D and p.kind in COMPUTE_KINDS:
        return p.slot != c.slot
    return p.kind is OpKind.OFFLOAD and c.kind in COMPUTE_KINDS


def necessary_waits(schedule: Schedule) -> list[tuple[int, int]]:
    """Cross-stream edges ``(d, i)`` that no other path (dependencies and stream order) implies and
    that order data (not ``memory_edge``): the waits whose loss lets op ``i`` touch memory before
    op ``d`` is done with it."""
    out = []
    for i, op in enumerate(schedule.ops):
        for d in op.deps:
            if schedule.ops[d].stream is op.stream or memory_edge(schedule, d, i):
                continue
            ops = list(schedule.ops)
            ops[i] = dataclasses.replace(op, deps=tuple(x for x in op.deps if x != d))
            anc = happens_before(dataclasses.replace(schedule, ops=tuple(ops)))
            if not anc[i] >> d & 1:
                out.append((d, i))
    return out


def sample_by_kind(schedule: Schedule, edges: list[tuple[int, int]]) -> dict[tuple[str, str], tuple[int, int]]:
    """One edge per (producer kind, consumer kind), the first in the list."""
    out: dict[tuple[str, str], tuple[int, int]] = {}
    for d, i in edges:
        out.setdefault((schedule.ops[d].kind.value, schedule.ops[i].kind.value), (d, i))
    return out


def same(got, want, exact: bool) -> bool:
    if exact:
        return got[0] == want[0] and all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
    # On a GPU the reference is the same backend with every wait, and some kernels (atomics in
    # backward reductions) are not bitwise reproducible run to run: about 1e-6 relative in FP32 and
    # 1e-2 in BF16 after two steps. A race reads NaN-poisoned or another layer's memory, an O(1)
    # change, so 5e-2 separates the two.
    close = lambda a, b: torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                                        rtol=5e-2, atol=1e-6)
    return close(got[0], want[0]) and all(close(x.cpu(), y.cpu()) for x, y in zip(got[1], want[1]))


def check_dropped_waits(name: str, adapter: Callable[[Callable[[str], float]], Any],
                        device: str = "cpu") -> set[tuple[str, str]]:
    """Drop each sampled necessary wait in turn, with its producer delayed by SLOW_S; return the
    (producer kind, consumer kind) pairs covered. Fails naming every dropped wait that went
    unnoticed (no error, and the losses and host state of the run with every wait: the CPU
    backend's exactly, or on a GPU the CUDA backend's within noise)."""
    trainer, snap = compiled(name, device)
    restore(trainer, snap, None)
    exact = device == "cpu"
    want = run_steps(trainer, CPUBackend() if exact else DropWait(CUDABackend(adapter=adapter(lambda label: 0.0))))
    covered, missed = set(), []
    for run, sched in enumerate(schedules_run(trainer)):
        for kinds, (d, i) in sample_by_kind(sched, necessary_waits(sched)).items():
            if kinds in covered:  # by an earlier run of this plan
                continue
            tag = f"@{run}.{d}"
            # The race shows only if the ops after the dropped wait run within the producer's delay.
            # On a loaded machine they may not: a run that shows nothing is tried again with a delay
            # long enough for any load (a wait that is not needed shows nothing at any delay).
            for slow in (SLOW_S, SLOW_RETRY_S):
                be = DropWait(CUDABackend(adapter=adapter(lambda label, tag=tag, slow=slow: slow if label.endswith(tag)
                                                          else 0.0)), victim=(run, i, d))
                restore(trainer, snap, be)
                try:
                    got = run_steps(trainer, be)
                except Exception:  # noqa: BLE001 - any error is the detector firing
                    got = None
                assert be.dropped, f"run {run}: op #{i} {sched.ops[i]!r} was not launched waiting on #{d}"
                if hasattr(be.inner.cuda, "close"):
                    be.inner.cuda.close()
                if got is None or not same(got, want, exact):
                    break
            else:
                missed.append(f"run {run}: #{d} {sched.ops[d]!r} -> #{i} {sched.ops[i]!r}")
            covered.add(kinds)
    assert not missed, "dropping these waits went unnoticed:\n" + "\n".join(missed)
    return covered


# -- exactness on the asynchronous fake -----------------------------------------------------------------

@pytest.mark.parametrize("name", list(PLANS))
def test_async_fake_cuda_trains_exactly_like_the_cpu_backend(name):
    trainer, snap = compiled(name)
    restore(trainer, snap, None)
    want = run_steps(trainer, CPUBackend())
    assert all(all(torch.isfinite(torch.tensor(x)).all() for x in step) for step in want[0])
    for seed in range(3):
        fake = AsyncFakeCuda(seed=seed, max_delay_s=2e-3)
        be = CUDABackend(adapter=fake)
        restore(trainer, snap, be)
        got = run_steps(trainer, be)
        fake.close()
        assert got[0] == want[0], f"seed {seed}: losses differ"  # exactly: same ops on the same data
        for layer, (x, y) in enumerate(zip(got[1], want[1])):
            assert torch.equal(x, y), f"seed {seed}: layer {layer}'s master weights or moments differ"


# -- dropped waits ----------------------------------------------------------------------------------------

def _async(delay):
    return AsyncFakeCuda(delay=delay)


# Every (producer, consumer) kind pair a necessary cross-stream wait has in these plans; the union
# over the plans is checked below, so a lowering change that drops a kind of edge is noticed.
KINDS = {
    ("H2D", "FWD"), ("H2D", "BWD"), ("FWD", "H2D"), ("BWD", "D2H"), ("D2H", "OPT"), ("OPT", "D2H"),
    ("FWD", "OFFLOAD"), ("OFFLOAD", "RELOAD"), ("RELOAD", "BWD"), ("OPT", "H2D"), ("D2H", "ACC"),
    ("ACC", "D2H"), ("CAST", "H2D"), ("H2D", "CAST"), ("OPT", "CAST"),  # BWD -> H2D is implied by the D2H
}
_covered: set[tuple[str, str]] = set()


@pytest.mark.parametrize("name", list(PLANS))
def test_dropping_a_necessary_wait_is_caught(name):
    _covered.update(check_dropped_waits(name, _async))


def test_dropped_waits_cover_every_dependency_kind():
    if len(_covered) == 0:
        pytest.skip("runs after test_dropping_a_necessary_wait_is_caught (run the whole file)")
    assert KINDS <= _covered, f"kinds never dropped: {sorted(KINDS - _covered)}"


def test_a_race_is_an_error_or_a_wrong_result_not_a_hang():
    # The detector's own check: an H2D->FWD wait dropped with the copy slowed reads a NaN-poisoned
    # slot, so the step's losses are not the CPU backend's.
    trainer, snap = compiled("one-slot-one-tile")
    restore(trainer, snap, None)
    want = run_steps(trainer, CPUBackend())
    sched = trainer.schedules.first
    d, i = next((d, i) for d, i in necessary_waits(sched)
                if sched.ops[d].kind.value == "H2D" and sched.ops[i].kind.value == "FWD")
    be = DropWait(CUDABackend(adapter=AsyncFakeCuda(delay=lambda label: SLOW_S if label.endswith(f"@0.{d}") else 0)),
                  victim=(0, i, d))
    restore(trainer, snap, be)
    got = run_steps(trainer, be)
    assert got[0] != want[0]
    assert not all(torch.isfinite(torch.tensor(x)).all() for x in got[0][0]), "the poisoned slot made NaNs"


# -- the same on real CUDA streams ----------------------------------------------------------------------------

@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("name", list(PLANS))
def test_cuda_dropping_a_necessary_wait_is_caught(name):  # CPU twin: test_dropping_a_necessary_wait_is_caught
    check_dropped_waits(name, SlowTorchCuda, device="cuda")


# -- a failed step ---------------------------------------------------------------------------------------------

class FailAt(DropWait):
    """Raises ``error`` at launch ``k`` of the first run: inside the op's work (``where`` "op"), or
    in the caller before the launch, as an executor error mid-run would (``where`` "executor")."""

    def __init__(self, inner, k: int, where: str):
        super().__init__(inner)
        self.at, self.where = k, where

    def launch(self, stream, fn, wait_for, label="", after=()):
        if self.run == 0 and self.k == self.at:
            if self.where == "executor":
                self.k += 1
                raise KeyError("injected executor failure")

            def fn():
                raise FloatingPointError("injected op failure")
        return super().launch(stream, fn, wait_for, label, after)


@pytest.mark.parametrize("where", ["FWD", "H2D", "OPT", "executor"])
def test_a_failed_step_leaves_the_backend_ready_for_an_exact_step(where):
    # The entry fence of the next run must not be skipped: a run left open by the failure would
    # let the next step's first ops race the batch copies and the ops the failed step left queued.
    trainer, snap = compiled("bf16-cast")
    restore(trainer, snap, None)
    want = run_steps(trainer, CPUBackend())
    sched = trainer.schedules.first
    kind = "FWD" if where == "executor" else where
    k = max(i for i, op in enumerate(sched.ops) if op.kind.value == kind)  # late: much is in flight
    fake = AsyncFakeCuda(seed=5, max_delay_s=2e-3)
    inner = CUDABackend(adapter=fake)
    restore(trainer, snap, FailAt(inner, k, "executor" if where == "executor" else "op"))
    with pytest.raises(Exception) as info:  # noqa: PT011 - which type depends on where; the text is checked
        trainer.step(batches()[0])
    assert "injected" in str(info.value) + str(info.value.__cause__)
    assert inner._run_records is None and not inner._issue.pending(), "the failed run was closed"
    restore(trainer, snap, inner)  # the same backend object runs on
    got = run_steps(trainer, inner)
    fake.close()
    assert got[0] == want[0]
    assert all(torch.equal(x, y) for x, y in zip(got[1], want[1]))
