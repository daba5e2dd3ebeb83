# `make demo`: set up .venv and train the digits example. `make test`: set up with dev extras and run every test.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# the [deepspeed] extra's range (pyproject.toml); built without its C++ ops, which it compiles on first use
DEEPSPEED_SPEC ?= deepspeed>=0.19,<0.20

.PHONY: demo test test-long test-fast test-examples bench setup setup-dev setup-deepspeed setup-xla bench-xla setup-docs docs chromium

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade pip

# torch first (the CPU build here; keep a torch you already have), then cadence itself
setup: $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==$(TORCH_VERSION)
	$(PY) -m pip install -e ".[examples]"

setup-dev: setup setup-deepspeed chromium
	$(PY) -m pip install -e ".[dev,docs]"

# DeepSpeed builds against the torch already installed (no build isolation) and without its ops
# (DS_BUILD_OPS=0): the few it needs (cpu_adam for optimizer offload) are compiled on first use and
# cached in .venv/torch_extensions (see cadence/distributed/deepspeed.py)
setup-deepspeed: setup
	$(PY) -c "import deepspeed" 2>/dev/null || { $(PY) -m pip install setuptools wheel ninja && \
		DS_BUILD_OPS=0 $(PY) -m pip install --no-build-isolation "$(DEEPSPEED_SPEC)"; }
	$(PY) -m cadence.distributed.deepspeed --build-ops

# the documentation site, built strictly into site/ (a warning, a broken link or a missing reference fails it);
# the tutorials are nbs/*.ipynb, executed in a fresh kernel during the build (docs/_ext/notebooks.py)
setup-docs: setup
	$(PY) -m pip install -e ".[docs]"

docs: setup-docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

# tests/test_docs.py opens the built site in a headless Chromium, from the system packages (root, or sudo, installs it)
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update && $$SUDO apt-get install -y chromium; }

demo: setup
	$(PY) examples/train_digits.py

# `make test` (CI) leaves out the tests marked `long` (pyproject.toml): further world sizes, engines and variants of
# what it covers, and the bench scripts' runs; `make test-long` runs those. Both pass before a change is done.
test: setup-dev setup-xla
	CADENCE_XLA_VENV=$(XLA_VENV) $(PY) -m pytest -m "not long" --durations=30

test-long: setup-dev setup-xla
	CADENCE_XLA_VENV=$(XLA_VENV) $(PY) -m pytest -m long --durations=30

test-fast: setup-dev
	$(PY) -m pytest -m "not slow"

# Accelerate's example scripts (imports swapped) x every engine through `cadence launch`, offline;
# the table goes to examples-status.md (`make test` runs a slice: tests/accelerate/examples/test_accelerate_examples.py)
test-examples: setup-dev
	$(PY) tests/accelerate/examples/matrix.py --jobs 2 --status examples-status.md

bench: setup
	$(PY) bench/overhead.py

# torch_xla needs torch of its own version exactly (2.9.0; the main environment is on torch 2.13), so the
# XLA tests (tests/xla) run their scripts in a second environment, built once outside the clone (every clone
# on this machine reuses it; ~4 GB download, ~7 GB on disk). CADENCE_XLA=off turns the XLA lane off.
XLA_TORCH_VERSION ?= 2.9.0
TORCH_XLA_VERSION ?= 2.9.0
XLA_VENV ?= $(HOME)/.cache/cadence/xla-torch$(XLA_TORCH_VERSION)-xla$(TORCH_XLA_VERSION)
# cadence's own dependencies (pyproject.toml); cadence itself comes from the clone on PYTHONPATH
XLA_DEPS ?= numpy fastcore pyyaml rich safetensors cloudpickle pytest "transformers>=5,<6"

setup-xla:
	@if [ "$$CADENCE_XLA" = off ]; then echo "CADENCE_XLA=off: the XLA environment is not built and tests/xla are skipped"; \
	elif [ ! -f "$(XLA_VENV)/.complete" ]; then \
		rm -rf "$(XLA_VENV)" && python3 -m venv "$(XLA_VENV)" && \
		"$(XLA_VENV)/bin/python" -m pip install torch==$(XLA_TORCH_VERSION) torch-xla==$(TORCH_XLA_VERSION) $(XLA_DEPS) && \
		touch "$(XLA_VENV)/.complete" || { echo "make setup-xla: could not build the XLA environment at $(XLA_VENV) \
			(disk space? the package registry?); the XLA tests need it. CADENCE_XLA=off turns them off"; exit 1; }; fi

bench-xla: setup-xla
	PJRT_DEVICE=CPU PYTHONPATH=$(CURDIR) "$(XLA_VENV)/bin/python" bench/xla.py
