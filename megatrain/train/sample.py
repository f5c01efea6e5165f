"""The one-line generation sample ``megatrain train`` prints when a run ends: a prompt from the
validation data and the trained model's greedy continuation of it (Hugging Face ``generate``)."""

from __future__ import annotations

PROMPT_TOKENS = 16
"""Tokens of the first validation window that prompt the sample of a language-modelling run."""

SHOWN_PROMPT_CHARS = 160
"""A longer prompt (an SFT example's) is shown by its last this many characters."""


def sample_prompt(dataset, task: str, rows: int, tokenizer) -> str:
    """The sample's prompt as text: the first :data:`PROMPT_TOKENS` tokens of the first
    validation window (``task="lm"``), or the first validation example's tokens before its first
    target token, i.e. its prompt in the run's template (``task="sft"``). ``rows``: the rows of a
    validation batch (``micro_batch_size``)."""
    batch = next(iter(dataset.eval_batches(rows, 1)))
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    end = PROMPT_TOKENS
    if task == "sft":
        targets = (labels != -100).nonzero()
        end = int(targets[0]) if len(targets) else len(ids)
    return tokenizer.decode(ids[:end].tolist())


def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int) -> str | None:
    """The greedy continuation (``do_sample=False``) of ``prompt`` by ``model`` (a transformers
    causal LM on the CPU), decoded without special tokens: what
    ``AutoModelForCausalLM.from_pretrained(checkpoint).generate(...)`` gives for the same prompt
    encoded without special tokens. At most ``max_new_tokens``, fewer when the model's
    ``max_position_embeddings`` ends first; None when the prompt leaves no room."""
    import torch

    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    room = getattr(model.config, "max_position_embeddings", None)
    n = max_new_tokens if room is None else min(max_new_tokens, room - len(ids))
    if n < 1 or not ids:
        return None
    training = model.training
    model.eval()  # dropout off, as for evaluation
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False, use_cache=False)
    finally:
        model.train(training)
    return tokenizer.decode(out[0, len(ids):].tolist())


def sample_line(prompt: str, completion: str) -> str:
    """``sample: 'prompt' -> 'completion'`` on one line (Python string literals: newlines escaped)."""
    shown = prompt if len(prompt) <= SHOWN_PROMPT_CHARS else "..." + prompt[-SHOWN_PROMPT_CHARS:]
    return f"sample (greedy): {shown!r} -> {completion!r}"
