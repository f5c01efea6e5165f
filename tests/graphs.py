"""Hand-built LayerGraphs and hypothesis strategies for tests of the planner.

``chain_graph(n)`` is the smallest realistic shape: a residual stream ``h0 -> h1 -> ...`` with the
first layer reading ``input_ids`` and the last reading ``labels`` and producing the loss, which is
how ``trace`` cuts a decoder-only transformer (minus its side values). Every number can be set per
layer, so tests can compute expected times and bytes by hand.
"""

from __future__ import annotations

from typing import Sequence

from hypothesis import strategies as st

from megatrain.ir.graph import BATCH_PRODUCER, Layer, LayerGraph, ParamSpec, Value, align_up
from megatrain.ir.hardware import HardwareSpec


def _per_layer(x: int | Sequence[int], n: int, what: str) -> list[int]:
    if isinstance(x, (int, bool)):
        return [x] * n
    if len(x) != n:
        raise ValueError(f"{what} has {len(x)} entries for {n} layers")
    return list(x)


def chain_graph(n_layers: int, *, numel: int | Sequence[int] = 1024, trainable: bool | Sequence[bool] = True,
                fwd_flops: int | Sequence[int] = 10**6, bwd_flops: int | Sequence[int] | None = None,
                act_bytes: int = 4096, work_bytes: int | Sequence[int] = 0,
                buffer_bytes: int | Sequence[int] = 0, micro_batch_size: int = 1, seq_len: int = 16,
                ids_bytes: int | None = None) -> LayerGraph:
    """An ``n_layers`` chain: layer i reads ``h{i-1}`` (layer 0 reads ``input_ids``), writes ``h{i}``.

    Each layer has one parameter of ``numel`` elements, rounded up to the tile alignment so the
    tile has no padding, trainable per ``trainable``. ``bwd_flops`` defaults to 3x ``fwd_flops``
    (recompute + backward). ``act_bytes`` is each residual value's size; ``ids_bytes`` that of
    ``input_ids`` and ``labels`` (default: int64 tokens). Scalars apply to every layer, sequences
    give one entry per layer.
    """
    numels = [align_up(x) for x in _per_layer(numel, n_layers, "numel")]
    train = [bool(t) for t in _per_layer(trainable, n_layers, "trainable")]
    fwd = _per_layer(fwd_flops, n_layers, "fwd_flops")
    bwd = [3 * f for f in fwd] if bwd_flops is None else _per_layer(bwd_flops, n_layers, "bwd_flops")
    work = _per_layer(work_bytes, n_layers, "work_bytes")
    bufs = _per_layer(buffer_bytes, n_layers, "buffer_bytes")
    ids_bytes = micro_batch_size * seq_len * 8 if ids_bytes is None else ids_bytes
    last = n_layers - 1
    values = [
        Value(0, "input_ids", (micro_batch_size, seq_len), "int64", ids_bytes, BATCH_PRODUCER, (0,), False),
        Value(1, "labels", (micro_batch_size, seq_len), "int64", ids_bytes, BATCH_PRODUCER, (last,), False),
    ]
    for i in range(last):
        hidden = max(1, act_bytes // 4 // (micro_batch_size * seq_len))
        values.append(Value(len(values), f"h{i}", (micro_batch_size, seq_len, hidden), "float32", act_bytes,
                            i, (i + 1,), True))
    values.append(Value(len(values), "loss", (), "float32", 4, last, (), True))
    loss = len(values) - 1
    layers = []
    for i in range(n_layers):
        inputs = (0,) if i == 0 else (2 + i - 1,)
        if i == last:
            inputs = inputs + (1,)
        outputs = (loss,) if i == last else (2 + i,)
        params = (ParamSpec(f"layers.{i}.weight", (numels[i],), 0, train[i]),)
        layers.append(Layer(index=i, name=f"layers.{i}", template=0, params=params, numel=numels[i],
                            trainable_numel=numels[i] if train[i] else 0, inputs=inputs, outputs=outputs,
                            buffers=(), fwd_flops=fwd[i], bwd_flops=bwd[i], buffer_bytes=bufs[i],
                            work_bytes=work[i]))
    return LayerGraph(layers=tuple(layers), values=tuple(values), batch_inputs=("input_ids", "labels"),
                      loss=loss, micro_batch_size=micro_batch_size, seq_len=seq_len)


def spec(**overrides) -> HardwareSpec:
    """A round-numbered spec for hand computation: 1 GB/s copies, 1 GFLOP/s, no latency, free launches."""
    base = dict(name="test", gpu_memory_bytes=10**10, bf16_flops=2e9, fp32_flops=1e9, matmul_efficiency=1.0,
                h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, duplex=True, host_memory_bytes=10**11,
                pinned_memory_cap_bytes=10**10, host_optimizer_params_per_s=1e9, op_latency_s=0.0,
                launch_overhead_s=0.0, gpu_reserve_bytes=0)
    base.update(overrides)
    return HardwareSpec(**base)


# -- hypothesis strategies -------------------------------------------------------------------------

@st.composite
def chain_graphs(draw, max_layers: int = 8) -> LayerGraph:
    """Chain graphs of 1..max_layers layers with random sizes, FLOPs and activation bytes."""
    n = draw(st.integers(1, max_layers))
    numel = draw(st.lists(st.integers(1, 1 << 16), min_size=n, max_size=n))
    fwd = draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n))
    work = draw(st.lists(st.integers(0, 1 << 20), min_size=n, max_size=n))
    return chain_graph(n, numel=numel, fwd_flops=fwd, work_bytes=work,
                       act_bytes=draw(st.integers(4, 1 << 20)),
                       trainable=draw(st.lists(st.booleans(), min_size=n, max_size=n)))


@st.composite
def hardware_specs(draw) -> HardwareSpec:
    """Specs with rates spread over four orders of magnitude either way, duplex or not."""
    rate = st.floats(1e6, 1e12)
    return spec(bf16_flops=draw(rate), fp32_flops=draw(rate), h2d_bytes_per_s=draw(rate),
                d2h_bytes_per_s=draw(rate), host_optimizer_params_per_s=draw(st.floats(1e5, 1e10)),
                matmul_efficiency=draw(st.floats(0.1, 1.0)), duplex=draw(st.booleans()),
                op_latency_s=draw(st.sampled_from([0.0, 1e-5])),
                launch_overhead_s=draw(st.sampled_from([0.0, 1e-5])))


def with_profiles(graph: LayerGraph, fwd: Sequence, bwd: Sequence) -> LayerGraph:
    """``graph`` with every layer given the kernel profiles ``fwd`` and ``bwd`` (sequences of
    :class:`~megatrain.ir.profile.Kernel`), as a traced layer has them."""
    from dataclasses import replace

    from megatrain.ir.profile import KernelProfile

    f, b = KernelProfile(tuple(fwd)), KernelProfile(tuple(bwd))
    return replace(graph, layers=tuple(replace(layer, fwd_profile=f, bwd_profile=b) for layer in graph.layers))


def kernel_spec(**overrides) -> HardwareSpec:
    """:func:`spec` with the kernel model's rates: 1 GB/s of GPU memory bandwidth, fused attention at
    1 GFLOP/s, no per-kernel overhead."""
    return spec(**{"memory_bytes_per_s": 1e9, "attention_flops": 1e9, "attention_backward_flops": 1e9,
                   "kernel_overhead_s": 0.0, **overrides})
