# Set-up and the entry points. Each target creates the virtual environment it needs.
#
#   make train         the main job: `megatrain train --config examples/train_lm.yaml` (a small Llama on this
#                      Python's standard library, on the CPU); ARGS="--max-steps 1000" passes its flags. It
#                      leaves runs/train_lm-<date-time>/: checkpoint/ (a Hugging Face model with its
#                      tokenizer), metrics.jsonl, loss.png
#   make sft           fine-tune make train's newest model on examples/data/alpaca_demo.json (--task sft,
#                      --init-from runs/train_lm-<newest>/checkpoint; examples/sft_lm.yaml); leaves
#                      runs/sft_lm-<date-time>/ the same way. ARGS as for make train
#   make setup         the virtual environment .venv (torch, megatrain and its extras), which train and sft use
#   make test          the test suite on the locked versions (constraints.txt): what CI runs; it adds
#                      DeepSpeed to .venv (and builds its CPU Adam op there once) for the tests of that kernel
#   make test-oldest   the trace and exactness tests on the oldest supported versions
#                      (constraints-oldest.txt); CI runs it too
#   make test-latest   the test suite on today's newest releases, after printing how they differ
#                      from the lock; `make lock` then writes them into constraints.txt
SHELL  := /bin/bash
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
EXTRAS := .[hf,plot,test]
# The tests that depend most on transformers' modelling code and on torch.export.
OLDEST_TESTS := tests/test_trace.py tests/test_exactness.py tests/test_compat.py

.PHONY: setup train sft test test-oldest test-latest lock clean

# $(call make-venv,DIR,PIP_INSTALL_ARGS): a virtual environment with torch (the CPU build 2.13.0,
# only where no torch is present; any torch >= 2.6 works) and megatrain installed editable.
# The editable installs are -qq: setuptools' "Editable installation" notice (16 lines, twice) is
# about folders that shadow the package, which no user of this checkout can act on; errors still print.
define make-venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -c "import torch" 2>/dev/null || $(1)/bin/python -m pip install --quiet torch==2.13.0
	$(1)/bin/python -m pip install -qq $(2) -e "$(EXTRAS)"
endef

# $(call add-deepspeed,DIR,PIP_INSTALL_ARGS): the [deepspeed] extra (DeepSpeed's CPU Adam, the host
# AdamW kernel its tests run when they ask for it). DeepSpeed is a source package whose set-up imports
# torch, so it is installed without isolation (setuptools first: Python 3.12's venv has none) and with
# no op prebuilt (DS_BUILD_OPS=0); then its CPU Adam is compiled once with ninja and g++, about 1.5
# CPU-minutes, into DIR/torch_extensions (megatrain.runtime.host_kernels.deepspeed_build_dir: one cache
# per environment, so checkouts do not rebuild over each other's), here rather than in the first test
# that asks for it. make test-oldest runs without it (its tests skip).
define add-deepspeed
	$(1)/bin/python -m pip install --quiet $(2) setuptools
	DS_BUILD_OPS=0 $(1)/bin/python -m pip install -qq --no-build-isolation $(2) -e ".[deepspeed]"
	$(1)/bin/python -c "from megatrain.runtime.host_kernels import HostAdamW; HostAdamW('deepspeed')"
endef

$(VENV)/.installed: pyproject.toml constraints.txt
	$(call make-venv,$(VENV),-c constraints.txt)
	touch $@

# The suite also runs DeepSpeed's kernel (the tests that name it); training does not need it (the
# default host AdamW kernel is torch's), so make setup, train and sft leave it out.
$(VENV)/.deepspeed: $(VENV)/.installed
	$(call add-deepspeed,$(VENV),-c constraints.txt)
	touch $@

.venv-oldest/.installed: pyproject.toml constraints-oldest.txt
	$(call make-venv,.venv-oldest,-c constraints-oldest.txt)
	touch $@

setup: $(VENV)/.installed

train: setup  ## megatrain train with examples/train_lm.yaml: a small Llama on the Python standard library's source, on the CPU
	$(PY) examples/train_lm.py $(ARGS)

sft: setup  ## fine-tune make train's newest model on a bundled alpaca-style set (--task sft --init-from), on the CPU
	$(PY) examples/sft_lm.py $(ARGS)

# The suite runs in TEST_WORKERS processes (pytest-xdist), one test file per worker at a time
# (--dist loadfile: a file's module fixtures are built once); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2
test: $(VENV)/.deepspeed  ## the test suite (CPU; CUDA tests skip without a GPU), in TEST_WORKERS=2 worker processes
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile $(ARGS)

test-oldest: .venv-oldest/.installed  ## trace and exactness tests on the oldest supported versions
	.venv-oldest/bin/python -c "import torch, transformers; print('oldest stack: torch', torch.__version__, '- transformers', transformers.__version__)"
	.venv-oldest/bin/python -m pytest $(OLDEST_TESTS) $(ARGS)

test-latest:  ## the test suite on today's newest releases; prints how they differ from the lock first
	rm -rf .venv-latest
	$(call make-venv,.venv-latest,--upgrade)
	$(call add-deepspeed,.venv-latest,--upgrade)
	.venv-latest/bin/python -m pip freeze --exclude-editable | grep -iv '^torch==' > .venv-latest/freeze.txt
	@echo "== newest releases vs constraints.txt (- locked, + newest) =="
	@diff <(grep -v '^#' constraints.txt | sort -f) <(sort -f .venv-latest/freeze.txt) | grep '^[<>]' | sed 's/^</-/; s/^>/+/' || echo "(no difference)"
	.venv-latest/bin/python -m pytest tests $(ARGS)

lock:  ## write the versions `make test-latest` installed into constraints.txt
	test -f .venv-latest/freeze.txt || { echo "run make test-latest first"; exit 2; }
	{ sed -n '/^#/p' constraints.txt; cat .venv-latest/freeze.txt; } > constraints.txt.new && mv constraints.txt.new constraints.txt

clean:
	rm -rf $(VENV) .venv-oldest .venv-latest *.egg-info .pytest_cache .hypothesis
