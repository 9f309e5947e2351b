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

.PHONY: build test test-race fixtures bench lint demo gpu-bundle fuzz clean

build:
	$(GO) build -o $(BIN) ./cmd/mooncake-go

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

demo: build
	./$(BIN) demo

gpu-bundle:
	bash scripts/gpu-bundle.sh

fuzz:
	$(GO) test -run '^$$' -fuzz FuzzRegionCheck -fuzztime 30s ./pkg/transfer/
	$(GO) test -run '^$$' -fuzz FuzzServerHandshake -fuzztime 30s ./pkg/transfer/
	$(GO) test -run '^$$' -fuzz FuzzReadFrame -fuzztime 30s ./pkg/transfer/
	$(GO) test -run '^$$' -fuzz FuzzDescriptorSeal -fuzztime 30s ./pkg/transfer/

clean:
	rm -rf bin gpu-bundle
