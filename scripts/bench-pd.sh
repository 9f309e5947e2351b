#!/usr/bin/env bash
# Colocated vs 1P1D over shm vs 1P1D over tcp on one machine, same model and
# load: TTFT, ITL and the KV transfer's share of TTFT (docs/BENCHMARKS.md).
#
#   scripts/bench-pd.sh [MODEL_DIR] [INPUT_LEN] [OUTPUT_LEN] [CONCURRENCY] [NUM_PROMPTS]
#
# MODEL_DIR defaults to a stories110m-shape random model written once into
# .cache/stories110m. Prints one line per configuration and the raw JSON.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./bin/mooncake-go
MODEL=${1:-.cache/stories110m}
IN=${2:-256}
OUT=${3:-32}
CONC=${4:-1}
NUM=${5:-8}
THREADS=${THREADS:-1}
# PREFILL_ARGS: extra flags for the prefill servers (e.g. --disaggregation-push-by-layer).
PREFILL_ARGS=${PREFILL_ARGS:-}
[ -x "$BIN" ] || make build >/dev/null
[ -f "$MODEL/config.json" ] || $BIN convert --random --config stories110m --output "$MODEL" >/dev/null
LOG=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.1; done; echo "no health at $1" >&2; exit 1; }
serve() { # name args...
  local name=$1; shift
  local port; port=$(free_port)
  $BIN serve --model-path "$MODEL" --port "$port" --threads "$THREADS" --log-level warn --disaggregation-timeout 120s "$@" \
    >"$LOG/$name.log" 2>&1 &
  pids+=($!)
  echo "http://127.0.0.1:$port"
}
metric() { # url name -> sum of the metric's samples
  curl -s "$1/metrics" | awk -v n="$2" '$1 ~ "^"n"({|$)" {s+=$2} END {printf "%.6f", s}'
}
bench() { $BIN bench serve --url "$1" --input-len "$IN" --output-len "$OUT" --concurrency "$CONC" --num-prompts "$NUM" --warmup 1 --json; }
report() { # label json transfer_s transfer_n [tail_s tail_n]
  python3 - "$@" <<'PY'
import json, sys
label, js, xs, xn = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
ts, tn = (float(sys.argv[5]), float(sys.argv[6])) if len(sys.argv) > 6 else (0, 0)
t = js["ttft_ms"]; i = js["itl_ms"]
share = ""
if xn > 0:
    per = xs / xn * 1e3
    share = f"  kv transfer {per:.2f} ms/request = {100 * per / t['mean']:.2f}% of mean TTFT"
if tn > 0:
    share += f", {ts / tn * 1e3:.2f} ms after the first token (kv tail)"
print(f"{label:14s} TTFT p50 {t['p50']:8.2f} p99 {t['p99']:8.2f} ms  ITL p50 {i['p50']:6.2f} p99 {i['p99']:6.2f} ms  "
      f"{js['output_throughput']:7.1f} tok/s  failed {js['failed']}{share}")
PY
}
echo "model $MODEL, input $IN, output $OUT, concurrency $CONC, prompts $NUM, threads $THREADS per server"

c=$(serve colocated); wait_health "$c"
report colocated "$(bench "$c")" 0 0
cleanup; pids=()

for backend in shm tcp; do
  # shellcheck disable=SC2086
  p=$(serve prefill-$backend --disaggregation-mode prefill --disaggregation-bootstrap-port 0 --disaggregation-transfer-backend $backend $PREFILL_ARGS)
  d=$(serve decode-$backend --disaggregation-mode decode --disaggregation-transfer-backend $backend)
  wait_health "$p"; wait_health "$d"
  lbp=$(free_port)
  $BIN lb --prefill "$p" --decode "$d" --port "$lbp" --log-level warn >"$LOG/lb-$backend.log" 2>&1 &
  pids+=($!)
  wait_health "http://127.0.0.1:$lbp"
  js=$(bench "http://127.0.0.1:$lbp")
  report "1P1D $backend" "$js" "$(metric "$p" mooncake_disagg_transfer_seconds_sum)" "$(metric "$p" mooncake_disagg_transfer_seconds_count)" \
    "$(metric "$p" mooncake_disagg_kv_tail_seconds_sum)" "$(metric "$p" mooncake_disagg_kv_tail_seconds_count)"
  cleanup; pids=()
done
