"""Replay a schedule through the real CUDA backend with the cost model's durations, in real time.

The simulator predicts a step from the cost model; the replay *runs* the same schedule through
:class:`megatrain.runtime.cuda.CUDABackend` -- its issue order, pending queues, host workers and
event waits, unchanged -- on :class:`ReplayCuda`, an :class:`AsyncFakeCuda` whose work is sleeping:

- a GPU op sleeps its ``cost.op_time`` on its stream's worker thread, holding its resource
  (``cost.resource_of``: one lock per copy engine, one for the GPU);
- the issuing thread sleeps the op's ``cost.launch_times`` entry while "launching" it, and the op
  cannot end before its launch did (kernels still being launched cannot have run);
- a host op sleeps its time on its host worker, holding the one host resource (the host's DRAM
  bandwidth, shared by the optimizer and the cast worker, as the simulator assumes).

All times are multiplied by ``scale`` (a step of seconds replays in a fraction), and the measured
step is divided by it. What the replay measures and the simulator does not model is then the
runtime's own behaviour: how its issue logic orders and blocks ops. ``replay_ratio`` is the
replayed step over the simulated one; sleeping adds tens of microseconds of wake-up latency per op,
so a ratio within a few percent of 1 means the two agree.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from megatrain.planner import cost
from megatrain.ir.graph import LayerGraph
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.schedule import Schedule
from megatrain.planner.simulate import simulate
from megatrain.testing.async_cuda import AsyncFakeCuda


class ReplayCuda(AsyncFakeCuda):
    """AsyncFakeCuda without random delays whose ``run`` costs the issuing thread ``launch(label)``
    seconds; the op's work waits for that launch to end before it may end."""

    def __init__(self, launch: Callable[[str], float]):
        super().__init__(max_delay_s=0.0)
        self._launch = launch

    def run(self, stream: Any, fn: Callable[[], Any], label: str) -> None:
        launched = threading.Event()

        def work() -> None:
            fn()
            launched.wait()

        super().run(stream, work, label)
        time.sleep(self._launch(label))
        launched.set()


def replay(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec, scale: float = 1.0) -> float:
    """Seconds (in the cost model's units) one run of ``schedule`` takes through the CUDA backend
    when every op takes its cost-model time; see the module docstring."""
    from megatrain.runtime.cuda import CUDABackend

    ops = schedule.ops
    dur = cost.op_times(schedule, graph, hw)
    launch = cost.launch_times(schedule, graph, hw)
    locks = {r: threading.Lock() for r in cost.Resource}
    fake = ReplayCuda(lambda label: launch[int(label)] * scale)
    backend = CUDABackend(adapter=fake)

    def work(i: int) -> Callable[[], None]:
        lock = locks[cost.resource_of(ops[i].stream, hw)]

        def run() -> None:
            with lock:
                time.sleep(dur[i] * scale)
        return run

    handles: list[Any] = [None] * len(ops)
    t0 = time.perf_counter()
    for i, op in enumerate(ops):
        waits = [handles[d] for d in op.deps if ops[d].stream is not op.stream]
        handles[i] = backend.launch(op.stream, work(i), waits, label=str(i),
                                    after=[handles[f] for f in schedule.fences(i)])
    backend.synchronize()
    seconds = (time.perf_counter() - t0) / scale
    backend.close()
    fake.close()
    return seconds


def replay_ratio(schedule: Schedule, graph: LayerGraph, hw: HardwareSpec, scale: float = 1.0) -> float:
    """Replayed step time over the simulated one."""
    return replay(schedule, graph, hw, scale) / simulate(schedule, graph, hw).step_time_s


__all__ = ["ReplayCuda", "replay", "replay_ratio"]


def main(argv: list[str] | None = None) -> None:
    """``python -m megatrain.testing.replay [model] [gpu] [global_batch] [seq_len]``: solve the model
    for the GPU in BF16, with and without gradient clipping, and print simulated vs replayed step
    times (each replay scaled to about 1.5 s of wall time)."""
    import sys

    from megatrain.ir.hardware import preset
    from megatrain.planner.presets import load_model_config, trace_preset
    from megatrain.planner.solve import SolveRequest, solve

    args = list(sys.argv[1:] if argv is None else argv)
    model, gpu, batch, seq = (args + ["llama-3-8b", "H100_SXM", "8", "4096"][len(args):])[:4]
    graph = trace_preset(load_model_config(model), seq_len=int(seq), compute_dtype="bfloat16").graph
    hw = preset(gpu)
    for clip in (False, True):
        sol = solve(SolveRequest(graph, hw, global_batch=int(batch), compute_dtype="bfloat16", clip_gradients=clip))
        sim = simulate(sol.schedule, sol.graph, hw).step_time_s
        rep = replay(sol.schedule, sol.graph, hw, scale=1.5 / sim)
        print(f"{model} {gpu} batch {batch}x{seq} clip={clip}: {len(sol.schedule.ops)} ops, simulated {sim:.3f} s, "
              f"replayed {rep:.3f} s, ratio {rep / sim:.3f}")


if __name__ == "__main__":
    main()
