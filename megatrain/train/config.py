"""``megatrain train``'s settings: :class:`TrainConfig` (every field is also a flag) and
:func:`load_train_config` (a YAML or JSON file, the saved run's settings under it, flags on top)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import Field

from megatrain.config import OptimizerSettings, describe_validation
from megatrain.data.sft_formats import SFT_FORMATS
from megatrain import bounds, optim
from megatrain.errors import ConfigError
from megatrain.ir.hardware import PRESETS as HARDWARE_PRESETS
from megatrain.planner.presets import preset_names
from megatrain.train.names import CONFIG_FILE

OptimizerName = Literal[tuple(optim.OPTIMIZERS)]  # type: ignore[valid-type]
"""A name of :data:`megatrain.optim.OPTIMIZERS` (the config's ``optimizer``)."""
SftFormatName = Literal[("auto", *SFT_FORMATS)]  # type: ignore[valid-type]
"""``auto`` or a name of :data:`megatrain.data.sft_formats.FORMATS` (the config's ``sft_format``)."""


class TrainConfig(pydantic.BaseModel):
    """Everything ``megatrain train`` needs; each field is also a flag (``seq_len`` -> ``--seq-len``).

    Paths in a config file are relative to the file's directory, paths in flags to the working
    directory. Optional fields take ``null`` in a file and ``none`` on the command line.
    """

    # allow_inf_nan=False: lr .inf or nan would train on (and be reported as "learning rate nan").
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, protected_namespaces=(), allow_inf_nan=False)

    model: str = Field(description=f"a preset ({preset_names()}), a Hugging Face config.json (or a directory holding "
                                   "only one) to train from scratch; a directory of safetensors weights with its "
                                   "config.json to start from them; or a megatrain checkpoint directory (with "
                                   "megatrain_state/) to resume exactly (default with init_from: init_from's "
                                   "config.json)")
    init_from: str | None = Field(None, description="a new run from the weights of this directory (a megatrain "
                                                    "checkpoint such as another run's output_dir/checkpoint, or "
                                                    "Hugging Face safetensors weights): only the weights are "
                                                    "taken, not a resume: step 0, fresh AdamW state, this run's "
                                                    "data, batch and learning-rate schedule; its tokenizer.json "
                                                    "is the run's tokenizer unless tokenizer is set")
    output_dir: str = Field(description="where metrics.jsonl, checkpoint/, tokenizer.json and loss.png go; "
                                        "empty, or holding this run (same model, data, seq_len, global_batch "
                                        "and seed), which then resumes from its checkpoint or starts over")
    task: Literal["lm", "sft", "dpo", "grpo"] = Field("lm", description="lm: language modelling on the text of data; sft: "
                                                         "supervised fine-tuning on alpaca, sharegpt, chat "
                                                         "messages or prompt/completion records (see data), loss "
                                                         "only on completion / assistant tokens, examples packed "
                                                         "into rows (sft_packing); a vision-language model (LLaVA) "
                                                         "fine-tunes on sharegpt/messages records with images, "
                                                         "read by its processor (see data); so do Qwen2-VL and "
                                                         "Qwen2.5-VL (see image_size); dpo: DPO on preference "
                                                         "pairs (TRL prompt/chosen/rejected, or LLaMA-Factory "
                                                         "ranking data; see dpo_*); grpo: GRPO on responses the "
                                                         "current weights generate (transformers' generate) to the "
                                                         "prompts of data, scored by reward (see group_size, "
                                                         "kl_coef); global_batch counts rows: a pair is 2, a group "
                                                         "group_size (docs/rl.md)")
    data: str | None = Field(None, description="lm: a directory of .txt/.py/.md/.rst, .jsonl and .parquet files, "
                                               "one such file, or a directory saved with Hugging Face "
                                               "datasets' save_to_disk (default: this Python's standard "
                                               "library). sft: a .json/.jsonl/.parquet/.csv/.arrow file, a "
                                               "save_to_disk directory, a directory of such files or with a "
                                               "LLaMA-Factory dataset_info.json, or NAME,NAME@DIR naming entries "
                                               "of DIR/dataset_info.json; several comma-separated, each with an "
                                               "optional mixing weight (a.json:2,b.jsonl). Images (for a "
                                               "vision-language model): an images column of image files "
                                               "(relative to the data file's directory, or DIR), one <image> in "
                                               "sharegpt text or one {type: image} content part in messages per "
                                               "file, up to images_per_row images per example, read with Pillow by "
                                               "the processor (AutoProcessor) of the model directory or of "
                                               "tokenizer; such examples are not packed")
    val_data: str | None = Field(None, description="dpo and grpo: held-out data of the same kind as data "
                                                   "(preference pairs; prompts with the reward's columns), "
                                                   "evaluated every eval_interval steps and at the end: DPO's loss, "
                                                   "reward accuracy and margin over all its pairs (TRL's eval_loss, "
                                                   "eval_rewards/*), GRPO's mean reward of group_size responses to "
                                                   "each of its prompts (val_reward_mean); null: no validation. lm "
                                                   "and sft hold out val_fraction of data instead")
    sft_format: SftFormatName = Field(
        "auto", description="sft: the record format of data files (auto: detected from each file's first "
                            "record; a dataset_info.json names each dataset's)")
    chat_template: str | None = Field(None, description="sft: a Jinja chat template file to render chats with "
                                                        "(default: the tokenizer's, from the chat_template.jinja or "
                                                        "tokenizer_config.json beside it, else megatrain's "
                                                        "<|role|> template; a vision-language model's: its "
                                                        "processor's); saved with the checkpoint's tokenizer")
    sft_loss: Literal["all", "last"] = Field("all", description="sft: which assistant turns of a chat are loss "
                                                                "targets: all of them, or only the last")
    sft_truncation: Literal["trim", "drop"] = Field(
        "trim", description="sft: an example longer than seq_len loses its oldest context (the system message, then "
                            "the oldest exchanges, then its first tokens), never its last answer (dropped when that "
                            "answer alone does not fit); drop: every example longer than seq_len is dropped. The "
                            "data: line and metrics.jsonl count both")
    sft_packing: bool = Field(True, description="sft: pack several examples per row (best-fit decreasing; "
                                                "position_ids restart at each example, so attention stays inside "
                                                "it); false: one example per row, padded")
    images_per_row: int = Field(1, ge=1, description="sft with a vision-language model (LLaVA, Qwen2-VL, "
                                                     "Qwen2.5-VL): the most images an example may carry, each example "
                                                     "one row (LLaVA: 0 to this many, text-only records too; a record "
                                                     "with more is an error), the run traced for this many fixed-size "
                                                     "image slots a row, unused ones zeros that reach no loss or "
                                                     "gradient (megatrain.compile(images_per_row=...)); Qwen2-VL and "
                                                     "Qwen2.5-VL: exactly this many, every row's patches traced alike "
                                                     "(image_grid_thw=...), or 0 to this many with "
                                                     "image_max_pixels; default 1, not read from the data: set it "
                                                     "to the most images a record has; 1 for a model without images")
    image_size: str | None = Field(None, pattern=r"^[1-9][0-9]*x[1-9][0-9]*$",
                                   description="sft with Qwen2-VL or Qwen2.5-VL: HxW pixels (height x width, e.g. "
                                               "448x448) every image is resized to (Pillow, the processor's "
                                               "resampling, aspect ratio not kept) before the processor reads it, "
                                               "so that every image has one patch grid, which megatrain traces "
                                               "(the processor then rounds HxW to multiples of patch_size x "
                                               "merge_size within its min/max pixels, as for any image); default: "
                                               "the size the processor gives a 448x448 image. LLaVA's processor "
                                               "resizes every image itself: not for LLaVA")
    image_max_pixels: int | None = Field(None, gt=0, le=bounds.MAX_IMAGE_PIXELS,
                                         description="sft with Qwen2-VL or Qwen2.5-VL, instead of image_size: every "
                                                     "image at its own size and aspect ratio, the processor's "
                                                     "smart_resize given this many pixels at most (LLaMA-Factory's "
                                                     "image_max_pixels; e.g. 589824 = 768x768), and 0 to "
                                                     "images_per_row images a record; the run is traced for "
                                                     "images_per_row images of that many pixels a row. Default: "
                                                     "off (image_size)")
    dpo_beta: float = Field(0.1, gt=0, description="dpo: the temperature beta of the DPO loss (TRL's beta)")
    dpo_loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="dpo: sigmoid (DPO, Rafailov et al. "
                                                                            "2023) or ipo (Azar et al. 2023), as "
                                                                            "TRL's loss_type")
    dpo_label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo: conservative DPO's label smoothing "
                                                                      "(sigmoid only)")
    dpo_reference: Literal["precompute", "bfloat16"] = Field(
        "precompute", description="dpo: the reference model: precompute (the initial model's log-probabilities of "
                                  "every pair, computed once before the first step, 4 bytes a token of host memory; "
                                  "TRL's precompute_ref_log_probs) or bfloat16 (a frozen BF16 copy of the initial "
                                  "weights on the host, 2 bytes a parameter, run on each batch)")
    reward: str = Field("megatrain.rl.rewards:arithmetic_reward",
                        description="grpo: the reward, module:function with TRL's signature fn(prompts, completions, "
                                    "**columns) -> list[float] (the prompt set's other columns as keyword lists), "
                                    "or several comma-separated, summed with reward_weights (TRL's reward_funcs; "
                                    "each one's mean is logged as reward_<function>_mean); default: the bundled rule "
                                    "reward for examples/data/rl/arithmetic.jsonl (1 for the exact answer, 0.1 for "
                                    "another integer)")
    reward_weights: list[float] | None = Field(None, description="grpo: one weight per reward function (TRL's "
                                                                 "reward_weights), comma-separated as a flag "
                                                                 "(--reward-weights 1,0.5); null: 1.0 each")
    group_size: int = Field(4, description="grpo: responses sampled per prompt, normalised against each other (GRPO's "
                                           "G; at least 2); global_batch / group_size prompts a step")
    kl_coef: float = Field(0.0, ge=0, description="grpo: the KL penalty to the reference (GRPO's beta, k3 "
                                                  "estimator); above 0 the planner holds a frozen BF16 copy of the "
                                                  "initial weights (TRL's default 0 needs none)")
    clip_low: float = Field(0.2, ge=0, lt=1, description="grpo: the importance ratio is clipped below at 1 - this "
                                                         "(PPO's epsilon)")
    clip_high: float | None = Field(None, ge=0, description="grpo: ... and above at 1 + this (DAPO's clip-higher; "
                                                            "null: clip_low)")
    grpo_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="grpo: how token losses are averaged (VERL's loss_agg_mode names): over every "
                                  "response token of the step (DAPO), per response then over responses (GRPO), or "
                                  "each response's sum over max_new_tokens (Dr. GRPO)")
    grpo_updates: int = Field(1, gt=0, description="grpo: optimizer steps on each batch of rollouts (TRL's "
                                                   "num_iterations, GRPO's mu); above 1 the ratio to the rollout "
                                                   "policy is clipped and clip_fraction is measured")
    max_new_tokens: int = Field(16, gt=0, description="grpo: the most tokens generated per response (it ends at the "
                                                      "end-of-text token); a prompt longer than seq_len - this is "
                                                      "left out (counted)")
    temperature: float = Field(1.0, gt=0, description="grpo: the sampling temperature of the rollouts (top_k and "
                                                      "top_p off); the loss's log-probabilities are the model's at "
                                                      "temperature 1, so only 1 gives an on-policy gradient")
    text_field: str = Field("text", description="the text field of .jsonl records and text column of "
                                                ".parquet files and saved datasets")
    max_bytes: int | None = Field(None, gt=0, description="train on only the corpus's first this many UTF-8 "
                                                          "bytes of text (the data line says when it cut the "
                                                          "corpus); null: all of it, tokenised in parallel into "
                                                          "the out-of-core token store. A trained BPE learns from "
                                                          "at most the first 10 MB")
    data_cache: str | None = Field(None, description="the token store's directory: the data tokenised once into "
                                                     "a memory-mapped file that training reads, reused while the "
                                                     "data files, tokenizer, eot_token, text_field and max_bytes "
                                                     "are unchanged, rebuilt when it fails its sha256 check "
                                                     "(default: output_dir/tokens)")
    tokenizer: str | None = Field(None, description="a tokenizers JSON file (default: the model directory's "
                                                    "tokenizer.json, else a byte-level BPE trained on the "
                                                    "data with the model's vocab_size); for a vision-language "
                                                    "model, the processor's directory (AutoProcessor; default: "
                                                    "the model directory)")
    eot_token: str | None = Field(None, description="the tokenizer's end-of-text token (default: the first of "
                                                    "<|endoftext|>, <|end_of_text|>, </s>, <eos> it has)")
    document_attention: bool = Field(True, description="lm task: each token attends only to earlier tokens of "
                                                       "its own document, not to the documents packed before "
                                                       "it in the window (position_ids restart at 0 at every "
                                                       "document start, as Hugging Face packing without padding "
                                                       "does); false: plain causal attention across the window")
    seq_len: int = Field(1024, ge=2, le=bounds.MAX_SEQ_LEN, description="tokens per training window")
    global_batch: int = Field(8, gt=0, le=bounds.MAX_GLOBAL_BATCH,
                              description="windows (rows) per optimizer step, over all ranks under torchrun (a "
                                          "multiple of micro_batch_size x ranks)")
    micro_batch_size: int | Literal["auto"] = Field(
        1, description="rows per micro-batch (global_batch must be a multiple of it), or auto: the solver chooses the "
                       "micro-batch size and count for global_batch on the hardware (device cuda: the run's hardware "
                       "or the measured GPU), the split whose simulated step is shortest with kernel issue counted, "
                       "and the run's 'micro-batches:' line says which and why; the CPU backend runs the default "
                       "plan, which chooses no split, so give a number there")
    lr: float = Field(3e-4, gt=0, description="peak learning rate")
    warmup_steps: int = Field(100, ge=0, description="steps of linear warm-up to lr")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine decays to lr x this at the last step")
    optimizer: OptimizerName = Field(
        "adamw", description="host optimizer: adamw (two FP32 moments, 8 bytes of state per parameter) or lion "
                             "(Chen et al. 2023, arXiv:2302.06675: one FP32 moment, 4 bytes, so more of a model "
                             "fits host memory; it wants an lr 3-10x lower and a weight_decay 3-10x higher "
                             "than AdamW's)")
    weight_decay: float = Field(0.1, ge=0, description="decoupled weight decay (AdamW and Lion)")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW first-moment decay; Lion: the update's "
                                                      "interpolation of moment and gradient")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW second-moment decay; Lion: its moment's decay")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon (Lion has none)")
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient L2 norm to this "
                                                               "(null: no clipping)")
    max_steps: int = Field(1000, gt=0, description="optimizer steps of the whole run (a resumed run counts "
                                                   "the steps before it)")
    eval_interval: int = Field(100, ge=0, description="evaluate every this many steps and at the end "
                                                      "(0: only at the end)")
    eval_batches: int = Field(8, gt=0, description="validation micro-batches per evaluation")
    checkpoint_interval: int = Field(500, ge=0, description="save output_dir/checkpoint every this many steps "
                                                            "and at the end (0: only at the end)")
    nonfinite: Literal["skip", "stop"] = Field(
        "stop", description="a step whose loss or gradient is NaN or infinite, whose update leaves NaN or infinite "
                            "weights, or (loss_spike) whose loss spikes is never kept: skip it and go on (a deferred "
                            "update is dropped; one that layers took during backward is undone by rolling back to "
                            "the last checkpoint and replaying the steps since without it), or stop (exit 2, "
                            "nothing saved)")
    max_consecutive_skips: int = Field(10, gt=0, description="nonfinite skip: this many steps in a row not kept stop "
                                                             "the run (exit 2), keeping its last checkpoint")
    loss_spike: float | None = Field(None, gt=1, description="a step whose loss exceeds this factor times the mean of "
                                                             "the last 20 kept steps' losses is treated as a "
                                                             "non-finite one (null: no spike check)")
    hardware: str | None = Field(None, description=f"a hardware preset ({', '.join(HARDWARE_PRESETS)}) or "
                                                   "HardwareSpec JSON file: the simulator's "
                                                   "predicted step, the MFU peak on a GPU, and with "
                                                   "device cuda the spec the plan is solved for (default: "
                                                   "the measured GPU)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where layers compute: auto takes the GPU where torch sees a CUDA device, else the CPU; "
                            "cpu or cuda forces one. The run's first line names the device and why (and, on the CPU "
                            "by choice, the GPU it leaves idle)")
    templates: Literal["eager", "compiled"] | None = Field(
        None, description="how the layer templates run: 'eager' (the traced graphs as they are) or 'compiled' "
                          "(each distinct template compiled once with torch.compile, inductor, before the first "
                          "step, said and timed; inductor's caches in $MEGATRAIN_CACHE_DIR/inductor, default "
                          "~/.cache/megatrain, so a rerun loads them) (default: eager on both devices: on the CPU "
                          "compiling costs about a minute per template and gains little; on CUDA until measured, "
                          "docs/architecture.md, 'Compiled templates and CUDA graphs')")
    cuda_graphs: bool | Literal["auto"] = Field(
        False, description="device cuda: replay each compute op (forward, recompute, local backward) from a CUDA "
                            "graph captured once per template, weight slot and variant after the first step "
                            "(one launch where an eager block issues hundreds); 'auto': where the planner finds "
                            "the step issue-bound on the hardware spec")
    val_fraction: float = Field(0.05, gt=0, lt=1, description="fraction of windows held out for validation")
    seed: int = Field(0, ge=-2**63, lt=2**64,  # torch.manual_seed's range (2**70 was an OverflowError)
                      description="seed of the initialisation, the validation split and the batch order")
    threads: int | None = Field(None, gt=0, description="torch intra-op threads of the CPU backend (null: "
                                                        "OMP_NUM_THREADS if set, else the CPUs this process may "
                                                        "use; megatrain.runtime.threads)")
    sample_tokens: int = Field(32, ge=0, description="at the end, print the trained model's greedy continuation "
                                                     "of a validation prompt, this many tokens (CPU backend; 0: "
                                                     "none)")
    collective_timeout: float = Field(600.0, gt=0, description="data parallel (under torchrun): seconds a rank "
                                                                 "waits in a collective (or, while rank 0 prepares "
                                                                 "the data or saves, for its heartbeat) before it "
                                                                 "stops with an error naming the rank that died or "
                                                                 "stopped")
    host_state: Literal["auto", "replicate", "shard"] = Field(
        "auto", description="data parallel over several nodes (torchrun --nnodes > 1): 'replicate' keeps a full copy "
                            "of the FP32 masters and Adam moments on every node; 'shard' keeps 1/nodes of them on "
                            "each and gathers every layer's weights over the network before use (ZeRO-3 style); "
                            "'auto' replicates where every node's available host memory holds the run and shards "
                            "otherwise, and prints which and why (one node: always replicate)")
    nvme_dir: str | None = Field(None, description="an existing directory on an NVMe drive: the Adam "
                                                   "moments of the layers chosen for it (every layer's, or with "
                                                   "host_memory only those that must leave it, and then with "
                                                   "max_grad_norm also deferred gradient tiles) live in files "
                                                   "there, read before the layer's update and written back "
                                                   "after it (megatrain.runtime.nvme); the files are scratch, "
                                                   "checkpoints stay the source of truth (null: all state in "
                                                   "host memory)")
    host_memory: str | None = Field(None, description="with nvme_dir: the host memory the run may use, e.g. "
                                                      "64GiB or 1.5TiB; only the state that "
                                                      "megatrain.planner.nvme.place_on_nvme moves so that the "
                                                      "plan's host bytes (cost.memory_breakdown) fit it, beside "
                                                      "the run's data, a checkpoint file being read and a model "
                                                      "built on the CPU (train.loop.host_beside_plan), goes to "
                                                      "NVMe: with max_grad_norm the layers' deferred gradient "
                                                      "tiles first, then Adam moments, each in the order the "
                                                      "step updates the layers (null: every layer's Adam "
                                                      "moments)")

    nvme_checksums: bool = Field(True, description="with nvme_dir: checksum every block of the NVMe files as it is "
                                                   "written and check it as it is read, so that a file changed on "
                                                   "disk stops the step instead of training on other state (costs "
                                                   "up to 14% of the I/O rate on this project's VM: bench/nvme_io.py)")

    @pydantic.model_validator(mode="before")
    @classmethod
    def _model_from_init_from(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("model") is None and data.get("init_from") is not None:
            return {**data, "model": data["init_from"]}
        return data

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        # pydantic takes True as 1 for an int field (max_steps: true trained 1 step): a YAML
        # true/false where a number belongs is a mistake.
        if isinstance(value, bool) and _numeric(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is a boolean, not a number; give a number")
        return value

    @pydantic.field_validator("reward_weights", mode="before")
    @classmethod
    def _weights_from_a_flag(cls, value: Any) -> Any:
        # --reward-weights 1,0.5 (a flag is one string; a config file gives a list)
        return [w.strip() for w in value.split(",")] if isinstance(value, str) else value

    @pydantic.field_validator("micro_batch_size")
    @classmethod
    def _positive_micro_batch_size(cls, value: int | str) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError(f"{value} rows: give a micro-batch size >= 1, or auto (the solver's)")
        return value

    @pydantic.model_validator(mode="after")
    def _consistent(self) -> "TrainConfig":
        if (why := batch_split_error(self.global_batch, self.micro_batch_size)) is not None:
            raise ValueError(why)  # pydantic's error type: load_train_config names the file and field
        if self.host_memory is not None and self.nvme_dir is None:
            raise ValueError(f"host_memory={self.host_memory!r} chooses which Adam moments and gradient tiles go "
                             "to NVMe, but no nvme_dir is set; give nvme_dir (a directory on an NVMe drive) or "
                             "drop host_memory")
        if self.cuda_graphs is True and self.device != "cuda":
            raise ValueError(f"cuda_graphs=true with device={self.device!r}: CUDA graphs capture GPU work; set "
                             "device cuda, or cuda_graphs false")
        if self.image_size is not None:
            h, w = (int(x) for x in self.image_size.split("x"))
            bounds.check_image_size(h, w, f"image_size={self.image_size}")
        if self.image_max_pixels is not None and self.image_size is not None:
            raise ValueError(f"image_size={self.image_size} resizes every image to one size and image_max_pixels="
                             f"{self.image_max_pixels} keeps each image's own: give one of them")
        if self.task in ("dpo", "grpo"):
            _check_rl(self)
        elif self.val_data is not None:
            raise ValueError(f"val_data is for task dpo and grpo; task {self.task} holds out val_fraction of data for "
                             "validation: drop val_data (or set val_fraction)")
        if self.warmup_steps > self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds max_steps={self.max_steps}; lower "
                             "warmup_steps")
        return self

    @property
    def micro_batches(self) -> int | None:
        """Micro-batches a step (on one rank), or None with ``micro_batch_size: auto`` (the plan's)."""
        return None if self.micro_batch_size == "auto" else self.global_batch // self.micro_batch_size

    def optimizer_settings(self) -> OptimizerSettings:
        """The host optimizer's settings (``megatrain.AdamW`` or ``megatrain.Lion``) this config gives."""
        fields = dict(lr=self.lr, betas=(self.beta1, self.beta2), weight_decay=self.weight_decay)
        return optim.optimizer_settings({"name": self.optimizer, **fields, **({"eps": self.eps} if self.optimizer == "adamw"
                                                                        else {})})


def batch_split_error(global_batch: int, micro_batch_size: int | Literal["auto"], ranks: int = 1) -> str | None:
    """Why ``global_batch`` rows do not split into ``ranks`` ranks' micro-batches of
    ``micro_batch_size`` rows each, or None where they do: the one check of a run's batch shape,
    for the config (one rank), ``megatrain train`` under torchrun and ``megatrain plan --config``
    (their ranks). With ``"auto"`` the rows must split over the ranks (the solver chooses a size
    that divides each rank's). ``megatrain.compile`` checks its own
    (``megatrain.product.planning.split_global_batch``)."""
    if micro_batch_size == "auto":
        if global_batch % ranks == 0:
            return None
        return (f"global_batch={global_batch} rows do not split over {ranks} ranks (micro_batch_size=auto chooses "
                f"each rank's micro-batches of its share); make global_batch a multiple of {ranks}")
    if global_batch % (micro_batch_size * ranks) == 0:
        return None
    if ranks == 1:
        return (f"global_batch={global_batch} is not a multiple of micro_batch_size={micro_batch_size}; change one of "
                "them")
    return (f"global_batch={global_batch} rows do not split into {ranks} ranks' micro-batches of "
            f"micro_batch_size={micro_batch_size}: make global_batch a multiple of {micro_batch_size * ranks} "
            "(micro_batch_size x ranks)")


def check_batch_split(global_batch: int, micro_batch_size: int | Literal["auto"], ranks: int = 1) -> None:
    """:func:`batch_split_error` as an error.

    Raises:
        ConfigError: the rows do not split (naming the multiple to use).
    """
    if (why := batch_split_error(global_batch, micro_batch_size, ranks)) is not None:
        raise ConfigError(why)


def _check_rl(cfg: "TrainConfig") -> None:
    """The batch shapes of ``--task dpo`` and ``--task grpo`` (ValueError naming the fix)."""
    if cfg.task == "dpo" and cfg.micro_batch_size == "auto":
        raise ValueError("task dpo with micro_batch_size auto: a pair's chosen and rejected responses are two rows "
                         "that must stay in one micro-batch, which the solver's split does not promise; give an even "
                         "micro_batch_size")
    if cfg.task == "dpo" and (cfg.global_batch % 2 or cfg.micro_batch_size % 2):
        raise ValueError(f"task dpo: global_batch={cfg.global_batch} and micro_batch_size={cfg.micro_batch_size} "
                         "count rows, a pair's chosen and rejected responses two rows that stay in one "
                         "micro-batch: make both even")
    if cfg.loss_spike is not None:
        raise ValueError(f"loss_spike={cfg.loss_spike} with task {cfg.task}: the spike check is not there yet for "
                         "DPO and GRPO (their loss is no language-model loss a window of means describes); drop "
                         "loss_spike")
    if cfg.task == "dpo" and cfg.dpo_label_smoothing and cfg.dpo_loss_type != "sigmoid":
        raise ValueError("dpo_label_smoothing applies to dpo_loss_type sigmoid")
    if cfg.task == "grpo":
        if cfg.group_size < 2:
            raise ValueError(f"group_size={cfg.group_size}: GRPO compares the responses to one prompt with each "
                             "other, so a group needs at least 2 (with 1, every advantage is 0 and nothing is "
                             "learned); set group_size 2 or more")
        if cfg.global_batch % cfg.group_size:
            raise ValueError(f"task grpo: global_batch={cfg.global_batch} rows do not split into groups of "
                             f"group_size={cfg.group_size}; make global_batch a multiple of it")
        functions = [f.strip() for f in cfg.reward.split(",")]
        if cfg.reward_weights is not None and len(cfg.reward_weights) != len(functions):
            raise ValueError(f"reward_weights {cfg.reward_weights}: {len(cfg.reward_weights)} weights for "
                             f"{len(functions)} reward functions ({', '.join(functions)}); give one per function")
        if cfg.max_new_tokens >= cfg.seq_len:
            raise ValueError(f"max_new_tokens={cfg.max_new_tokens} leaves no room for a prompt in seq_len="
                             f"{cfg.seq_len}; raise seq_len or lower max_new_tokens")


def rl_reference(cfg: TrainConfig) -> str | None:
    """``"bfloat16"`` when the run holds a frozen BF16 reference (the planner counts it): DPO with
    ``dpo_reference: bfloat16``, GRPO with ``kl_coef > 0``; else None."""
    if cfg.task == "grpo" and cfg.kl_coef > 0 or cfg.task == "dpo" and cfg.dpo_reference == "bfloat16":
        return "bfloat16"
    return None


def resolve_device(cfg: TrainConfig, *, planning: bool = False) -> tuple[TrainConfig, str]:
    """``cfg`` with ``device: auto`` made ``cuda`` where torch sees a CUDA device and ``cpu``
    otherwise, and the line that says which device the run uses and why (``megatrain train``'s
    first line). Imports torch; no CUDA context is created (``torch.cuda.device_count`` asks the
    driver only). ``planning``: the settings are planned here, not run (``megatrain plan
    --config``), so ``device: cuda`` is planned for the GPU of the run's hardware on any machine.

    Raises:
        ConfigError: ``device: cuda`` where torch sees no CUDA device (a CPU build of torch, or no
            driver or GPU) and not ``planning``; the message says which and what to change.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    seen = f"torch {torch.__version__} sees {gpus} CUDA GPU{'s' if gpus != 1 else ''}"
    if not gpus:
        seen = (f"torch {torch.__version__} is a build without CUDA" if torch.version.cuda is None
                else f"torch {torch.__version__} sees no CUDA GPU")
    if cfg.device == "auto":
        device = "cuda" if gpus else "cpu"
        return cfg.model_copy(update={"device": device}), f"device: {device} (auto: {seen})"
    if cfg.device == "cuda" and not gpus and planning:
        return cfg, f"device: cuda, as set (planned here, where {seen})"
    if cfg.device == "cuda" and not gpus:
        raise ConfigError(f"device: cuda, but {seen}; install a CUDA build of torch on a machine with an NVIDIA GPU, or "
                          "train on the CPU (--device cpu, or auto)")
    if cfg.device == "cpu" and gpus:
        return cfg, (f"device: cpu, as set (device: cpu); {seen}, which this run leaves idle: --device auto or "
                     "--device cuda trains on it")
    return cfg, f"device: {cfg.device}, as set ({seen})"


def load_train_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None, *,
                      saved_run: bool = False) -> TrainConfig:
    """The config from a YAML (``.yaml``/``.yml``) or JSON (``.json``) file with ``overrides`` on top.

    Args:
        path: the config file, a mapping of TrainConfig fields; None for flags only. Relative
            paths in it (``model``, ``data``, ``tokenizer``, ``hardware``, ``output_dir``) are relative
            to the file's directory; a ``model`` or ``hardware`` naming no file there stays as it is
            (a preset name).
        overrides: field values that replace the file's (the CLI's flags); the string ``"none"`` or
            ``"null"`` sets an optional field to None.
        saved_run: when ``output_dir`` holds a run's ``train_config.json``, its settings are the
            defaults under the file and the flags (``megatrain train`` sets this, so a resume needs
            only ``--model`` and ``--output-dir``).

    Raises:
        ConfigError: the file is missing, not YAML/JSON, not a mapping, or a field is unknown,
            missing or out of range (the message names the field and the file).
    """
    values: dict[str, Any] = {}
    where = "flags"
    if path is not None:
        p = Path(path)
        where = f"{p} and flags"
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        text = p.read_text()
        suffix = p.suffix.lower()
        try:
            if suffix in (".yaml", ".yml"):
                import yaml

                loaded = yaml.safe_load(text)
            elif suffix == ".json":
                loaded = json.loads(text)
            else:
                raise ConfigError(f"config file {p}: suffix {p.suffix!r} is neither .yaml, .yml nor .json")
        except (ValueError, ImportError) as e:  # json.JSONDecodeError is a ValueError
            raise ConfigError(f"config file {p} is not valid {suffix[1:].upper()}: {e}") from None
        except Exception as e:  # yaml.YAMLError, imported lazily
            if type(e).__module__.startswith("yaml"):
                raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
            raise
        if loaded is None:
            loaded = {}
        bounds.check_expanded_size(loaded, f"config file {p}")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping of fields, not a {type(loaded).__name__}")
        values.update(_relative_to(p.parent, loaded))
    optional = {name for name, f in TrainConfig.model_fields.items() if _allows_none(f.annotation)}
    for k, v in (overrides or {}).items():
        if k in optional and isinstance(v, str) and v.strip().lower() in ("none", "null"):
            v = None
        values[k] = v
    if saved_run and isinstance(values.get("output_dir"), str):
        saved = Path(values["output_dir"]) / CONFIG_FILE
        if saved.is_file():  # the run in output_dir: its settings are the defaults
            try:
                run = json.loads(saved.read_bytes().decode("utf-8"))
            except ValueError as e:
                raise ConfigError(f"{saved} is not valid JSON ({e}); delete it or choose another output_dir") from None
            if isinstance(run, dict):
                values = {**{k: v for k, v in run.items() if k in TrainConfig.model_fields}, **values}
                where += f" on top of {saved}"
    try:
        return TrainConfig.model_validate(values)
    except pydantic.ValidationError as e:
        raise ConfigError(f"invalid train config ({where}): {describe_validation(e, missing_hint=_flag_hint)}") from None


_PATH_FIELDS = ("model", "init_from", "data", "val_data", "tokenizer", "hardware", "output_dir", "data_cache",
                "chat_template")


def _relative_to(base: Path, loaded: dict) -> dict:
    out = dict(loaded)
    for k in _PATH_FIELDS:
        v = out.get(k)
        if k in ("data", "val_data") and isinstance(v, str) and v and not (base / v).exists():
            out[k] = _relative_data(base, v)
        elif isinstance(v, str) and v and not Path(v).is_absolute():
            p = base / v
            if k in ("init_from", "data", "val_data", "tokenizer", "output_dir", "data_cache", "chat_template") \
                    or p.exists():
                out[k] = str(p)
    return out


def _relative_data(base: Path, v: str) -> str:
    """An SFT data list (``a.json:2,b.jsonl``) or ``NAMES@DIR`` with its paths relative to ``base``."""
    names, at, directory = v.rpartition("@")
    if at:
        return f"{names}@{directory if Path(directory).is_absolute() else base / directory}"
    return ",".join(item if Path(item).is_absolute() else str(base / item) for item in v.split(","))


def _flag_hint(field: str) -> str:
    return f": give --{field.replace('_', '-')} or '{field}:' in the config file"


def _numeric(annotation) -> bool:
    """Whether a field's annotation takes an int or a float (``int``, ``float | None``), not a bool."""
    import typing

    args = typing.get_args(annotation) or (annotation,)
    return bool not in args and any(a in (int, float) for a in args)


def _allows_none(annotation) -> bool:
    return type(None) in getattr(annotation, "__args__", ())
