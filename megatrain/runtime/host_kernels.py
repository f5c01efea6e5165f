"""The host kernels: the AdamW and Lion steps of one layer's tiles (the classes that
:attr:`megatrain.optim.OptimizerSpec.kernel` names, :func:`host_kernel`), and the thread team that
runs them.

AdamW. :class:`HostAdamW` steps a flat FP32 master tile and its two FP32 moments in place with one
of two kernels, both element-wise, vectorised and parallel over the calling thread's OpenMP team:

- ``"torch"``: torch's fused CPU AdamW (``torch._fused_adamw_``, the kernel that
  ``torch.optim.AdamW(fused=True)`` and ``torch.optim.adamw.adamw(fused=True)`` run);
- ``"deepspeed"``: DeepSpeed's CPU Adam (the C++ ``cpu_adam`` op behind ``DeepSpeedCPUAdam``,
  AVX-512/AVX2/NEON; Ren et al. 2021, "ZeRO-Offload", arXiv:2101.06840), installed with
  ``pip install megatrain[deepspeed]``.

``MEGATRAIN_HOST_ADAM`` chooses: ``auto`` (the default) and ``torch`` take torch's; ``deepspeed``
takes DeepSpeed's, only when asked for (without the package it is an error, as is an op that fails
to build: nothing falls back silently).

Why torch's by default: the issuing thread. torch's kernel releases the Python GIL for its whole
call (its generated binding dispatches with ``gil_scoped_release``), so while a host worker steps a
layer the issuing thread goes on launching GPU work. DeepSpeed's ``adam_update`` holds the GIL for
its whole call (DeepSpeed 0.19.8 ``csrc/adam/cpu_adam.cpp`` binds it without ``gil_scoped_release``):
every launch waits for the step to end. On the first GPU host (one H100, 16-core Xeon, 2026-11-27)
that froze the issuing thread for about 270 ms of an 844 ms step (BENCHMARKS.md), and torch's kernel
stepped the same tiles as fast (3.95 against 3.88 G params/s, ``bench/host_optimizer.py``), which
also measures each kernel's stall of the issuing thread. DeepSpeed's is kept for a host where it is
faster; its steps then stall issue for their whole length.

Building DeepSpeed's op. DeepSpeed compiles it with ninja and the host C++ compiler the first time
a process loads it (about 1.5 CPU-minutes) unless it was prebuilt at install
(``DS_BUILD_CPU_ADAM=1``). :class:`HostAdamW` loads it when it is made (at compile, not in the
first step), and a build is never silent: a line on stderr says what is compiled, why and where
before it starts, and its time after. The build is cached in ``$TORCH_EXTENSIONS_DIR``; where that
is not set and Python runs in a virtual environment, in one of its own
(:func:`deepspeed_build_dir`), so two checkouts or environments never rebuild over each other's
cache; elsewhere in torch's default, ``~/.cache/torch_extensions``. ``make setup`` builds it once
per environment.

Step and cast. ``HostAdamW.step(cast_into=...)`` also writes the new master in BF16 (what a CAST
writes for the next H2D), chunk by chunk while each chunk is in the cache: 30 bytes of host
traffic per parameter where a step and a separate cast take 34, measured 1.05-1.07x
``DeepSpeedCPUAdam.step`` followed by that cast on a shared 2-core AMD EPYC VM (2026-11-27, 1
thread; README, "The host optimizer and its threads"). The runtime's schedule still runs each CAST as an op of its own.

Both match ``torch.optim.AdamW`` to the project's 1e-5 (tests/test_host_kernels.py); they differ
from each other by rounding (DeepSpeed multiplies by ``1 / sqrt(1 - beta2^t)``, keeps ``beta^t`` as
a running float product, and takes ``lr`` as a float).

Gradients. FP32 gradients are stepped as they are. Neither kernel takes BF16 gradients with FP32
parameters (torch's raises "expected scalar type Float"; DeepSpeed's types its gradients as its
parameters and would misread them), so BF16 gradients (``Plan.gradient_dtype``) are widened,
exactly, chunk by chunk: :data:`CHUNK_ELEMENTS` per thread of the calling thread's team at a time
into an FP32 scratch of this object's, each chunk stepped right after. For a team of one or two the
chunk stays in the last-level cache, so the widened copy never reaches DRAM: 26 bytes of host
memory traffic per parameter (2 for the BF16 gradient, 24 for the master and moments), where
widening the whole tile into an FP32 scratch first costs 34 (and an FP32 gradient tile 28); a
larger team's larger chunks keep each parallel region long, and the scratch small. The kernels are
element-wise and every chunk but the last is a multiple of their vector width, so the chunked step
is bitwise the step of the widened tile. A gradient scale (``grad_scale``: the
gradients are divided by it, torch's convention; a carried update's clip factor) is torch's kernel
argument; for DeepSpeed's, whose op has none, the chunks are divided in the scratch. Each chunk
is two parallel regions (the widening, the step), and a team larger than one waits at each for
its threads to wake: on a host whose cores are oversubscribed that is a scheduler time slice
(measured on a 2-core VM under a load of 8, a team of 2 stepped BF16 tiles in chunks of 512 Ki
elements 10x slower than with one whole-tile widening, in chunks of 1 Mi 3x; a team of 1, that
VM's budget, :func:`megatrain.ir.hardware.host_worker_threads`, 1.5x faster). The chunk grows
with the team for that reason, and ``host_optimizer_bf16_params_per_s`` is measured, so the cost
model sees what a host does.

Threads. The kernels parallelise over the *calling thread's* OpenMP team, whose size
:func:`set_thread_team` sets for that thread alone (the CUDA backend's host workers call it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch

from megatrain.errors import ConfigError
from megatrain.optim import OptimizerSpec
from megatrain.ir.layout import OPT_CHUNK_ELEMENTS

T = TypeVar("T")

KERNELS = ("torch", "deepspeed")
"""The host AdamW kernels :class:`HostAdamW` runs."""

HOST_ADAM_ENV = "MEGATRAIN_HOST_ADAM"
"""Environment variable that chooses the kernel: ``auto`` (default: torch's), ``torch`` or ``deepspeed``."""

EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"
"""torch's variable for the directory JIT-built C++ extensions (DeepSpeed's ops) are cached in."""

CHUNK_ELEMENTS = OPT_CHUNK_ELEMENTS
"""Elements per intra-op thread of a chunk of a chunked step (BF16 gradients, or a gradient scale
with DeepSpeed's kernel): :data:`megatrain.ir.layout.OPT_CHUNK_ELEMENTS`, which says why."""


def set_thread_team(threads: int) -> None:
    """Give the calling thread an intra-op team of ``threads`` threads for the ATen (and MKL)
    kernels it runs from now on, leaving other threads' teams as they are.

    ATen's OpenMP backend keeps the team size in the calling thread's OpenMP state
    (``omp_set_num_threads``, ``mkl_set_num_threads_local``), and each thread that starts a
    parallel region gets a pool of its own, so two threads run teams of different sizes at once
    (torch 2.13, checked by thread counts in ``/proc/self/task``). ``torch.set_num_threads`` also
    stores the size in a process-wide default that a thread takes at its *first* parallel op
    (``at::lazy_init_num_threads``): asking ``torch.get_num_threads()`` first makes that first
    time now, so another thread's later ``set_num_threads`` cannot reset this one's team (without
    it, a worker ran with the size the other worker set). DeepSpeed's kernel parallelises with
    ``#pragma omp parallel for``, so the same team size applies to it. With ATen's native thread
    pool (builds without OpenMP) the pool is process-wide and this sets it for every thread.

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads < 1:
        raise ValueError(f"set_thread_team({threads}): a thread team has at least one thread")
    torch.get_num_threads()
    torch.set_num_threads(threads)


def run_on_team(threads: int, fn: Callable[[], T]) -> T:
    """``fn()`` run on a new thread whose intra-op team is ``threads`` (:func:`set_thread_team`), as
    the CUDA backend's host workers run their ops, so that the calling thread's team is left alone;
    returns its result, or raises its exception here."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            set_thread_team(threads)
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = e

    t = threading.Thread(target=run, name=f"megatrain-team-{threads}", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def deepspeed_installed() -> bool:
    """Whether the ``deepspeed`` package can be imported (not imported here: that takes seconds)."""
    return importlib.util.find_spec("deepspeed") is not None


def host_adam_kernel(setting: str | None = None) -> str:
    """The kernel ``setting`` (default: ``$MEGATRAIN_HOST_ADAM``, else ``"auto"``) names:
    ``"torch"`` (also for ``"auto"``: it releases the GIL, see the module docstring) or
    ``"deepspeed"``.

    Raises:
        ConfigError: an unknown setting, or ``"deepspeed"`` without the package.
    """
    return _host_adam_choice(setting)[0]


def _host_adam_choice(setting: str | None) -> tuple[str, str]:
    """:func:`host_adam_kernel`'s choice and where it came from (for the build line)."""
    where = "the argument"
    if setting is None:
        setting, where = os.environ.get(HOST_ADAM_ENV, "auto"), f"${HOST_ADAM_ENV}"
    choice = setting.strip().lower()
    if choice == "auto":
        return "torch", where
    if choice not in KERNELS:
        raise ConfigError(f"host AdamW kernel {setting!r} ({where}): use 'auto', 'torch' or 'deepspeed'")
    if choice == "deepspeed" and not deepspeed_installed():
        raise ConfigError(f"host AdamW kernel 'deepspeed' ({where}) but the deepspeed package is not installed: "
                          "pip install megatrain[deepspeed], or use 'torch'")
    return choice, where


def deepspeed_build_dir() -> str | None:
    """The directory DeepSpeed's JIT-built ops are cached in when megatrain loads one:
    ``$TORCH_EXTENSIONS_DIR`` when set; else, when Python runs in a virtual environment
    (``sys.prefix != sys.base_prefix``), ``<environment>/torch_extensions/torch-<version>`` (one
    per torch version: an op built against another torch may not load); else None, torch's
    default (``~/.cache/torch_extensions/<python>_<accelerator>``), shared by every environment of
    the user."""
    if os.environ.get(EXTENSIONS_ENV):
        return os.environ[EXTENSIONS_ENV]
    if sys.prefix != sys.base_prefix:
        return os.path.join(sys.prefix, "torch_extensions", f"torch-{torch.__version__}")
    return None


_DS_LOCK = threading.Lock()
_DS_OP: Any = None
_DS_IDS = itertools.count(1 << 20)  # DeepSpeedCPUAdam numbers its optimizers from 0: keep clear of them


def _deepspeed_op(why: str = "DeepSpeed's host AdamW kernel is asked for") -> Any:
    """DeepSpeed's ``cpu_adam`` op, loaded once per process: prebuilt at install, from the build
    cache (:func:`deepspeed_build_dir`), or built there first with a line on stderr before and
    after (``why``: the reason the line gives).

    Raises:
        ConfigError: the op did not build or load.
    """
    global _DS_OP
    with _DS_LOCK:
        if _DS_OP is None:
            try:
                _DS_OP = _load_deepspeed_op(why)
            except Exception as e:
                raise ConfigError(f"DeepSpeed's CPU Adam op did not build or load ({type(e).__name__}: {e}); it needs "
                                  "ninja and a C++ compiler on the first use (or DS_BUILD_CPU_ADAM=1 at install). "
                                  f"Fix that, or run torch's kernel: {HOST_ADAM_ENV}=torch (the default)") from e
        return _DS_OP


def _load_deepspeed_op(why: str) -> Any:
    from deepspeed.git_version_info import installed_ops
    from deepspeed.ops.op_builder import CPUAdamBuilder

    builder = CPUAdamBuilder()
    if installed_ops.get(builder.name, False):
        return builder.load(verbose=False)  # prebuilt at install: nothing to compile
    root = deepspeed_build_dir()
    with _environ(EXTENSIONS_ENV, root):
        from torch.utils.cpp_extension import _get_build_directory

        where = _get_build_directory(builder.name, verbose=False)
        built = os.path.exists(os.path.join(where, f"{builder.name}.so"))
        if not built:
            print(f"megatrain: building DeepSpeed's CPU Adam op ({builder.name}, C++ with ninja and the host compiler, "
                  f"about 1.5 CPU-minutes, once per environment) because {why}; cached in {where}",
                  file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        op = builder.load(verbose=False)
        if not built:
            print(f"megatrain: DeepSpeed's CPU Adam op built in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                  flush=True)
    return op


@contextlib.contextmanager
def _environ(name: str, value: str | None) -> Iterator[None]:
    """``os.environ[name] = value`` inside the block (nothing when ``value`` is None), then as before:
    torch reads ``TORCH_EXTENSIONS_DIR`` when it builds or loads, and other code of the process
    keeps the user's setting."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


class HostAdamW:
    """AdamW steps of flat FP32 host tiles with one kernel (see the module docstring).

    Args:
        kernel: ``"auto"``, ``"torch"`` or ``"deepspeed"``; None: ``$MEGATRAIN_HOST_ADAM``
            (:func:`host_adam_kernel`). DeepSpeed's op is loaded (built, the first time in an
            environment) here.

    Raises:
        ConfigError: as :func:`host_adam_kernel`, or DeepSpeed's op did not build or load.
    """

    def __init__(self, kernel: str | None = None):
        self.kernel, where = _host_adam_choice(kernel)
        self._ds_id: int | None = None
        self._scratch: torch.Tensor | None = None
        if self.kernel == "deepspeed":
            # Now, at compile: a build (minutes) must not hide in the first step's first OPT.
            asked = f"{HOST_ADAM_ENV}=deepspeed" if where.startswith("$") else "HostAdamW(kernel='deepspeed')"
            _deepspeed_op(f"{asked} asks for DeepSpeed's host AdamW kernel")

    def __repr__(self) -> str:
        return f"HostAdamW(kernel={self.kernel!r})"

    def step(self, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
             step: torch.Tensor, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
             grad_scale: torch.Tensor | None = None, scratch: torch.Tensor | None = None,
             cast_into: torch.Tensor | None = None) -> torch.Tensor:
        """One AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` in place from ``grad``, as
        ``torch.optim.AdamW`` (decoupled weight decay, bias correction) takes it; with ``cast_into``,
        also the updated ``param`` rounded to BF16 into it (what a CAST writes for the next H2D).
        Returns the sum of the updated ``param`` (0-dim FP32; NaN or inf where an element is, or
        where the sum overflows), for the executor's finite check: in a chunked step each chunk is
        summed while it is in the cache, sparing the check its own read of the master from DRAM
        (4 bytes per parameter); an unchunked step (FP32 gradients, nothing to cast) sums the
        tile after it.

        Args:
            param, exp_avg, exp_avg_sq: contiguous FP32 tensors of one shape (flat tiles).
            grad: the gradients, contiguous, that shape, FP32 or BF16.
            step: the 0-dim FP32 step count of these tiles (as torch's optimizer state); the call
                adds one and updates with the new count.
            grad_scale: 0-dim FP32 tensor the gradients are divided by, or None.
            scratch: FP32 tensor for a chunked step, of at least :data:`CHUNK_ELEMENTS` x the
                calling thread's ``torch.get_num_threads()`` elements (or ``grad``'s, if fewer);
                None: this object's own, made at first need.
            cast_into: contiguous BF16 tensor of ``param``'s shape, or None. The step then runs
                chunk by chunk (as for BF16 gradients) and casts each stepped chunk of ``param``
                into it while the chunk is still in the cache: bitwise what stepping and then
                casting the whole tile gives, without the cast's second read of the master from
                DRAM (host traffic per parameter 28 + 2 bytes with FP32 gradients, 26 + 2 with
                BF16 ones, against 28 + 6 for a step and a separate cast). Neither kernel has
                such an output (DeepSpeed 0.19's ``adam_update`` takes one dtype for parameters
                and gradients and writes no copy), so the cast is torch's ``copy_``.

        Raises:
            ValueError: a tensor is not contiguous or not of ``param``'s shape, or a dtype other
                than the above (DeepSpeed's op would update a copy, or misread the gradients).
        """
        _check_tiles(param, grad, exp_avg, exp_avg_sq)
        if cast_into is not None and (cast_into.dtype != torch.bfloat16 or not cast_into.is_contiguous()
                                      or cast_into.shape != param.shape):
            raise ValueError(f"HostAdamW.step: cast_into is {cast_into.dtype} of shape {tuple(cast_into.shape)} "
                             f"(contiguous={cast_into.is_contiguous()}); it must be contiguous torch.bfloat16 of "
                             f"param's shape {tuple(param.shape)}")
        widen = grad.dtype != torch.float32 or (grad_scale is not None and self.kernel == "deepspeed")
        if self.kernel == "torch":
            def run(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
                torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=lr, beta1=betas[0], beta2=betas[1],
                                    weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
                                    grad_scale=grad_scale, found_inf=None)
        else:
            op, opt_id, count = _deepspeed_op(), self._deepspeed_id(lr, betas, eps, weight_decay), int(step) + 1

            def run(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> None:
                op.adam_update(opt_id, count, lr, betas[0], betas[1], eps, weight_decay, True, p, g, m, v)
        step += 1  # (torch's kernel reads the new count from the tensor)
        if not widen and cast_into is None:
            run(param, grad, exp_avg, exp_avg_sq)
            return param.sum()
        chunk = CHUNK_ELEMENTS * torch.get_num_threads()  # this thread's team
        buf = self._chunk_scratch(scratch, min(chunk, grad.numel())) if widen else None
        divide = grad_scale if self.kernel == "deepspeed" else None  # torch's kernel divides by grad_scale itself
        total = torch.zeros((), dtype=torch.float32)
        for lo in range(0, grad.numel(), chunk):
            hi = min(lo + chunk, grad.numel())
            g = grad[lo:hi]
            if buf is not None:
                g = buf[:hi - lo].copy_(g)
                if divide is not None:
                    g.div_(divide)
            run(param[lo:hi], g, exp_avg[lo:hi], exp_avg_sq[lo:hi])
            total += param[lo:hi].sum()
            if cast_into is not None:
                cast_into[lo:hi].copy_(param[lo:hi])
        return total

    def update(self, param: torch.Tensor, grad: torch.Tensor, states: "list[torch.Tensor]", step: torch.Tensor,
               settings: Any, *, grad_scale: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The host kernel interface of :class:`megatrain.optim.OptimizerSpec`: :meth:`step` with
        ``states`` = ``[exp_avg, exp_avg_sq]`` and ``settings`` a :class:`megatrain.AdamW`; returns
        the sum of the updated ``param`` (see :meth:`step`)."""
        exp_avg, exp_avg_sq = states
        return self.step(param, grad, exp_avg, exp_avg_sq, step, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                  weight_decay=settings.weight_decay, grad_scale=grad_scale, scratch=scratch)

    def _chunk_scratch(self, scratch: torch.Tensor | None, need: int) -> torch.Tensor:
        if scratch is not None:
            if scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < need:
                raise ValueError(f"HostAdamW.step: the scratch ({scratch.dtype}, {scratch.numel()} elements, "
                                 f"contiguous={scratch.is_contiguous()}) must be contiguous FP32 of at least {need} "
                                 "elements (CHUNK_ELEMENTS per thread of the team, or the gradients' count if fewer)")
            return scratch.view(-1)
        if self._scratch is None or self._scratch.numel() < need:
            # Pageable, kept: OPTs run one at a time on the host worker (layout.gradient_scratch_numel).
            self._scratch = torch.empty(need, dtype=torch.float32)
        return self._scratch

    def _deepspeed_id(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> int:
        """This object's optimizer in DeepSpeed's op (which keeps ``beta^t`` per optimizer id)."""
        if self._ds_id is None:
            op = _deepspeed_op()
            self._ds_id = next(_DS_IDS)
            op.create_adam(self._ds_id, lr, betas[0], betas[1], eps, weight_decay, True, False)
            weakref.finalize(self, op.destroy_adam, self._ds_id)
        return self._ds_id


class HostLion:
    """Lion steps of flat FP32 host tiles (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms", arXiv:2302.06675, Algorithm 2; :class:`megatrain.optim.Lion` gives the update),
    in torch's element-wise CPU ops, parallel over the calling thread's intra-op team.

    It steps the tile chunk by chunk, :data:`CHUNK_ELEMENTS` per thread at a time, so that a
    chunk's passes (the update's interpolation and sign, the decay, the step, the moment's
    ``lerp``) stay in the cache; BF16 or scaled gradients are widened to FP32 (and divided by
    ``grad_scale``) into this object's scratch first, as :class:`HostAdamW` does, FP32 ones are
    read in place, and the scratch holds the chunk's update too: no tile-sized temporary. DRAM
    traffic per parameter with FP32 gradients: 20 bytes (the master and the moment read and
    written, the gradient read; AdamW: 28); the passes cost compute, and on this project's 2-core
    VM it stepped at 0.8-1.1x torch's fused AdamW (README, "Optimizers: AdamW and Lion").
    """

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None

    def __repr__(self) -> str:
        return "HostLion()"

    def update(self, param: torch.Tensor, grad: torch.Tensor, states: "list[torch.Tensor]", step: torch.Tensor,
               settings: Any, *, grad_scale: torch.Tensor | None = None,
               scratch: torch.Tensor | None = None) -> torch.Tensor:
        """One Lion update of ``param`` and its moment ``states[0]`` in place from ``grad``; returns
        the sum of the updated ``param`` (0-dim FP32), each chunk summed while it is in the cache
        (the executor's finite check, as :meth:`HostAdamW.step`'s).

        Args:
            param, states[0]: contiguous FP32 tensors of one shape (flat tiles).
            grad: the gradients, contiguous, that shape, FP32 or BF16.
            step: the 0-dim FP32 step count of these tiles; the call adds one (Lion does not read it).
            settings: a :class:`megatrain.Lion` (``lr``, ``betas``, ``weight_decay``).
            grad_scale: 0-dim FP32 tensor the gradients are divided by, or None.
            scratch: FP32 tensor of at least twice the chunk (:data:`CHUNK_ELEMENTS` x the team,
                or the gradients' count if fewer); None: this object's own.

        Raises:
            ValueError: a tensor is not contiguous, not of ``param``'s shape, or of another dtype.
        """
        (exp_avg,) = states
        _check_tiles(param, grad, exp_avg, kernel="HostLion.update")
        beta1, beta2 = settings.betas
        lr, decay = settings.lr, 1.0 - settings.lr * settings.weight_decay
        step += 1
        n = grad.numel()
        chunk = min(CHUNK_ELEMENTS * torch.get_num_threads(), max(n, 1))
        if scratch is None:
            if self._scratch is None or self._scratch.numel() < 2 * chunk:
                self._scratch = torch.empty(2 * chunk, dtype=torch.float32)
            scratch = self._scratch
        elif scratch.dtype != torch.float32 or not scratch.is_contiguous() or scratch.numel() < 2 * chunk:
            raise ValueError(f"HostLion.update: the scratch ({scratch.dtype}, {scratch.numel()} elements) must be "
                             f"contiguous FP32 of at least {2 * chunk} elements (two chunks)")
        scratch = scratch.view(-1)
        widen = grad.dtype != torch.float32 or grad_scale is not None
        total = torch.zeros((), dtype=torch.float32)
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            g = grad[lo:hi]
            if widen:  # FP32 gradients are read in place
                g = scratch[:hi - lo].copy_(g)
                if grad_scale is not None:
                    g.div_(grad_scale)
            p, m = param[lo:hi], exp_avg[lo:hi]
            u = torch.mul(m, beta1, out=scratch[chunk:chunk + hi - lo]).add_(g, alpha=1.0 - beta1).sign_()
            if decay != 1.0:
                p.mul_(decay)
            p.add_(u, alpha=-lr)
            m.lerp_(g, 1.0 - beta2)  # beta2 * m + (1 - beta2) * g in one pass
            total += p.sum()
        return total


def host_kernel(spec: OptimizerSpec) -> "HostAdamW | HostLion":
    """A new host kernel of optimizer ``spec``: the class its ``kernel`` path names."""
    import importlib

    module, _, name = spec.kernel.rpartition(".")
    return getattr(importlib.import_module(module), name)()


def _check_tiles(param: torch.Tensor, grad: torch.Tensor, *states: torch.Tensor,
                 kernel: str = "HostAdamW.step") -> None:
    names = ("exp_avg", "exp_avg_sq")
    named = {"param": param, "grad": grad, **{names[k]: t for k, t in enumerate(states)}}
    for name, t in named.items():
        want = (torch.float32, torch.bfloat16) if name == "grad" else (torch.float32,)
        if t.dtype not in want or not t.is_contiguous() or t.shape != param.shape:
            raise ValueError(f"{kernel}: {name} is {t.dtype} of shape {tuple(t.shape)} "
                             f"(contiguous={t.is_contiguous()}); it must be contiguous "
                             f"{' or '.join(str(d) for d in want)} of param's shape {tuple(param.shape)}")


__all__ = ["CHUNK_ELEMENTS", "EXTENSIONS_ENV", "HOST_ADAM_ENV", "KERNELS", "HostAdamW", "HostLion", "host_kernel",
           "deepspeed_build_dir", "deepspeed_installed", "host_adam_kernel", "run_on_team", "set_thread_team"]
