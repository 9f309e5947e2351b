#!/usr/bin/env bash
# gpu-bundle.sh: build here (no Go toolchain on the GPU machines) everything
# scripts/test-gpu.sh runs there, into the git-ignored folder gpu-bundle/:
#   bin/mooncake-go.xz          stripped CLI (when cmd/mooncake-go builds)
#   bin/<pkg path with dots>.test.xz   GPU test binaries (go test -c, stripped)
#   shared/models/stories260K   a copy of the small model (MOONCAKE_SHARED there)
# Pass it to the device with carry=["gpu-bundle"] (64 MiB at most).
# Extra packages: GPU_TEST_PKGS="./pkg/transfer/nvlink ./internal/compute/cuda" scripts/gpu-bundle.sh
set -euo pipefail
cd "$(dirname "$0")/.."
out=gpu-bundle
shared=${MOONCAKE_SHARED:-../shared}
pkgs=(./internal/dl ./internal/cuda ./internal/topo ./pkg/transfer/nvlink)
# shellcheck disable=SC2206
pkgs+=(${GPU_TEST_PKGS:-})

rm -rf "$out"
mkdir -p "$out/bin" "$out/shared/models" "$out/shared/reference"
export CGO_ENABLED=1
export CGO_CFLAGS="${CGO_CFLAGS:--O2 -g} -Wno-deprecated-declarations" # go-nvml's deprecated NVML calls

if [ -d cmd/mooncake-go ]; then
	if go build -trimpath -ldflags "-s -w" -o "$out/bin/mooncake-go" ./cmd/mooncake-go; then
		echo "built mooncake-go"
	else
		echo "warning: cmd/mooncake-go does not build; bundle has no CLI" >&2
	fi
fi
for p in "${pkgs[@]}"; do
	name=$(echo "${p#./}" | tr '/' '.')
	go test -c -trimpath -ldflags "-s -w" -o "$out/bin/$name.test" "$p"
	echo "built $name.test"
done
xz -T0 -6 "$out"/bin/*
if [ -d "$shared/models/stories260K" ]; then
	cp -r "$shared/models/stories260K" "$out/shared/models/"
	cp "$shared/reference/stories260K-greedy.json" "$out/shared/reference/"
else
	echo "warning: $shared/models/stories260K not found" >&2
fi
du -sh "$out"
ls -l "$out/bin"
