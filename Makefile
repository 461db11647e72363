# The README's two commands: `make serve` and `make test`. Both build .venv from nothing.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
export PYTHONUNBUFFERED := 1

.PHONY: setup serve test test-all bench table1 clean

setup: $(STAMP)

# torch is pinned to the CPU build on this machine's disk (pip's find-links); the pin keeps
# pip from ever resolving a CUDA build of several GB.
$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[train,dev]" "torch==2.13.0"
	@$(BIN)/python -c "import torch, onnxruntime, faiss, fastapi; print('setup ok: torch', torch.__version__, '| onnxruntime', onnxruntime.__version__, '| faiss', faiss.__version__)"
	touch $(STAMP)

serve: setup
	$(BIN)/slc serve --port $(PORT) $(if $(BUNDLE),$(BUNDLE),)

test: setup
	$(BIN)/python -m pytest -q -ra

test-all: setup
	$(BIN)/python -m pytest -q -ra -m "not bench"

# About 15 minutes on 2 cores the first time (the D = 1,000,000 bundle and its index are
# built once and cached under $$SLC_HOME/bench), about 8 after. BENCH_CLASSES to narrow it.
BENCH_CLASSES ?= 10,1000,100000,1000000
bench: setup
	$(BIN)/slc bench losses --out docs/results
	$(BIN)/slc bench scale --classes $(BENCH_CLASSES) --duration 8 --out docs/results

table1: setup
	$(BIN)/slc experiment table1 --dataset mnist5k --seeds 3 --out docs/results/table1-mnist5k

clean:
	rm -rf $(VENV) build *.egg-info
