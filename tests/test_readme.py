"""Every code block of README.md and of the manual, docs/*.md, runs as written.

The blocks are read from README.md and then from each page of docs/ (in name order), in order.
``python`` blocks run in this process, ``bash`` blocks in bash with the virtual environment's
``bin/`` on ``PATH`` (as after ``source .venv/bin/activate``), all in one working directory, the
user's, shared by the blocks in that order. Two comments before a block's fence say how it is used:

- ``<!-- readme-test: file: PATH -->``: the block is a file the text refers to (``run.yaml``, a
  ``config.json``); it is written to ``PATH`` before any block runs, not run.
- ``<!-- readme-test: skip: REASON -->``: not run here; REASON says why (it needs GPUs or
  machines this CPU does not have, or names the test that runs it).

``text`` blocks and blocks without a language are output or diagrams. What the text leaves to
the reader is filled in by :func:`workspace` and :data:`PREPARE` (what the text assumes: a
``corpus/``, ``chats.jsonl``, a saved model, a finished ``make train``, a directory for NVMe
files), and :data:`TINY` sizes the blocks down: the text's ``...`` and its real-scale choices
(2000 steps, seq_len 1024, a 30 M-parameter model) become tiny ones, each replacement listed below
and checked to apply. Nothing else is changed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
"""The files whose blocks run: the front page, then the manual."""
TINY_MODEL = "tiny-model/config.json"
"""The model the CLI examples train here instead of their 30 M-parameter preset (which
test_the_complete_config_json_is_the_llama_30m_preset checks): 2 layers, hidden 32, vocab 320."""
TINY_LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    file: str | None = None
    skip: str | None = None
    page: str = "README.md"  # the file, relative to the repository's root

    @property
    def id(self) -> str:
        return f"{self.page}:L{self.line}-{self.lang or 'plain'}"


def readme_blocks(text: str, page: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` (the file ``page``) with their ``readme-test`` directive (the
    line before the fence)."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        directive = re.match(r"^<!-- readme-test: (skip|file): (.+?) -->$", lines[i - 1]) if i else None
        kw = {directive.group(1): directive.group(2)} if directive else {}
        blocks.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n", page=page, **kw))
        i = end + 1
    return blocks


BLOCKS = [b for path in PAGES for b in readme_blocks(path.read_text(), str(path.relative_to(ROOT)))]

TINY: dict[str, list[tuple[str, str]]] = {
    # The first example says "LlamaConfig(...)": a model of the reader's.
    "LlamaConfig(...)": [("LlamaConfig(...)", f"LlamaConfig({', '.join(f'{k}={v}' for k, v in TINY_LLAMA.items())})"),
                         ("seq_len=2048", "seq_len=64"), ("(32, 2048)", "(32, 64)")],
    'megatrain.from_pretrained("path/to/saved_model"': [("seq_len=2048", "seq_len=64"), ("(4, 2048)", "(4, 64)")],
    # run.yaml's sizes are a real run's; every command that uses it trains 2 to 4 tiny steps.
    "# run.yaml:": [("model: llama-30m", f"model: {TINY_MODEL}"), ("seq_len: 1024", "seq_len: 32"), ("global_batch: 32", "global_batch: 4"),
                    ("micro_batch_size: 4 ", "micro_batch_size: 2 "), ("warmup_steps: 100", "warmup_steps: 1"),
                    ("max_steps: 10000", "max_steps: 2"), ("eval_interval: 200", "eval_interval: 1"),
                    ("checkpoint_interval: 1000", "checkpoint_interval: 0")],
    "megatrain train --config run.yaml --max-steps 2000": [("--max-steps 2000", "--max-steps 3"),
                                                           ("--max-steps 20000", "--max-steps 4")],
    "megatrain train --model llama-30m --seq-len 256": [
        ("--model llama-30m", f"--model {TINY_MODEL}"), ("--seq-len 256", "--seq-len 32"), ("--global-batch 16 --micro-batch-size 4", "--global-batch 4 --micro-batch-size 2"),
        ("--max-steps 2000", "--max-steps 2 --warmup-steps 1 --eval-batches 1 --max-bytes 100000 --sample-tokens 4"),
        ("--global-batch 8 --micro-batch-size 4", "--global-batch 4 --micro-batch-size 2"),
        ("--warmup-steps 10", "--warmup-steps 1"), ("--max-steps 300", "--max-steps 2 --eval-batches 1 --sample-tokens 4")],
    # A placeholder path: a directory of this machine.
    'nvme_dir="/mnt/nvme/run1"': [("/mnt/nvme/run1", "nvme")],
    "--nvme-dir /mnt/nvme/run1": [("/mnt/nvme/run1", "nvme")],
}


def _corpus(ws: Path) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (ws / "corpus").mkdir()
    for name in ("textwrap.py", "difflib.py", "shlex.py"):
        (ws / "corpus" / name).write_text((stdlib / name).read_text())


def _chats(ws: Path) -> None:
    with open(ws / "chats.jsonl", "w") as f:
        for i in range(40):  # 2 validation examples at val_fraction 0.05
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                             {"role": "assistant", "content": f"{2 * i}."}]}) + "\n")


def _saved_model(ws: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(ws / "path" / "to" / "saved_model")


def _after_make_train(ws: Path) -> None:
    from megatrain.examples import train_lm

    assert train_lm.main(["--max-steps", "2", "--warmup-steps", "1", "--max-bytes", "50000", "--seq-len", "32",
                          "--global-batch", "4", "--micro-batch-size", "2", "--eval-batches", "1",
                          "--sample-tokens", "0"]) == 0  # in ws: runs/train_lm-<date-time>/


PREPARE = {
    "megatrain.from_pretrained(\"path/to/saved_model\"": _saved_model,
    'glob.glob("runs/train_lm-*/checkpoint")': _after_make_train,
    "--data chats.jsonl": _chats,
}


def _matching(key: str) -> list[Block]:
    return [b for b in BLOCKS if key in b.code]


def _sized(block: Block) -> str:
    """The block's code with :data:`TINY`'s replacements (each a whole number or word: "2000" does
    not match the start of "20000")."""
    code = block.code
    for key, pairs in TINY.items():
        if key in block.code:
            for old, new in pairs:
                code, n = re.subn(re.escape(old) + r"(?![\w.])", new.replace("\\", "\\\\"), code)
                assert n, f"{block.id}: {old!r} is not in the block any more; update TINY"
    return code


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The reader's working directory, with the files the text names written from their blocks."""
    ws = tmp_path_factory.mktemp("readme")
    (ws / "nvme").mkdir()
    _corpus(ws)  # run.yaml's data
    (ws / TINY_MODEL).parent.mkdir()
    (ws / TINY_MODEL).write_text(json.dumps({"model_type": "llama", **TINY_LLAMA, "vocab_size": 320,
                                             "max_position_embeddings": 64}))
    for block in BLOCKS:
        if block.file:
            path = ws / block.file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_sized(block))
    return ws


def test_every_substitution_and_preparation_names_one_block():
    for key in [*TINY, *PREPARE]:
        assert len(_matching(key)) == 1, f"{key!r} matches {[b.id for b in _matching(key)]}"


def test_the_complete_config_json_is_the_llama_30m_preset(workspace):
    from megatrain.planner.presets import MODEL_PRESETS, build_meta_model, load_model_config

    block, = [b for b in BLOCKS if b.file == "my-model/config.json"]
    assert json.loads(block.code) == MODEL_PRESETS["llama-30m"]
    model = build_meta_model(load_model_config(workspace / block.file))
    assert sum(p.numel() for p in model.parameters()) == 29_368_832


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang in ("python", "bash")], ids=lambda b: b.id)
def test_readme_block_runs(block, workspace, monkeypatch, capsys):
    if block.skip:
        pytest.skip(f"{block.id}: {block.skip}")
    monkeypatch.chdir(workspace)
    monkeypatch.setattr("megatrain.runtime.measure.MATMUL_SECONDS", 0.02)
    for key, prepare in PREPARE.items():
        if key in block.code:
            prepare(workspace)
    code = _sized(block)
    if block.lang == "python":
        import torch.distributed as dist

        # The data-parallel example runs as torchrun's one process would: torchrun sets these.
        port = _free_port()
        for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                     "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(k, v)
        try:
            exec(compile(code, f"{block.page} (line {block.line})", "exec"), {"__name__": "__readme__"})
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    # No time limit: on a loaded machine a run may take minutes, and pytest's own timeout (if any) rules.
    proc = subprocess.run(["bash", "-eo", "pipefail", "-c", code], cwd=workspace, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"{block.id} exited {proc.returncode}:\n{code}\n{proc.stderr[-4000:]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_directives_are_read():
    blocks = readme_blocks("text\n<!-- readme-test: skip: needs GPUs -->\n```bash\nnvidia-smi\n```\n\n"
                           "<!-- readme-test: file: a.yaml -->\n```yaml\nx: 1\n```\n```python\nprint(1)\n```\n")
    assert [(b.lang, b.skip, b.file, b.code) for b in blocks] == [
        ("bash", "needs GPUs", None, "nvidia-smi\n"), ("yaml", None, "a.yaml", "x: 1\n"), ("python", None, None, "print(1)\n")]
    assert [b.line for b in blocks] == [3, 8, 11]


def _slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_link_between_the_pages_reaches_a_file_and_its_heading():
    """The front page and the manual link to each other by path and heading: each relative link
    names a file that exists and, with ``#anchor``, a heading of that file (outside code blocks)."""
    def headings(path: Path) -> set[str]:
        found, fenced = set(), False
        for line in path.read_text().splitlines():
            fenced ^= line.startswith("```")
            m = None if fenced else re.match(r"^#+ (.+)$", line)
            if m:
                found.add(_slug(m.group(1)))
        return found

    checked = 0
    for page in [*PAGES, ROOT / "BENCHMARKS.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(ROOT)}: link {target!r}: no file {file}"
            if anchor and file.suffix == ".md":
                assert anchor in headings(file), f"{page.relative_to(ROOT)}: link {target!r}: no such heading"
            checked += 1
    assert checked > 50


def test_the_readme_is_a_front_page():
    """README.md is the front page (what it is, the compile example, the two commands, status,
    links, a tour of the code): at most 250 lines; the manual is docs/."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, len(lines)
    assert {"## Install and first run", "## The two commands", "## Status", "## The manual",
            "## A tour of the code"} <= set(lines)
