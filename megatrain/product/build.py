"""``megatrain.compile``: ``materialize(plan_model(...))`` for a fixed batch shape, or a
:class:`~megatrain.product.shapes.ShapeFreeTrainer` that plans each batch shape it meets."""

from __future__ import annotations

from typing import Literal, Mapping, Sequence

from torch import nn

from megatrain.optim import AdamW
from megatrain.errors import ConfigError
from megatrain.ir.hardware import HardwareSpec
from megatrain.ir.plan import Plan
from megatrain.optim import Lion, optimizer_settings, spec_of
from megatrain.planner.front import compile_options
from megatrain.product.materializer import materialize
from megatrain.product.planning import plan_model
from megatrain.product.shapes import DEFAULT_MAX_SHAPES, ShapeFreeTrainer
from megatrain.trainer import Trainer


def compile(model: nn.Module, *, seq_len: int | None = None, micro_batch_size: int | None = None,
            micro_batches: int | None = None, global_batch: int | None = None, optimizer: AdamW | Lion | Mapping | None = None,
            plan: Plan | Literal["default"] | None = None, device: str = "cpu",
            input_names: Sequence[str] = ("input_ids", "labels"), max_grad_norm: float | None = None,
            hardware: HardwareSpec | str | None = None, compute_dtype: str | None = None,
            nvme_dir: str | None = None, seq_len_buckets: Sequence[int] | None = None,
            max_shapes: int | None = None, share_host_memory: bool = True,
            host_state: str | None = None, per_token_loss: bool = True,
            image_grid_thw: Sequence[Sequence[int]] | None = None, images_per_row: int = 1,
            templates: str | None = None, cuda_graphs: bool | str | None = None,
            reference: Literal["bfloat16"] | None = None) -> Trainer:
    """Compile ``model`` for training on one device with all persistent state in host memory:
    ``materialize(plan_model(model, ...), optimizer)``.

    ``plan_model`` traces the model (on whatever device it is on, ``meta`` included) into a
    LayerGraph, takes ``plan`` or chooses one, and lowers and verifies the train schedules, once;
    ``materialize`` allocates the host tiles (FP32 master weights and the optimizer's state: 12
    bytes per parameter with AdamW's two moments, 8 with Lion's one), binds the module's parameters to them and builds the executor. The model's
    parameters then live only in the tiles: ``model.state_dict()`` shows the trained weights.

    Args:
        model: an ``nn.Module`` whose ``forward(**batch)`` returns the loss (a Hugging Face causal
            LM given ``labels``, or any module returning a scalar tensor).
        seq_len: tokens per sequence. None (the default): shape-free; returns a
            ``megatrain.shapes.ShapeFreeTrainer`` (:mod:`megatrain.product.shapes`) that plans each batch shape it meets (from the
            first batch on), caches up to ``max_shapes`` of them (default 8) and pads to
            ``seq_len_buckets`` when given (see ``megatrain.shapes``).
        micro_batch_size: sequences per micro-batch (default 1, or what ``global_batch`` gives;
            shape-free: the batch's rows divided by ``micro_batches``).
        micro_batches: micro-batches per step (gradient accumulation; default 1, or what
            ``global_batch`` gives); the global batch is ``micro_batch_size * micro_batches``
            sequences (on each rank under data parallel).
        global_batch: sequences per optimizer step, over every data-parallel rank (each rank's
            ``step`` then takes ``global_batch / ranks`` of them). Alone (no ``micro_batch_size``,
            no ``micro_batches``), the solver chooses the micro-batch size and count for the
            ``hardware`` (given, or measured on ``device="cuda"``) with the rest of the plan: the
            split whose simulated step is shortest, counting the issuing thread, so it is the one
            that keeps the GPU, not kernel issue, the bottleneck where memory allows. The model
            is traced at that size and trained at it: ``trainer.planned.options.micro_batch_size``
            and ``trainer.plan.micro_batches`` say which, and ``trainer.planned.decisions`` why.
            With a given ``plan``, its ``micro_batches`` and ``global_batch / (ranks x
            micro_batches)`` sequences each. With one of ``micro_batch_size`` or
            ``micro_batches``, the other is what divides ``global_batch``; with both, they must
            multiply to it. Fixed shapes only (give ``seq_len``).
        optimizer: the host optimizer's settings (:mod:`megatrain.optim`): ``megatrain.AdamW``
            (the default), ``megatrain.Lion`` (Chen et al. 2023, arXiv:2302.06675: one FP32
            moment, 4 bytes of state per parameter against AdamW's 8), or a dict of their fields
            with ``"name"`` choosing (``{"name": "lion", "lr": 3e-5, "weight_decay": 0.1}``;
            default ``"adamw"``). The plan counts that optimizer's state bytes.
        plan: a ``Plan``; ``"default"`` for the default plan; by default the solver chooses one
            (see ``hardware``).
        hardware: what to plan for when ``plan`` is None: a ``HardwareSpec``, a preset name
            (a key of ``megatrain.ir.hardware.PRESETS``, e.g. ``"H100_SXM"``) or a spec JSON
            file. The solver (``megatrain.planner.solve``) then picks slots, prefetch distance,
            resident layers, checkpoint offload/recompute and the optimizer placement for the
            shortest simulated step that fits, with this micro-batch split. With None: on
            ``device="cuda"`` the machine is measured (``measure_hardware()``, a few seconds);
            on ``device="cpu"``, which has no GPU rates to plan with, the default plan (two
            slots, prefetch distance one, every checkpoint kept) is used. With a given plan, the
            spec the step is predicted on (``Trainer.planned.timeline``).
        compute_dtype: ``"float32"`` (strict full precision) or ``"bfloat16"`` (BF16 weights and
            matmuls under autocast; FP32 masters, moments and gradients). Default: BF16 on CUDA,
            FP32 on the CPU. A given ``plan`` brings its own.
        device: ``"cpu"`` (the CPU backend) or ``"cuda"``.
        input_names: the keyword inputs of ``forward``, each a ``LongTensor[batch, seq_len]``:
            e.g. ``("input_ids", "attention_mask", "labels")`` for padded batches,
            ``("input_ids", "position_ids", "labels")`` for packed documents (see ``Trainer.step``).
            A vision-language model (LLaVA) also takes ``"pixel_values"``: up to ``images_per_row``
            ``FloatTensor[3, H, W]`` images per row, each row holding its images' tokens in order
            (see ``images_per_row`` for the two layouts; :mod:`megatrain.planner.trace.vlm`).
            Qwen2-VL and Qwen2.5-VL take
            ``("input_ids", "pixel_values", "image_grid_thw", "labels")`` (and optionally
            ``"mm_token_type_ids"``, ``"attention_mask"``) as their processor returns them: the
            images' patches ``[patches, C*T*P*P]`` float32 and grids ``[images, 3]``, every row's
            images in row order (see ``image_grid_thw``; :mod:`megatrain.planner.trace.qwen_vl`).
        max_grad_norm: clip the gradients to this global L2 norm, as
            ``torch.nn.utils.clip_grad_norm_`` does, or None. Clipping needs every gradient before
            any update, so the optimizer steps then run in the next step's forward
            (``OptimizerPlacement.NEXT_FORWARD``), with one host gradient tile per layer (4 bytes
            per parameter of transient host memory); ``evaluate`` and ``save`` apply the last
            step's update first (``Trainer.flush``).
        nvme_dir: an existing directory on an NVMe drive, for a plan that keeps some layers' Adam
            moments there (``Plan.nvme_moments``, read before and written after each of their
            optimizer steps: :mod:`megatrain.runtime.nvme`); its files are scratch, checkpoints
            stay the source of truth. Required for such a plan, ignored otherwise.
        share_host_memory: data parallel under ``torchrun``: the ranks of a node share one copy
            of the host state and split the optimizer work (True, the default), or each keeps a
            copy (False); see :func:`plan_model`.
        host_state: data parallel over several nodes: ``"shard"`` holds ``1 / nodes`` of the host
            state on each node (ZeRO-3 style), ``"replicate"`` a full copy; see :func:`plan_model`.
            Fixed shapes only (give ``seq_len``).
        image_grid_thw: Qwen2-VL and Qwen2.5-VL: patch grids ``(t, h, w)`` (as the processor
            returns them in ``image_grid_thw``: a 448x448 image with 14-pixel patches is
            ``[(1, 32, 32)]``, the default) whose patches, ``sum(t * h * w)``, are each row's
            budget: a row carries any images (of any grids, any number, none) whose patches fit
            it, as many as its image tokens say, in the order ``image_grid_thw`` lists them. The
            trace and plan hold the budget's patches a row, each micro-batch's real patches first
            and zeros after (read by no image token: nothing added to the loss or any gradient;
            the attention over them is counted, as it runs). A row over the budget is refused
            (BatchError naming the row, its patches and the grids to compile with); shape-free (no
            ``seq_len``), the grids of each batch's row with the most patches are its shape's.
            Other models: None.
        images_per_row: LLaVA: the most images a row carries (K, default 1); a row carries 0 to K,
            as many as its image tokens (``image_token_id``, one per image feature) say. The trace
            and plan hold K image slots a row whatever a batch's counts. ``pixel_values`` float32
            comes as K slots a row, ``[batch * K, 3, H, W]``, row ``r``'s images first in
            ``[r * K, (r + 1) * K)`` and any values in its unused slots; or in Hugging Face's layout,
            ``[images, 3, H, W]``, each real image once, rows in order (as a processor returns a
            batch; told apart by the count; with K images in every row they are the same). Unused
            slots become zeros whose features no image token reads: they add nothing to the loss
            or to any gradient (``vlm.place_images``). A row with more than K images, a partial
            image's tokens, or an image count fitting neither layout is refused (BatchError);
            shape-free (no ``seq_len``), K is each batch's (its slots, or its most images a row)
            and this argument is not used.
        per_token_loss: the loss of a global batch is the mean over its supervised tokens (labels
            that are not -100, after the model's shift) across every micro-batch and rank, as
            eager PyTorch computes it on the whole batch (True, the default; needs a model whose
            loss is a mean cross-entropy). False: the mean of the micro-batch means, each
            micro-batch weighted equally (Megatron-LM's default; the only way for a model whose
            loss megatrain cannot count). See :mod:`megatrain.runtime.loss`.
        templates: how the layer templates run (``Plan.templates``): ``"eager"`` (the traced graphs
            as they are) or ``"compiled"``: each distinct template compiled once with
            ``torch.compile`` (inductor, whole graph) and shared by every layer using it, here,
            before the first step, with a line on stderr saying what is compiled and one the
            seconds it took (``Trainer.executor.compile_reports``); inductor's caches live in
            ``$MEGATRAIN_CACHE_DIR/inductor`` (default ``~/.cache/megatrain``), so the next run
            of the same model and shapes loads the kernels. None: a given plan's, else eager on
            both devices (``megatrain.planner.front.DEFAULT_TEMPLATES``; CUDA's default waits on
            the GPU measurement). FP32 training stays within 1e-5 of eager, BF16 within the
            derived BF16 bounds, and dropout draws eager's masks.
        cuda_graphs: capture each compute op once per template, weight slot and variant in a CUDA
            graph and replay it (``Plan.cuda_graphs``; the first step runs eagerly and the graphs
            are captured after it, said on stderr): True, False, or ``"auto"`` (on where the
            planner finds the step issue-bound on ``hardware``). None: a given plan's, else False.
            CUDA only.
        reference: ``"bfloat16"`` plans host memory for a frozen BF16 copy of the weights, the
            reference model of preference and RL training (``megatrain.rl.Reference``, 2 bytes per
            parameter); None (the default) plans none (reference log-probabilities precomputed
            before training need none: ``megatrain.rl.precompute_reference``). Fixed shapes only.

    Raises:
        ConfigError: an option or optimizer setting out of range (``images_per_row`` below 1
            included); ``seq_len`` beyond a Hugging Face model's ``max_position_embeddings``
            (``megatrain.models.check_positions``); a ``global_batch`` below 1, without ``seq_len``,
            that the micro-batches (of the given size, count or plan, times the ranks) do not
            split or multiply to, or alone where nothing chooses the split (``plan="default"``, or
            ``device="cpu"`` without ``hardware``: give ``hardware=`` or ``micro_batch_size=``;
            :func:`megatrain.product.planning.split_global_batch`).
        TraceError / UnsupportedModelError: the model cannot be traced or is not supported (a
            Hugging Face model that is not a causal decoder: ``megatrain.models``; ``images_per_row``
            other than 1 for a model that is not LLaVA with ``pixel_values``).
        PlanError, ScheduleError: the plan does not fit the model.
        Nothing is bound to the model unless every step before binding succeeded.
    """
    if seq_len is None:
        if global_batch is not None:
            raise ConfigError(f"global_batch={global_batch} with shape-free compile (seq_len=None): the solver plans "
                              "the split for one batch shape; give seq_len=, or leave global_batch out (each batch's "
                              "rows are its global batch, in micro_batches micro-batches)")
        if plan is not None and plan != "default":
            raise ConfigError("a Plan is made for one batch shape: give seq_len and micro_batch_size with it, "
                              "or leave plan unset (shape-free compile plans each shape)")
        if host_state is not None or reference is not None:
            what = f"host_state={host_state!r}" if host_state is not None else f"reference={reference!r}"
            raise ConfigError(f"{what} with shape-free compile (seq_len=None): not supported "
                              "yet; give seq_len and micro_batch_size")
        return ShapeFreeTrainer(model, micro_batch_size=micro_batch_size,
                                micro_batches=1 if micro_batches is None else micro_batches,
                                seq_len_buckets=seq_len_buckets,
                                max_shapes=DEFAULT_MAX_SHAPES if max_shapes is None else max_shapes,
                                optimizer=optimizer, nvme_dir=nvme_dir, plan=plan, device=device,
                                input_names=input_names, max_grad_norm=max_grad_norm, hardware=hardware,
                                compute_dtype=compute_dtype, share_host_memory=share_host_memory,
                                per_token_loss=per_token_loss, image_grid_thw=image_grid_thw,
                                **{k: v for k, v in (("templates", templates), ("cuda_graphs", cuda_graphs))
                                   if v is not None})
    if seq_len_buckets is not None or max_shapes is not None:
        raise ConfigError("seq_len_buckets and max_shapes are for shape-free compile (seq_len=None); with "
                          f"seq_len={seq_len} every batch has that length")
    compile_options(seq_len, 1 if micro_batch_size is None else micro_batch_size,
                    1 if micro_batches is None else micro_batches, input_names, device, max_grad_norm, per_token_loss)
    opt = optimizer_settings(optimizer)  # settings errors before anything is traced
    planned = plan_model(model, seq_len=seq_len, micro_batch_size=micro_batch_size, micro_batches=micro_batches,
                         global_batch=global_batch, plan=plan, device=device, input_names=input_names, max_grad_norm=max_grad_norm,
                         hardware=hardware, compute_dtype=compute_dtype, share_host_memory=share_host_memory,
                         host_state=host_state, per_token_loss=per_token_loss, optimizer_name=spec_of(opt).name,
                         image_grid_thw=image_grid_thw, images_per_row=images_per_row, templates=templates,
                         cuda_graphs=cuda_graphs, reference=reference)
    return materialize(planned, opt, nvme_dir=nvme_dir)


__all__ = ["compile"]
