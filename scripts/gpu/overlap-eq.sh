#!/usr/bin/env bash
# overlap-eq.sh: the overlapped scheduler serves what the plain one serves
# (one GPU, bundle carried): two servers over the same random llama3-8b
# shape, with and without --disable-overlap-schedule, get the same batch of
# 16 requests (greedy, and seeded sampling with penalties) through
# /generate; their texts must be equal. Prints one line; logs in $OUT.
set -u
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp/overlap-eq}
mkdir -p "$log"
w=$(mktemp -d)
trap 'rm -rf "$w"; kill $(jobs -p) 2>/dev/null' EXIT
export XDG_CACHE_HOME=$w/cache
xz -dc gpu-bundle/bin/mooncake-go.xz >"$w/mc" && chmod +x "$w/mc" || { echo "FAIL no CLI in the bundle"; exit 1; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
health() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; return 1; }
body='{"text": ["The quick brown fox", "Once upon a time", "In the beginning", "A B C D", "1 2 3 4 5", "hello", "Disaggregated serving", "KV cache pages", "x", "y y y", "zz", "tensor", "graph", "queue", "step", "gap"], "sampling_params": [{"max_new_tokens": 96, "temperature": 0}, {"max_new_tokens": 80, "temperature": 0.8, "top_p": 0.9, "frequency_penalty": 0.5, "seed": 3}, {"max_new_tokens": 64, "temperature": 0}, {"max_new_tokens": 120, "temperature": 1.1, "top_k": 40, "seed": 9}, {"max_new_tokens": 96, "temperature": 0}, {"max_new_tokens": 33, "temperature": 0}, {"max_new_tokens": 70, "temperature": 0.7, "repetition_penalty": 1.2, "seed": 4}, {"max_new_tokens": 96, "temperature": 0}, {"max_new_tokens": 50, "temperature": 0}, {"max_new_tokens": 90, "temperature": 0.9, "min_p": 0.05, "seed": 5}, {"max_new_tokens": 96, "temperature": 0}, {"max_new_tokens": 17, "temperature": 0}, {"max_new_tokens": 96, "temperature": 0}, {"max_new_tokens": 61, "temperature": 0.6, "seed": 6}, {"max_new_tokens": 96, "temperature": 0}, {"max_new_tokens": 96, "temperature": 1.0, "presence_penalty": 0.8, "seed": 7}]}'
outs=()
for extra in "" "--disable-overlap-schedule"; do
	p=$(port)
	"$w/mc" serve --device cuda --random-weights llama3-8b --random-seed 7 --log-level warn $extra --port "$p" >"$log/serve${extra:+-plain}.log" 2>&1 &
	pid=$!
	health "http://127.0.0.1:$p" || { echo "FAIL no health ($extra): $(tail -3 "$log/serve${extra:+-plain}.log")"; exit 1; }
	curl -sf "http://127.0.0.1:$p/generate" -H 'Content-Type: application/json' -d "$body" >"$log/out${extra:+-plain}.json" || echo "FAIL generate ($extra)"
	curl -sf "http://127.0.0.1:$p/metrics" | grep -E '^mooncake_engine_queued_passes_total' >"$log/queued${extra:+-plain}.txt"
	kill $pid; wait $pid 2>/dev/null
done
python3 - "$log" <<'PY'
import json, sys
d = sys.argv[1]
a = json.load(open(f"{d}/out.json")); b = json.load(open(f"{d}/out-plain.json"))
q = open(f"{d}/queued.txt").read().split()[-1]; qp = open(f"{d}/queued-plain.txt").read().split()[-1]
diff = [i for i, (x, y) in enumerate(zip(a, b)) if x["text"] != y["text"] or x["meta_info"]["completion_tokens"] != y["meta_info"]["completion_tokens"]]
n = sum(x["meta_info"]["completion_tokens"] for x in a)
print(("FAIL" if diff or len(a) != 16 else "ok") + f" overlap vs plain: {len(a)} requests, {n} tokens, differing {diff}; queued passes {q} (plain {qp})")
PY
