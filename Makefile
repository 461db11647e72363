# The README's two commands: `make serve` and `make test`. Both build .venv from nothing.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?=
export PYTHONUNBUFFERED := 1
comma := ,

# An NVIDIA GPU the driver sees -> the gpu extra (onnxruntime-gpu, CUDA 13 like PyPI's torch); else the CPU builds.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
EXTRAS := train,dev$(if $(GPU),$(comma)gpu,)

.PHONY: setup serve test test-unit test-all lint docs bench robustness table1 server-venv clean gpu-check

setup: $(STAMP)

# torch is pinned (2.13.0; the CPU build on a machine without a GPU); the pin keeps pip from ever
# resolving another. With a GPU, PyPI's torch 2.13.0 is a CUDA 13 build and onnxruntime-gpu 1.27+
# is CUDA 13 too: one CUDA major (faiss stays the CPU build). onnxruntime-gpu ships the same module
# as onnxruntime, so the CPU build is removed; the last line prints the providers a session really
# gets (CUDAExecutionProvider only where the CUDA libraries load). tools/ is installed beside the server
# as its own distribution, slc-lab (tools/pyproject.toml: the load tester, benchmarks, experiments).
$(STAMP): pyproject.toml tools/pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) (e.g. apt-get install python3.11-venv)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[$(EXTRAS)]" -e ./tools "torch==2.13.0"
ifneq ($(GPU),)
	$(BIN)/pip uninstall -q -y onnxruntime
	$(BIN)/pip install -q --force-reinstall --no-deps "onnxruntime-gpu>=1.27,<2"
endif
	@$(BIN)/python -c "import torch, onnxruntime, faiss, fastapi; from serving.core.device.backend import usable_providers; print('setup ok: torch', torch.__version__, 'cuda', torch.version.cuda, '| onnxruntime', onnxruntime.__version__, 'uses', usable_providers(), '| faiss', faiss.__version__)"
	touch $(STAMP)

serve: setup
	$(BIN)/slc serve $(if $(PORT),--port $(PORT),) $(if $(BUNDLE),$(BUNDLE),)

test: setup
	$(BIN)/python -m pytest -q -ra

# the fast tier only: no server processes, sockets or slow tests
test-unit: setup
	$(BIN)/python -m pytest -q -ra -m "not slow and not bench and not integration"

test-all: setup
	$(BIN)/python -m pytest -q -ra -m "not bench"

# Where torch sees CUDA: glyphs-latin trained on cuda in bf16 against the CPU in fp32, exported, served
# with --device cuda and checked against offline math (a table; exit 1 on a mismatch); then the serving
# phase: slc bench device (D = 10^5, 10^6, 10^7 on the GPU against its floor and the CPU server,
# docs/results/gpu-serving.md), and where a device pass's time goes (tools/bench/device_profile.py).
# Without CUDA: one line, exit 0.
GPU_CLASSES ?= 100000,1000000,10000000
GPU_BUDGET_S ?= 480
# The one prepared GPU check (tools/bench/gpu_suite.py), within GPU_BUDGET_S: tools/gpu_check.py (train,
# export, serve against offline math), then slc beside an onnxruntime peer on the same card by D and head
# precision, and one connection's softmax taken apart -> docs/results/gpu-bench.{json,md}. Without CUDA:
# one line, exit 0. `slc bench gpu --device cpu --no-check` is its smoke run on the CPU provider.
gpu-check: setup
	$(BIN)/slc bench gpu --classes $(GPU_CLASSES) --budget-s $(GPU_BUDGET_S) --out docs/results

lint: setup
	$(BIN)/ruff check --select F,E9 slc serving trainer models tests

# docs/cli.md from the commands' own help (a test keeps them equal)
docs: setup
	$(BIN)/python -m slc.clidoc > docs/cli.md

# The server-only install (no extras, no slc-lab: no torch, no CUDA wheels) in .venv-server, and its size.
server-venv:
	test -x .venv-server/bin/python || $(PY) -m venv .venv-server
	.venv-server/bin/pip install -q --upgrade pip
	.venv-server/bin/pip install -q .
	@du -sh .venv-server | cut -f1 | xargs echo "server-only venv:"

# About 15 minutes on 2 cores the first time (the D = 1,000,000 bundle and its index are
# built once and cached under $$SLC_HOME/bench), about 8 after. BENCH_CLASSES to narrow it.
BENCH_CLASSES ?= 10,1000,100000,1000000
bench: setup
	$(BIN)/slc bench losses --out docs/results
	$(BIN)/slc bench scale --classes $(BENCH_CLASSES) --duration 8 --out docs/results

# Hostile bodies, schemathesis and a kill -9 soak against real servers: docs/results/{hostile,fuzz,soak}.md
robustness: setup
	$(BIN)/slc bench hostile --out docs/results
	$(BIN)/slc bench fuzz --max-examples 200 --out docs/results
	$(BIN)/slc bench soak --duration 120 --kills 4 --out docs/results

table1: setup
	$(BIN)/slc experiment table1 --dataset mnist5k --seeds 3 --out docs/results/table1-mnist5k

clean:
	rm -rf $(VENV) .venv-server build *.egg-info
