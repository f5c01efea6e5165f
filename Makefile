# Set-up and the two entry points. Each target creates the virtual environment it needs.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip

.PHONY: setup train test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The CPU build of torch 2.13.0 only where no torch is present; any torch >= 2.6 works.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[hf,plot,test]"
	touch $@

setup: $(VENV)/.installed

train: setup  ## train a small Llama on the Python standard library's source, on the CPU
	$(PY) examples/train_lm.py $(ARGS)

test: setup  ## the test suite (CPU; CUDA tests skip without a GPU)
	$(PY) -m pytest tests $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
