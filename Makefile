# kvsidecar: the single entry point. `make help` lists the targets.

GO        ?= go
PKGS      ?= ./...
FUZZTIME  ?= 10s
BIN       ?= bin/kvsidecar
PROTOC    ?= protoc
# bin/kvsidecar carries the git revision (`kvsidecar version`, kvsidecar_build_info)
# whenever git can read this checkout's last commit, even where GOFLAGS says
# -buildvcs=false. Expanded only by the recipes that build it.
BUILDVCS   = $(shell git log -1 --format=%H >/dev/null 2>&1 && echo -buildvcs=auto || echo -buildvcs=false)
# The Python tests, tools and the vLLM runs use the project's environment,
# built by `make venv` from python/requirements.txt with PYTHON_BASE (3.11).
VENV      ?= .venv
PYTHON_BASE ?= python3
PYTHON    := $(abspath $(VENV))/bin/python

.PHONY: help build venv vllm-demo bench-vllm test test-go test-0rtt test-python flake-check e2e bench bench-once fuzz-short lint generate verify ci demo gpu-check clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-11s %s\n", $$1, $$2}'

build: ## build bin/kvsidecar
	$(GO) build $(BUILDVCS) -o $(BIN) ./cmd/kvsidecar

venv: ## build the pinned Python environment .venv (vLLM, torch, pytest, ...) unless it is up to date
	VENV=$(VENV) PYTHON_BASE=$(PYTHON_BASE) python/tools/mkvenv.sh

test: test-go test-0rtt test-python ## every test: Go (race detector, shuffled; 0-RTT without it) and Python (the README's test command)

test-go: ## run every Go test with the race detector, in shuffled order
	$(GO) test -race -shuffle=on $(PKGS)

test-0rtt: ## the tests that need 0-RTT streams, which race builds never open (quic-go#4303): without the race detector
	$(GO) test -count=1 -run 'ZeroRTT|FirstKVByte|HandshakeBench' ./connector/ ./transfer/ ./cmd/kvsidecar/internal/demo/

test-python: build venv ## run the Python tests (pytest in .venv, against bin/kvsidecar), the real vLLM engines included
	cd python && KVSIDECAR_BIN=$(CURDIR)/$(BIN) $(PYTHON) -m pytest -q -rP -p no:cacheprovider

flake-check: ## every Go test (-race -shuffle=on -count=3) while a CPU burner keeps every core busy
	GO=$(GO) PKGS='$(PKGS)' .ci/flake-check

e2e: ## run the black-box tests of the built binary
	$(GO) test -race -count=1 ./e2e/...

bench: ## run the benchmarks
	$(GO) test -run '^$$' -bench . -benchmem $(PKGS)

bench-once: ## run each benchmark once so they keep compiling and running
	$(GO) test -run '^$$' -bench . -benchtime 1x $(PKGS)

fuzz-short: ## run every fuzz target for FUZZTIME each; fails only on a written failing input
	FUZZTIME=$(FUZZTIME) GO=$(GO) .ci/fuzz-short

lint: venv ## gofmt and go vet (with and without cgo); ruff and mypy over python/ (pinned in .venv)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	CGO_ENABLED=0 $(GO) vet $(PKGS)
	cd python && $(PYTHON) -m ruff check .
	$(PYTHON) -m mypy

# The files `make generate` writes beside the protobuf code: Go's limits and
# error reasons for the Python client (internal/pygen).
PYGEN_OUT := python/kvsidecar/limits.py python/kvsidecar/reasons.py

generate: ## regenerate proto/kvsidecar/v1/*.pb.go, python/kvsidecar/v1/*_pb2.py(i) (needs protoc: apt-get install protobuf-compiler), and python/kvsidecar/{limits,reasons}.py from Go
	@command -v $(PROTOC) >/dev/null || { echo "protoc not found: apt-get install protobuf-compiler"; exit 1; }
	$(PROTOC) --proto_path=proto --plugin=protoc-gen-go="$$($(GO) tool -n protoc-gen-go)" \
	  --go_out=proto --go_opt=paths=source_relative --python_out=python --pyi_out=python proto/kvsidecar/v1/*.proto
	$(GO) run ./internal/pygen -out python/kvsidecar

verify: generate ## generated code (Go and Python) and go.mod are up to date; builds without cgo
	git diff --exit-code -- proto python/kvsidecar/v1 $(PYGEN_OUT) go.mod go.sum
	@out=$$(git ls-files --others --exclude-standard -- proto python/kvsidecar/v1 $(PYGEN_OUT)); \
	  if [ -n "$$out" ]; then echo "generated files not checked in:"; echo "$$out"; exit 1; fi
	$(GO) mod tidy -diff
	CGO_ENABLED=0 $(GO) build ./...

ci: lint verify test demo bench-once fuzz-short ## everything CI runs: the README's two commands (make test, make demo) and the rest

demo: ## the main job: prefill→decode on the host backend over a real trace
	@echo "make demo: building $(BIN) first (a cold build takes a minute or two)..."
	$(GO) build $(BUILDVCS) -o $(BIN) ./cmd/kvsidecar
	./$(BIN) demo

vllm-demo: build venv ## the main job for a vLLM user: prefill and decode vLLM engines on the CPU, token-exact against a single engine (VLLM_DEMO_FLAGS=--zero-copy: vLLM's KV cache in the sidecars' pages)
	$(PYTHON) python/tools/vllm_demo.py --kvsidecar $(BIN) $(VLLM_DEMO_FLAGS)

bench-vllm: build venv ## KVSidecarConnector beside vLLM's NixlConnector and a single engine: TTFT and KV transfer time per prompt length (bench-vllm.json, bench-vllm.png)
	$(PYTHON) python/tools/bench_vllm.py --kvsidecar $(BIN) --out bench-vllm

gpu-check: ## on a real GPU: conformance, local API device fds (e2e), demo --backend cuda; fails at once without one
	GO=$(GO) .ci/gpu-check

clean: ## remove build outputs
	rm -rf bin
