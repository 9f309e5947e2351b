# mooncake-go. `make demo` runs the whole thing on this machine; `make test`
# runs every test CI runs.
GO        ?= go
BIN       := bin/mooncake-go
# The real-process suite runs on its own, after the rest, so its timing
# bounds are not measured while other packages compete for the 2 cores.
E2E       := ./test/e2e
PKGS       = $(shell $(GO) list ./... | grep -v /test/e2e)
# Packages tested again under the race detector and allocator invariants.
RACE_PKGS := ./pkg/transfer/... ./internal/kvcache/... ./internal/engine/... ./internal/disagg/... ./internal/lb/...
export MOONCAKE_SHARED ?= $(abspath ../shared)
# go-nvml's C bindings call NVML functions NVIDIA marked deprecated: without this,
# every fresh build prints ~150 lines of -Wdeprecated-declarations about them. Go's
# default flags (-O2 -g) are kept; a CGO_CFLAGS of the caller's is extended.
export CGO_CFLAGS := $(or $(CGO_CFLAGS),-O2 -g) -Wno-deprecated-declarations

.PHONY: build test test-race fixtures bench lint demo gpu-bundle fuzz clean

# The binary's version (mooncake-go version) comes from its build info: the
# module's version and the VCS revision and time. Go stamps the revision in a
# clone, not in a git worktree: the linker flags carry it there.
CLI       := github.com/mooncake-go/mooncake-go/internal/cli
LDFLAGS   := -X $(CLI).revision=$(shell git rev-parse HEAD 2>/dev/null) \
             -X $(CLI).revisionTime=$(shell git log -1 --format=%cI 2>/dev/null) \
             -X $(CLI).revisionModified=$(shell git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo true)
build:
	$(GO) build -buildvcs=auto -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/mooncake-go

fixtures:
	bash scripts/npm-fixtures.sh
	bash scripts/npm-openai.sh

test: fixtures build lint
	$(GO) test -count=1 -timeout 20m $(PKGS)
	$(GO) test -count=1 -timeout 10m $(E2E)
	$(GO) test -count=1 -race -tags invariants -timeout 20m $(RACE_PKGS)

bench: build
	$(GO) test -run '^$$' -bench . -benchtime 2s ./pkg/transfer/... ./internal/compute/...

lint:
	@test -z "$$(gofmt -l $$(git ls-files '*.go'))" || (gofmt -l $$(git ls-files '*.go'); echo "gofmt needed"; exit 1)
	$(GO) vet ./...
	bash scripts/check-imports.sh

# One request through the LB, a breakdown, and it stops (DEMO_FLAGS=--keep-serving keeps serving).
demo: build
	./$(BIN) demo $(DEMO_FLAGS)

gpu-bundle:
	bash scripts/gpu-bundle.sh

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzRegionCheck -fuzztime 30s ./pkg/transfer/
	$(GO) test -run '^$$' -fuzz FuzzServerHandshake -fuzztime 30s ./pkg/transfer/
	$(GO) test -run '^$$' -fuzz FuzzReadFrame -fuzztime 30s ./pkg/transfer/
	$(GO) test -run '^$$' -fuzz FuzzDescriptorSeal -fuzztime 30s ./pkg/transfer/

clean:
	rm -rf bin gpu-bundle
