"""Buffer layout: where a plan's bytes go, which lowering records in the Schedule and the runtime reads.

Everything here is arithmetic on a (LayerGraph, Plan): no hardware rate and no time, so the IR
holds it and every layer may import it. Lowering fills a :class:`BufferLayout` from these functions
(``Schedule.layout``); the runtime lays out its GPU slots, pinned arena, host shards and NVMe I/O
buffers from that record, and the verifier's rule ``layout`` checks it against the graph. The cost
model (:mod:`megatrain.planner.memory`) counts the same bytes from the same functions.

Shards and slices. Under data parallel a layer's trainable elements split into ``shards``
contiguous optimizer shards of :data:`SHARD_ALIGN_ELEMENTS`-aligned size (:func:`optimizer_shard`),
a shared cast splits the whole tile the same way (:func:`cast_shard`), a reduce-scatter pads the
gradient tile to ``shards`` equal chunks (:func:`reduced_numel`), and with ``Plan.host_state ==
"shard"`` each node holds one slice of every tile (:func:`node_slice`).

Pinned host memory is exactly what DMA reads or writes, and :func:`pinned_buffers` lays it out
for the runtime, which pins the same regions (one arena registered with ``cudaHostRegister``, not
the caching host allocator, which rounds every block up to a power of two): the host gradient
tiles that D2H writes (``plan.gradient_itemsize`` per element), each sized to the widest layer that
uses it (one per trainable layer, at its own size, when the optimizer waits for the next step;
:func:`gradient_tile_numels`); with BF16
compute the staging tiles that H2D reads, ``max numel x 2`` each (with ``plan.cast_once`` one per
layer, ``numel x 2``: :func:`staging_tile_numels`); the offloaded checkpoints, one
region per (value, micro-batch) alive at once; and each layer's gradient norm and finite flag.
Every region starts on a page and takes whole pages (``HOST_PAGE_BYTES``). With FP32 compute H2D
reads the master row itself, so each layer's master is pinned too, rounded up to whole pages
(:func:`pinned_master_bytes`); the Adam moments are never DMA'd and stay pageable.

GPU slots (:func:`slot_numels`): each of the ``plan.slots`` streaming slots sized for the widest
layer that is not resident, each resident layer's slot for that layer alone. Host scratch: with
BF16 gradients that the optimizer reads from a host tile, one FP32 scratch of
``OPT_CHUNK_ELEMENTS`` per host worker thread (:func:`gradient_scratch_numel`). NVMe: the I/O
buffers of the moments' and the gradients' pools (:func:`nvme_buffers`, :func:`nvme_gradient_buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatrain.optim import ADAMW
from megatrain.ir.graph import Layer, LayerGraph
from megatrain.ir.plan import ActivationPolicy, OptimizerPlacement, Plan

def gradient_tiles(graph: LayerGraph) -> dict[int, int]:
    """The host gradient tile of each trainable layer (in layer order) where each has its own: the
    ring tile with NEXT_FORWARD placement layer by layer, the accumulator with per-micro-batch
    passes. Lowering assigns them, the verifier checks them and the cost model sizes them."""
    trainable = [i for i, layer in enumerate(graph.layers) if layer.trainable_numel > 0]
    return {layer: k for k, layer in enumerate(trainable)}


GRAD_ITEMSIZE = 4
"""FP32 gradients: the accumulators, the optimizer's input, and the GPU slot, D2H and host tiles
unless the plan sends BF16 ones (``Plan.gradient_itemsize`` is what those use)."""

OPT_CHUNK_ELEMENTS = 1 << 19
"""Elements per intra-op thread that an OPT of BF16 gradients widens at a time into its FP32
scratch (2 MiB per thread), stepping each chunk right after
(:class:`megatrain.runtime.host_kernels.HostAdamW`). For one or two threads the chunk stays in the
last-level cache between its widening and its step (about 34 bytes move per chunk element
meanwhile: 17 MiB per thread, and an AMD Zen 4 CCD has 32 MiB, a Xeon Platinum 8480C socket 105 MB),
so the widened copy stays out of DRAM; a larger team gets a chunk as many times larger, so that
each of the chunk's two parallel regions (the widening, the step) gives every thread half a
million elements, whose milliseconds dwarf the team's wake-up. A multiple of every kernel's vector
width (16 FP32 lanes of AVX-512 times DeepSpeed's unroll of 8), so that the chunked step is
bitwise the unchunked one."""

MASTER_BYTES_PER_ELEMENT = 4
"""FP32 master weight per tile element."""

MOMENT_BYTES_PER_ELEMENT = ADAMW.state_bytes_per_param
"""AdamW's FP32 exp_avg and exp_avg_sq per trainable tile element; a plan's own optimizer's is
:func:`state_bytes_per_param`."""


def state_bytes_per_param(plan: Plan | None = None) -> int:
    """Bytes of optimizer state per trainable parameter under ``plan``'s host optimizer
    (``Plan.optimizer_name``; None: AdamW's 8): 4 per FP32 state row of its spec."""
    return (plan.optimizer_spec if plan is not None else ADAMW).state_bytes_per_param

STAGING_ITEMSIZE = 2
"""The staging ring holds BF16 copies of the tiles H2D is about to read."""

HOST_PAGE_BYTES = 4096
"""Granularity of pinned host memory: ``cudaHostRegister`` page-locks whole pages, so every pinned
region starts on a page boundary and is a whole number of pages (the x86-64 base page; on a host
with larger pages the driver locks whole pages of its own size around each region)."""

NORM_ITEMSIZE = 4
"""Each layer's gradient norm reaches the host as one FP32 value (D2H, pinned)."""

FLAG_ITEMSIZE = 1
"""Each layer's finite flag reaches the host as one bool (D2H, pinned)."""


SHARD_ALIGN_ELEMENTS = 16
"""Optimizer shards start on a multiple of 16 FP32 elements (64 bytes, one x86 cache line), so two
ranks stepping neighbouring shards of a shared tile never write the same line."""


def optimizer_shard(numel: int, shards: int, index: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a layer's ``numel`` trainable parameters that rank ``index`` of
    ``shards`` steps (``Plan.optimizer_shards``): contiguous, in rank order, each but the last
    ``ceil(numel / shards)`` rounded up to :data:`SHARD_ALIGN_ELEMENTS` (the last may be shorter or
    empty). Together they cover ``[0, numel)`` once.

    Raises:
        ValueError: ``index`` is not in ``[0, shards)``.
    """
    if not 0 <= index < shards:
        raise ValueError(f"optimizer shard {index} of {shards}: the index is in [0, {shards})")
    per = _shard_size(numel, shards)
    lo = min(numel, index * per)
    return lo, min(numel, lo + per)


def _shard_size(numel: int, shards: int) -> int:
    """Elements of each but the last of ``shards`` optimizer shards of ``numel``: ``ceil(numel /
    shards)`` rounded up to :data:`SHARD_ALIGN_ELEMENTS`."""
    return -(-(-(-numel // SHARD_ALIGN_ELEMENTS)) // shards) * SHARD_ALIGN_ELEMENTS


def cast_shard(numel: int, trainable_numel: int, plan: Plan, index: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a layer's master tile (``numel`` elements, the first
    ``trainable_numel`` trainable) that rank ``index`` of a node CASTs into the node's shared
    staging tile with ``plan.shared_cast``: its optimizer shard (:func:`optimizer_shard` of
    ``plan.optimizer_shards``), which only its own OPT writes, the node's last rank also the
    frozen parameters after the trainable prefix (nothing steps them). The ranks' shards tile
    ``[0, numel)``. Without ``shared_cast``, ``(0, numel)``: each rank casts the whole tile.

    Raises:
        ValueError: ``index`` is not in ``[0, plan.optimizer_shards)``."""
    if not plan.shared_cast:
        return 0, numel
    lo, hi = optimizer_shard(trainable_numel, plan.optimizer_shards, index)
    return lo, numel if index == plan.optimizer_shards - 1 else hi


def reduced_numel(numel: int, plan: Plan) -> int:
    """Elements a host gradient tile or accumulator of a layer with ``numel`` trainable parameters
    holds under ``plan``: ``numel``, or with ``plan.gradient_reduction == "reduce_scatter"``
    ``update_shards x`` the shard size of :func:`optimizer_shard` (fewer than ``update_shards x
    16`` more; ``Plan.update_shards``): a reduce-scatter needs equal chunks, so the tile is padded
    to them (the executor zeroes the padding before each REDUCE_SCATTER, so it never changes a sum)."""
    if plan.gradient_reduction != "reduce_scatter":
        return numel
    return plan.update_shards * _shard_size(numel, plan.update_shards)


def node_slice(numel: int, trainable_numel: int, plan: Plan, node: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a layer's master tile (``numel`` elements, the first
    ``trainable_numel`` trainable) that node ``node`` holds, with its Adam moments for
    ``[lo, min(hi, trainable_numel))``. ``[0, numel)`` unless ``plan.host_state == "shard"``; then
    the union of the optimizer shards (:func:`optimizer_shard` of ``plan.update_shards``) of the
    node's ``optimizer_shards`` consecutive ranks, so each rank's shard lies in its node's slice,
    and the last node also holds the frozen parameters after the trainable prefix (they have no
    shard: nothing steps them). The nodes' slices tile ``[0, numel)`` in node order.

    Raises:
        ValueError: ``node`` is not in ``[0, plan.nodes)``.
    """
    if not 0 <= node < plan.nodes:
        raise ValueError(f"node {node} of a plan with {plan.nodes} nodes: the index is in [0, {plan.nodes})")
    if plan.host_state != "shard":
        return 0, numel
    ways, g = plan.update_shards, plan.optimizer_shards
    lo = optimizer_shard(trainable_numel, ways, node * g)[0]
    hi = numel if node == plan.nodes - 1 else optimizer_shard(trainable_numel, ways, node * g + g - 1)[1]
    return lo, hi


def optimizer_numel(layer: Layer, plan: Plan | None = None) -> int:
    """Trainable parameters of ``layer`` one rank's OPT updates: its shard
    (:func:`optimizer_shard`, the largest) among the ``plan.optimizer_shards`` ranks that share a
    copy, and with ``plan.host_state == "shard"`` among the ``optimizer_shards x nodes`` ranks that
    share one copy spread over the nodes (each node holds and updates ``1 / nodes``). All of them
    for one rank (``plan`` None, or one shard)."""
    if plan is None:
        return layer.trainable_numel
    ways = plan.optimizer_shards * (plan.nodes if plan.host_state == "shard" else 1)
    lo, hi = optimizer_shard(layer.trainable_numel, ways, 0)
    return hi - lo


def widens_gradients(plan: Plan) -> bool:
    """Whether the host optimizer reads BF16 gradients from a host tile, widening them chunk by chunk
    in an FP32 scratch (with per-micro-batch passes ACC widens them into the FP32 accumulator instead)."""
    return plan.gradient_dtype == "bfloat16" and not plan.accumulates_on_host


def page_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pinned pages (``HOST_PAGE_BYTES``)."""
    return -(-nbytes // HOST_PAGE_BYTES) * HOST_PAGE_BYTES


def gradient_tile_numels(graph: LayerGraph, plan: Plan) -> tuple[int, ...]:
    """Elements of each of the ``plan.grad_ring`` host gradient tiles: the widest
    ``trainable_numel`` among the layers whose D2H writes the tile (0 for a tile no D2H uses).

    With ``OptimizerPlacement.NEXT_FORWARD`` layer by layer, tile ``k`` belongs to the ``k``-th
    trainable layer (:func:`megatrain.planner.lower.gradient_tiles`) and is sized to it alone.
    Otherwise the D2Hs take the tiles in turn, in the order the local backwards run (trainable
    layers from last to first, once per pass): D2H number ``k`` of the step writes tile
    ``k % grad_ring``, as :mod:`megatrain.planner.lower` assigns them. The verifier checks that
    every D2H's layer fits its tile (rule ``budget``).
    """
    layers = graph.layers
    widths = [0] * plan.grad_ring
    if plan.optimizer is OptimizerPlacement.NEXT_FORWARD and not plan.accumulates_on_host:
        for layer, k in gradient_tiles(graph).items():
            # A layer of Plan.nvme_gradients keeps its tile on NVMe: its index stays, sized 0.
            if k < plan.grad_ring and layer not in plan.nvme_gradients:
                widths[k] = reduced_numel(layers[layer].trainable_numel, plan)
        return tuple(widths)
    backward = [i for i in range(len(layers) - 1, -1, -1) if layers[i].trainable_numel > 0]
    passes = plan.micro_batches if plan.accumulates_on_host else 1
    for k, layer in enumerate(backward * passes):
        r = k % plan.grad_ring
        widths[r] = max(widths[r], reduced_numel(layers[layer].trainable_numel, plan))
    return tuple(widths)


def gradient_ring_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of the host gradient tiles, ``plan.gradient_itemsize`` per element, each in whole
    pages (what ``pinned_buffers`` gives them)."""
    return sum(page_up(w * plan.gradient_itemsize) for w in gradient_tile_numels(graph, plan))


def staging_tile_numels(graph: LayerGraph, plan: Plan) -> tuple[int, ...]:
    """Elements of each BF16 staging tile: with ``plan.cast_once`` tile ``k`` is layer ``k``'s and
    sized to it; otherwise each of the ``staging_ring`` tiles is sized for the widest layer (any
    layer may be cast into any tile, and every layer is loaded at least once per step). None with
    FP32 compute, or with the host state sharded across nodes (H2D reads the gather tile:
    ``Plan.staged``)."""
    if not plan.staged:
        return ()
    if plan.cast_once:
        return tuple(layer.numel for layer in graph.layers)
    return (max(layer.numel for layer in graph.layers),) * plan.staging_ring


def shared_staging_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of a node's shared BF16 staging tiles (``plan.shared_cast``: one per layer, in
    whole pages, once per group of ranks sharing a host copy, not in any rank's arena); 0 without."""
    if not plan.shared_cast:
        return 0
    return sum(page_up(n * STAGING_ITEMSIZE) for n in staging_tile_numels(graph, plan))


def pinned_master_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of the FP32 master rows: with FP32 compute H2D reads each layer's master row
    directly, so each is pinned, rounded up to whole pages; with BF16 compute none (H2D reads the
    staging tiles)."""
    if plan.compute_dtype != "float32":
        return 0
    return sum(page_up(layer.numel * MASTER_BYTES_PER_ELEMENT) for layer in graph.layers)


PinnedKind = str
"""``"norms"``, ``"flags"``, ``"ring"``, ``"staging"``, ``"offload"`` or ``"nvme_gradients"`` (the
gradient I/O buffers of ``Plan.nvme_gradients``, :func:`nvme_gradient_buffers`)."""


@dataclass(frozen=True, slots=True)
class PinnedTile:
    """One region of the pinned arena: ``nbytes`` at byte ``offset`` (a multiple of
    ``HOST_PAGE_BYTES``). ``key`` is the tile index for ``ring`` and ``staging``, ``(value id,
    micro-batch)`` for ``offload`` (micro-batch 0 for every pass with per-micro-batch passes, which
    reuse one copy), and 0 for ``norms`` and ``flags`` (``[n_layers]`` FP32 and bool)."""

    kind: PinnedKind
    key: int | tuple[int, int]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PinnedLayout:
    """The pinned arena of one plan: its tiles in order, and its size ``nbytes`` (whole pages)."""

    tiles: tuple[PinnedTile, ...]
    nbytes: int

    def tile(self, kind: PinnedKind, key: int | tuple[int, int]) -> PinnedTile:
        """The tile ``(kind, key)``. Raises KeyError naming it when the layout has none."""
        for t in self.tiles:
            if t.kind == kind and t.key == key:
                return t
        raise KeyError(f"the pinned layout has no {kind} tile {key!r}")

    def bytes_of(self, kind: PinnedKind) -> int:
        """Bytes the tiles of ``kind`` take in the arena, page rounding included."""
        return sum(page_up(t.nbytes) for t in self.tiles if t.kind == kind)

    def covers(self, other: "PinnedLayout") -> bool:
        """Whether every tile of ``other`` has a tile of the same kind and key here at least as large."""
        have = {(t.kind, t.key): t.nbytes for t in self.tiles}
        return all(have.get((t.kind, t.key), -1) >= t.nbytes for t in other.tiles)


def pinned_buffers(graph: LayerGraph, plan: Plan, mode: str = "train") -> PinnedLayout:
    """The pinned arena a schedule of ``mode`` under ``plan`` needs besides the master rows.

    ``"train"``: per-layer norms and flags, the gradient tiles (:func:`gradient_tile_numels`), the
    staging tiles with BF16 compute, and a region per offloaded checkpoint (``graph.values[v].nbytes``
    for each value of :meth:`LayerGraph.checkpoints` of a layer whose policy is OFFLOAD, for every
    micro-batch layer by layer, once with per-micro-batch passes). ``"eval"``: the staging tiles.
    ``"update"``: the gradient tiles (and the staging tiles with ``Plan.nvme_masters``: the CAST
    after such a layer's OPT fills its tile). ``"train"`` and ``"update"`` also hold the gradient I/O
    buffers of ``Plan.nvme_gradients`` (:func:`nvme_gradient_buffers`: a D2H lands in them, so they
    are pinned). Each tile starts on a page and takes whole pages.
    """
    regions: list[tuple[PinnedKind, int | tuple[int, int], int]] = []
    n = len(graph.layers)
    if mode in ("train", "update"):
        if mode == "train":
            regions += [("norms", 0, n * NORM_ITEMSIZE), ("flags", 0, n * FLAG_ITEMSIZE)]
        regions += [("ring", r, w * plan.gradient_itemsize) for r, w in enumerate(gradient_tile_numels(graph, plan))]
        count, nbytes = nvme_gradient_buffers(graph, plan)
        regions += [("nvme_gradients", k, nbytes) for k in range(count)]
    if (mode in ("train", "eval") or (mode == "update" and plan.nvme_masters)) and not plan.shared_cast:
        # An update of a layer whose master is on NVMe casts the new master into its staging tile;
        # shared tiles are the node's (shared_staging_bytes).
        regions += [("staging", t, w * STAGING_ITEMSIZE) for t, w in enumerate(staging_tile_numels(graph, plan))]
    if mode == "train":
        copies = plan.micro_batches if plan.layer_by_layer else 1
        for p in range(n):
            if plan.activation(p) is ActivationPolicy.OFFLOAD:
                regions += [("offload", (vid, mb), graph.values[vid].nbytes)
                            for mb in range(copies) for vid in graph.checkpoints(p)]
    tiles, offset = [], 0
    for kind, key, nbytes in regions:
        tiles.append(PinnedTile(kind, key, offset, nbytes))
        offset += page_up(nbytes)
    return PinnedLayout(tuple(tiles), offset)


def slot_numels(graph: LayerGraph, slots: int,
                resident: frozenset[int] | set[int] = frozenset()) -> tuple[tuple[int, int], ...]:
    """``(numel, trainable_numel)`` of each GPU slot, in slot order: ``slots`` streaming slots sized
    for the widest layer not in ``resident`` (only those stream through them), then one slot per
    resident layer, ascending, sized for that layer (the lowering's slot numbering)."""
    layers = graph.layers
    streamed = [layer for i, layer in enumerate(layers) if i not in resident]
    width = max((layer.numel for layer in streamed), default=0)
    gwidth = max((layer.trainable_numel for layer in streamed), default=0)
    own = [(layers[r].numel, layers[r].trainable_numel) for r in sorted(resident)]
    return tuple([(width, gwidth)] * slots + own)


def gradient_scratch_numel(graph: LayerGraph, plan: Plan, threads: int = 1) -> int:
    """FP32 elements of the host scratch an OPT widens BF16 gradients into, a chunk at a time, on a
    team of ``threads`` (:data:`OPT_CHUNK_ELEMENTS` per thread, fewer for narrower layers) when
    :func:`widens_gradients`, else 0. One suffices: OPTs run one at a time, in order, on the host
    stream. (:func:`memory_breakdown` counts the team of :func:`host_worker_threads` of the spec's
    ``host_cores``, one thread where it has none. DeepSpeed's kernel also divides a clipped update's
    FP32 gradients by the clip scale in such a scratch, which this does not count.)"""
    if not widens_gradients(plan):
        return 0
    return min(OPT_CHUNK_ELEMENTS * threads, max((layer.trainable_numel for layer in graph.layers), default=0))


def nvme_bytes(layer: Layer, masters: bool = False, plan: Plan | None = None) -> int:
    """Bytes an NVME_READ or NVME_WRITE of ``layer`` moves on one rank: its FP32 optimizer state
    (:func:`state_bytes_per_param`, AdamW's two moments: 8 bytes per trainable parameter; under
    ``plan``'s data parallel, of the part one rank steps,
    :func:`optimizer_numel`: each rank's file holds its optimizer shard, the whole tile where each
    rank steps a copy of its own) and, with ``masters`` (``Plan.nvme_masters``: one file holds
    both), its FP32 master before them (4 bytes per parameter, frozen ones included), padded to the
    4096-byte O_DIRECT alignment (``runtime.nvme.ALIGN``)."""
    nbytes = (optimizer_numel(layer, plan) * state_bytes_per_param(plan)
              + (layer.numel * MASTER_BYTES_PER_ELEMENT if masters else 0))
    return -(-nbytes // 4096) * 4096


NVME_BUFFERS = 2
"""Host I/O buffers of the NVMe tier's gradient pool, and the default of the moments' pool
(``Plan.nvme_buffers``): one being read or written while the OPT uses the other (the lowering's
read-ahead, ``lower.add_nvme_io``, hands them out in turn)."""


def nvme_buffers(graph: LayerGraph, plan: Plan) -> tuple[int, int]:
    """``(count, bytes each)`` of the host I/O buffers the moments of ``plan.nvme_moments`` (and the
    masters of ``plan.nvme_masters``) pass through: ``plan.nvme_buffers``, or one per NVMe layer
    when there are fewer (the lowering's ``Op.buf`` indices are below it), each :func:`nvme_bytes`
    of the widest NVMe layer's file (whole 4096-byte blocks: the runtime reads and writes them with
    ``O_DIRECT``). ``(0, 0)`` without NVMe layers. Pageable: nothing in them goes to the GPU (a
    master's BF16 copy is cast into its pinned staging tile first)."""
    if not plan.nvme_moments:
        return 0, 0
    return (min(plan.nvme_buffers, len(plan.nvme_moments)),
            max(nvme_bytes(graph.layers[i], i in plan.nvme_masters, plan) for i in plan.nvme_moments))


def nvme_gradient_bytes(layer: Layer, plan: Plan) -> int:
    """Bytes an NVME_READ or NVME_WRITE of ``layer``'s gradient tile moves (``Op.gbuf``): its
    trainable gradients in ``plan.gradient_dtype`` (4 or 2 bytes each), padded to 4096 bytes."""
    return -(-layer.trainable_numel * plan.gradient_itemsize // 4096) * 4096


def nvme_gradient_buffers(graph: LayerGraph, plan: Plan) -> tuple[int, int]:
    """``(count, bytes each)`` of the pinned gradient I/O buffers of ``plan.nvme_gradients``
    (``Op.gbuf`` indexes them): :data:`NVME_BUFFERS`, or one per such layer when there are fewer,
    each :func:`nvme_gradient_bytes` of the widest such layer. The D2Hs of those layers land in
    them in turn (each waits for the NVME_WRITE that emptied its buffer) and the next step's
    NVME_READs fill them for the carried OPTs (``lower.add_nvme_io``). ``(0, 0)`` without such
    layers. Pinned (a D2H writes them by DMA), in the arena (:func:`pinned_buffers`)."""
    if not plan.nvme_gradients:
        return 0, 0
    return (min(NVME_BUFFERS, len(plan.nvme_gradients)),
            max(nvme_gradient_bytes(graph.layers[i], plan) for i in plan.nvme_gradients))


def gather_scratch_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Bytes of a node's weight-gather scratch (pageable, shared by its ranks): a send buffer of the
    longest node slice and a receive buffer of ``nodes`` of them, in the compute dtype, for the
    widest layer, in whole pages (``runtime.distributed.gather_weights``); 0 unless
    ``plan.host_state == "shard"``."""
    if plan.host_state != "shard":
        return 0
    chunk = max((hi - lo for layer in graph.layers for lo, hi in (node_slice(layer.numel, layer.trainable_numel,
                                                                             plan, n) for n in range(plan.nodes))),
                default=0)
    return page_up((plan.nodes + 1) * chunk * plan.compute_itemsize)


GATHER_BUFFERS = 2
"""Pinned host tiles per node that sharded weights are all-gathered into (host_state "shard"): one
being received while the GPUs copy from the other."""


def gather_buffer_bytes(graph: LayerGraph, plan: Plan) -> int:
    """Pinned bytes of a node's :data:`GATHER_BUFFERS` tiles, each the widest layer in the compute
    dtype in whole pages; 0 unless ``plan.host_state == "shard"``."""
    if plan.host_state != "shard":
        return 0
    return GATHER_BUFFERS * page_up(max((layer.numel for layer in graph.layers), default=0) * plan.compute_itemsize)


# -- the record lowering fills -----------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LayerLayout:
    """How one layer's tiles split across ranks and nodes (element offsets, ``[lo, hi)``).

    ``optimizer_shards[k]``: the trainable elements rank ``k`` of the ``Plan.update_shards`` ranks
    steps (:func:`optimizer_shard`; one ``(0, trainable_numel)`` without sharding).
    ``cast_shards[k]``: the master elements rank ``k`` of a node casts (:func:`cast_shard`; one per
    ``Plan.optimizer_shards``). ``node_slices[n]``: the master elements node ``n`` holds
    (:func:`node_slice`; one per ``Plan.nodes``). ``reduced_numel``: elements of the layer's host
    gradient tile and accumulator (:func:`reduced_numel`: its trainable elements, padded for a
    reduce-scatter)."""

    optimizer_shards: tuple[tuple[int, int], ...]
    cast_shards: tuple[tuple[int, int], ...]
    node_slices: tuple[tuple[int, int], ...]
    reduced_numel: int


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """Every buffer a schedule runs on, with its size and offsets: what the runtime allocates and
    where each rank's and node's part of a tile is, so it derives none of it.

    ``slots``: ``(numel, trainable_numel)`` of each GPU weight and gradient slot, in slot order
    (:func:`slot_numels`). ``pinned``: the pinned arena of the schedule's mode
    (:func:`pinned_buffers`: norms, flags, gradient ring tiles, staging tiles, offloaded
    checkpoints, the gradient I/O buffers of ``Plan.nvme_gradients``; byte offsets, whole pages).
    ``nvme_buffers``: ``(count, bytes each)`` of the moments' pageable NVMe I/O buffers
    (:func:`nvme_buffers`, ``Op.buf`` indexes them). ``gather_buffers``: ``(count, bytes each)`` of
    a sliced host state's gather tiles and ``gather_scratch_bytes`` its weight gathers' scratch
    (:func:`gather_buffer_bytes`, :func:`gather_scratch_bytes`; zeros unless ``Plan.host_state ==
    "shard"``). ``layers[i]``: layer ``i``'s shards and slices (:class:`LayerLayout`).

    The verifier's rule ``layout`` checks it against the graph and the ops
    (:mod:`megatrain.planner.verify`)."""

    slots: tuple[tuple[int, int], ...]
    pinned: PinnedLayout
    nvme_buffers: tuple[int, int]
    gather_buffers: tuple[int, int]
    gather_scratch_bytes: int
    layers: tuple[LayerLayout, ...]


def buffer_layout(graph: LayerGraph, plan: Plan, mode: str = "train") -> BufferLayout:
    """The :class:`BufferLayout` of a ``mode`` schedule of ``graph`` under ``plan``, from the
    functions above (what ``lower`` records in ``Schedule.layout``)."""
    shards, nodes = plan.update_shards, plan.nodes
    layers = tuple(LayerLayout(
        optimizer_shards=tuple(optimizer_shard(lay.trainable_numel, shards, k) for k in range(shards)),
        cast_shards=tuple(cast_shard(lay.numel, lay.trainable_numel, plan, k) for k in range(plan.optimizer_shards)),
        node_slices=tuple(node_slice(lay.numel, lay.trainable_numel, plan, n) for n in range(nodes)),
        reduced_numel=reduced_numel(lay.trainable_numel, plan)) for lay in graph.layers)
    sliced = plan.host_state == "shard"
    return BufferLayout(
        slots=slot_numels(graph, plan.slots, plan.resident), pinned=pinned_buffers(graph, plan, mode),
        nvme_buffers=nvme_buffers(graph, plan),
        gather_buffers=(GATHER_BUFFERS, gather_buffer_bytes(graph, plan) // GATHER_BUFFERS) if sliced else (0, 0),
        gather_scratch_bytes=gather_scratch_bytes(graph, plan), layers=layers)


__all__ = ["BufferLayout", "LayerLayout", "buffer_layout", "gradient_tiles", "GRAD_ITEMSIZE", "OPT_CHUNK_ELEMENTS",
           "MASTER_BYTES_PER_ELEMENT", "MOMENT_BYTES_PER_ELEMENT", "state_bytes_per_param", "STAGING_ITEMSIZE",
           "HOST_PAGE_BYTES", "NORM_ITEMSIZE", "FLAG_ITEMSIZE", "SHARD_ALIGN_ELEMENTS", "optimizer_shard",
           "cast_shard", "reduced_numel", "node_slice", "optimizer_numel", "widens_gradients", "page_up",
           "gradient_tile_numels", "gradient_ring_bytes", "staging_tile_numels", "shared_staging_bytes",
           "pinned_master_bytes", "PinnedKind", "PinnedTile", "PinnedLayout", "pinned_buffers", "slot_numels",
           "gradient_scratch_numel", "nvme_bytes", "NVME_BUFFERS", "nvme_buffers", "nvme_gradient_bytes",
           "nvme_gradient_buffers", "gather_scratch_bytes", "GATHER_BUFFERS", "gather_buffer_bytes"]
