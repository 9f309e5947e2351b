#!/usr/bin/env bash
# tcp-profile.sh: run ON a GPU machine from the repo root (bundle carried):
# Go CPU profiles of `bench transfer --protocol tcp --use-vram` at one block
# size: the initiator of a read from a host-memory target (the initiator's
# receive side: socket -> staging -> device) and of a write to a GPU target,
# each with --baseline; profiles and results in $OUT (go tool pprof -top
# there). BS (65536), DUR (4s).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-/tmp/tcp-profile}
mkdir -p "$O"
work=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$work"' EXIT
xz -dc gpu-bundle/bin/mooncake-go.xz >"$work/mc" && chmod +x "$work/mc"
BS=${BS:-65536}
DUR=${DUR:-4s}
for c in "host read" "vram write"; do
	set -- $c
	tflags=(--mode target --protocol tcp --local-server-name 127.0.0.1:0 --buffer-size 1073741824 --log-level warn)
	[ "$1" = vram ] && tflags+=(--use-vram)
	"$work/mc" bench transfer "${tflags[@]}" >"$work/target.log" 2>&1 &
	tgt=$!
	for _ in $(seq 300); do grep -q "listening on" "$work/target.log" && break; sleep 0.1; done
	seg=$(grep -o "listening on [^ ]*" "$work/target.log" | awk '{print $3}')
	"$work/mc" bench transfer --mode initiator --segment-id "$seg" --protocol tcp --use-vram --operation "$2" \
		--block-size "$BS" --batch-size 128 --threads 4 --duration "$DUR" --buffer-size 1073741824 --baseline --json \
		--log-level warn --cpu-profile "$O/initiator-$1-$2.pprof" >"$O/result-$1-$2.json"
	echo "$1 $2: $(cat "$O/result-$1-$2.json" | head -c 400)"
	kill $tgt
	wait $tgt 2>/dev/null || true
done
