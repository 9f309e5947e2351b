#!/usr/bin/env bash
# Transfer engine between two processes on this machine, against a plain
# baseline measured in the same run (docs/BENCHMARKS.md):
#   scripts/bench-transfer.sh [PROTOCOL...]   (default: tcp shm)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./bin/mooncake-go
[ -x "$BIN" ] || make build >/dev/null
DUR=${DUR:-3s}
BUF=${BUF:-268435456}
LOG=$(mktemp)
$BIN bench transfer --mode target --local-server-name 127.0.0.1:0 --buffer-size "$BUF" --log-level warn >"$LOG" 2>&1 &
tgt=$!
trap 'kill $tgt 2>/dev/null; wait 2>/dev/null' EXIT
for _ in $(seq 100); do grep -q "listening on" "$LOG" && break; sleep 0.1; done
seg=$(grep -o "listening on [^ ]*" "$LOG" | awk '{print $3}')
for proto in "${@:-tcp shm}"; do
  for op in write read; do
    for bs in 4096 65536 262144 1048576; do
      out=$($BIN bench transfer --mode initiator --segment-id "$seg" --protocol "$proto" --operation $op --block-size $bs \
        --batch-size 128 --threads 4 --duration "$DUR" --buffer-size "$BUF" --baseline --json --log-level warn)
      python3 - "$out" <<'PY'
import json, sys
r = json.loads(sys.argv[1]); b = r["baseline"]
print(f"{r['transport']:4s} {r['operation']:5s} block {r['block_size']:8d}  {r['gb_per_s']:7.2f} GB/s  "
      f"baseline {b['kind']} {b['gb_per_s']:7.2f} GB/s  ratio {r['ratio']:.2f}  "
      f"p50 {r['latency_p50_ms']:.2f} ms p99 {r['latency_p99_ms']:.2f} ms")
PY
    done
  done
done
