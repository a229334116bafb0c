# Every target installs what it needs first. CI runs `make test` (see .ci/run).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
ARGS ?=

.PHONY: run install dev test lint format typecheck bench config clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(STAMP)

dev: $(DEV_STAMP)

## Start Engram with the defaults (extra flags: make run ARGS="--upstream http://127.0.0.1:8080")
run: $(STAMP)
	$(BIN)/engram serve $(ARGS)

## Run the whole test suite
test: $(DEV_STAMP)
	$(BIN)/python -m pytest $(ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check proxy tests scripts
	$(BIN)/ruff format --check proxy tests scripts

format: $(DEV_STAMP)
	$(BIN)/ruff format proxy tests scripts
	$(BIN)/ruff check --fix proxy tests scripts

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

bench: $(DEV_STAMP)
	$(BIN)/python scripts/bench_proxy.py $(ARGS)

## Regenerate config/engram.toml from the settings model
config: $(STAMP)
	$(BIN)/python -m proxy config --defaults > config/engram.toml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
