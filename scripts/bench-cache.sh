#!/usr/bin/env bash
# Prefix caching and cache-aware routing on the shared-prefix workload
# (docs/BENCHMARKS.md): 8 groups of prompts, each its group's prefix then
# tokens of its own.
#
#   scripts/bench-cache.sh [colocated|pd|all]
#
# colocated: one server with the radix cache, one with --disable-radix-cache,
#   the same load on each in turn, ROUNDS times, the order alternating (the
#   cached one flushed first).
# pd: 2 prefill + 2 decode servers behind an LB, round_robin and cache_aware
#   in turn, ROUNDS times, the order alternating (caches flushed through the
#   LB first); the prefill servers'
#   KV pools hold PD_PREFILL_TOKENS, about half of the groups' prefixes.
# Prints one line per run and the ratios of each round (same round, same
# machine state). Defaults: the stories110m shape (random f32 weights, written
# once into .cache/stories110m), a 768-token prefix and 128-token suffixes.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=./bin/mooncake-go
WHAT=${1:-all}
MODEL=${MODEL:-.cache/stories110m}
PREFIX=${PREFIX:-768}
SUFFIX=${SUFFIX:-128}
OUT=${OUT:-8}
NGROUPS=${NGROUPS:-8}
NUM=${NUM:-32}
CONC=${CONC:-1}
PD_CONC=${PD_CONC:-2}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-1}
PAGE=${PAGE:-64}
PD_PREFILL_TOKENS=${PD_PREFILL_TOKENS:-4096}
MAX_ID=${MAX_ID:-250}
[ -x "$BIN" ] || make build >/dev/null
[ -f "$MODEL/config.json" ] || $BIN convert --random --config stories110m --output "$MODEL" >/dev/null
LOG=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { for _ in $(seq 1200); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.1; done; echo "no health at $1" >&2; exit 1; }
serve() { # name args... -> URL; the pid goes into pids via a file
  local name=$1; shift
  local port; port=$(free_port)
  $BIN serve --model-path "$MODEL" --port "$port" --threads "$THREADS" --page-size "$PAGE" --log-level warn \
    --disaggregation-timeout 300s "$@" >"$LOG/$name.log" 2>&1 &
  echo $! >>"$LOG/pids"
  echo "http://127.0.0.1:$port"
}
adopt() { while read -r p; do pids+=("$p"); done <"$LOG/pids"; : >"$LOG/pids"; }
bench() { # url conc [bench flags...]
  local url=$1 conc=$2; shift 2
  $BIN bench serve --url "$url" --shared-prefix-len "$PREFIX" --num-groups "$NGROUPS" --input-len "$SUFFIX" --output-len "$OUT" \
    --num-prompts "$NUM" --concurrency "$conc" --max-token-id "$MAX_ID" --warmup 1 --timeout 20m --json "$@"
}
report() { # label json
  python3 - "$@" <<'PY'
import json, sys
label, j = sys.argv[1], json.loads(sys.argv[2])
t = j["ttft_ms"]
comp = j.get("prefill_tokens_computed")
print(f"{label:24s} TTFT p50 {t['p50']:9.1f} p99 {t['p99']:9.1f} ms  {j['request_throughput']:6.3f} req/s  "
      f"{j['output_throughput']:7.2f} tok/s  cached {100 * j['cached_token_share']:5.1f}%  "
      f"computed {comp if comp is not None else '-'}  failed {j['failed']}", flush=True)
PY
}
ratio() { # label json_a json_b: a over b
  python3 - "$@" <<'PY'
import json, sys
label, a, b = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
ca, cb = a.get("prefill_tokens_computed"), b.get("prefill_tokens_computed")
comp = f", prompt tokens computed {cb / ca:.2f}x fewer" if ca and cb else ""
share = f", cached share {a['cached_token_share'] / b['cached_token_share']:.2f}x" if b["cached_token_share"] else ""
print(f"  {label}: TTFT p50 {b['ttft_ms']['p50'] / a['ttft_ms']['p50']:.2f}x lower, "
      f"throughput {a['request_throughput'] / b['request_throughput']:.2f}x{share}{comp}", flush=True)
PY
}
echo "model $MODEL, $NGROUPS groups, prefix $PREFIX + suffix $SUFFIX, output $OUT, $NUM prompts, page $PAGE, threads $THREADS per server, $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"

if [ "$WHAT" = colocated ] || [ "$WHAT" = all ]; then
  on=$(serve radix-on); off=$(serve radix-off --disable-radix-cache); adopt
  wait_health "$on"; wait_health "$off"
  for r in $(seq "$ROUNDS"); do
    curl -sf -XPOST "$on/flush_cache" >/dev/null
    if [ $((r % 2)) = 1 ]; then # the order alternates
      a=$(bench "$on" "$CONC"); report "round $r radix cache" "$a"
      b=$(bench "$off" "$CONC"); report "round $r no radix cache" "$b"
    else
      b=$(bench "$off" "$CONC"); report "round $r no radix cache" "$b"
      a=$(bench "$on" "$CONC"); report "round $r radix cache" "$a"
    fi
    ratio "round $r cache / none" "$a" "$b"
    echo "  load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
  cleanup; pids=()
fi

if [ "$WHAT" = pd ] || [ "$WHAT" = all ]; then
  p1=$(serve prefill1 --disaggregation-mode prefill --disaggregation-bootstrap-port 0 --max-total-tokens "$PD_PREFILL_TOKENS")
  p2=$(serve prefill2 --disaggregation-mode prefill --disaggregation-bootstrap-port 0 --max-total-tokens "$PD_PREFILL_TOKENS")
  d1=$(serve decode1 --disaggregation-mode decode); d2=$(serve decode2 --disaggregation-mode decode); adopt
  for u in "$p1" "$p2" "$d1" "$d2"; do wait_health "$u"; done
  for r in $(seq "$ROUNDS"); do
    declare -A js=()
    order="round_robin cache_aware"
    [ $((r % 2)) = 1 ] || order="cache_aware round_robin" # the order alternates
    for policy in $order; do
      lbp=$(free_port)
      $BIN lb --prefill "$p1" --prefill "$p2" --decode "$d1" --decode "$d2" --port "$lbp" --policy "$policy" --log-level warn \
        --upstream-idle-timeout 10m >"$LOG/lb-$policy-$r.log" 2>&1 &
      lbpid=$!
      wait_health "http://127.0.0.1:$lbp"
      curl -sf -XPOST "http://127.0.0.1:$lbp/flush_cache" >/dev/null
      js[$policy]=$(bench "http://127.0.0.1:$lbp" "$PD_CONC" --metrics-url "$p1" --metrics-url "$p2")
      report "round $r 2P2D $policy" "${js[$policy]}"
      kill "$lbpid"; wait "$lbpid" 2>/dev/null || true
    done
    ratio "round $r cache_aware / round_robin" "${js[cache_aware]}" "${js[round_robin]}"
    echo "  load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
fi
