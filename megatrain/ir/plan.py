"""The Plan: the knobs a solver chooses, as one frozen record.

The lowering pass turns (LayerGraph, Plan) into a Schedule; nothing downstream of the Plan makes
a choice of its own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from megatrain.errors import PlanError
from megatrain.optim import OPTIMIZERS, OptimizerSpec
from megatrain.ir.enums import IdentityEnum
from megatrain.ir.graph import LayerGraph


class ActivationPolicy(IdentityEnum):
    """What happens to a layer's boundary activation (its output checkpoint) between passes."""

    KEEP = "keep"  # stays in GPU memory until the local backward of its consumers
    OFFLOAD = "offload"  # D2H to pinned host memory after forward, H2D back before backward
    RECOMPUTE = "recompute"  # not stored; recomputed from the previous checkpoint


class OptimizerPlacement(enum.Enum):
    """When a layer's host AdamW step runs."""

    DURING_BACKWARD = "during_backward"  # as soon as its gradients reach the host
    NEXT_FORWARD = "next_forward"  # after backward, when clipping needs the global norm first


@dataclass(frozen=True, slots=True)
class Plan:
    """How one training step runs.

    Attributes:
        micro_batches: micro-batches per step (gradient accumulation), >= 1.
        slots: streaming weight buffer slots on the GPU, each sized for the largest streamed layer.
        prefetch_distance: how many layer visits ahead an H2D weight copy may start, in
            ``[0, slots - 1]``; 0 means no overlap of copy and compute.
        grad_ring: host gradient tiles that D2H writes and the optimizer (or, with per-micro-batch
            passes, the accumulation) reads, >= 1; with ``optimizer=NEXT_FORWARD`` and
            layer-by-layer passes one per trainable layer (they hold the gradients until the next
            step's forward; per-micro-batch passes keep them in the accumulators instead).
        resident: layers whose weights are copied to the GPU once per step and kept for both
            passes (each in a slot of its own, beside the streaming slots).
        activations: one ActivationPolicy per layer, for its output checkpoint.
        layer_by_layer: run every micro-batch through a layer while its weights are on the GPU
            (L2L, Pudipeddi et al. 2020, arXiv:2002.05645): one weight load per pass and gradients
            accumulated on the GPU, for the memory of all micro-batches' checkpoints. False: each
            micro-batch makes its own forward and backward pass (weights copied in every pass),
            with the checkpoints of one micro-batch alive at a time, and gradients accumulated
            on the host in one FP32 accumulator per trainable layer (4 bytes per trainable
            parameter, as ZeRO-Offload accumulates on the CPU; Ren et al. 2021,
            arXiv:2101.06840).
        optimizer: when each layer's host optimizer step runs.
        compute_dtype: dtype of the weights the GPU computes with, ``"float32"`` or ``"bfloat16"``;
            H2D copies move ``numel x itemsize`` bytes per layer. Masters and moments stay FP32;
            gradients too unless they are BF16 where exact (``d2h_dtype``, :attr:`gradient_dtype`).
        staging_ring: host tiles holding compute-dtype copies of layers about to be copied to the
            GPU (unused when ``compute_dtype`` is float32: H2D reads the master tile directly; and
            with ``host_state == "shard"``: H2D reads the gather tile, :attr:`staged`).
        cast_once: BF16 only. Each layer gets a staging tile of its own, sized to it
            (``staging_ring`` is then unused), which the step's first copy of the layer fills by a
            CAST and its later copies re-read while its master is unchanged: one CAST per layer per
            step instead of one per copy (6 bytes per element of host traffic saved per reuse),
            for 2 bytes per element of pinned memory.
        d2h_dtype: dtype of the weight gradients in the GPU gradient slot, over D2H and in the host
            gradient tiles: ``"float32"``, ``"bfloat16"``, or None (the default) for the narrowest
            exact one, :attr:`gradient_dtype`. BF16 needs BF16 compute (the gradient of a BF16
            weight is a BF16 value, so BF16 carries it exactly in half the bytes) and a slot that
            holds one micro-batch's gradients (not ``layer_by_layer`` with several micro-batches,
            which sums them in the slot in FP32). The host widens them to FP32 where it reads
            them (ACC into the FP32 accumulator, OPT into an FP32 scratch); norms and finite flags
            are computed in FP32 on the device.
        nvme_moments: layers whose Adam moments live on the NVMe tier (:mod:`megatrain.planner.nvme`):
            they have no rows in host memory; the lowering reads them (NVME_READ) into a host I/O
            buffer (``Op.buf``, ``layout.nvme_buffers``) before the layer's OPT, which steps them
            there, and writes them back (NVME_WRITE) after it, on the I/O stream. The runtime
            needs an NVMe directory (``nvme_dir``).
        nvme_buffers: host I/O buffers of the moments' pool (``layout.nvme_buffers``), >= 1: how far
            the NVMe reads run ahead of the OPTs. The first ``nvme_buffers`` reads are issued at
            the start of the step, so they overlap the forward pass (with updates during the
            backward the I/O stream is otherwise idle until the first OPT), and each later read
            waits only for the write that empties its buffer. More buffers keep the I/O stream
            busy over more of the step, each for the widest NVMe layer's moments in host memory;
            the planner chooses the count (:func:`megatrain.planner.nvme.solve_with_nvme`).
        nvme_gradients: layers whose deferred gradient tile (``OptimizerPlacement.NEXT_FORWARD``,
            layer-by-layer passes or one micro-batch, one rank) waits on the NVMe tier between
            steps instead of in a pinned host tile of its own: the layer's D2H lands in a pinned
            gradient I/O buffer (``Op.gbuf``, ``layout.nvme_gradient_buffers``), an NVME_WRITE takes
            it to the layer's file, and the next step's NVME_READ brings it back into a gradient
            I/O buffer for the carried OPT. Needs an NVMe directory (``nvme_dir``).
        nvme_masters: layers whose FP32 master weights live on the NVMe tier too, in one file with
            their Adam moments (so a subset of ``nvme_moments``): the NVME_READ before the layer's
            OPT brings masters and moments into its I/O buffer (12 bytes per trainable parameter,
            4 per frozen one), the OPT steps them there, a CAST from that buffer writes the new
            BF16 copy into the layer's staging tile, and the NVME_WRITE (which waits for the CAST)
            takes them back. BF16 compute with ``cast_once`` only: the layer's own pinned staging
            tile then keeps its BF16 copy between steps, and that copy is what every H2D reads, so
            the FP32 master is needed by the OPT alone (with FP32 compute the H2D reads the master
            row itself; with a shared staging ring each copy would need a CAST from the master).
        data_parallel: ranks that train one global batch together (torch.distributed, one
            process per rank, each running this schedule on its own micro-batches). >1 lowers an
            ALL_REDUCE of each layer's step gradients (on the COMM stream, after the op that
            completes them on the host, before anything reads them) that sums them over the
            ranks (each rank's are of its share of the global batch's loss), so every rank steps
            the same gradients, and a COUNT_REDUCE of the step's supervised tokens (the loss's
            divisor) before the loss layer's first backward. 1: one process, no collectives.
        optimizer_shards: data parallel within a node: how many ranks share one copy of the
            persistent host state (FP32 masters and Adam moments in shared memory,
            :mod:`megatrain.runtime.distributed`) and split its AdamW work. Each of them steps its
            own contiguous shard of every layer's tile (:func:`megatrain.ir.layout.optimizer_shard`),
            and an ALL_GATHER after each OPT (on the COMM stream; on shared memory, a barrier of the
            node's ranks) makes the updated shards every rank's before anything reads the layer's
            master again. 1 (the default): each rank steps whole tiles of a copy of its own.
        nodes: machines the ``data_parallel`` ranks are spread over, evenly
            (:attr:`gpus_per_node` each), >= 1 and a divisor of ``data_parallel``. The ranks of one
            node share its host memory bandwidth, which the host ops run at
            (:func:`megatrain.planner.time.host_rate`), and ``optimizer_shards`` of them (a divisor of
            ``gpus_per_node``) one copy of the persistent state. Topology lives on the Plan, not the HardwareSpec: the spec describes one
            node's hardware (and ``measure_hardware()`` measures one machine), while how many ranks
            and nodes a run uses is the run's choice, as ``data_parallel`` is.
        host_state: where the persistent host state lives when ``nodes > 1``: ``"replicate"`` (the
            default), a full copy on every node; or ``"shard"``, ``1 / nodes`` of it on each node
            (ZeRO-3 style: Rajbhandari et al. 2020, arXiv:1910.02054), every layer's weights
            all-gathered over the network before each use (:func:`megatrain.planner.time.weight_gather_time`)
            and each node updating its own ``1 / nodes``. A planning choice
            (:mod:`megatrain.planner.topology`). The runtime runs it with ``optimizer_shards`` =
            the GPUs per node: global rank ``r`` steps shard ``r`` of ``data_parallel``
            (:attr:`update_shards`), node ``n`` holds the union of its ranks' shards
            (:func:`megatrain.ir.layout.node_slice`), and an ALL_GATHER with a gather tile
            (``Op.tile``) before every H2D gathers the layer's weights in the compute dtype, which
            the H2D reads (no CAST with BF16: :attr:`staged`).
        gradient_reduction: how the lowering reduces each layer's step gradients across the
            ranks: ``"all_reduce"`` (the default; ALL_REDUCE, every rank gets the whole reduced
            tile) or ``"reduce_scatter"`` (REDUCE_SCATTER, each rank gets the sum of only its
            optimizer shard, :func:`megatrain.ir.layout.optimizer_shard`, which is all its OPT
            reads: half the all-reduce's bytes). Allowed only where ``optimizer_shards ==
            data_parallel > 1``: one node whose ranks share one host copy, so the shards the
            ranks step make up the whole tile of that copy. With several nodes every node's copy
            needs the whole reduced tile, so the reduction stays an all-reduce, unless the state is
            sharded across the nodes (``host_state == "shard"`` with ``optimizer_shards`` = the GPUs
            per node): then each rank's shard is all it steps, over the world (:attr:`update_shards`).
        shared_cast: BF16 ``cast_once`` staging tiles shared by the ``optimizer_shards`` ranks of a
            node that share one host copy (``host_state == "replicate"``): one tile per layer per node,
            in the node's shared memory (2 bytes per element per node, not per rank), into which
            each rank CASTs only its optimizer shard of the layer (:func:`megatrain.ir.layout.cast_shard`,
            ``1 / optimizer_shards`` of the host traffic); an ALL_GATHER of the layer (a barrier
            of the node's ranks) between the CASTs and the H2Ds that read the tile makes it whole
            before any rank copies it (issue 16). False: every rank casts whole layers into tiles
            of its own.
        optimizer_name: the host optimizer the OPTs run (a name in :data:`megatrain.optim.OPTIMIZERS`):
            its spec sets the optimizer state bytes per trainable parameter the cost model sizes
            host memory and the NVMe tier with (``"adamw"``: two FP32 moments, 8 bytes;
            ``"lion"``: one, 4 bytes) and its host traffic per parameter.
        templates: how the compute ops run the layer templates: ``"eager"`` (the traced
            ``fx.GraphModule`` as it is, one dispatched kernel per aten op) or ``"compiled"``
            (each distinct template compiled once with ``torch.compile(fullgraph=True)``, inductor,
            and shared by every layer that uses it; the backward through AOTAutograd;
            :mod:`megatrain.runtime.templates`). Compiling happens when the trainer is built, its
            time reported; the artefacts are cached on disk across runs.
        cuda_graphs: run each FWD, RECOMPUTE and BWD as the replay of a CUDA graph captured once per
            (template, weight slot, variant) on static input buffers (:mod:`megatrain.runtime.graphs`):
            one launch where an eager template issues hundreds, for the graphs' memory pool
            (``MemoryBreakdown.graph_pool``). CUDA backend only; the planner turns it on where the
            step is issue-bound when asked (``megatrain.planner.graphs``).
    """

    micro_batches: int = 1
    slots: int = 2
    prefetch_distance: int = 1
    grad_ring: int = 2
    resident: frozenset[int] = frozenset()
    activations: tuple[ActivationPolicy, ...] = ()
    layer_by_layer: bool = True
    optimizer: OptimizerPlacement = OptimizerPlacement.DURING_BACKWARD
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    staging_ring: int = 2
    cast_once: bool = False
    d2h_dtype: Literal["float32", "bfloat16"] | None = None
    nvme_moments: frozenset[int] = frozenset()
    nvme_gradients: frozenset[int] = frozenset()
    nvme_buffers: int = 2
    nvme_masters: frozenset[int] = frozenset()
    data_parallel: int = 1
    optimizer_shards: int = 1
    nodes: int = 1
    host_state: Literal["replicate", "shard"] = "replicate"
    gradient_reduction: Literal["all_reduce", "reduce_scatter"] = "all_reduce"
    shared_cast: bool = False
    optimizer_name: str = "adamw"
    templates: Literal["eager", "compiled"] = "eager"
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        if self.templates not in ("eager", "compiled"):
            raise PlanError(f"Plan.templates={self.templates!r}: use 'eager' (the traced templates as they are) or "
                            "'compiled' (torch.compile, once per template)")
        if not isinstance(self.cuda_graphs, bool):
            raise PlanError(f"Plan.cuda_graphs={self.cuda_graphs!r}: use True or False")
        if self.optimizer_name not in OPTIMIZERS:
            raise PlanError(f"Plan.optimizer_name={self.optimizer_name!r}: use one of {sorted(OPTIMIZERS)}")
        if self.d2h_dtype not in (None, "float32", "bfloat16"):
            raise PlanError(f"Plan.d2h_dtype={self.d2h_dtype!r}: use 'float32', 'bfloat16' or None (the narrowest "
                            "exact one)")
        if self.d2h_dtype == "bfloat16" and not self.bf16_gradients_exact:
            why = ("FP32 compute makes FP32 gradients" if self.compute_dtype != "bfloat16" else
                   f"layer-by-layer passes sum the {self.micro_batches} micro-batches' gradients in the slot in FP32")
            raise PlanError(f"Plan.d2h_dtype='bfloat16' with compute_dtype={self.compute_dtype!r}, "
                            f"layer_by_layer={self.layer_by_layer}, micro_batches={self.micro_batches}: {why}, which "
                            "BF16 would round; use d2h_dtype=None or 'float32', or BF16 compute with one micro-batch "
                            "per slot (micro_batches=1 or layer_by_layer=False)")
        if self.cast_once and self.compute_dtype == "float32":
            raise PlanError("Plan.cast_once=True with compute_dtype='float32': only BF16 compute casts; drop "
                            "cast_once or compute in bfloat16")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise PlanError(f"Plan.compute_dtype={self.compute_dtype!r}: use 'float32' or 'bfloat16'")
        if self.staging_ring < 1:
            raise PlanError(f"Plan.staging_ring={self.staging_ring}: at least one staging tile is needed")
        if self.micro_batches < 1:
            raise PlanError(f"Plan.micro_batches={self.micro_batches}: must be >= 1")
        if self.slots < 1:
            raise PlanError(f"Plan.slots={self.slots}: at least one weight buffer slot is needed")
        if not 0 <= self.prefetch_distance <= self.slots - 1:
            raise PlanError(f"Plan.prefetch_distance={self.prefetch_distance} with {self.slots} slots: "
                            f"the distance must be in [0, slots - 1]; raise slots or lower the distance")
        if self.grad_ring < 1:
            raise PlanError(f"Plan.grad_ring={self.grad_ring}: at least one host gradient tile is needed")
        if any(r < 0 for r in self.resident):
            raise PlanError(f"Plan.resident={sorted(self.resident)}: layer indices must be >= 0")
        if any(i < 0 for i in self.nvme_moments):
            raise PlanError(f"Plan.nvme_moments={sorted(self.nvme_moments)}: layer indices must be >= 0")
        if self.nvme_buffers < 1:
            raise PlanError(f"Plan.nvme_buffers={self.nvme_buffers}: the NVMe reads need at least one host I/O "
                            "buffer; use 1 (no read-ahead) or more")
        if any(i < 0 for i in self.nvme_gradients):
            raise PlanError(f"Plan.nvme_gradients={sorted(self.nvme_gradients)}: layer indices must be >= 0")
        if any(i < 0 for i in self.nvme_masters):
            raise PlanError(f"Plan.nvme_masters={sorted(self.nvme_masters)}: layer indices must be >= 0")
        if self.nvme_masters and not (self.compute_dtype == "bfloat16" and self.cast_once):
            # Only a staging tile of the layer's own keeps its BF16 copy between steps, so that no
            # H2D (nor eval) needs the FP32 master, which then only the OPT reads.
            raise PlanError(f"Plan.nvme_masters={sorted(self.nvme_masters)} with compute_dtype={self.compute_dtype!r}, "
                            f"cast_once={self.cast_once}: masters go to NVMe only with BF16 compute and "
                            "cast_once=True (each layer's own pinned BF16 staging tile is what H2D reads, so only "
                            "the OPT needs the FP32 master); set compute_dtype='bfloat16' and cast_once=True, or "
                            "drop nvme_masters")
        if not self.nvme_masters <= self.nvme_moments:
            raise PlanError(f"Plan.nvme_masters names layers {sorted(self.nvme_masters - self.nvme_moments)} that "
                            "are not in nvme_moments: a layer's masters share one NVMe file (one read and one write "
                            "per step) with its Adam moments; add them to nvme_moments")
        if self.nvme_masters and self.data_parallel > 1:
            # Moments on NVMe run under data parallel (each rank's files hold its optimizer shard),
            # masters do not: every rank's H2D or CAST reads the whole layer's master, which would
            # then be split over the ranks' files; a gather of the shards into each rank's staging
            # tile after the OPTs is not lowered.
            raise PlanError(f"Plan.nvme_masters={sorted(self.nvme_masters)} with data_parallel={self.data_parallel}: "
                            "masters on NVMe run on one rank only: each rank's file would hold its optimizer shard "
                            "of the master, while every rank reads the whole layer's weights (gathering the "
                            "shards into each rank's staging tile is not lowered); drop nvme_masters (keep "
                            "nvme_moments, which run under data parallel) or train on one rank")
        if self.nvme_gradients and (self.optimizer is not OptimizerPlacement.NEXT_FORWARD
                                    or self.accumulates_on_host or self.data_parallel > 1):
            # Only a deferred update leaves a gradient tile waiting between steps; per-micro-batch
            # passes keep an accumulator that every micro-batch adds into (a read-modify-write of
            # the file per micro-batch, not lowered). Under data parallel the ALL_REDUCE /
            # REDUCE_SCATTER reads the ring tile (or accumulator), while such a layer's D2H lands
            # in a gradient I/O buffer that its NVME_WRITE empties at once: reducing in that buffer
            # before the write is not lowered nor verified.
            raise PlanError(f"Plan.nvme_gradients={sorted(self.nvme_gradients)} with optimizer={self.optimizer.value}, "
                            f"layer_by_layer={self.layer_by_layer}, micro_batches={self.micro_batches}, "
                            f"data_parallel={self.data_parallel}: gradient tiles go to NVMe only when they wait for "
                            "the next step (optimizer NEXT_FORWARD, i.e. clipped gradients) in a tile of their own "
                            "(layer-by-layer passes or one micro-batch) on one rank (under data parallel the "
                            "gradients are reduced in the ring tile, and a tile on NVMe is written out from its I/O "
                            "buffer before any reduction); drop nvme_gradients (Adam moments on NVMe do run under "
                            "data parallel) or change the plan")
        if self.data_parallel < 1:
            raise PlanError(f"Plan.data_parallel={self.data_parallel}: the number of ranks is >= 1")
        if self.nodes < 1 or self.data_parallel % self.nodes:
            raise PlanError(f"Plan.nodes={self.nodes} with data_parallel={self.data_parallel}: the ranks are spread "
                            "evenly over the nodes, so nodes must be >= 1 and divide data_parallel; set "
                            "data_parallel = gpus_per_node x nodes")
        if self.host_state not in ("replicate", "shard"):
            raise PlanError(f"Plan.host_state={self.host_state!r}: use 'replicate' (a full copy per node) or 'shard' "
                            "(1/nodes of it per node)")
        if self.host_state == "shard" and self.nodes == 1:
            raise PlanError("Plan.host_state='shard' with nodes=1: sharding splits the host state across nodes; "
                            "use host_state='replicate' on one node")
        if self.data_parallel > 1 and self.d2h_dtype == "bfloat16":
            raise PlanError("Plan.d2h_dtype='bfloat16' with data_parallel > 1: the ranks' gradients are summed on "
                            "the host, which BF16 would round; use d2h_dtype='float32'")
        if self.optimizer_shards < 1 or self.data_parallel % self.optimizer_shards:
            raise PlanError(f"Plan.optimizer_shards={self.optimizer_shards} with data_parallel={self.data_parallel}: "
                            "the ranks that share a node's host state are >= 1 and divide the ranks; use the "
                            "GPUs per node (torchrun --nproc-per-node)")
        if (self.data_parallel // self.nodes) % self.optimizer_shards:
            raise PlanError(f"Plan.optimizer_shards={self.optimizer_shards} with {self.data_parallel // self.nodes} "
                            f"ranks per node (data_parallel={self.data_parallel}, nodes={self.nodes}): the ranks "
                            "that share a host copy are on one node; use a divisor of the GPUs per node")
        if self.gradient_reduction not in ("all_reduce", "reduce_scatter"):
            raise PlanError(f"Plan.gradient_reduction={self.gradient_reduction!r}: use 'all_reduce' or "
                            "'reduce_scatter'")
        if self.gradient_reduction == "reduce_scatter" and not self.update_shards == self.data_parallel > 1:
            raise PlanError(f"Plan.gradient_reduction='reduce_scatter' with data_parallel={self.data_parallel}, "
                            f"optimizer_shards={self.optimizer_shards}, nodes={self.nodes} and "
                            f"host_state={self.host_state!r}: each rank gets only its shard of the reduced "
                            "gradients, which is enough only when every rank steps a shard of one copy (one "
                            "node with optimizer_shards == data_parallel > 1, or host_state='shard' with "
                            "optimizer_shards = the GPUs per node); use gradient_reduction='all_reduce'")
        if self.shared_cast and not (self.cast_once and self.optimizer_shards > 1 and self.host_state == "replicate"):
            raise PlanError(f"Plan.shared_cast=True with cast_once={self.cast_once}, optimizer_shards="
                            f"{self.optimizer_shards}, host_state={self.host_state!r}: the node's ranks share the "
                            "staging tiles of the host copy they share, a tile per layer (BF16 cast_once), each "
                            "casting its optimizer shard; use shared_cast=False, or cast_once=True with "
                            "optimizer_shards > 1 and host_state='replicate'")

    def check_against(self, graph: LayerGraph) -> None:
        """Raise PlanError when the plan does not fit ``graph`` (layer counts and indices)."""
        n = len(graph.layers)
        if self.activations and len(self.activations) != n:
            raise PlanError(f"Plan.activations has {len(self.activations)} entries for a graph of {n} "
                            "layers: give one policy per layer, or none for KEEP everywhere")
        bad = [r for r in self.resident if r >= n]
        if bad:
            raise PlanError(f"Plan.resident names layers {bad}, but the graph has {n} layers")
        bad = [i for i in sorted(self.nvme_moments) if i >= n or graph.layers[i].trainable_numel == 0]
        if bad:
            raise PlanError(f"Plan.nvme_moments names layers {bad}, which the graph of {n} layers does not have or "
                            "which have no trainable parameters (so no Adam moments); name trainable layers only")
        bad = [i for i in sorted(self.nvme_gradients) if i >= n or graph.layers[i].trainable_numel == 0]
        if bad:
            raise PlanError(f"Plan.nvme_gradients names layers {bad}, which the graph of {n} layers does not have or "
                            "which have no trainable parameters (so no gradient tile); name trainable layers only")
        trainable = sum(1 for layer in graph.layers if layer.trainable_numel > 0)
        if (self.optimizer is OptimizerPlacement.NEXT_FORWARD and not self.accumulates_on_host
                and self.grad_ring < trainable):
            raise PlanError(f"Plan.grad_ring={self.grad_ring} with optimizer steps in the next forward: each of "
                            f"the {trainable} trainable layers keeps its gradients in a host tile of its own "
                            f"until then; set grad_ring={trainable}")

    @property
    def accumulates_on_host(self) -> bool:
        """Per-micro-batch passes with several micro-batches: gradients are summed on the host."""
        return not self.layer_by_layer and self.micro_batches > 1

    @property
    def update_shards(self) -> int:
        """Ranks whose OPTs split each layer's trainable parameters between them, each stepping its
        :func:`~megatrain.ir.layout.optimizer_shard`: ``optimizer_shards`` (the ranks of a node
        that share a copy), times ``nodes`` when the state is sharded across nodes (``host_state
        == "shard"``: the copy is spread over every node, so with ``optimizer_shards`` = the GPUs
        per node every rank of the world steps ``1 / data_parallel``)."""
        return self.optimizer_shards * (self.nodes if self.host_state == "shard" else 1)

    @property
    def staged(self) -> bool:
        """Whether H2D copies read BF16 staging tiles that CASTs fill from the masters: BF16 compute
        where the node holds whole masters. With ``host_state == "shard"`` the weight gather
        already fills a node-shared gather tile in the compute dtype, so the H2D reads that tile
        directly and nothing is cast on the host (``staging_ring`` and ``cast_once`` are then
        unused, as with FP32 compute)."""
        return self.compute_dtype != "float32" and self.host_state != "shard"

    @property
    def gpus_per_node(self) -> int:
        """Ranks on each node: ``data_parallel / nodes``."""
        return self.data_parallel // self.nodes

    @property
    def compute_itemsize(self) -> int:
        return 2 if self.compute_dtype == "bfloat16" else 4

    @property
    def bf16_gradients_exact(self) -> bool:
        """BF16 holds every weight gradient of a step's slot exactly: BF16 compute (autograd returns
        the gradient of a BF16 weight in BF16) and no sum of several micro-batches in the slot."""
        return self.compute_dtype == "bfloat16" and not (self.layer_by_layer and self.micro_batches > 1)

    @property
    def gradient_dtype(self) -> str:
        """The weight gradients' dtype on the GPU slot, over D2H and in the host tiles: ``d2h_dtype``,
        or when that is None BF16 where it is exact (:attr:`bf16_gradients_exact`; never slower:
        half the D2H and pinned bytes) and FP32 otherwise."""
        if self.d2h_dtype is not None:
            return self.d2h_dtype
        return "bfloat16" if self.bf16_gradients_exact else "float32"

    @property
    def gradient_itemsize(self) -> int:
        """Bytes per weight gradient element in the GPU slot, over D2H and in the host tiles."""
        return 2 if self.gradient_dtype == "bfloat16" else 4

    @property
    def optimizer_spec(self) -> OptimizerSpec:
        """The spec of :attr:`optimizer_name` (state rows, bytes per parameter, host kernel)."""
        return OPTIMIZERS[self.optimizer_name]

    def activation(self, layer: int) -> ActivationPolicy:
        return self.activations[layer] if self.activations else ActivationPolicy.KEEP


def default_plan(graph: LayerGraph, micro_batches: int = 1, clip_gradients: bool = False) -> Plan:
    """Two slots, prefetch distance one, a checkpoint kept at every layer boundary.

    With ``clip_gradients`` the optimizer steps wait for the global gradient norm: they run in the
    next step's forward, and every trainable layer gets a host gradient tile.
    """
    if clip_gradients:
        trainable = sum(1 for layer in graph.layers if layer.trainable_numel > 0)
        plan = Plan(micro_batches=micro_batches, optimizer=OptimizerPlacement.NEXT_FORWARD,
                    grad_ring=max(1, trainable))
        plan.check_against(graph)
        return plan
    plan = Plan(micro_batches=micro_batches)
    plan.check_against(graph)
    return plan
