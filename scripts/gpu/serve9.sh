#!/usr/bin/env bash
# serve9.sh: issue 9's serving figures on one H200 (repo root, bundle
# carried): a colocated llama3-8b-shape server (random bf16 weights made on
# the GPU) under `bench serve`:
#   1K in / 128 out, concurrency 32, 64 prompts   (with and without CUDA graphs)
#   1K in / 128 out, concurrency 128, 256 prompts
#   128 in / 1024 out, concurrency 64, 128 prompts (with and without the
#   overlapped scheduling)
# and, when bench serve has --shared-prefix-len, the prefix cache's figure:
# 8 groups sharing a 2K prefix, radix cache on vs --disable-radix-cache.
# One line per run; logs in $OUT. ONLY=prefix runs the prefix cache's pair
# alone; NO_PREFIX=1 leaves it out; ONLY=chunks runs the 1K-input pair at
# each of CHUNKS' --chunked-prefill-size.
set -u
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp/serve9}
mkdir -p "$log"
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
export XDG_CACHE_HOME=$w/cache
xz -dc gpu-bundle/bin/mooncake-go.xz >"$w/mc" && chmod +x "$w/mc" || { echo "FAIL no CLI in the bundle"; exit 1; }
mc=$w/mc
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
health() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "FAIL no health at $1"; return 1; }
M="--device cuda --random-weights llama3-8b --random-seed 7 --max-running-requests 256 --max-total-tokens 400000 --log-level warn"
summ() { python3 -c 'import json,sys; r=json.load(sys.stdin); t=r["ttft_ms"]; i=r["itl_ms"]; c=r.get("cached_token_share"); print(f"TTFT mean {t["mean"]:.1f} p50 {t["p50"]:.1f} p99 {t["p99"]:.1f} ms  ITL p50 {i["p50"]:.2f} p99 {i["p99"]:.2f} ms  {r["output_throughput"]:.0f} tok/s  failed {r["failed"]}" + (f"  cached {100*c:.0f}%" if c is not None else ""))'; }
run() { # label serve-extra bench-args...
	local label=$1 extra=$2
	shift 2
	local p
	p=$(port)
	$mc serve $M $extra --port "$p" >"$log/$label.serve.log" 2>&1 &
	local pid=$!
	if health "http://127.0.0.1:$p"; then
		echo -n "$label: "
		timeout 240 $mc bench serve --url "http://127.0.0.1:$p" --warmup 2 --json "$@" >"$log/$label.json" 2>"$log/$label.bench.log" &&
			summ <"$log/$label.json" || { echo "FAIL (rc $?)"; tail -3 "$log/$label.bench.log"; }
	else
		tail -5 "$log/$label.serve.log"
	fi
	kill $pid 2>/dev/null; wait $pid 2>/dev/null
}
if [ "${ONLY:-}" = chunks ]; then # CHUNKS="2048 8192": the 1K-input runs at each --chunked-prefill-size
	for c in ${CHUNKS:-2048 8192}; do
		run "in1k-c32-chunk$c" "--chunked-prefill-size $c" --input-len 1024 --output-len 128 --concurrency 32 --num-prompts 64
		run "in1k-c128-chunk$c" "--chunked-prefill-size $c" --input-len 1024 --output-len 128 --concurrency 128 --num-prompts 256
	done
	exit 0
fi
if [ "${ONLY:-}" != prefix ]; then
	run in1k-c32 "" --input-len 1024 --output-len 128 --concurrency 32 --num-prompts 64
	run in1k-c32-nograph "--disable-cuda-graph" --input-len 1024 --output-len 128 --concurrency 32 --num-prompts 64
	run in1k-c128 "" --input-len 1024 --output-len 128 --concurrency 128 --num-prompts 256
	run in128-out1k-c64 "" --input-len 128 --output-len 1024 --concurrency 64 --num-prompts 128
	run in128-out1k-c64-nooverlap "--disable-overlap-schedule" --input-len 128 --output-len 1024 --concurrency 64 --num-prompts 128
fi
if [ -z "${NO_PREFIX:-}" ] && $mc bench serve --help 2>&1 | grep -q -- --shared-prefix-len; then
	P="--shared-prefix-len 2048 --num-groups 8 --input-len 128 --output-len 32 --concurrency 16 --num-prompts 128"
	run prefix-radix "" $P
	run prefix-noradix "--disable-radix-cache" $P
fi
