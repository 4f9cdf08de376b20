# Two commands for a newcomer: `make run` and `make test`. Everything else is installed from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .make-stamps
MODELS := models
TINY := $(MODELS)/tiny-llama/config.json $(MODELS)/tiny-qwen2/config.json $(MODELS)/tiny-qwen3/config.json
# A CPU build of torch lies in /opt/wheels on our machines; elsewhere pip takes PyPI's.
PIP_FIND := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=

.PHONY: all run test test-gpu model venv apt-deps clean

all: test

# A bare Debian machine may lack Python itself or its venv module: install them from apt (we run as root there).
$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	@if ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
		echo "installing python3, python3-venv and python3-pip from apt"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip; \
	fi
	@touch $@

apt-deps: $(STAMPS)/apt

$(STAMPS)/venv: pyproject.toml | $(STAMPS)/apt
	@mkdir -p $(STAMPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PIP_FIND) "torch==2.13.0"
	$(PY) -m pip install -q $(PIP_FIND) -e ".[dev]"
	@touch $@

venv: $(STAMPS)/venv

$(TINY) &: scripts/make_tiny_models.py scripts/tiny_corpus.py | $(STAMPS)/venv
	$(PY) scripts/make_tiny_models.py --out $(MODELS)

model: $(TINY)

run: $(TINY)
	$(PY) -m engine.demo --model-path $(MODELS)/tiny-qwen2

test: $(TINY)
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

# On a CUDA machine: the GPU-marked tests (bf16 parity on the tiny models).
test-gpu: $(TINY)
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(STAMPS) $(MODELS) .pytest_cache
