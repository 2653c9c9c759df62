# inflight: the two set-up commands are `make run` and `make test`.
# Everything installs into .venv/ at the repo root; torch==2.13.0 goes in first so that
# no later dependency range can pull the multi-GB CUDA build onto a CPU machine.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
DEMO_MODEL := models/demo
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: install run test lint crds bench bench-quick clean help

help:
	@echo "make run    - install what is missing, make the demo model, serve it on $(HOST):$(PORT)"
	@echo "make test   - install what is missing, run the whole test suite"
	@echo "make lint   - ruff"
	@echo "make crds   - copy crds/ into the Helm chart"
	@echo "make bench  - the benchmark suite (writes bench/results/)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
		|| $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(PY) -m inflight.runtime.demo_model $(DEMO_MODEL)

run: $(STAMP) $(DEMO_MODEL)/config.json
	@echo
	@echo "Serving $(DEMO_MODEL) on http://$(HOST):$(PORT). Try, from another terminal:"
	@echo "  curl http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"demo\", \"prompt\": \"def fib(n):\", \"max_tokens\": 32}'"
	@echo
	$(PY) -m inflight.runtime serve --model $(DEMO_MODEL) --served-model-name demo --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check inflight tests

crds:
	mkdir -p charts/inflight/crds
	cp crds/*.yaml charts/inflight/crds/

$(BENCH_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m inflight.bench all

clean:
	rm -rf $(VENV) models build *.egg-info
