"""``megatrain train --task dpo`` and ``--task grpo``: preference and RL training as a run.

The stages are ``megatrain train``'s (device, model, plan once with its host-memory preflight,
materialize, weights), then a loop of its own:

- **dpo**: the pairs of ``data`` (:mod:`megatrain.data.preference`: TRL's prompt/chosen/rejected,
  plain or conversational, and LLaMA-Factory's ranking data), each side tokenised as SFT tokenises
  an answer (the chat template through ``apply_chat_template``; targets only on the last assistant
  turn), right-padded to ``seq_len``; the reference's log-probabilities precomputed over every pair
  before the first step (``dpo_reference: precompute``) or a frozen BF16 copy of the initial weights
  (``bfloat16``); each step trains on :class:`megatrain.rl.DPOLoss` on ``global_batch / 2`` pairs.
- **grpo**: the prompts of ``data`` (a ``prompt`` column, a string or a message list, and any other
  columns, which the reward reads); each step samples ``group_size`` responses to each of
  ``global_batch / group_size`` prompts with ``transformers``' ``generate`` on the current weights,
  scores them with ``reward`` (``module:function``, :mod:`megatrain.rl.rewards`), normalises the
  rewards per group (:func:`megatrain.rl.group_advantages`) and trains on
  :class:`megatrain.rl.GRPOLoss` (``grpo_updates`` steps per batch of rollouts).

Per-step metrics go to ``metrics.jsonl`` (:data:`DPO_FIELDS`, :data:`GRPO_FIELDS` beside the usual
loss, lr, grad_norm, tokens and timing) and ``loss.png`` (the loss, and the reward or the DPO reward
accuracy and margin). Bad input stops the run with one error and no update: a record without a
chosen or rejected response or with an empty one (before anything is built), a reward function
that raises or returns a NaN (before that step's update), ``group_size`` 1 (config validation).

Rollouts on the CPU backend generate with ``trainer.model``, whose parameters are the host tiles
(no copy). On CUDA a BF16 copy of the model on the GPU takes the weights after every step
(:func:`megatrain.rl.rollout_weights`) and generates while the trainer's GPU slots are released
(:func:`megatrain.rl.gpu_released`); the model must fit the GPU in BF16 with its KV cache, and a
larger one needs an external engine (vLLM, SGLang) fed by ``rollout_weights`` (the Python API).

A run resumes as ``megatrain train``'s other tasks do (the same command on the same ``output_dir``;
SIGINT and SIGTERM finish the update under way and save a checkpoint first): each checkpoint holds
the seeded order, the reference and a pending batch of rollouts beside the trainer's state
(:class:`RlRun`), so the resumed run takes the uninterrupted run's steps; :data:`RESUME_SETTINGS`
must be the checkpoint's.

``val_data`` is evaluated every ``eval_interval`` steps and at the end (:meth:`RlRun.evaluate`:
DPO's loss and rewards on its pairs, GRPO's mean reward on its prompts), into that step's row.

A step that is not applied (a non-finite loss or gradient) stops the run, or with ``nonfinite:
skip`` is counted and skipped where it changed nothing (:meth:`RlRun.not_kept`).

Not here yet: data parallel under torchrun; the rollback to the checkpoint of a step that changed
weights; ``loss_spike``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from megatrain.errors import BatchError, ConfigError, MegatrainError
from megatrain.train.config import rl_reference

if TYPE_CHECKING:
    import torch

    from megatrain.train.config import TrainConfig

DPO_FIELDS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin")
"""DPO's per-step metrics, as TRL's ``DPOTrainer`` logs them (``rewards/chosen``, ...), over the
step's pairs before its update: ``rewards_chosen`` the mean of ``beta (pi_c - ref_c)``,
``rewards_rejected`` of ``beta (pi_r - ref_r)``, ``rewards_accuracy`` the fraction of pairs whose
chosen reward exceeds the rejected one, ``rewards_margin`` the mean difference (``pi``, ``ref``: a
response's summed log-probabilities, per-token means for IPO, as TRL)."""

GRPO_FIELDS = ("reward_mean", "reward_std", "kl", "clip_fraction", "response_length", "rollout_s")
"""GRPO's per-step metrics, as TRL's ``GRPOTrainer`` logs them: ``reward_mean`` / ``reward_std`` of
the step's responses (std Bessel-corrected, over all of them), ``kl`` the mean over response tokens
of the k3 estimate to the reference before the update (null without a reference), ``clip_fraction``
the fraction of response tokens whose ratio to the rollout policy is clipped where it matters
(``r < 1 - clip_low`` with a negative advantage, or ``r > 1 + clip_high`` with a positive one: TRL's
``clip_ratio/region_mean``; 0 on a batch's first update, where ``r = 1``), ``response_length`` the
mean tokens generated per response (the end-of-text token counted), ``rollout_s`` the seconds the
rollouts and rewards took."""


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Pairs:
    """Tokenised preference pairs: ``input_ids`` and ``labels`` ``[2 * pairs, seq_len]`` int64, rows
    ``2k`` chosen and ``2k + 1`` rejected (:class:`megatrain.rl.DPOLoss`'s layout), right-padded with
    the end-of-text token (label -100); ``trimmed`` / ``dropped``: pairs whose context was cut / that
    did not fit ``seq_len``."""

    input_ids: "torch.Tensor"
    labels: "torch.Tensor"
    trimmed: int
    dropped: int

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    def batch(self, pairs: "torch.Tensor") -> dict[str, "torch.Tensor"]:
        """The rows of the pairs ``pairs`` (indices), each pair's two rows together."""
        import torch

        rows = torch.stack((2 * pairs, 2 * pairs + 1), 1).flatten()
        return {"input_ids": self.input_ids[rows], "labels": self.labels[rows]}


def _row(ids, targets, seq_len: int, pad: int):
    import torch

    row = torch.full((seq_len,), pad, dtype=torch.long)
    labels = torch.full((seq_len,), -100, dtype=torch.long)
    row[:len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    t = torch.as_tensor(targets, dtype=torch.bool)
    labels[:len(ids)][t] = row[:len(ids)][t]
    return row, labels


def _run_tokenizer(cfg: "TrainConfig", source, texts: Callable[[], list[str]]):
    """The run's tokenizer (``tokenizer``, the model directory's, or a BPE trained on ``texts()``),
    its end-of-text token, the chat template and the ChatTokenizer of the last assistant turn."""
    from megatrain import data as D
    from megatrain.train.corpus import bos_token, check_vocab, run_chat_template, run_eot_token, run_tokenizer

    tokenizer, origin = run_tokenizer(cfg, source, texts)
    check_vocab(tokenizer, origin, source.config.vocab_size)
    eot = run_eot_token(cfg, tokenizer, origin)
    template, template_origin = run_chat_template(cfg, source)
    chat = D.ChatTokenizer(tokenizer, template, eos_token=eot, bos_token=bos_token(tokenizer, eot), loss="last")
    return tokenizer, origin, eot, chat, template, template_origin or "megatrain default"


def _example_text(example) -> str:
    from megatrain.data.sft_formats import Chat

    if isinstance(example, Chat):
        return "\n".join(str(m.get("content") or "") for m in example.messages)
    return example.prompt + example.completion


def _read_pairs(data: str, what: str):
    """``(sources, [(chosen, rejected, where), ...])`` of the preference data ``data``.

    Raises:
        ConfigError: unreadable data or a record that is no preference pair (``what``: the setting).
    """
    from megatrain.data.preference import iter_pairs, resolve_preference_data

    try:
        sources = resolve_preference_data(data)
        return sources, [(c, r, where) for s in sources for c, r, where in iter_pairs(s)]
    except (OSError, ValueError, ImportError) as e:
        raise ConfigError(f"{what}: {e}") from None


def _encode_pairs(cfg: "TrainConfig", raw, chat, pad: int, what: str) -> Pairs:
    """The pairs of ``raw`` tokenised by ``chat`` into rows of ``seq_len`` (:class:`Pairs`).

    Raises:
        ConfigError: a record that is no preference pair (``what``: the setting, and the record).
    """
    import torch

    from megatrain.data.sft_formats import RecordError

    ids, labels = [], []
    trimmed = dropped = 0
    for c, r, where in raw:
        try:
            (ec, tc), (er, tr) = chat.fit(c, cfg.seq_len, cfg.sft_truncation), chat.fit(r, cfg.seq_len,
                                                                                       cfg.sft_truncation)
        except RecordError as e:
            raise ConfigError(f"{what}: {where()}: {e}") from None
        if ec is None or er is None:
            dropped += 1
            continue
        trimmed += bool(tc or tr)
        for enc in (ec, er):
            row, lab = _row(enc.ids, enc.targets, cfg.seq_len, pad)
            ids.append(row)
            labels.append(lab)
    return Pairs(torch.stack(ids) if ids else torch.empty(0, cfg.seq_len, dtype=torch.long),
                 torch.stack(labels) if labels else torch.empty(0, cfg.seq_len, dtype=torch.long), trimmed, dropped)


def prepare_pairs(cfg: "TrainConfig", source, echo: Callable[[str], None]):
    """``(tokenizer, eot, Pairs, chat template, validation Pairs)`` of ``cfg.data`` and
    ``cfg.val_data`` (None without) for ``task: dpo``; the tokenizer (when trained) is trained on
    ``data`` alone.

    Raises:
        ConfigError: no data; unreadable data or a record that is no preference pair (naming the
            setting, file and record: a missing or empty chosen or rejected response); fewer pairs
            that fit ``seq_len`` than one step takes; ``val_data`` with no pair that fits.
    """
    if cfg.data is None:
        raise ConfigError("task dpo needs data (--data): TRL prompt/chosen/rejected records, or a directory whose "
                          "dataset_info.json has LLaMA-Factory ranking entries")
    t0 = time.perf_counter()
    sources, raw = _read_pairs(cfg.data, "data")
    val_raw = _read_pairs(cfg.val_data, "val_data")[1] if cfg.val_data is not None else None
    tokenizer, origin, eot, chat, template, template_origin = _run_tokenizer(
        cfg, source, lambda: [_example_text(e) for c, r, _ in raw for e in (c, r)])
    pad = tokenizer.token_to_id(eot)
    pairs = _encode_pairs(cfg, raw, chat, pad, "data")
    if pairs.num_pairs < cfg.global_batch // 2:
        raise ConfigError(f"data: {pairs.num_pairs} preference pairs fit seq_len={cfg.seq_len} ({pairs.dropped} "
                          f"dropped), fewer than one step's {cfg.global_batch // 2} (global_batch {cfg.global_batch} "
                          "rows, 2 a pair); lower global_batch or raise seq_len")
    val = None
    if val_raw is not None:
        val = _encode_pairs(cfg, val_raw, chat, pad, "val_data")
        if not val.num_pairs:
            raise ConfigError(f"val_data {cfg.val_data!r}: none of its {len(val_raw)} preference pairs fits "
                              f"seq_len={cfg.seq_len}; raise seq_len or give other val_data")
    held = "" if val is None else (f"; validation: {val.num_pairs:,} pairs of {cfg.val_data} ({val.dropped:,} "
                                   "dropped)")
    echo(f"data: {len(raw):,} preference pairs from {', '.join(s.name for s in sources)}; {pairs.trimmed:,} trimmed "
         f"to seq_len (oldest context cut, responses kept), {pairs.dropped:,} dropped; {pairs.num_pairs:,} pairs in "
         f"{2 * pairs.num_pairs:,} rows of {cfg.seq_len}{held}; chat template: {template_origin}, {chat.describe()}; "
         f"tokenizer: {origin}, vocab {tokenizer.get_vocab_size():,}, end-of-text {eot!r} "
         f"({time.perf_counter() - t0:.1f} s)")
    return tokenizer, eot, pairs, template, val


@dataclass(frozen=True, slots=True)
class Prompts:
    """The prompts of a GRPO run: ``ids`` (each prompt's tokens, a list of ints), ``prompts`` (as
    given: a string or a message list, what the reward function gets), ``columns`` (the prompt set's
    other columns, a list per column); ``dropped``: prompts longer than ``seq_len - max_new_tokens``."""

    ids: list[list[int]]
    prompts: list[Any]
    columns: dict[str, list[Any]]
    dropped: int


def encode_prompt(chat, prompt) -> list[int]:
    """A prompt's token ids: a string as it is (no special tokens, as an SFT completion's prompt);
    a message list rendered by the chat template with the generation prompt (``apply_chat_template``)."""
    if isinstance(prompt, str):
        return chat.hf(prompt, add_special_tokens=False)["input_ids"]
    text = chat.hf.apply_chat_template(list(prompt), chat_template=chat.template, tokenize=False,
                                       add_generation_prompt=True)
    return chat.hf(text, add_special_tokens=False)["input_ids"]


def _read_prompts(data: str, what: str) -> list[dict]:
    """The records of ``data``, each with a non-empty ``prompt`` (a string, or a message list;
    one given as a JSON string is parsed).

    Raises:
        ConfigError: unreadable data, a record without a prompt (naming it), or none at all
            (``what``: the setting).
    """
    import json

    from megatrain.data.sft_sources import iter_rows, record_where, resolve_sft_data

    records = []
    try:
        for s in resolve_sft_data(data):
            for path, i, row in iter_rows(s):
                prompt = row.get("prompt")
                if isinstance(prompt, str) and prompt[:1] == "[":
                    prompt = json.loads(prompt)
                if not (isinstance(prompt, str) and prompt or isinstance(prompt, list) and prompt):
                    raise ConfigError(f"{what}: {record_where(path, i)}: field 'prompt' must be a non-empty string or "
                                      f"a list of messages (TRL's prompt-only format), got {prompt!r}")
                records.append(row)
    except (OSError, ValueError, ImportError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{what}: {e}") from None
    if not records:
        raise ConfigError(f"{what} {data!r} holds no prompts")
    return records


def _encode_prompts(cfg: "TrainConfig", records: list[dict], chat) -> Prompts:
    """The prompts of ``records`` that leave room for ``max_new_tokens`` in ``seq_len``, tokenised."""
    room = cfg.seq_len - cfg.max_new_tokens
    keep = []
    for r in records:
        ids = encode_prompt(chat, r["prompt"])
        if 0 < len(ids) <= room:
            keep.append((ids, r))
    names = [k for k in records[0] if k != "prompt"]
    return Prompts([ids for ids, _ in keep], [r["prompt"] for _, r in keep],
                   {k: [r.get(k) for _, r in keep] for k in names}, len(records) - len(keep))


def prepare_prompts(cfg: "TrainConfig", source, echo: Callable[[str], None]):
    """``(tokenizer, eot, Prompts, chat template, validation Prompts)`` of ``cfg.data`` and
    ``cfg.val_data`` (None without) for ``task: grpo``: records with a ``prompt`` field (a string,
    or a list of messages), read through ``datasets``; the tokenizer (when trained) is trained on
    ``data`` alone.

    Raises:
        ConfigError: no data; unreadable data; a record without a prompt (naming the setting and
            record); no prompt that leaves room for ``max_new_tokens`` in ``seq_len``, or fewer
            prompts than one step takes; ``val_data`` with no prompt that fits.
    """
    import json

    if cfg.data is None:
        raise ConfigError("task grpo needs data (--data): records with a 'prompt' field (e.g. "
                          "examples/data/rl/arithmetic.jsonl)")
    t0 = time.perf_counter()
    records = _read_prompts(cfg.data, "data")
    val_records = _read_prompts(cfg.val_data, "val_data") if cfg.val_data is not None else None
    tokenizer, origin, eot, chat, template, template_origin = _run_tokenizer(
        cfg, source, lambda: [json.dumps(r, default=str) for r in records])
    room = cfg.seq_len - cfg.max_new_tokens
    prompts = _encode_prompts(cfg, records, chat)
    per_step = cfg.global_batch // cfg.group_size
    if len(prompts.ids) < per_step:
        raise ConfigError(f"data: {len(prompts.ids)} prompts fit seq_len={cfg.seq_len} - max_new_tokens="
                          f"{cfg.max_new_tokens} tokens ({prompts.dropped} longer), fewer than one step's {per_step}; "
                          "raise seq_len or lower global_batch")
    val = None
    if val_records is not None:
        val = _encode_prompts(cfg, val_records, chat)
        if not val.ids:
            raise ConfigError(f"val_data {cfg.val_data!r}: none of its {len(val_records)} prompts fits seq_len="
                              f"{cfg.seq_len} - max_new_tokens={cfg.max_new_tokens} tokens; raise seq_len or give "
                              "other val_data")
    held = "" if val is None else f"; validation: {len(val.ids):,} prompts of {cfg.val_data} ({val.dropped:,} longer)"
    echo(f"data: {len(records):,} prompts, {prompts.dropped:,} left out (longer than seq_len - max_new_tokens = {room} "
         f"tokens){held}; columns for the reward: {list(prompts.columns) or 'none'}; chat template (message prompts): "
         f"{template_origin}; tokenizer: {origin}, vocab {tokenizer.get_vocab_size():,}, end-of-text {eot!r} "
         f"({time.perf_counter() - t0:.1f} s)")
    return tokenizer, eot, prompts, template, val


# ---------------------------------------------------------------------------------------------
# Metrics of the losses (TRL's definitions)
# ---------------------------------------------------------------------------------------------

def dpo_metrics(loss, logprobs: "torch.Tensor", mask: "torch.Tensor", ref: "torch.Tensor") -> dict[str, float]:
    """:data:`DPO_FIELDS` of one batch (pairs in consecutive rows) from the policy's and the
    reference's per-token log-probabilities (``[rows, seq_len]`` FP32) and ``mask`` (``[rows,
    seq_len]`` bool), with ``loss`` (a :class:`megatrain.rl.DPOLoss`) giving beta and whether a
    response's log-probability is its sum (sigmoid) or per-token mean (ipo), as TRL's ``DPOTrainer``."""
    import torch

    def per_row(lp):
        s = torch.where(mask, lp, torch.zeros_like(lp)).sum(1)
        return s / mask.sum(1) if loss.loss_type == "ipo" else s

    rewards = loss.beta * (per_row(logprobs) - per_row(ref))
    chosen, rejected = rewards[0::2], rewards[1::2]
    return {"rewards_chosen": float(chosen.mean()), "rewards_rejected": float(rejected.mean()),
            "rewards_accuracy": float((chosen > rejected).float().mean()),
            "rewards_margin": float((chosen - rejected).mean())}


def grpo_metrics(loss, logprobs: "torch.Tensor", mask: "torch.Tensor", tensors) -> dict[str, float | None]:
    """``kl`` and ``clip_fraction`` (:data:`GRPO_FIELDS`) of the policy's log-probabilities
    ``logprobs`` (``[rows, seq_len]``) against ``tensors["ref_logprobs"]`` (if any) and
    ``tensors["old_logprobs"]`` (the rollout policy's), over the response tokens ``mask``, with
    ``loss`` (a :class:`megatrain.rl.GRPOLoss`) giving the clip range (TRL's ``GRPOTrainer``)."""
    import torch

    n = mask.sum()
    kl = None
    if "ref_logprobs" in tensors:
        d = tensors["ref_logprobs"] - logprobs
        kl = float(torch.where(mask, torch.exp(d) - d - 1, torch.zeros_like(d)).sum() / n)
    ratio = torch.exp(logprobs - tensors["old_logprobs"])
    adv = tensors["advantages"]
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    clipped = ((ratio < 1 - loss.clip_low) & (adv < 0)) | ((ratio > 1 + loss.clip_high) & (adv > 0))
    return {"kl": kl, "clip_fraction": float((clipped & mask).sum() / n)}


# ---------------------------------------------------------------------------------------------
# Rollouts
# ---------------------------------------------------------------------------------------------

class Rollout:
    """Responses to prompts from ``transformers``' ``generate`` on the trainer's current weights.

    CPU backend: ``trainer.model`` itself, whose parameters are the host tiles (after
    ``trainer.flush()``). CUDA: a BF16 copy of the model on the GPU, given the weights before every
    rollout (:func:`megatrain.rl.rollout_weights`), generating while the trainer's slots are released.

    Raises (constructor):
        ConfigError: on CUDA, the model does not fit the free GPU memory in BF16 with room for its
            KV cache (use an external engine fed by ``rollout_weights``); on the CPU, weights that are
            not all in host memory.
    """

    def __init__(self, trainer, eot_id: int, *, max_new_tokens: int, temperature: float):
        import torch

        self.trainer, self.eot_id = trainer, eot_id
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.engine = None
        on_host = all(p.device.type == "cpu" for p in trainer.model.parameters())
        if trainer.backend.device.type != "cuda" and not on_host:
            raise ConfigError("rollouts on the CPU backend generate with the model whose parameters are the host "
                              "tiles, but some of this plan's weights live elsewhere (masters on NVMe); drop nvme_dir "
                              "for task grpo")
        if trainer.backend.device.type == "cuda":
            from transformers import AutoModelForCausalLM

            from megatrain.rl import release_gpu, retake_gpu

            config = trainer.model.config
            need = 2 * sum(layer.numel for layer in trainer.graph.layers)
            release_gpu(trainer)
            free = torch.cuda.mem_get_info()[0]
            if need * 1.25 > free:
                retake_gpu(trainer)
                raise ConfigError(f"rollouts: the model's BF16 weights ({need / 2**30:.2f} GiB, plus its KV cache) do "
                                  f"not fit the GPU's {free / 2**30:.2f} GiB free beside the trainer: megatrain "
                                  "train --task grpo generates on this GPU only for models that fit it in BF16; use an "
                                  "external engine (vLLM, SGLang) fed by megatrain.rl.rollout_weights")
            self.engine = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, trust_remote_code=False).to("cuda").eval()
            retake_gpu(trainer)

    def generate(self, prompt_ids: Sequence[Sequence[int]], seed: int) -> list[list[int]]:
        """One sampled response per prompt (top-k and top-p off, ``temperature``), each its tokens up
        to and including the first end-of-text token (or ``max_new_tokens`` tokens)."""
        import torch

        from megatrain.rl import gpu_released, rollout_weights

        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.eot_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):  # left padding: every response starts at column `width`
            ids[i, width - len(p):] = torch.as_tensor(p)
            attn[i, width - len(p):] = 1
        kw = dict(max_new_tokens=self.max_new_tokens, do_sample=True, temperature=self.temperature, top_k=0,
                  top_p=1.0, eos_token_id=self.eot_id, pad_token_id=self.eot_id)
        torch.manual_seed(seed)
        if self.engine is None:
            self.trainer.flush()  # the parameters are the host tiles: the last deferred update applied
            model = self.trainer.model
            training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    out = model.generate(ids, attention_mask=attn, **kw)
            finally:
                model.train(training)
        else:
            for bucket in rollout_weights(self.trainer, 256 << 20, device="cuda"):
                self.engine.load_state_dict(dict(bucket), strict=False)
            with gpu_released(self.trainer), torch.no_grad():
                out = self.engine.generate(ids.cuda(), attention_mask=attn.cuda(), **kw).cpu()
        responses = []
        for row in out[:, width:].tolist():
            n = row.index(self.eot_id) + 1 if self.eot_id in row else len(row)
            responses.append(row[:n])
        return responses


def score_rollouts(rollout: Rollout, tokenizer, prompts: Prompts, chosen: Sequence[int], *, group_size: int,
                   reward: Callable, reward_name: str, seed: int):
    """``group_size`` responses to each prompt of ``chosen`` (indices of ``prompts``), sampled with
    ``seed`` and scored. Returns ``(rows, responses, rewards)``: each response's prompt index, its
    tokens (up to and including the end-of-text token), and ``rewards`` ``[rows]`` FP32.

    Raises:
        BatchError: as :func:`megatrain.rl.rewards.score`.
    """
    from megatrain.rl.rewards import score

    rows = [i for i in chosen for _ in range(group_size)]
    responses = rollout.generate([prompts.ids[i] for i in rows], seed)
    eot = rollout.eot_id
    texts = [tokenizer.decode([t for t in r if t != eot]) for r in responses]
    columns = {k: [v[i] for i in rows] for k, v in prompts.columns.items()}
    return rows, responses, score(reward, [prompts.prompts[i] for i in rows], texts, columns, name=reward_name)


def grpo_batch(rollout: Rollout, tokenizer, prompts: Prompts, chosen: Sequence[int], *, group_size: int,
               seq_len: int, reward: Callable, reward_name: str, seed: int):
    """One batch of rollouts: ``group_size`` responses to each prompt of ``chosen`` (indices of
    ``prompts``), scored and normalised per group. Returns ``(batch, rewards, response lengths)``:
    ``batch`` holds ``input_ids`` and ``labels`` ``[rows, seq_len]`` (prompt, then the response, the
    only supervised tokens, right-padded with the end-of-text token) and ``advantages`` ``[rows]``
    FP32; ``rewards`` ``[rows]`` FP32.

    Raises:
        BatchError: the reward function raised, returned another number of values or a value that
            is not finite (:func:`megatrain.rl.rewards.score`); before anything is updated.
    """
    import torch

    from megatrain.rl import group_advantages

    rows, responses, rewards = score_rollouts(rollout, tokenizer, prompts, chosen, group_size=group_size,
                                              reward=reward, reward_name=reward_name, seed=seed)
    advantages = group_advantages(rewards, group_size)
    ids, labels = [], []
    for i, r in zip(rows, responses):
        p = prompts.ids[i]
        row, lab = _row(p + r, [False] * len(p) + [True] * len(r), seq_len, rollout.eot_id)
        ids.append(row)
        labels.append(lab)
    batch = {"input_ids": torch.stack(ids), "labels": torch.stack(labels), "advantages": advantages}
    return batch, rewards, [len(r) for r in responses]


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def save_rl_plot(rows: list[dict], path, *, title: str, task: str) -> None:
    """``loss.png`` of an RL run: the loss per step, and beside it GRPO's mean reward or DPO's
    reward accuracy and margin; the validation's (``val_data``) as points where evaluated.

    Raises:
        ImportError: matplotlib is not installed (the ``plot`` extra).
    """
    from megatrain.train.metrics import new_figure, save_png

    fig = new_figure((10, 4.5))
    a, b = fig.subplots(1, 2)
    steps = [r["step"] for r in rows]
    nan = float("nan")  # a step not applied has no loss
    a.plot(steps, [nan if r["loss"] is None else r["loss"] for r in rows], linewidth=1, label=f"{task} loss")
    a.set_xlabel("step")
    a.set_ylabel("loss")
    series = ("reward_mean",) if task == "grpo" else ("rewards_accuracy", "rewards_margin")
    for name in series:
        b.plot(steps, [nan if r.get(name) is None else r[name] for r in rows], linewidth=1, label=name)
    # The evaluations (val_data), as points at their steps.
    for ax, name in ((a, "val_loss"), (b, "val_reward_mean"), (b, "val_rewards_accuracy")):
        at = [(r["step"], r[name]) for r in rows if r.get(name) is not None]
        if at:
            ax.plot(*zip(*at), marker="o", linewidth=1, label=name)
    b.set_xlabel("step")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize="medium")
    save_png(fig, path)


def train_rl(cfg: "TrainConfig", *, echo: Callable[[str], None], device: str, given: "TrainConfig"):
    """Run ``cfg`` (``task`` dpo or grpo, device resolved) to ``max_steps``, or until SIGINT or
    SIGTERM (the update under way finishes, a checkpoint is saved, and the same command resumes
    from it); module docstring. An ``output_dir`` holding this run continues it from its
    checkpoint (as ``megatrain train``'s other tasks: :func:`megatrain.train.rundir.check_output_dir`).
    Returns a :class:`megatrain.train.loop.TrainResult`.

    Raises:
        ConfigError: as ``megatrain train``, and: data parallel (WORLD_SIZE > 1), a checkpoint to
            resume that is not of this task or was trained with another ``group_size``,
            ``grpo_updates`` or reference (:data:`RESUME_SETTINGS`), bad preference or prompt data,
            a reward that cannot be imported.
        BatchError: the reward function raised or returned a non-finite value (naming the step;
            that step's update is not made).
        MegatrainError: a step whose loss or gradient was not finite (not applied; the run stops).
    """
    import os

    from megatrain.files import DirectoryLock
    from megatrain.rl.rewards import load_rewards
    from megatrain.train.loop import _finished
    from megatrain.train.rundir import LOCK_FILE, check_output_dir, saved_train_state
    from megatrain.train.stages import held_locks, model_source, nvme_dir_lock, set_threads

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(f"task {cfg.task} runs on one process; data parallel (torchrun) is not there yet for it")
    echo(device)
    set_threads(cfg, echo, load=False)
    out = Path(cfg.output_dir)
    reward = load_rewards(cfg.reward, cfg.reward_weights) if cfg.task == "grpo" else None
    source = model_source(cfg, out)
    lock = DirectoryLock(out / LOCK_FILE, f"output_dir {out}")
    with held_locks(lock, nvme_dir_lock(cfg)):
        resuming_here, source, finished = check_output_dir(out, source, cfg, echo, lock)
        if finished is not None:
            return _finished(cfg, out, finished, echo)
        if source.kind == "checkpoint":
            check_rl_resume(saved_train_state(source.directory), cfg, source.directory)
        out.mkdir(parents=True, exist_ok=True)
        if not lock.held:  # output_dir did not exist when the run began
            lock.acquire()
        run = RlRun(cfg, echo, given, source, reward, resuming_here)
        run.prepare()
        run.train_loop()
        return run.finish()


RESUME_SETTINGS = {"dpo": ("dpo_reference",), "grpo": ("group_size", "grpo_updates", "reference")}
"""What a resumed DPO or GRPO run must share with its checkpoint besides ``megatrain train``'s
(``seq_len``, ``global_batch``, ``seed``, the data): what fixes the order of the pairs or prompts,
the updates a batch of rollouts gets, and what the reference is (``reference``: GRPO has one where
``kl_coef > 0``). Other settings (``lr``, ``kl_coef``'s value, ``temperature``, ``reward``, ...)
apply from the resumed step on."""


def _rl_settings(cfg: "TrainConfig") -> dict[str, Any]:
    return {"task": cfg.task, "dpo_reference": cfg.dpo_reference, "group_size": cfg.group_size,
            "grpo_updates": cfg.grpo_updates, "reference": rl_reference(cfg)}


def check_rl_resume(state: dict | None, cfg: "TrainConfig", where: Path) -> None:
    """Refuse to resume ``where`` (its ``megatrain train`` state, :func:`saved_train_state`) as
    ``cfg``'s run: a checkpoint of no DPO/GRPO run, of the other task, or with other
    :data:`RESUME_SETTINGS`.

    Raises:
        ConfigError: naming the setting, both values and what to do instead.
    """
    rl = (state or {}).get("rl")
    new_run = (f"to start a new run from its weights instead, give --init-from {where} with another "
               "output_dir")
    if not isinstance(rl, dict):
        raise ConfigError(f"{where} is a checkpoint of a task lm or sft run (it holds no DPO/GRPO state), not of a "
                          f"{cfg.task} run; {new_run}")
    now = _rl_settings(cfg)
    if rl.get("task") != cfg.task:
        raise ConfigError(f"{where} is a checkpoint of a task {rl.get('task')} run, not {cfg.task}; {new_run}")
    why = {"group_size": "it fixes how many prompts a step takes", "grpo_updates": "it fixes the updates of a batch",
           "reference": "kl_coef > 0 keeps a BF16 reference, 0 none", "dpo_reference": "it fixes the reference"}
    for key in RESUME_SETTINGS[cfg.task]:
        if rl.get(key) != now[key]:
            raise ConfigError(f"{where} was trained with {key}={rl.get(key)!r} but this run has {key}={now[key]!r} "
                              f"({why[key]}); resuming needs the checkpoint's; {new_run}")


def data_fingerprint(data: "Pairs | Prompts", val: "Pairs | Prompts | None" = None) -> str:
    """sha256 of what a run trains and validates on, in order: the pairs' token and label rows, or
    the prompts' tokens, prompts and reward columns, of ``data`` then ``val`` (what a resume checks
    it was given again)."""
    import hashlib
    import json

    h = hashlib.sha256()
    for part in (data, val):
        if isinstance(part, Pairs):
            for t in (part.input_ids, part.labels):
                h.update(str(tuple(t.shape)).encode())
                h.update(t.contiguous().numpy().tobytes())
        elif part is not None:
            h.update(json.dumps([part.ids, part.prompts, part.columns], default=str, sort_keys=True).encode())
        h.update(b"|")
    return h.hexdigest()


PENDING_TENSORS = ("input_ids", "labels", "advantages", "old_logprobs", "ref_logprobs")
"""A GRPO batch of rollouts' tensors, saved with a checkpoint taken between its updates (as
``pending.<name>``) so that the resumed run makes the batch's remaining updates on the same
rollouts."""


class RlRun:
    """A DPO or GRPO run's stages once its ``output_dir`` and locks are held (:func:`train_rl`):
    :meth:`prepare` (the data, then ``megatrain train``'s plan and materialise stages, the run's
    files, the checkpoint, the loss and its reference or rollouts, or all of it resumed),
    :meth:`train_loop` (a batch of pairs or of rollouts, then its updates, each an :meth:`update`)
    and :meth:`finish` (the last checkpoint, the plot, the result). The checkpoint, the run's files
    and the plot are :mod:`megatrain.train.stages`', as the LM/SFT run's.

    A checkpoint (:meth:`save`) holds, beside the trainer's state, the seeded order's generator
    and the pairs or prompts still to take, the reference (the precomputed log-probabilities, or
    the BF16 copy of the initial weights) and, between the updates of a batch of rollouts, that
    batch (:data:`PENDING_TENSORS`): a resumed run makes the steps the uninterrupted one would have.
    """

    def __init__(self, cfg: "TrainConfig", echo: Callable[[str], None], given: "TrainConfig", source, reward,
                 resuming_here: bool = False):
        self.cfg, self.echo, self.given, self.source, self.reward = cfg, echo, given, source, reward
        self.resuming_here = resuming_here
        self.out = Path(cfg.output_dir)

    def prepare(self) -> None:
        """Everything before the first step. Raises as :func:`train_rl`."""
        import hashlib

        from megatrain.checkpoint import load_extra_tensors
        from megatrain.ir.plan import OptimizerPlacement
        from megatrain.ir.hardware import load_hardware
        from megatrain.runtime.measure import measure_matmul_flops
        from megatrain.train import loop
        from megatrain.train.corpus import match_special_tokens
        from megatrain.train.guard import Guard, decay_hint
        from megatrain.train.metrics import MetricsLog, run_rates
        from megatrain.train.rundir import CHECKPOINT_DIR, METRICS_FILE
        from megatrain.train.stages import Checkpoint, write_run_files

        cfg, source, echo = self.cfg, self.source, self.echo
        hw = load_hardware(cfg.hardware) if cfg.hardware else None
        # The data first (small: pairs and prompts are read into memory), so that a bad record is
        # reported before the model is built.
        prepare = prepare_pairs if cfg.task == "dpo" else prepare_prompts
        self.tokenizer, eot, self.data, template, self.val = prepare(cfg, source, echo)
        self.fingerprint = data_fingerprint(self.data, self.val)
        planned = loop._plan(cfg, source, hw, echo)
        cpu_peak = measure_matmul_flops("cpu") if cfg.device == "cpu" else None
        self.trainer, self.start, self.skipped, state = loop._materialize_and_load(cfg, planned, source,
                                                                                   self.fingerprint, echo)
        # megatrain train's verdict on each step (loss_spike is refused for these tasks: none here)
        self.guard = Guard(deferred=self.trainer.plan.optimizer is OptimizerPlacement.NEXT_FORWARD,
                           loss_spike=None, decay=decay_hint(cfg.lr, cfg.weight_decay))
        self.guard.restore(state, self.start)
        self.rates = run_rates(cfg, planned, hw, cpu_peak, echo)
        tokenizer_config = match_special_tokens(self.trainer.model, self.tokenizer, eot, cfg.seq_len, template)
        tokenizer_json = self.tokenizer.to_str()
        self.tokenizer_sha = hashlib.sha256(tokenizer_json.encode()).hexdigest()
        write_run_files(self.out, self.given, tokenizer_json)
        self.metrics = MetricsLog(self.out / METRICS_FILE)
        # Rows a crashed run wrote after its last checkpoint are run again: drop them.
        start, here = self.start, self.resuming_here
        self.metrics.keep(lambda r: here and r["step"] <= start)
        resumed = source.kind == "checkpoint"
        self.checkpoint = Checkpoint(self.trainer, self.out / CHECKPOINT_DIR, tokenizer_json, tokenizer_config,
                                     last_saved=start if here else None)
        saved = load_extra_tensors(source.directory) if resumed else {}
        self._prepare_loss(eot, saved, state.get("rl", {}) if resumed else {})

    def _prepare_loss(self, eot: str, saved: dict, rl: dict) -> None:
        """The loss, the rows a step takes, and DPO's reference (precomputed, or a frozen BF16 copy)
        or GRPO's rollouts; the seeded order of the pairs or prompts. ``saved`` / ``rl``: a resumed
        checkpoint's extra tensors and RL state (empty for a new run)."""
        import torch

        from megatrain.rl import DPOLoss, GRPOLoss, Reference, target_mask

        cfg, trainer, data, echo = self.cfg, self.trainer, self.data, self.echo
        if rl_reference(cfg):
            self.reference = Reference(trainer, weights=saved.get("reference_weights") if rl else None)
        else:
            self.reference = None
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.order = torch.empty(0, dtype=torch.long)
        if rl:
            self.generator.set_state(saved["order_generator"])
            self.order = saved["order"]
        self.ref_all = saved.get("reference_logprobs")
        self.ref_val = saved.get("reference_logprobs_val")
        self.pending = None  # (batch, target mask, its metrics, its first step, updates made)
        if cfg.task == "dpo":
            self.loss = DPOLoss(cfg.dpo_beta, cfg.dpo_loss_type, cfg.dpo_label_smoothing)
            self.per_step = cfg.global_batch // 2
            if self.reference is None and self.ref_all is None:  # a new run: the initial policy's, every pair's
                t0 = time.perf_counter()
                self.ref_all = precompute_pairs(trainer, data, self.per_step)
                if self.val is not None:
                    self.ref_val = precompute_pairs(trainer, self.val, self.per_step)
                n = data.num_pairs + (self.val.num_pairs if self.val is not None else 0)
                size = self.ref_all.numel() + (self.ref_val.numel() if self.ref_val is not None else 0)
                echo(f"reference: the initial model's log-probabilities of {n:,} pairs, precomputed "
                     f"({size * 4 / 2**20:,.1f} MiB, {time.perf_counter() - t0:.1f} s)")
            elif self.reference is None:
                echo(f"reference: the initial model's log-probabilities of {data.num_pairs:,} pairs, from the "
                     "checkpoint")
            else:
                echo(f"reference: a frozen BF16 copy of the initial weights ({self.reference.nbytes / 2**20:,.1f} MiB"
                     + (", from the checkpoint)" if rl else ")"))
        else:
            self.loss = GRPOLoss(cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.grpo_aggregation, cfg.max_new_tokens)
            self.per_step = cfg.global_batch // cfg.group_size
            self.rollout = Rollout(trainer, self.tokenizer.token_to_id(eot), max_new_tokens=cfg.max_new_tokens,
                                   temperature=cfg.temperature)
            echo(f"rollouts: {self.per_step} prompts x {cfg.group_size} responses a step, up to {cfg.max_new_tokens} "
                 "tokens each, transformers' generate on the current weights ("
                 + ("trainer.model, the host tiles" if self.rollout.engine is None else "a BF16 copy on the GPU")
                 + f"); reward {cfg.reward}; KL coefficient {cfg.kl_coef}")
            pending = rl.get("pending")
            if pending:
                batch = {k: saved[f"pending.{k}"] for k in PENDING_TENSORS if f"pending.{k}" in saved}
                self.pending = (batch, target_mask(batch["labels"]), pending["extra"], pending["first_step"],
                                pending["done"])
                echo(f"resume: the rollouts of step {pending['first_step'] + 1}, {pending['done']} of their updates "
                     "made, from the checkpoint")
        self.n_items = data.num_pairs if cfg.task == "dpo" else len(data.ids)

    def take(self, k: int) -> "torch.Tensor":
        """The next ``k`` pairs or prompts (indices) of the seeded order."""
        import torch

        if len(self.order) < k:  # a new epoch: a seeded permutation of every pair or prompt
            self.order = torch.cat([self.order, torch.randperm(self.n_items, generator=self.generator)])
        chosen, self.order = self.order[:k], self.order[k:]
        return chosen

    def updates(self, first_step: int) -> int:
        """The updates of the batch taken at step ``first_step + 1``: one of pairs; ``grpo_updates``
        of rollouts, never past ``max_steps``."""
        return 1 if self.cfg.task == "dpo" else min(self.cfg.grpo_updates, self.cfg.max_steps - first_step)

    def train_loop(self) -> None:
        """Step to ``max_steps``, or until SIGINT/SIGTERM (the update under way finishes, then a
        checkpoint is saved): each batch of pairs one update, each batch of rollouts up to
        ``grpo_updates``. Sets ``step`` and ``stopped`` (the signal's name, or None)."""
        from megatrain.train.loop import _StopOnSignal

        cfg = self.cfg
        self.step, self.stopped = self.start, None
        with _StopOnSignal() as stop:
            while self.step < cfg.max_steps and self.stopped is None:
                if self.pending is None:
                    first = self.step
                    self.pending = (*(self.dpo_batch() if cfg.task == "dpo" else self.grpo_batch()), first, 0)
                batch, mask, base, first, done = self.pending
                extra = base
                if cfg.task == "grpo":
                    current = batch["old_logprobs"] if done == 0 else self.trainer.logprobs(batch)
                    extra = {**base, **grpo_metrics(self.loss, current, mask, batch)}
                # What a checkpoint of this step keeps: the batch while updates of it remain.
                self.pending = (batch, mask, base, first, done + 1) if done + 1 < self.updates(first) else None
                self.update(batch, extra)
                self.stopped = stop.name
            if self.stopped is not None:
                if self.checkpoint.last_saved != self.step:
                    self.save(self.step)
                self.echo(f"{self.stopped}: stopped after step {self.step}; saved {self.checkpoint.path}. The same "
                          "command resumes from it")

    def dpo_batch(self):
        """``(batch, target mask, DPO_FIELDS)`` of the next pairs, with the reference's
        log-probabilities."""
        import torch

        from megatrain.rl import target_mask

        idx = self.take(self.per_step)
        batch = self.data.batch(idx)
        if self.ref_all is not None:
            batch["ref_logprobs"] = self.ref_all[torch.stack((2 * idx, 2 * idx + 1), 1).flatten()]
        else:
            batch["ref_logprobs"] = self.reference.logprobs(batch)
        mask = target_mask(batch["labels"])
        return batch, mask, dpo_metrics(self.loss, self.trainer.logprobs(batch), mask, batch["ref_logprobs"])

    def grpo_batch(self):
        """``(batch, target mask, the rollout's GRPO_FIELDS)`` of the next prompts' rollouts.

        Raises:
            BatchError: the reward function failed (naming the step; nothing of it applied).
        """
        from megatrain.rl import target_mask

        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        try:
            batch, rewards, lengths = grpo_batch(self.rollout, self.tokenizer, self.data,
                                                 self.take(self.per_step).tolist(), group_size=cfg.group_size,
                                                 seq_len=cfg.seq_len, reward=self.reward,
                                                 reward_name=f"reward {cfg.reward}", seed=cfg.seed * 1_000_003 + step)
        except BatchError as e:
            raise BatchError(f"step {step + 1}: {e}; nothing of step {step + 1} was applied") from e.__cause__
        if self.reference is not None:
            batch["ref_logprobs"] = self.reference.logprobs(batch)
        batch["old_logprobs"] = self.trainer.logprobs(batch)  # the rollout policy's (ratio 1 on the first update)
        mask = target_mask(batch["labels"])
        extra = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                 "response_length": sum(lengths) / len(lengths), "rollout_s": time.perf_counter() - t0,
                 **self.reward_means("reward")}
        return batch, mask, extra

    def reward_means(self, prefix: str) -> dict[str, float]:
        """With several reward functions, each one's mean over the last scored responses,
        ``<prefix>_<function>_mean`` (TRL's ``rewards/<function>/mean``); {} with one."""
        functions = getattr(self.reward, "functions", ())
        if len(functions) < 2:
            return {}
        labels = self.reward.labels
        return {f"{prefix}_{labels[name]}_mean": float(r.mean()) for name, r in self.reward.last.items()}

    def update(self, batch: dict, extra: dict) -> None:
        """One optimizer step on ``batch``, its metrics row (``extra``: the task's fields), its line,
        and the checkpoint where due.

        Raises:
            MegatrainError: the step was not applied (a non-finite loss, gradient or weight).
            CheckpointError: the checkpoint due failed (the message says what the same command does).
        """
        from megatrain.train.lr import lr_at
        from megatrain.train.metrics import step_row

        cfg = self.cfg
        lr = lr_at(self.step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps,
                   min_lr_ratio=cfg.min_lr_ratio)
        self.trainer.set_lr(lr)
        res = self.trainer.step(batch, loss=self.loss)
        self.step += 1
        step = self.step
        verdict = self.guard.judge(step, res, res.nonfinite_weights, self.trainer.graph.layers)
        row = {**step_row(step, res, lr, self.rates, applied=verdict.action == "keep",
                          trimmed=getattr(self.data, "trimmed", None), dropped=getattr(self.data, "dropped", None)),
               **extra}
        if verdict.action != "keep":
            self.metrics.append(row)
            self.not_kept(verdict)
            return
        self.guard.keep(res.loss)
        if self.val is not None and (step == cfg.max_steps or cfg.eval_interval and step % cfg.eval_interval == 0):
            row.update(self.evaluate())
        self.metrics.append(row)
        shown = (f"reward {extra['reward_mean']:.3f}" if cfg.task == "grpo"
                 else f"accuracy {extra['rewards_accuracy']:.2f}, margin {extra['rewards_margin']:+.3f}")
        if "val_reward_mean" in row:
            shown += f"; validation reward {row['val_reward_mean']:.3f}"
        elif row.get("val_loss") is not None:
            shown += f"; validation loss {row['val_loss']:.4f}, accuracy {row['val_rewards_accuracy']:.2f}"
        self.echo(f"step {step}: loss {res.loss:+.4f}, {shown}")
        if cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0 and step < cfg.max_steps:
            self.save(step)

    def not_kept(self, verdict) -> None:
        """A step the guard did not keep (:meth:`megatrain.train.guard.Guard.judge`: its loss or a
        gradient was not finite, or an update left non-finite weights). With ``nonfinite: skip`` a
        ``skip`` verdict (nothing of it changed the weights: deferred updates) is counted
        (``skipped_steps``), said, and the run goes on to the next batch (or update).

        Raises:
            MegatrainError: ``nonfinite: stop``; a ``rollback`` verdict (a step that changed weights:
                megatrain train's other tasks roll back to the last checkpoint there, these do not
                yet); or ``max_consecutive_skips`` steps in a row not kept.
        """
        cfg, guard, why = self.cfg, self.guard, verdict.why
        if cfg.nonfinite == "stop":
            raise MegatrainError(f"{why}; the update was not kept and the run stops (nonfinite: stop; lower --lr, set "
                                 "--max-grad-norm, or --nonfinite skip to go on)")
        if verdict.action == "rollback":
            raise MegatrainError(f"{why}, and it changed weights (a layer took its update during backward, or an "
                                 f"update left non-finite weights): task {cfg.task} does not roll back to its "
                                 "checkpoint yet, so the run stops; set --max-grad-norm (the updates then wait for "
                                 "the whole gradient and a bad step changes nothing), or lower --lr")
        self.skipped += 1
        guard.in_a_row += 1
        if guard.in_a_row >= cfg.max_consecutive_skips:
            raise MegatrainError(f"{guard.in_a_row} steps in a row were not kept (the last: {why}): the run "
                                 f"diverged; stopping (max_consecutive_skips={cfg.max_consecutive_skips}); lower --lr")
        self.echo(f"{why}; skipped (nothing of it applied; {self.skipped} skipped so far)")

    def evaluate(self) -> dict[str, float]:
        """The validation metrics of the current weights on ``val_data``: DPO's ``val_loss`` and
        ``val_`` + :data:`DPO_FIELDS` over all its pairs (against the precomputed or BF16
        reference), TRL's ``eval_*``; GRPO's ``val_reward_mean`` and ``val_reward_std`` of
        ``group_size`` responses to each of its prompts (sampled at ``temperature`` with the same
        seeds at every evaluation, so that evaluations differ by the weights only; the training
        RNG is left as it was).

        Raises:
            BatchError: the reward function failed on a validation response (naming it).
        """
        import torch

        from megatrain.rl import target_mask

        cfg, val = self.cfg, self.val
        if cfg.task == "dpo":
            lp = precompute_pairs(self.trainer, val, self.per_step)
            ref = self.ref_val if self.ref_val is not None else precompute_pairs(self.reference, val, self.per_step)
            mask = target_mask(val.labels)
            loss = float(self.loss(lp, mask, {"ref_logprobs": ref}, {"pairs": val.num_pairs}))
            return {"val_loss": loss, **{f"val_{k}": v for k, v in dpo_metrics(self.loss, lp, mask, ref).items()}}
        rewards, each = [], {}
        cuda = [torch.cuda.current_device()] if self.trainer.backend.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            for at in range(0, len(val.ids), self.per_step):
                chunk = range(at, min(at + self.per_step, len(val.ids)))
                try:
                    rewards.append(score_rollouts(self.rollout, self.tokenizer, val, chunk, group_size=cfg.group_size,
                                                  reward=self.reward, reward_name=f"reward {cfg.reward}",
                                                  seed=cfg.seed * 1_000_003 + 10**12 + at)[2])
                except BatchError as e:
                    raise BatchError(f"validation after step {self.step}: {e}") from e.__cause__
                for name, got in getattr(self.reward, "last", {}).items():
                    each.setdefault(name, []).append(got)
        r = torch.cat(rewards)
        out = {"val_reward_mean": float(r.mean()), "val_reward_std": float(r.std()) if len(r) > 1 else 0.0}
        if len(each) > 1:  # several reward functions: each one's mean, as in training
            out.update({f"val_reward_{self.reward.labels[name]}_mean": float(torch.cat(t).mean())
                        for name, t in each.items()})
        return out

    def save(self, step: int) -> None:
        """The checkpoint of ``step``: the trainer, and what the rest of the run needs (the class
        docstring), as ``extra_tensors`` and the ``rl`` entry of the train state.

        Raises:
            CheckpointError: the save failed; the message says what the same command does then.
        """
        from megatrain.errors import CheckpointError
        from megatrain.train.rundir import STATE_KEY, train_state

        state = train_state(self.cfg, step, self.skipped, self.fingerprint, self.tokenizer_sha, self.guard.state())
        tensors = {"order_generator": self.generator.get_state(), "order": self.order}
        if self.ref_all is not None:
            tensors["reference_logprobs"] = self.ref_all
        if self.ref_val is not None:
            tensors["reference_logprobs_val"] = self.ref_val
        if self.reference is not None:
            tensors["reference_weights"] = self.reference.weights
        pending = None
        if self.pending is not None:
            batch, _, extra, first, done = self.pending
            tensors.update({f"pending.{k}": batch[k] for k in PENDING_TENSORS if k in batch})
            pending = {"first_step": first, "done": done, "extra": extra}
        state[STATE_KEY]["rl"] = {**_rl_settings(self.cfg), "pending": pending}
        last = self.checkpoint.last_saved
        try:
            self.checkpoint.save(step, state, tensors)
        except CheckpointError as e:
            after = f"the same command resumes from step {last}" if last is not None else \
                "the same command starts the run again"
            raise CheckpointError(f"step {step}: {e}; then {after}") from e.__cause__

    def finish(self):
        """The last checkpoint (unless this step's is saved), the metrics closed, ``loss.png`` and
        the closing line; the :class:`megatrain.train.loop.TrainResult`."""
        from megatrain.train.loop import TrainResult
        from megatrain.train.metrics import finite, read_metrics
        from megatrain.train.model import model_label
        from megatrain.train.rundir import METRICS_FILE, PLOT_FILE
        from megatrain.train.stages import plot_or_note

        cfg, out, step = self.cfg, self.out, self.step
        if self.checkpoint.last_saved != step:
            self.save(step)
        self.metrics.close()
        rows = read_metrics(out / METRICS_FILE)
        plot_or_note(lambda: save_rl_plot(rows, out / PLOT_FILE, task=cfg.task,
                                          title=f"{model_label(cfg)}: {cfg.task}, {step} steps, global batch "
                                                f"{cfg.global_batch}"), self.echo)
        ckpt = self.checkpoint.path
        applied = [r["loss"] for r in rows if r.get("applied")]
        loss = finite(applied[-1]) if applied else None
        val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
        self.echo(f"done: step {step}, loss {'n/a' if loss is None else f'{loss:.4f}'}; model directory: {ckpt}; "
                  f"metrics: {out / METRICS_FILE}")
        return TrainResult(step=step, skipped_steps=self.skipped, stopped_by=self.stopped, loss=loss,
                           val_loss=val[-1] if val else None, checkpoint=ckpt, output_dir=out)


def precompute_pairs(trainer, pairs: Pairs, per_step: int) -> "torch.Tensor":
    """The trainer's per-token log-probabilities of every row of ``pairs`` (``[2 * pairs, seq_len]``
    FP32), ``per_step`` pairs at a time (the step's shape; the last chunk filled up with the first
    pairs and cut)."""
    import torch

    n = pairs.num_pairs
    out = []
    for a in range(0, n, per_step):
        idx = torch.arange(a, a + per_step) % n
        lp = trainer.logprobs(pairs.batch(idx))
        out.append(lp[:2 * (min(a + per_step, n) - a)])
    return torch.cat(out)
