"""No code from a model directory runs (issue 44, item 1): every transformers call of the package
that can load a class from a directory passes ``trust_remote_code=False``, and a processor
directory whose ``auto_map`` names its own ``processing_*.py`` is refused with one error even when
the terminal would answer transformers' question with ``y``."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import megatrain
from megatrain.errors import ConfigError

PACKAGE = Path(megatrain.__file__).parent

# Methods that build a class from a directory or a config, and may import the directory's code.
LOADERS = {"from_pretrained", "from_config"}
# AutoConfig.for_model(model_type) looks model_type up in transformers' own CONFIG_MAPPING and
# builds nothing else (an unknown type raises): it can load no code, and takes no trust_remote_code
# (a keyword would become a config attribute).
NO_CODE_METHODS = {"for_model"}


def _no_code(call: ast.Call) -> bool:
    for kw in call.keywords:
        if kw.arg == "trust_remote_code":
            return isinstance(kw.value, ast.Constant) and kw.value.value is False
        if kw.arg is None and isinstance(kw.value, (ast.Name, ast.Attribute)) and \
                ast.unparse(kw.value).split(".")[-1] == "NO_CODE":
            return True
    return False


def _loader_calls(tree: ast.AST):
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        method = node.func.attr
        receiver = ast.unparse(node.func.value).split(".")[-1]
        if method in LOADERS or (receiver.startswith("Auto") and method not in NO_CODE_METHODS):
            yield node


def test_every_transformers_loading_call_passes_trust_remote_code_false():
    calls, bad = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for call in _loader_calls(tree):
            calls += 1
            if not _no_code(call):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{call.lineno}: {ast.unparse(call)[:120]}")
        for node in ast.walk(tree):  # and nothing ever turns it on
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                assert isinstance(node.value, ast.Constant) and node.value.value is False, \
                    f"{path}:{node.value.lineno}: trust_remote_code={ast.unparse(node.value)}"
    assert calls >= 5  # the walk sees the package's calls (pretrained, presets, loop, hf_load)
    assert not bad, "calls that may run a model directory's code (pass trust_remote_code=False, or load " \
                    "through megatrain.hf_load):\n" + "\n".join(bad)


def test_a_processor_directory_with_its_own_code_is_refused_even_when_the_prompt_says_yes(tmp_path, monkeypatch):
    from megatrain.examples.tiny_llava_sft import write_processor
    from megatrain.train.corpus import _processor

    write_processor(tmp_path)
    for name in ("processor_config.json", "tokenizer_config.json"):  # a class only its own file defines
        d = json.loads((tmp_path / name).read_text())
        d.pop("processor_class", None)
        if name == "processor_config.json":
            d["auto_map"] = {"AutoProcessor": "processing_evil.EvilProcessor"}
        (tmp_path / name).write_text(json.dumps(d))
    ran = tmp_path / "ran"
    (tmp_path / "processing_evil.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    monkeypatch.setattr("builtins.input", lambda *a: "y")  # transformers' "Do you wish to run the custom code?"
    cfg = SimpleNamespace(tokenizer=str(tmp_path))
    source = SimpleNamespace(directory=None, config=SimpleNamespace(model_type="llava"))
    with pytest.raises(ConfigError, match=r"defined only by the directory's own Python code \(processor_config.json: "
                                          r"processing_evil.EvilProcessor\).*runs no code from a model directory"):
        _processor(cfg, source)
    assert not ran.exists()
