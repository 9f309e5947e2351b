#!/usr/bin/env bash
# tcp-vram.sh: run ON a GPU machine from the repo root (after
# scripts/gpu-bundle.sh built gpu-bundle/ and the call carried it). Two
# processes on GPU 0, both forced to tcp: `bench transfer --use-vram`
# GPU->GPU (target --use-vram) and GPU->host (target host memory), write and
# read, against raw TCP between the same two processes in the same run.
#   BIN=path/to/mooncake-go  (default: unpacked from gpu-bundle/bin)
#   DUR=4s BUF=1073741824 BLOCKS="65536 1048576"
set -euo pipefail
cd "$(dirname "$0")/../.."
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
BIN=${BIN:-}
if [ -z "$BIN" ]; then
	xz -dc gpu-bundle/bin/mooncake-go.xz >"$work/mooncake-go" && chmod +x "$work/mooncake-go"
	BIN=$work/mooncake-go
fi
DUR=${DUR:-4s}
BUF=${BUF:-1073741824}
BLOCKS=${BLOCKS:-65536 1048576}
for target in vram host; do
	tflags=(--mode target --protocol tcp --local-server-name 127.0.0.1:0 --buffer-size "$BUF" --log-level warn)
	[ "$target" = vram ] && tflags+=(--use-vram)
	"$BIN" bench transfer "${tflags[@]}" >"$work/target.log" 2>&1 &
	tgt=$!
	for _ in $(seq 300); do grep -q "listening on" "$work/target.log" && break; sleep 0.1; done
	seg=$(grep -o "listening on [^ ]*" "$work/target.log" | awk '{print $3}')
	[ -n "$seg" ] || { cat "$work/target.log"; exit 1; }
	for op in write read; do
		for bs in $BLOCKS; do
			out=$("$BIN" bench transfer --mode initiator --segment-id "$seg" --protocol tcp --use-vram --operation $op \
				--block-size "$bs" --batch-size 128 --threads 4 --duration "$DUR" --buffer-size "$BUF" --baseline --json --log-level warn)
			python3 - "$out" "$target" <<'PY'
import json, sys
r = json.loads(sys.argv[1]); b = r.get("baseline") or {}
print(f"gpu->{sys.argv[2]:4s} {r['transport']} {r['operation']:5s} block {r['block_size']:8d}  {r['gb_per_s']:6.2f} GB/s  "
      f"raw-tcp {b.get('gb_per_s', 0):6.2f} GB/s  ratio {r.get('ratio', 0):.2f}  p50 {r['latency_p50_ms']:.2f} ms p99 {r['latency_p99_ms']:.2f} ms")
PY
		done
	done
	kill $tgt
	wait $tgt 2>/dev/null || true
done
