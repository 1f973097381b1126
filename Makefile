# kvsidecar: the single entry point. `make help` lists the targets.

GO        ?= go
PKGS      ?= ./...
FUZZTIME  ?= 10s
SOAK_MINUTES ?= 10
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

.PHONY: help build venv vllm-demo bench-vllm bench-staging soak test go-serial test-go test-quic-path test-0rtt test-python test-gpu-bundle flake-check flake-check-vllm e2e bench bench-once fuzz-short lint generate verify ci demo gpu-check gpu-bundle clean

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-11s %s\n", $$1, $$2}'

build: ## build bin/kvsidecar
	$(GO) build $(BUILDVCS) -o $(BIN) ./cmd/kvsidecar

venv: ## build the pinned Python environment .venv (vLLM, torch, pytest, ...) unless it is up to date
	VENV=$(VENV) PYTHON_BASE=$(PYTHON_BASE) python/tools/mkvenv.sh

# The connector is also checked against upstream vLLM 0.33.0, in an overlay
# of $(VENV): .venv-vllm033 holds vllm 0.33.0 alone
# (python/requirements-vllm033.txt) and takes the rest from $(VENV). Its
# tests keep vLLM's model-info cache apart (VLLM_CACHE_ROOT), so the two
# releases do not evict each other's.
VENV033   ?= .venv-vllm033
PYTHON033 := $(abspath $(VENV033))/bin/python
.PHONY: venv-vllm033 test-python-vllm033

venv-vllm033: venv ## build .venv-vllm033 (upstream vLLM 0.33.0 over .venv) unless it is up to date
	VENV=$(VENV033) REQS=python/requirements-vllm033.txt BASE_VENV=$(VENV) PYTHON_BASE=$(PYTHON_BASE) \
	  CHECK='vllm.v1.core.sched.scheduler kvsidecar.vllm.connector' python/tools/mkvenv.sh

test-python-vllm033: build venv-vllm033 ## the connector against upstream vLLM 0.33.0 (in .venv-vllm033): its base's methods, vLLM's real scheduler
	cd python && KVSIDECAR_BIN=$(CURDIR)/$(BIN) VLLM_CACHE_ROOT=$(abspath $(VENV033))/vllm-cache \
	  $(PYTHON033) -m pytest -q -rP -p no:cacheprovider tests/test_vllm_base.py tests/test_vllm_real_scheduler.py

# The Go checks one after another, beside the Python tests: a vLLM engine's
# start is three processes each importing vLLM on one core (about 60
# CPU-seconds over a minute on this 2-core machine), so the Go tests fill the
# other core. Each suite is the other's burner, so their deadlines are
# scaled as under `make flake-check`'s burners (KVSIDECAR_TIME_SCALE, 2 unless
# set; the e2e tests that wait out a lease or a deadline wait twice as long).
GO_TESTS := test-go test-quic-path test-0rtt test-gpu-bundle
BESIDE    = KVSIDECAR_TIME_SCALE=$${KVSIDECAR_TIME_SCALE:-2} $(MAKE) --no-print-directory -j2 --output-sync=line test-python go-serial

test: build venv ## every test: Go (race detector, shuffled; the connector and e2e suites also with every READ over QUIC; 0-RTT without it), the GPU bundle's build and the vLLM 0.33 checks, one after another, beside the Python tests (the README's test command)
	@$(BESIDE) GO_SERIAL='$(GO_TESTS) test-python-vllm033'

go-serial: # the targets in GO_SERIAL, one at a time (for test and ci)
	@for t in $(GO_SERIAL); do $(MAKE) --no-print-directory $$t || exit 1; done

test-go: ## run every Go test with the race detector, in shuffled order
	$(GO) test -race -shuffle=on $(PKGS)

test-quic-path: ## the connector and e2e suites again with the same-host path off (KVSIDECAR_SAME_HOST=off): every READ over QUIC
	KVSIDECAR_SAME_HOST=off $(GO) test -race -shuffle=on -count=1 ./connector/ ./e2e/

test-0rtt: ## the tests that need 0-RTT streams, which race builds never open (quic-go#4303): without the race detector
	$(GO) test -count=1 -run 'ZeroRTT|FirstKVByte|HandshakeBench' ./connector/ ./transfer/ ./cmd/kvsidecar/internal/demo/

test-gpu-bundle: ## make gpu-bundle builds, and its run.sh fails at once without a GPU (no GPU needed)
	GO=$(GO) .ci/gpu-bundle-check

test-python: build venv ## run the Python tests (pytest in .venv, against bin/kvsidecar), the real vLLM engines included
	cd python && KVSIDECAR_BIN=$(CURDIR)/$(BIN) $(PYTHON) -m pytest -q -rP -p no:cacheprovider

flake-check: ## every Go test (-race -shuffle=on -count=3) while a CPU burner keeps every core busy
	GO=$(GO) PKGS='$(PKGS)' .ci/flake-check

flake-check-vllm: build venv ## the zero-copy real-engine tests, 3 runs in a row, while a CPU burner keeps every core busy (not in CI)
	PYTHON=$(PYTHON) BIN=$(BIN) .ci/flake-check-vllm

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

ci: ## everything CI runs: the README's two commands (make test, make demo) and the rest (verify, bench-once, fuzz-short, lint), one after another beside the venv's build and the Python tests
	@$(BESIDE) GO_SERIAL='verify $(GO_TESTS) demo bench-once fuzz-short lint test-python-vllm033'

demo: ## the main job: prefill→decode on the host backend over a real trace
	@echo "make demo: building $(BIN) first (a cold build takes a minute or two)..."
	$(GO) build $(BUILDVCS) -o $(BIN) ./cmd/kvsidecar
	./$(BIN) demo

vllm-demo: build venv ## the main job for a vLLM user: prefill and decode vLLM engines on the CPU, token-exact against a single engine (VLLM_DEMO_FLAGS=--zero-copy: vLLM's KV cache in the sidecars' pages)
	$(PYTHON) python/tools/vllm_demo.py --kvsidecar $(BIN) $(VLLM_DEMO_FLAGS)

soak: build venv ## chaos soak (not in CI): staging and zero-copy vLLM engines for SOAK_MINUTES (10) under traffic while sidecars and engines are killed; every answer against a single engine, nothing held at the end
	$(PYTHON) python/tools/soak.py --kvsidecar $(BIN) --minutes $(SOAK_MINUTES) $(SOAK_FLAGS)

bench-vllm: build venv ## zero copy and staging beside vLLM's NixlConnector (pull, push) and one engine: decode TTFT taken apart, real transfers checked, a load mode (bench-vllm.json, .png)
	$(PYTHON) python/tools/bench_vllm.py --kvsidecar $(BIN) --out bench-vllm

bench-staging: venv ## the staging copies (Staging.save/load) of a 4096-token request against the byte index they replaced and a plain copy (BENCH_STAGING_FLAGS: --reps, --threads, --cases)
	$(PYTHON) python/tools/bench_staging.py $(BENCH_STAGING_FLAGS)

gpu-check: ## on a real GPU: conformance, local API device fds (e2e), demo --backend cuda; fails at once without one
	GO=$(GO) .ci/gpu-check

# The archive make gpu-bundle writes (under bin/, which git ignores).
GPU_BUNDLE ?= bin/kvsidecar-gpu-bundle.tar.gz

gpu-bundle: ## build bin/kvsidecar-gpu-bundle.tar.gz (GPU_BUNDLE): gpu-check's steps and a GPU bench, prebuilt, for a GPU machine with only the driver, bash and python3 (run.sh)
	GO=$(GO) .ci/gpu-bundle $(GPU_BUNDLE)

clean: ## remove build outputs
	rm -rf bin
