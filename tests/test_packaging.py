"""Installing megatrain prints no warning of ours, and the wheel holds what the examples read."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                    reason="needs setuptools in this environment (make setup installs it)")
def test_the_wheel_builds_without_setuptools_warnings_and_holds_the_examples_data(tmp_path):
    """setuptools' "Package would be ignored" warnings (about 40 lines for each data directory under
    examples/, some 180 at every `make setup`) came from include-package-data checking the data
    files it tracks against `packages`; the package data is exactly pyproject's package-data lists."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "runs")
    for d in ("megatrain", "examples"):
        shutil.copytree(ROOT / d, src / d, ignore=ignore)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    build = p.stdout + p.stderr
    assert "would be ignored" not in build and "BuildBackendWarning" not in build, build[-3000:]
    wheel, = (tmp_path / "wheel").glob("megatrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("megatrain/examples/train_lm.yaml", "megatrain/examples/tiny-llama/config.json",
                 "megatrain/examples/sft_lm.yaml", "megatrain/examples/data/alpaca_demo.json",
                 "megatrain/examples/train_lm.py", "megatrain/train/early.py"):
        assert data in names, data
    assert any(n.startswith("megatrain/examples/data/vlm_sft/images/") for n in names)
