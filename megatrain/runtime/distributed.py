"""Data parallel on ``torch.distributed``: who the ranks are, the process groups the host
collectives run in, and the node's shared host state.

Topology. ``torchrun`` gives every process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``; the ranks of one node are ``LOCAL_WORLD_SIZE`` consecutive global ranks
(torchrun numbers them node by node). Without the local variables every rank is a node of its
own. :func:`topology` reads them once the default process group exists.

Groups. The collectives of a schedule (ALL_REDUCE or REDUCE_SCATTER, ALL_GATHER, COUNT_REDUCE) read and
write host memory, so they run in gloo groups made here, whatever the default group's backend (NCCL
on GPUs reduces device memory only): one over every rank and one per node (``new_group`` is called
for every node on every rank, as torch.distributed requires).

Shared host state. With ``Plan.optimizer_shards > 1`` the ranks of a node keep one copy of the
FP32 masters and Adam moments, not one each: the node's first rank (its leader) creates a file in
``/dev/shm`` (a tmpfs: memory, not disk), sized for every layer's block, and tells the others its
name; every rank maps it with ``MAP_SHARED``; once all have, the leader unlinks it, so the memory
goes back to the system when the last rank exits, however it exits. The leader initialises the
weights (each rank's module is bound to views of the shared blocks without writing them), and the
leaders of all nodes then take global rank 0's weights (a broadcast), so every rank starts from the
same weights, as DDP's construction does.

Sharded across nodes (``Plan.host_state == "shard"``, ZeRO-3 style: Rajbhandari et al. 2020,
arXiv:1910.02054). Global rank ``r`` of ``N`` steps shard ``r`` of every layer
(``layout.optimizer_shard``) and node ``n`` holds only the union of its ranks' shards
(``layout.node_slice``) of the masters and moments, in its shared mapping, with
``layout.GATHER_BUFFERS`` gather tiles after them. The gradients are reduce-scattered over every
rank; before each read of a layer's weights the schedule's ALL_GATHER puts the whole layer, from
every node's slice, into a gather tile (:func:`gather_weights`). At compile global rank 0
initialises the weights into whole rows of its own (4 bytes per parameter, dropped after) and
broadcasts them to the node leaders, one layer at a time (:func:`broadcast_slices`); no module
keeps its parameters (``host.unbind_parameters``).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import mmap
import os
import shutil
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from megatrain.errors import CollectiveError, ConfigError
from megatrain.ir.layout import node_slice, optimizer_shard

SHM_DIR = "/dev/shm"
"""Where the node's shared host state is created (a tmpfs). ``MEGATRAIN_SHM_DIR`` overrides it."""


@dataclass(frozen=True, slots=True)
class Topology:
    """This process's place among the ranks: global ``rank`` of ``world``; ``local_rank`` of the
    ``local_world`` ranks of node ``node`` (of ``world // local_world`` nodes)."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    def __post_init__(self) -> None:
        if self.local_world < 1 or self.world % self.local_world:
            raise ConfigError(f"LOCAL_WORLD_SIZE={self.local_world} does not divide WORLD_SIZE={self.world}: every "
                              "node must run as many ranks (torchrun --nproc-per-node)")
        if not 0 <= self.local_rank < self.local_world or self.rank % self.local_world != self.local_rank:
            raise ConfigError(f"rank {self.rank} has LOCAL_RANK={self.local_rank} with LOCAL_WORLD_SIZE="
                              f"{self.local_world}: megatrain expects torchrun's numbering, node by node")

    @property
    def node(self) -> int:
        return self.rank // self.local_world

    @property
    def leader(self) -> bool:
        """The node's first rank: it creates and initialises the node's shared host state."""
        return self.local_rank == 0


def topology() -> Topology:
    """The default process group's ranks, with the node layout from torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (each rank its own node when they are not set).

    Raises:
        ConfigError: the local variables contradict the global ones.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank % local_world)))
    return Topology(rank, world, local_rank, local_world)


def world_timeout() -> datetime.timedelta | None:
    """The timeout the default process group was made with (``init_process_group(timeout=)``), or
    None where its backend does not say (``new_group`` would otherwise fall back to torch's
    default, 30 minutes, whatever the user chose)."""
    import torch.distributed as dist

    group = dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):  # no backend for that device, or one without options
            continue
    return None


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a failure of the ``torch.distributed`` calls inside into a :class:`CollectiveError`
    that names ``what`` (an op such as ``ALL_REDUCE:L3``, or "the barrier after a save"), this
    rank, the timeout and, from the ranks' heartbeats (:class:`Heartbeat`), the rank that stopped."""
    try:
        yield
    except RuntimeError as e:  # gloo and NCCL raise DistBackendError (a RuntimeError), timeouts included
        import torch.distributed as dist

        timeout = world_timeout()
        waited = f"{timeout.total_seconds():g} s" if timeout is not None else "torch's default timeout"
        first = (str(e).strip().splitlines() or [repr(e)])[0]
        raise CollectiveError(
            f"data parallel: {what} failed on rank {dist.get_rank()} of {dist.get_world_size()} ({type(e).__name__}: "
            f"{first}). {who_stopped() or 'Another rank died, hung or failed on its own'} (the process group's "
            f"timeout is {waited}: init_process_group(timeout=), megatrain train --collective-timeout). The ranks' "
            "states may differ now, so every rank stops: restart all of them from the last checkpoint (saves are "
            "atomic, so it is complete)") from e


# -- heartbeats: which rank stopped ------------------------------------------------------------------

_HEARTBEAT_KEY = "megatrain/heartbeat/{rank}"


class Heartbeat:
    """Each rank's record, in the process group's key-value store, of when it was last alive and
    which step it had begun: a daemon thread writes it every ``interval`` seconds, and
    :meth:`step` when a step begins. A rank that dies or is stopped (SIGSTOP, a hung driver
    holding the interpreter) stops writing; one stuck in a wait keeps writing but stays at its
    step. :func:`who_stopped` reads them when a collective fails, so the error names that rank
    (a collective's own timeout error names no peer). One per process (:meth:`start`)."""

    _current: "Heartbeat | None" = None

    def __init__(self, store, rank: int, interval: float):
        import threading

        self.store, self.rank, self.interval = store, rank, interval
        self.step_no, self.what = 0, "setting up"
        self._beat()
        self._thread = threading.Thread(target=self._run, name="megatrain-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, interval: float) -> "Heartbeat | None":
        """The process's heartbeat, started once (None without a process group or its store)."""
        import torch.distributed as dist

        if cls._current is None and dist.is_initialized():
            store = _store()
            try:
                cls._current = cls(store, dist.get_rank(), interval) if store is not None else None
            except Exception as e:  # a store that refuses writes: errors then name no rank, waits are barriers
                import logging

                logging.getLogger(__name__).warning("no heartbeats in the process group's store (%s): a failed "
                                                    "collective will not name the rank that stopped", e)
        return cls._current

    def _beat(self) -> None:
        import time

        self.store.set(_HEARTBEAT_KEY.format(rank=self.rank), f"{time.time():.3f}|{self.step_no}|{self.what}")

    def _run(self) -> None:
        import time

        while True:
            time.sleep(self.interval)
            try:
                self._beat()
            except Exception:  # the store went away (the job is ending): nothing left to tell
                return

    @classmethod
    def step(cls, what: str) -> None:
        """This rank begins ``what`` (a step): recorded at once."""
        hb = cls._current
        if hb is not None:
            hb.step_no += 1
            hb.what = what
            try:
                hb._beat()
            except Exception:
                pass


def _store():
    """The default process group's key-value store (torchrun's, or the init method's), or None."""
    import torch.distributed as dist

    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def who_stopped() -> str | None:
    """A sentence naming the ranks that stopped, from their heartbeats: silent for more than three
    intervals, or at an earlier step than the others. None when it cannot tell."""
    import time

    import torch.distributed as dist

    hb = Heartbeat._current
    if hb is None:
        return None
    records = {}
    try:
        for r in range(dist.get_world_size()):
            key = _HEARTBEAT_KEY.format(rank=r)
            if hb.store.check([key]):
                t, n, what = hb.store.get(key).decode().split("|", 2)
                records[r] = (float(t), int(n), what)
    except Exception:  # the store is gone too
        return None
    now = time.time()
    latest = max((n for _, n, _ in records.values()), default=0)
    silent = [r for r in range(dist.get_world_size()) if r not in records or now - records[r][0] > 3 * hb.interval]
    behind = [r for r, (_, n, _) in records.items() if n < latest and r not in silent]
    parts = [f"rank {r} stopped: no heartbeat for {now - records[r][0]:.0f} s (its last: {records[r][2]})"
             if r in records else f"rank {r} never reported" for r in silent]
    ahead = records[max(records, key=lambda q: records[q][1])][2] if records else ""
    parts += [f"rank {r} has not begun {ahead} (it last began {records[r][2]})" for r in behind]
    text = "; ".join(parts)
    return text[:1].upper() + text[1:] if text else None


_BARRIERS = itertools.count()


def patient_barrier(what: str, failed: BaseException | None = None) -> None:
    """A barrier over every rank that waits as long as the ranks it waits for are alive, around work
    of any length (rank 0's data preparation, its save) where a collective's timeout would stop a
    healthy run: through the store, not a collective, checking the heartbeats of the ranks not
    there yet. A rank whose heartbeat stops for longer than the process group's timeout is named.
    Every rank calls it the same number of times; ``failed``: this rank's work raised it, and the
    others learn so at once (this rank does not wait).

    Raises:
        CollectiveError: another rank failed, or stopped (naming it and what it last did).
    """
    import time

    import torch.distributed as dist

    hb = Heartbeat._current
    if hb is None or dist.get_world_size() == 1:
        if failed is None and dist.is_initialized():
            with collective(what):
                dist.barrier()
        return
    n, me, world = next(_BARRIERS), dist.get_rank(), dist.get_world_size()
    key = f"megatrain/barrier/{n}/{{}}"
    hb.store.set(key.format(me), "ok" if failed is None else f"failed: {type(failed).__name__}: {failed}"[:500])
    if failed is not None:
        return
    timeout = (world_timeout() or datetime.timedelta(minutes=30)).total_seconds()
    pending = [r for r in range(world) if r != me]
    while pending:
        try:
            hb.store.wait([key.format(r) for r in pending], datetime.timedelta(seconds=hb.interval))
        except RuntimeError:  # not all there yet (DistStoreError on the timeout)
            pass
        for r in list(pending):
            if hb.store.check([key.format(r)]):
                state = hb.store.get(key.format(r)).decode()
                if state != "ok":
                    raise CollectiveError(f"data parallel: {what}: rank {r} {state}; every rank stops: fix that, then "
                                          "restart all of them (from the last checkpoint, if there is one)")
                pending.remove(r)
        beats = {}
        for r in pending:
            k = _HEARTBEAT_KEY.format(rank=r)
            beats[r] = float(hb.store.get(k).decode().split("|")[0]) if hb.store.check([k]) else None
        now = time.time()
        gone = [r for r, t in beats.items() if t is not None and now - t > timeout]
        if gone:
            raise CollectiveError(f"data parallel: {what} on rank {me}: {who_stopped() or f'rank {gone[0]} stopped'} "
                                  f"(no heartbeat for longer than the process group's timeout, {timeout:g} s). Every rank "
                                  "stops: restart all of them (from the last checkpoint, if there is one)")


def sum_over_ranks(values: list[float] | list[int], dtype: torch.dtype, group: Any) -> torch.Tensor:
    """``values`` summed elementwise over the ranks of ``group`` (a gloo group; None: the default
    group), as a host tensor of ``dtype``: the global batch's supervised tokens (COUNT_REDUCE, int64,
    exact), an evaluation's summed losses and counts (float64). Every rank must call it, in the
    same order; wrap it in :func:`collective`."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=dtype)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


class Groups:
    """The gloo process groups the host collectives use: ``world`` (every rank; None where the
    default group is that), ``node`` (the ranks of this process's node) and ``leaders`` (every
    node's first rank). ``timeout``: how long a collective waits for the other ranks before it
    raises (a rank that died or hangs); default the default group's."""

    def __init__(self, topo: Topology, timeout: datetime.timedelta | None = None):
        import torch.distributed as dist

        timeout = world_timeout() if timeout is None else timeout
        kw: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        self.topo = topo
        self.world = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", **kw)
        self.node = None
        for node in range(topo.world // topo.local_world):
            ranks = list(range(node * topo.local_world, (node + 1) * topo.local_world))
            g = dist.new_group(ranks, backend="gloo", **kw)
            if node == topo.node:
                self.node = g
        self.leaders = dist.new_group(list(range(0, topo.world, topo.local_world)), backend="gloo", **kw)


class SharedHostMemory:
    """One ``MAP_SHARED`` mapping of a file in ``/dev/shm``, shared by the ranks of a node, from
    which :class:`~megatrain.runtime.host.HostState` carves its page-aligned blocks in order (the
    same order, so the same offsets, on every rank). Made by :func:`shared_host_memory`."""

    def __init__(self, path: str, nbytes: int, create: bool):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size != nbytes:
                raise ConfigError(f"the node's shared host state {path!r} has {os.fstat(fd).st_size} bytes, not "
                                  f"{nbytes}: the ranks of a node traced different models; give every rank the same "
                                  "model and shapes")
            self.inode = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.path, self.nbytes, self._used = path, nbytes, 0

    def take(self, nbytes: int, align: int) -> torch.Tensor:
        """The next ``uint8[nbytes]`` of the mapping, starting on a multiple of ``align`` bytes."""
        start = -(-self._used // align) * align
        if start + nbytes > self.nbytes:
            raise RuntimeError(f"shared host memory {self.path!r}: {start + nbytes} bytes asked of {self.nbytes}")
        self._used = start + nbytes
        return torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes, offset=start)


def shared_host_memory(nbytes: int, topo: Topology, group: Any, directory: str | None = None) -> SharedHostMemory:
    """The node's shared mapping of ``nbytes``: the leader creates it, the others open it (the name
    goes from the leader to them in ``group``, the node's group), and the leader unlinks it once
    every rank has it mapped. Collective over the node's ranks.

    Raises:
        ConfigError: the directory lacks room (a container's ``/dev/shm`` is 64 MiB unless it is
            run with ``--shm-size``), named with the bytes needed and what to change.
    """
    import torch.distributed as dist

    directory = directory or os.environ.get("MEGATRAIN_SHM_DIR", SHM_DIR)
    payload: list[str | None] = [None, None]  # the file's name, or why there is none
    if topo.leader:
        free = shutil.disk_usage(directory).free if os.path.isdir(directory) else -1
        if free < nbytes:
            payload[1] = (f"the node's shared host state needs {nbytes / 2**30:.2f} GiB in {directory!r}, which "
                          + ("does not exist" if free < 0 else f"has {free / 2**30:.2f} GiB free") + ": give the "
                          "container more shared memory (docker run --shm-size), point MEGATRAIN_SHM_DIR at a larger "
                          "tmpfs, or compile with share_host_memory=False (one copy per rank)")
        else:
            payload[0] = os.path.join(directory, f"megatrain-host-{os.getpid()}-{os.urandom(6).hex()}")
    dist.broadcast_object_list(payload, src=topo.rank - topo.local_rank, group=group)
    name, error = payload
    if error is not None:
        raise ConfigError(error)
    mem = None
    try:
        if topo.leader:
            mem = SharedHostMemory(name, nbytes, create=True)
        dist.barrier(group=group)
        if not topo.leader:
            mem = SharedHostMemory(name, nbytes, create=False)
        dist.barrier(group=group)
    finally:
        if topo.leader and os.path.exists(name):
            os.unlink(name)
    return mem


@dataclass(frozen=True, slots=True)
class DataParallelHost:
    """What :func:`data_parallel_host` set up: the ranks' ``topo``, the host collectives'
    ``groups``, the node's ``shared`` mapping (None: this rank has a copy of its own) and whether
    this rank writes the host state at set-up (``writer``: the node's leader, or every rank
    without sharing)."""

    topo: Topology
    groups: Groups
    shared: SharedHostMemory | None
    writer: bool
    sharded: bool = False

    def barrier(self, what: str) -> None:
        """Wait for every rank, in the gloo group of every rank (``what`` names it in a
        :class:`CollectiveError`)."""
        import torch.distributed as dist

        with collective(what):
            dist.barrier(group=self.groups.world)

    @property
    def shard_index(self) -> int:
        """This rank's optimizer shard (``layout.optimizer_shard`` of ``Plan.update_shards``): its global
        rank when the state is sharded across nodes (``sharded``), its place in the node when the
        node shares one copy, else 0."""
        if self.sharded:
            return self.topo.rank
        return self.topo.local_rank if self.shared is not None else 0


def data_parallel_host(nbytes: int, data_parallel: int, optimizer_shards: int, nodes: int = 1,
                       sharded: bool = False) -> DataParallelHost:
    """Set up data parallel for a plan with ``data_parallel`` ranks over ``nodes`` nodes of which
    ``optimizer_shards`` per node share the host state (``nbytes`` of it, ``host_layout.shared_nbytes``;
    with ``sharded``, ``Plan.host_state == "shard"``, the node's slice of it). Collective.

    Raises:
        ConfigError: the plan's ranks or nodes are not the process group's, or its shards not the
            node's ranks (a sharded state needs every rank of a node sharing its slice); no room in
            ``/dev/shm`` (:func:`shared_host_memory`).
    """
    topo = topology()
    if data_parallel != topo.world:
        raise ConfigError(f"the plan has data_parallel={data_parallel} but the process group has {topo.world} "
                          "ranks; compile in the process group you train in")
    if optimizer_shards not in (1, topo.local_world):
        raise ConfigError(f"the plan shares each node's host state among optimizer_shards={optimizer_shards} ranks, "
                          f"but a node runs LOCAL_WORLD_SIZE={topo.local_world}; compile on the nodes you train on")
    if sharded and (optimizer_shards != topo.local_world or nodes != topo.world // topo.local_world):
        raise ConfigError(f"the plan shards the host state over nodes={nodes} with optimizer_shards={optimizer_shards}, "
                          f"but the process group has {topo.world // topo.local_world} nodes of LOCAL_WORLD_SIZE="
                          f"{topo.local_world}: each node's ranks share its slice, so optimizer_shards must be the "
                          "ranks per node; compile with share_host_memory=True on the nodes you train on")
    g = Groups(topo)
    timeout = world_timeout()
    Heartbeat.start(interval=min(10.0, (timeout.total_seconds() if timeout else 1800.0) / 10))
    if optimizer_shards == 1:
        return DataParallelHost(topo, g, None, True, sharded)
    return DataParallelHost(topo, g, shared_host_memory(nbytes, topo, g.node), topo.leader, sharded)


def broadcast_slices(rows: list[torch.Tensor] | None, host: Any, dp: DataParallelHost) -> None:
    """Give every node's slice of the host state (``host``: a sliced ``HostState``) global rank 0's
    initial master weights: ``rows`` (rank 0 only; None elsewhere) holds each layer's whole FP32
    row; layer by layer, rank 0 broadcasts it to the node leaders, each of which copies its
    ``[lo, hi)`` into its node's slice (so a leader holds one whole row at a time besides its
    slice), then the node's ranks wait for their leader. Collective."""
    import torch.distributed as dist

    with collective("the broadcast of rank 0's weights to the nodes' slices at compile"):
        if dp.writer:
            for li, layer in enumerate(host.graph.layers):
                row = rows[li] if dp.topo.rank == 0 else torch.empty((layer.numel,), dtype=torch.float32)
                dist.broadcast(row, src=0, group=dp.groups.leaders)
                lo, hi = host.tile_layout.slices[li]
                host.master(li).copy_(row[lo:hi])
        if dp.shared is not None:
            dist.barrier(group=dp.groups.node)


def gather_weights(host: Any, layer: int, lo_hi: list[tuple[int, int]], dst: torch.Tensor,
                   dp: DataParallelHost) -> None:
    """Gather layer ``layer``'s whole master tile into ``dst`` (a node-shared ``numel``-element
    tile of the compute dtype, FP32 or BF16) from every node's slice of it (``lo_hi[n]``: node
    ``n``'s ``[lo, hi)``, ``layout.node_slice``). The node's ranks wait for each other (every
    rank's update of its shard, and every read of ``dst``'s last content, is done); each casts
    its share (``layout.optimizer_shard`` of the slice among the node's ranks) of the node's slice
    into the shared send buffer (``host.gather_scratch``); once all have, the node leaders
    all-gather the send buffers over the leaders' group into the shared receive buffer (gloo
    needs equal sizes: each slice is padded to the longest); then each rank copies its share of
    the layer into its place in ``dst``, and they wait again, so none reads ``dst`` before it is
    whole. So the node's host copies are split between its ranks, as their casts are with
    ``Plan.shared_cast`` (``megatrain.planner.time.weight_gather_host_time``). Collective; raises ``CollectiveError``
    as :func:`collective`."""
    import torch.distributed as dist

    node_group = dp.groups.node
    shared = dp.shared is not None
    ranks, me = (dp.topo.local_world, dp.topo.local_rank) if shared else (1, 0)
    chunk = max(hi - lo for lo, hi in lo_hi)
    lo, hi = lo_hi[dp.topo.node]
    scratch = host.gather_scratch
    if scratch is None or scratch.numel() < (len(lo_hi) + 1) * chunk * dst.element_size():
        raise ConfigError(f"the weight gather of layer {layer} needs a scratch of {(len(lo_hi) + 1) * chunk} elements "
                          "(megatrain.ir.layout.gather_scratch_bytes), and the sliced host state has "
                          f"{0 if scratch is None else scratch.numel() // dst.element_size()}; make it with "
                          "scratch_bytes=megatrain.ir.layout.gather_scratch_bytes(graph, plan)")
    flat = scratch[:(len(lo_hi) + 1) * chunk * dst.element_size()].view(dst.dtype)
    send, recv = flat[:chunk], flat[chunk:]
    if shared:
        dist.barrier(group=node_group)
    a, b = optimizer_shard(hi - lo, ranks, me)
    send[a:b].copy_(host.master(layer)[a:b])  # this rank's share of the node's slice, cast
    if shared:
        dist.barrier(group=node_group)
    if dp.writer:
        dist.all_gather(list(recv.split(chunk)), send, group=dp.groups.leaders)
    if shared:
        dist.barrier(group=node_group)
    a, b = optimizer_shard(dst.numel(), ranks, me)  # this rank's share of the layer
    for n, (p, q) in enumerate(lo_hi):
        s, e = max(a, p), min(b, q)
        if s < e:
            dst[s:e].copy_(recv[n * chunk + s - p:n * chunk + e - p])
    if shared:
        dist.barrier(group=node_group)


def broadcast_masters(masters: list[torch.Tensor], dp: DataParallelHost) -> None:
    """Give every copy of the host state global rank 0's master weights (``masters``: each layer's
    FP32 master row), as DDP does at construction, then let the node's ranks read them. Collective."""
    import torch.distributed as dist

    topo = dp.topo
    group = dp.groups.world if dp.shared is None else dp.groups.leaders
    with collective("the broadcast of rank 0's weights at compile"):
        if dp.writer and (dp.shared is None or topo.world > topo.local_world):
            for m in masters:
                dist.broadcast(m, src=0, group=group)
        if dp.shared is not None:
            dist.barrier(group=dp.groups.node)



class SliceReader:
    """Whole rows of a sliced host state (``Plan.host_state == "shard"``), read on global rank 0
    from the node leaders' slices, one row at a time, while the other leaders :meth:`serve`: what
    ``Trainer.save`` writes a checkpoint from. Rank 0 asks for a row (:meth:`row`: a broadcast of
    ``(layer, kind)`` over the leaders' group), each leader sends its part (padded to the longest,
    ``dist.gather``), and rank 0 assembles it; :meth:`close` ends the leaders' loops. Rank 0 keeps
    the last row (a layer's parameters are read one after another), so it holds about one layer
    beyond its node's slice. ``plan`` gives every node's slice (``layout.node_slice``)."""

    def __init__(self, host: Any, dp: DataParallelHost, plan: Any):
        self.host, self.dp = host, dp
        self.slices = [[node_slice(lay.numel, lay.trainable_numel, plan, n) for lay in host.graph.layers]
                       for n in range(plan.nodes)]
        self._last: tuple[tuple[int, int], torch.Tensor] | None = None

    def row(self, layer: int, kind: int) -> torch.Tensor:
        """Rank 0: ``float32[numel]`` (``kind`` 0, the master) or ``float32[trainable_numel]`` (1, 2:
        the moments) of ``layer``, whole. Collective with the leaders' :meth:`serve`."""
        import torch.distributed as dist

        if self._last is not None and self._last[0] == (layer, kind):
            return self._last[1]
        with collective(f"the gather of layer {layer}'s row {kind} to rank 0 for a save"):
            dist.broadcast(torch.tensor([layer, kind], dtype=torch.int64), src=0, group=self.dp.groups.leaders)
            full = self._gather(layer, kind)
        self._last = ((layer, kind), full)
        return full

    def serve(self) -> None:
        """A node leader but rank 0: send this node's part of each row rank 0 asks for, until :meth:`close`."""
        import torch.distributed as dist

        with collective("the gather of the node's slices to rank 0 for a save"):
            while True:
                req = torch.empty((2,), dtype=torch.int64)
                dist.broadcast(req, src=0, group=self.dp.groups.leaders)
                if int(req[0]) < 0:
                    return
                self._gather(int(req[0]), int(req[1]))

    def close(self) -> None:
        """Rank 0: end the leaders' :meth:`serve` loops."""
        import torch.distributed as dist

        self._last = None
        with collective("the end of the gathers to rank 0 for a save"):
            dist.broadcast(torch.tensor([-1, 0], dtype=torch.int64), src=0, group=self.dp.groups.leaders)

    def _gather(self, layer: int, kind: int) -> torch.Tensor | None:
        import torch.distributed as dist

        t = self.host.graph.layers[layer].trainable_numel
        # A node's part: its master slice, or the moments of its slice's trainable elements.
        parts = [(lo, hi) if kind == 0 else (min(lo, t), min(hi, t)) for lo, hi in (s[layer] for s in self.slices)]
        chunk = max(1, max(b - a for a, b in parts))
        a, b = parts[self.dp.topo.node]
        mine = torch.zeros((chunk,), dtype=torch.float32)
        local = self.host.master(layer) if kind == 0 else self.host._moment(layer, kind - 1)
        mine[:b - a].copy_(local[:b - a])
        got = [torch.empty((chunk,), dtype=torch.float32) for _ in parts] if self.dp.topo.rank == 0 else None
        dist.gather(mine, got, dst=0, group=self.dp.groups.leaders)
        if got is None:
            return None
        full = torch.empty((parts[-1][1] if kind else self.host.graph.layers[layer].numel,), dtype=torch.float32)
        for (a, b), part in zip(parts, got):
            full[a:b].copy_(part[:b - a])
        return full
