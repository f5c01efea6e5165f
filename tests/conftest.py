"""Shared fixtures: tiny models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os

# Before torch loads OpenMP (megatrain.runtime.threads, as `megatrain train` does): threads that
# sleep between parallel regions keep the suite's steps from slowing down many times over on a
# machine other work keeps busy. The tests' subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def requires_cuda(test):
    """A test that needs a CUDA GPU: marked ``cuda`` (so ``pytest -m cuda`` selects it, as the GPU
    probe does) and skipped where there is none."""
    return pytest.mark.cuda(_NO_CUDA(test))


def tiny_llama(layers: int = 2, vocab: int = 96, hidden: int = 32, device: str | None = None, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw.setdefault("tie_word_embeddings", False)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, **kw)
    if device == "meta":
        with torch.device("meta"):
            return LlamaForCausalLM(cfg)
    return LlamaForCausalLM(cfg)


def tiny_gpt(layers: int = 2, vocab: int = 96, d_model: int = 32):
    from megatrain.examples.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=vocab, max_seq_len=64, d_model=d_model, n_heads=4, n_layers=layers))


def random_batch(rows: int, seq_len: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def eager_train(model, batches, opt: torch.optim.Optimizer, max_grad_norm: float | None = None,
                **forward_kw) -> list[float]:
    """Eager training, one optimizer step per whole batch: the model's own loss (its mean over
    the batch's supervised tokens), backward, ``clip_grad_norm_`` when ``max_grad_norm`` is given,
    ``opt.step()``. Returns each step's loss; ``forward_kw`` goes to every forward."""
    out = []
    for batch in batches:
        opt.zero_grad()
        loss = model(**batch, **forward_kw).loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        out.append(loss.item())
    return out


class BackendWrapper:
    """A backend for the executor that forwards everything (memory, ``device``, ``synchronize``,
    ``abort``, ...) to ``inner``; a test's wrapper overrides only what it watches or changes, so a
    method the Backend protocol gains reaches every wrapper at once."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "inner":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def manual_section(heading: str) -> str:
    """The section of README.md or a page of docs/ under the heading ``heading`` (its title, e.g.
    "Padded and packed batches"; leading ``#`` are ignored, so the heading may move between levels
    and pages), up to the next heading of its level or above."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    title = heading.lstrip("#").strip()
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = page.read_text().splitlines(keepends=True)
        levels, fenced = [], False  # each line's heading level (0: not a heading; a code block's "# ..." is not)
        for line in lines:
            fenced ^= line.startswith("```")
            level = len(line) - len(line.lstrip("#"))
            levels.append(level if level and not fenced and line[level:level + 1] == " " else 0)
        for i, line in enumerate(lines):
            if levels[i] and line[levels[i]:].strip() == title:
                end = next((j for j in range(i + 1, len(lines)) if 0 < levels[j] <= levels[i]), len(lines))
                return "".join(lines[i:end])
    raise LookupError(f"no heading {title!r} in README.md or docs/*.md")


def readme_snippet(heading: str) -> str:
    """The first ```python block of the section ``heading`` (:func:`manual_section`), as source code."""
    section = manual_section(heading)
    start = section.index("```python\n") + len("```python\n")
    return section[start:section.index("```\n", start)]


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """megatrain's cache directory (``MEGATRAIN_CACHE_DIR``; inductor's caches under it) for the
    session's compiled templates, shared by every test and subprocess that compiles (they inherit
    the variable), and by the xdist workers of one run, so each template and shape compiles cold
    once per run (a minute or more on a 2-core CPU), not once per test. A ``MEGATRAIN_CACHE_DIR``
    already set (a developer's persistent cache) is kept."""
    if os.environ.get("MEGATRAIN_CACHE_DIR"):
        yield os.environ["MEGATRAIN_CACHE_DIR"]
        return
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "megatrain-cache"
    path.mkdir(exist_ok=True)
    saved = {k: os.environ.get(k) for k in ("MEGATRAIN_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    # Both: inductor reads its own variable, which an earlier compile in this worker may have set.
    os.environ["MEGATRAIN_CACHE_DIR"] = str(path)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    try:
        yield str(path)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
