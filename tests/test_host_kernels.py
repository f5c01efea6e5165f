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
from megatrain.runtime.host_kernels import (CHUNK_ELEMENTS, HostAdamW, HostLion, host_adam_kernel, run_on_team,
                                            set_thread_team)

DS = pytest.mark.skipif(not host_kernels.deepspeed_installed(), reason="DeepSpeed is not installed "
                        "(pip install megatrain[deepspeed])")
KERNELS = ["torch", pytest.param("deepspeed", marks=DS)]
ADAMW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# On a team of one, two chunks and a tail that is not a multiple of any vector width (on a team of
# two, one chunk and that tail): the chunked path's edges.
NUMEL = 2 * CHUNK_ELEMENTS + 1237
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
    """Ten steps on a tile of two chunks and a tail (a team of one, as a host worker on this CI's two
    cores): the master and both moments equal torch.optim.AdamW's (stepping the same gradients
    widened to FP32, times the clip factor) to 1e-5."""
    run_on_team(1, lambda: _matches_torch_adamw(kernel, grad_dtype, clip))


def _matches_torch_adamw(kernel, grad_dtype, clip):
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
@pytest.mark.parametrize("team", [1, 2])
def test_step_from_bf16_tiles_is_bitwise_the_step_of_the_widened_tile(kernel, clip, team):
    """The chunked widening gives bitwise what widening the whole tile into an FP32 scratch and
    stepping that gave (the OPT of BF16 gradients before), whatever the team (and so the chunk):
    the kernels are element-wise and every chunk but the last is a multiple of their vector width."""
    run_on_team(team, lambda: _bitwise(kernel, clip))


def _bitwise(kernel, clip):
    (p, m, v, s), (q, mq, vq, sq) = tiles(), tiles()
    chunked, widened = HostAdamW(kernel), HostAdamW(kernel)
    scale = None if clip is None else torch.tensor(1.0 / clip)
    for g in grads(3, dtype=torch.bfloat16):
        wide = g.float() if scale is None or kernel == "torch" else g.float() / scale  # DeepSpeed's op takes no scale
        chunked.step(p, g, m, v, s, grad_scale=scale, **ADAMW)
        widened.step(q, wide, mq, vq, sq, grad_scale=scale if kernel == "torch" else None, **ADAMW)
    assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq)
    assert chunked._scratch.numel() == min(NUMEL, CHUNK_ELEMENTS * torch.get_num_threads())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_with_cast_into_is_bitwise_the_step_then_the_cast(kernel, grad_dtype):
    """cast_into (the step and the BF16 copy for the next H2D, chunk by chunk) leaves the master
    and moments bitwise as the plain step does and writes bitwise the CAST of the new master, on
    two chunks and a tail; so it matches torch.optim.AdamW as test_kernel_matches_torch_adamw does."""
    def run() -> None:
        (p, m, v, s), (q, mq, vq, sq) = tiles(), tiles()
        fused, plain = HostAdamW(kernel), HostAdamW(kernel)
        out = torch.full((NUMEL,), float("nan"), dtype=torch.bfloat16)
        for g in grads(2, dtype=grad_dtype):
            fused.step(p, g, m, v, s, cast_into=out, **ADAMW)
            plain.step(q, g, mq, vq, sq, **ADAMW)
            assert torch.equal(out, q.bfloat16())
        assert torch.equal(p, q) and torch.equal(m, mq) and torch.equal(v, vq) and s.item() == sq.item() == 2
    run_on_team(1, run)


@pytest.mark.parametrize("kernel", KERNELS + ["lion"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_returns_the_sum_of_the_stepped_tile_for_the_finite_check(kernel, grad_dtype):
    """The executor's finite check reads the sum the kernel returns (summed chunk by chunk in the
    chunked paths): it is the sum of the stepped master, within the worst case of a float32 sum
    of n positive terms (n * 2^-24 relative; one chunk left out would be off by a third), and it
    is not finite where one element of the tail chunk is not (Lion's sign turns a NaN gradient
    into 0, so the master's last element is made inf here, for both optimizers)."""
    import megatrain

    def run() -> None:
        opt = HostLion() if kernel == "lion" else HostAdamW(kernel)
        cfg = megatrain.Lion(lr=1e-3) if kernel == "lion" else megatrain.AdamW(**ADAMW)
        p, m, v, s = tiles()
        p.abs_().add_(1.0)
        states = [m] if kernel == "lion" else [m, v]
        g = grads(1, dtype=grad_dtype)[0]
        total = opt.update(p, g, states, s, cfg)
        assert total.dtype == torch.float32 and total.dim() == 0
        assert abs(total.item() - p.double().sum().item()) <= NUMEL * 2.0 ** -24 * p.double().sum().item()
        p[-1] = float("inf")
        assert not torch.isfinite(opt.update(p, g, states, s, cfg))
    run_on_team(1, run)


def test_the_scratch_is_a_chunk_per_thread_and_the_cost_model_counts_it():
    from graphs import chain_graph, spec
    from megatrain.ir.plan import Plan

    wide = chain_graph(2, numel=8 * CHUNK_ELEMENTS)
    bf16 = Plan(compute_dtype="bfloat16", staging_ring=1)
    assert cost.widens_gradients(bf16)
    assert cost.gradient_scratch_numel(wide, bf16) == CHUNK_ELEMENTS == cost.OPT_CHUNK_ELEMENTS
    assert cost.gradient_scratch_numel(wide, bf16, threads=3) == 3 * CHUNK_ELEMENTS
    assert cost.gradient_scratch_numel(chain_graph(2, numel=1 << 12), bf16, threads=3) == 1 << 12
    # The plan's memory counts the team of the spec's cores (one thread where it has none).
    assert cost.memory_breakdown(wide, bf16, spec(host_cores=5)).gradient_scratch == 4 * CHUNK_ELEMENTS * 4
    assert cost.memory_breakdown(wide, bf16, spec()).gradient_scratch == CHUNK_ELEMENTS * 4

    def too_small():
        HostAdamW("torch").step(*tiles()[:1], grads(1, dtype=torch.bfloat16)[0], *tiles()[1:],
                                scratch=torch.empty(CHUNK_ELEMENTS - 1), **ADAMW)
    with pytest.raises(ValueError, match=f"at least {CHUNK_ELEMENTS} elements"):
        run_on_team(1, too_small)


def test_step_refuses_tiles_the_kernels_would_misread():
    p, m, v, step = tiles(64)
    adam = HostAdamW("torch")
    with pytest.raises(ValueError, match="grad is torch.float16"):
        adam.step(p, torch.zeros(64, dtype=torch.float16), m, v, step, **ADAMW)
    with pytest.raises(ValueError, match=r"exp_avg is .* \(contiguous=False\)"):
        adam.step(p, torch.zeros(64), torch.zeros(128)[::2], v, step, **ADAMW)
    with pytest.raises(ValueError, match="of param's shape"):
        adam.step(p, torch.zeros(32), m, v, step, **ADAMW)
    with pytest.raises(ValueError, match="cast_into is torch.float16 .* must be contiguous torch.bfloat16"):
        adam.step(p, torch.zeros(64), m, v, step, cast_into=torch.zeros(64, dtype=torch.float16), **ADAMW)
    assert step.item() == 0, "a refused step counts nothing"


def test_kernel_setting(monkeypatch):
    """auto is torch's kernel (it releases the GIL) also where DeepSpeed is installed; DeepSpeed's
    only when asked for, and loaded (built, the first time) when the HostAdamW is made."""
    monkeypatch.setattr(host_kernels, "deepspeed_installed", lambda: True)
    loads = []
    monkeypatch.setattr(host_kernels, "_deepspeed_op", loads.append)
    monkeypatch.delenv(host_kernels.HOST_ADAM_ENV, raising=False)
    assert host_adam_kernel() == "torch" == host_adam_kernel(" Auto ") and HostAdamW().kernel == "torch"
    assert not loads, "DeepSpeed's op is never loaded (or built) unless asked for"
    monkeypatch.setenv(host_kernels.HOST_ADAM_ENV, "torch")
    assert host_adam_kernel() == "torch" and HostAdamW().kernel == "torch"
    assert host_adam_kernel("deepspeed") == "deepspeed"
    monkeypatch.setenv(host_kernels.HOST_ADAM_ENV, "deepspeed")
    assert HostAdamW().kernel == "deepspeed" and HostAdamW("deepspeed").kernel == "deepspeed"
    assert loads == ["MEGATRAIN_HOST_ADAM=deepspeed asks for DeepSpeed's host AdamW kernel",
                     "HostAdamW(kernel='deepspeed') asks for DeepSpeed's host AdamW kernel"]
    monkeypatch.setenv(host_kernels.HOST_ADAM_ENV, "apex")
    with pytest.raises(ConfigError, match=r"'apex' \(\$MEGATRAIN_HOST_ADAM\): use 'auto', 'torch' or 'deepspeed'"):
        HostAdamW()
    monkeypatch.setattr(host_kernels, "deepspeed_installed", lambda: False)
    assert host_adam_kernel("auto") == "torch"
    with pytest.raises(ConfigError, match=r"megatrain\[deepspeed\]"):
        host_adam_kernel("deepspeed")


def test_deepspeed_build_cache_is_the_environments_own(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert host_kernels.deepspeed_build_dir() == str(tmp_path)  # the user's setting wins
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(host_kernels.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(host_kernels.sys, "base_prefix", "/usr")
    assert host_kernels.deepspeed_build_dir() == str(tmp_path / "venv" / "torch_extensions" / f"torch-{torch.__version__}")
    monkeypatch.setattr(host_kernels.sys, "base_prefix", str(tmp_path / "venv"))  # no virtual environment
    assert host_kernels.deepspeed_build_dir() is None  # torch's default


def test_a_deepspeed_build_is_never_silent(monkeypatch, tmp_path, capsys):
    """A build of DeepSpeed's op says what, why and where before it starts and its time after; it
    goes to the environment's own cache, with the user's TORCH_EXTENSIONS_DIR (unset here) as it
    was afterwards; an op already built, or prebuilt at install, loads without a word."""
    import sys
    import types

    seen = []

    class Builder:
        name = "cpu_adam"

        def load(self, verbose=False):
            import os

            root = os.environ.get("TORCH_EXTENSIONS_DIR")
            seen.append(root)
            if not installed["cpu_adam"]:  # DeepSpeed's JIT: torch builds it under TORCH_EXTENSIONS_DIR
                os.makedirs(os.path.join(root, self.name), exist_ok=True)
                open(os.path.join(root, self.name, f"{self.name}.so"), "w").close()
            return "op"

    installed = {"cpu_adam": False}
    monkeypatch.setitem(sys.modules, "deepspeed.git_version_info", types.SimpleNamespace(installed_ops=installed))
    monkeypatch.setitem(sys.modules, "deepspeed.ops.op_builder", types.SimpleNamespace(CPUAdamBuilder=Builder))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(host_kernels.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(host_kernels.sys, "base_prefix", "/usr")
    assert host_kernels._load_deepspeed_op("the test asks for it") == "op"
    err = capsys.readouterr().err.splitlines()
    where = host_kernels.deepspeed_build_dir()
    assert seen == [where] and where.startswith(str(tmp_path / "venv"))
    assert len(err) == 2, err
    assert err[0].startswith("megatrain: building DeepSpeed's CPU Adam op (cpu_adam") and "the test asks for it" in err[0]
    assert err[0].endswith(f"cached in {where}/cpu_adam")
    assert err[1].startswith("megatrain: DeepSpeed's CPU Adam op built in ") and err[1].endswith(" s")
    import os

    assert "TORCH_EXTENSIONS_DIR" not in os.environ
    assert host_kernels._load_deepspeed_op("again") == "op" and capsys.readouterr().err == ""  # cached: loaded quietly
    installed["cpu_adam"] = True
    seen.clear()
    assert host_kernels._load_deepspeed_op("prebuilt") == "op" and capsys.readouterr().err == "" and seen == [None]


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


# -- bench/host_optimizer.py ------------------------------------------------------------------------------

def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "host_optimizer.py"
    spec = importlib.util.spec_from_file_location("host_optimizer_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_host_optimizer_dry_run(tmp_path):
    import json

    bench = _bench()
    out = tmp_path / "r.json"
    r = bench.main(["--dry-run", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(r))
    ds = host_kernels.deepspeed_installed()
    assert r["megatrain_kernel"] == HostAdamW().kernel and r["rounds"] == 2
    cases = {"megatrain", "megatrain_in_chunks", "torch_fused_adamw", "megatrain_bf16_grads", "before_bf16_grads",
             "cast", "megatrain_step_and_cast", "megatrain_bf16_grads_step_and_cast", "megatrain_then_cast"}
    cases |= {"megatrain_deepspeed_kernel", "deepspeed_cpu_adam", "deepspeed_cpu_adam_then_cast"} if ds else set()
    assert set(r["rates"]) == set(r["rate_spread"]) == set(r["dram_bytes_per_param"]) == cases
    assert all(x > 0 for x in r["rates"].values())
    # The fused copy saves the separate cast's read of the master and, summing each chunk in the
    # cache, the whole-tile step's second read for the finite check: 4 + 4 bytes per parameter.
    dram = r["dram_bytes_per_param"]
    assert dram["megatrain_then_cast"] - dram["megatrain_step_and_cast"] == 8
    assert dram["megatrain"] - dram["megatrain_in_chunks"] == 4
    ratios = r["ratios"]
    pairs = {"megatrain_over_torch_fused_adamw", "megatrain_bf16_grads_over_before_bf16_grads",
             "megatrain_bf16_grads_over_megatrain", "cast_over_megatrain",
             "megatrain_step_and_cast_over_megatrain_then_cast", "megatrain_in_chunks_over_megatrain"}
    pairs |= {"megatrain_over_deepspeed_cpu_adam", "megatrain_in_chunks_over_deepspeed_cpu_adam", "deepspeed_cpu_adam_over_torch_fused_adamw",
              "megatrain_step_and_cast_over_deepspeed_cpu_adam_then_cast",
              "megatrain_bf16_grads_step_and_cast_over_deepspeed_cpu_adam_then_cast"} if ds else set()
    assert set(ratios) == set(r["ratio_spread"]) == set(r["cpu_ratios"]) == pairs
    assert all(x > 0 for x in ratios.values())
    for k, sp in r["ratio_spread"].items():
        assert sp["min"] <= sp["q25"] <= ratios[k] <= sp["q75"] <= sp["max"]
    target = r["target"]
    assert target["ratio"] == "megatrain_step_and_cast_over_deepspeed_cpu_adam_then_cast"
    if ds:
        assert target["wall_value"] == ratios[target["ratio"]]
        assert target["cpu_value"] == r["cpu_ratios"][target["ratio"]]
        assert target["met"] == (target["cpu_value"] >= 1.0) and target["met_wall"] == (target["wall_value"] >= 1.0)
    else:
        assert target["met"] is target["met_wall"] is target["cpu_value"] is None
    # Every kernel, from FP32 and from BF16 gradients, within the project's bound of torch.optim.AdamW.
    exact = r["exactness"]["max_rel_err_vs_torch_adamw"]
    assert len(exact) == (8 if ds else 4) and r["exactness"]["ok"] and max(exact.values()) <= 1e-5
    assert r["host_streams"]["after_threads"] == r["threads"] and r["host_streams"]["before_threads"] == 2 * r["machine"]["cores"]
    assert set(r["wait"]) == {"before_spinning_cpu_s_per_s", "after_blocking_cpu_s_per_s"}
    assert set(r["call_us_1024_elements"]) == {"megatrain", "torch_fused_adamw"} | ({"deepspeed_cpu_adam"} if ds else set())
    # The issuing thread beside each kernel and host op: the default kernel's stall is the target.
    stalls = r["issuing_thread"]["cases"]
    assert set(stalls) == {c for c in bench.STALL_CASES if c in cases} | {"acc", "lion", "nvme_write", "nvme_read"}
    for st in stalls.values():
        assert st["reps"] == 2 and st["kernel_s"] > 0 and 0 <= st["stalled_s"] <= st["gaps_over_stall_gap_s"] + 0.05
        assert st["stalled_fraction"] == pytest.approx(st["stalled_s"] / (st["kernel_s"] * 2), rel=1.0)
    assert r["stall_target"] == {"case": "megatrain", "kernel": "torch", "at_most": 0.05,
                                 "stalled_fraction": stalls["megatrain"]["stalled_fraction"],
                                 "met": stalls["megatrain"]["stalled_fraction"] < 0.05}


def test_issue_stall_sees_a_call_that_holds_the_gil():
    """The bench's ticker: a call that holds the GIL for its whole length (the builtin sum over a
    range is one C call, as DeepSpeed's adam_update) lets the issuing thread tick not once while it
    runs, so the longest stall is the call itself and the GIL sleep is counted as stall, not as
    waiting for a core. (A GIL-releasing call's figures depend on the machine's load: the bench's.)"""
    st = _bench().issue_stall(lambda: sum(range(2_000_000)), threads=1, reps=2)
    assert st["ticks_per_s"] == 0.0
    assert st["longest_stall_s"] >= st["kernel_s"] * 0.999


def test_bench_ratios_pair_the_cases_round_by_round():
    # a is twice b's rate in round 0, as fast in round 1, half in round 2 (a slow spell hits both).
    seconds = {"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]}
    assert _bench()._paired(seconds, "a", "b") == 1.0
    assert _bench()._paired({"a": [1.0, 9.0], "b": [2.0, 18.0]}, "a", "b") == 2.0
    assert _bench()._spread([3.0, 1.0, 2.0, 5.0, 4.0]) == {"min": 1.0, "q25": 2.0, "q75": 4.0, "max": 5.0}


def test_bench_host_optimizer_refuses_bad_sizes(capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--threads", "0"])
    assert "must be >= 1" in capsys.readouterr().err
