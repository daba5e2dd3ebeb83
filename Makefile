# `make demo`: set up .venv and train the digits example. `make test`: set up with dev extras and run every test.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: demo test test-fast bench setup setup-dev

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# torch first (the CPU build here; keep a torch you already have), then cadence itself
setup: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==$(TORCH_VERSION)
	$(PY) -m pip install -e ".[examples]"

setup-dev: setup
	$(PY) -m pip install -e ".[dev]"

demo: setup
	$(PY) examples/train_digits.py

test: setup-dev
	$(PY) -m pytest

test-fast: setup-dev
	$(PY) -m pytest -m "not slow"

bench: setup
	$(PY) bench/overhead.py
