"""The host kernels (megatrain.runtime.host_kernels): each AdamW kernel against torch.optim.AdamW,
the chunked step from BF16 gradients against the step of the widened tile, the kernel setting, and
per-thread intra-op teams."""

from __future__ import annotations

import threading

import pytest
import torch

from megatrain.errors import ConfigError
from megatrain.planner import cost
from megatrain.runtime import host_kernels
from megatrain.runtime.host_kernels import CHUNK_ELEMENTS, HostAdamW, host_adam_kernel, set_thread_team

DS = pytest.mark.skipif(not host_kernels.deepspeed_installed(), reason="DeepSpeed is not installed "
                        "(pip install megatrain[deepspeed])")
KERNELS = ["torch", pytest.param("deepspeed", marks=DS)]
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# Two chunks and a tail that is not a multiple of any vector width: the chunked path's edges.
NUMEL = CHUNK_ELEMENTS + 1237
RTOL = 1e-5


def tiles(numel: int = NUMEL, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g), torch.zeros(numel), torch.zeros(numel), torch.zeros(())


def grads(steps: int, numel: int = NUMEL, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(numel, generator=g) * 1e-2).to(dtype) for _ in range(steps)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("clip", [None, 0.25], ids=["unscaled", "grad_scale"])
def test_kernel_matches_torch_adamw(kernel, grad_dtype, clip):
    """Ten steps on a tile of two chunks and a tail: the master and both moments equal
    torch.optim.AdamW's (stepping the same gradients widened to FP32, times the clip factor) to 1e-5."""
    p, m, v, step = tiles()
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], foreach=False, **ADAMW)
    adam = HostAdamW(kernel)
    scale = None if clip is None else torch.tensor(1.0 / clip)  # the executor's carried clip scale
    for g in grads(10, dtype=grad_dtype):
        ref.grad = g.float() if clip is None else g.float() * clip  # (torch's kernel divides g in place)
        adam.step(p, g, m, v, step, grad_scale=scale, **ADAMW)
        opt.step()
    state = opt.state[ref]
    assert step.item() == state["step"].item() == 10
    assert rel(p, ref.detach()) <= RTOL
    assert rel(m, state["exp_avg"]) <= RTOL and rel(v, state["exp_avg_sq"]) <= RTOL


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("clip", [None, 0.25], ids=["unscaled", "grad_scale"])
def test_step_from_bf16_tiles_is_bitwise_the_step_of_the_widened_tile(kernel, clip):
    """The chunked widening in the cache gives bitwise what widening the whole tile into an FP32
    scratch and stepping that gave (the OPT of BF16 gradients before): the kernels are element-wise
    and every chunk but the last is a multiple of their vector width."""
    (p, m, v, s), (q, mq, vq, sq) = tiles(), tiles()
    chunked, widened = HostAdamW(kernel), HostAdamW(kernel)
    scale = None if clip is None else torch.tensor(1.0 / clip)
    scratch = torch.empty(CHUNK_ELEMENTS)
    for g in grads(3, dtype=torch.bfloat16):
        wide = g.float() if scale is None or kernel == "torch" else g.float() / scale  # DeepSpeed's op takes no scale
        chunked.step(p, g, m, v, s, grad_scale=scale, scratch=scratch, **ADAMW)
        widened.step(q, wide, mq, vq, sq, grad_scale=scale if kernel == "torch" else None, **ADAMW)
    assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq)


def test_the_scratch_is_one_chunk_and_the_cost_model_counts_it():
    from graphs import chain_graph
    from megatrain.planner.plan import Plan

    wide = chain_graph(2, numel=3 * CHUNK_ELEMENTS)
    bf16 = Plan(compute_dtype="bfloat16", staging_ring=1)
    assert cost.widens_gradients(bf16)
    assert cost.gradient_scratch_numel(wide, bf16) == CHUNK_ELEMENTS == cost.OPT_CHUNK_ELEMENTS
    assert cost.gradient_scratch_numel(chain_graph(2, numel=1 << 12), bf16) == 1 << 12
    with pytest.raises(ValueError, match="at least"):
        HostAdamW("torch").step(*tiles()[:1], grads(1, dtype=torch.bfloat16)[0], *tiles()[1:],
                                scratch=torch.empty(CHUNK_ELEMENTS - 1), **ADAMW)


def test_step_refuses_tiles_the_kernels_would_misread():
    p, m, v, step = tiles(64)
    adam = HostAdamW("torch")
    with pytest.raises(ValueError, match="grad is torch.float16"):
        adam.step(p, torch.zeros(64, dtype=torch.float16), m, v, step, **ADAMW)
    with pytest.raises(ValueError, match=r"exp_avg is .* \(contiguous=False\)"):
        adam.step(p, torch.zeros(64), torch.zeros(128)[::2], v, step, **ADAMW)
    with pytest.raises(ValueError, match="of param's shape"):
        adam.step(p, torch.zeros(32), m, v, step, **ADAMW)
    assert step.item() == 0, "a refused step counts nothing"


def test_kernel_setting(monkeypatch):
    monkeypatch.setattr(host_kernels, "deepspeed_installed", lambda: True)
    monkeypatch.delenv(host_kernels.HOST_ADAM_ENV, raising=False)
    assert host_adam_kernel() == "deepspeed" == host_adam_kernel(" Auto ")
    monkeypatch.setenv(host_kernels.HOST_ADAM_ENV, "torch")
    assert host_adam_kernel() == "torch" and HostAdamW().kernel == "torch"
    assert host_adam_kernel("deepspeed") == "deepspeed"
    monkeypatch.setenv(host_kernels.HOST_ADAM_ENV, "apex")
    with pytest.raises(ConfigError, match=r"'apex' \(\$MEGATRAIN_HOST_ADAM\): use 'auto', 'torch' or 'deepspeed'"):
        HostAdamW()
    monkeypatch.setattr(host_kernels, "deepspeed_installed", lambda: False)
    assert host_adam_kernel("auto") == "torch"
    with pytest.raises(ConfigError, match=r"megatrain\[deepspeed\]"):
        host_adam_kernel("deepspeed")


def test_each_thread_keeps_its_own_team():
    """Two threads with teams of 3 and 1, each set before the other's: each runs its parallel ops
    with its own size, and the calling thread's team is untouched. Without set_thread_team's
    first ``get_num_threads`` the first thread would take the second's size at its first parallel
    op (ATen's lazy per-thread start)."""
    main = torch.get_num_threads()
    barrier, seen = threading.Barrier(2), {}

    def worker(name: str, threads: int, first: bool) -> None:
        if first:
            set_thread_team(threads)
        barrier.wait()
        if not first:
            set_thread_team(threads)
        barrier.wait()
        torch.randn(1 << 16).add_(1)  # a parallel op
        seen[name] = torch.get_num_threads()

    ts = [threading.Thread(target=worker, args=("a", 3, True)), threading.Thread(target=worker, args=("b", 1, False))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert seen == {"a": 3, "b": 1}
    assert torch.get_num_threads() == main
    with pytest.raises(ValueError, match="at least one thread"):
        set_thread_team(0)
