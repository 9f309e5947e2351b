#!/bin/sh
# Golden references from transformers for the tiny random architectures.
#
# 1. Here (no torch needed): make the tiny HF directories, seed 0:
#        scripts/golden.sh                 -> build/golden/<shape>/
# 2. On the GPU machine (PyTorch + transformers), in one call of the device
#    tool with carry ["build/golden"]:
#        python3 scripts/py/golden.py --out "$OUT" build/golden/*
# 3. Here: copy the fixtures it wrote into the tree and run the check:
#        cp <files_at>/*.json internal/model/testdata/golden/
#        go test ./internal/compute/cpu -run Golden -v
set -eu
cd "$(dirname "$0")/.."
go build -o bin/mooncake-go ./cmd/mooncake-go
rm -rf build/golden
mkdir -p build/golden
for s in tiny tiny-llama3 tiny-qwen2 tiny-mistral tiny-qwen3 tiny-qwen3-moe tiny-mixtral tiny-qwen2-moe; do
	bin/mooncake-go convert --random --config "$s" --seed 0 --output "build/golden/$s" >/dev/null
done
du -sh build/golden
echo 'now, on the GPU machine: python3 scripts/py/golden.py --out "$OUT" build/golden/*  (carry build/golden)'
