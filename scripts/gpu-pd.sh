#!/usr/bin/env bash
# gpu-pd.sh: run ON the two-GPU machine from the repo root after
# scripts/gpu-bundle.sh (the bundle carries the CLI, stories260K and its
# reference). It checks, with logs in $OUT:
#   1. the llama2.c -> HF conversion of stories260K against transformers'
#      LlamaForCausalLM (greedy tokens and logits);
#   2. an 8B-shape random-weight model (llama3-8b, bf16, weights made on the
#      GPU from one seed) colocated on GPU 0 vs 1P1D with prefill on GPU 0 and
#      decode on GPU 1 (KV over NVLink, auto backend): greedy outputs equal at
#      concurrency 1, and bench serve at inputs 1K/4K/8K (concurrency 1) and
#      concurrency 1/8/32 at 1K, outputs 128; the KV transfer's share of TTFT.
#   3. PD_VARIANTS="pass layer": the 1P1D round once per way of pushing the KV.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-gpu-bundle/logs}
mkdir -p "$log"
w=$(mktemp -d)
xz -dc gpu-bundle/bin/mooncake-go.xz >"$w/mc" && chmod +x "$w/mc"
mc=$w/mc
export XDG_CACHE_HOME=$w/cache
shared=gpu-bundle/shared

specs=${PD_SPECS:-"1024 1 3|4096 1 3|8192 1 3|1024 8 16|1024 32 32"}
if [ -z "${QUICK:-}" ]; then
echo "=== transformers check of the converted stories260K"
$mc convert --model-path $shared/models/stories260K/stories260K.bin --tokenizer-path $shared/models/stories260K/tok512.bin \
	--output "$w/s260hf" >/dev/null
timeout 120 python3 scripts/py/check_hf_greedy.py "$w/s260hf" $shared/reference/stories260K-greedy.json 2>&1 | grep -v Warning | tee "$log/transformers.txt"
fi

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
health() { for _ in $(seq 600); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "no health at $1"; return 1; }
M="--device cuda --random-weights llama3-8b --random-seed 7 --chunked-prefill-size 8192 --max-total-tokens 300000 --log-level warn"
bench() { # url label
	IFS='|' read -ra list <<<"$specs"
	for spec in "${list[@]}"; do
		set -- $1 $2 $spec
		echo -n "$2 input $3 conc $4: "
		timeout 120 $mc bench serve --url "$1" --input-len $3 --output-len 128 --concurrency $4 --num-prompts $5 --warmup 1 --json |
			python3 -c 'import json,sys; r=json.load(sys.stdin); t=r["ttft_ms"]; i=r["itl_ms"]; print(f"TTFT mean {t["mean"]:.1f} p50 {t["p50"]:.1f} p99 {t["p99"]:.1f} ms  ITL p50 {i["p50"]:.2f} p99 {i["p99"]:.2f} ms  {r["output_throughput"]:.0f} tok/s failed {r["failed"]}")'
	done
}
greedy() { # url out
	python3 - "$1" "$2" <<'PY'
import json, random, sys, urllib.request
url, out = sys.argv[1], sys.argv[2]
random.seed(11)
res = []
for n in (100, 1000, 3000):
    ids = [random.randint(3, 250) for _ in range(n)]
    body = json.dumps({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}).encode()
    r = json.load(urllib.request.urlopen(urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"}), timeout=120))
    res.append(r["output_ids"])
json.dump(res, open(out, "w"))
print("greedy outputs:", [x[:6] for x in res])
PY
}

echo "=== colocated on GPU 0"
p0=$(port)
$mc serve $M --base-gpu-id 0 --port $p0 >"$log/colocated.log" 2>&1 &
cpid=$!
if health "http://127.0.0.1:$p0"; then
	greedy "http://127.0.0.1:$p0" "$w/colocated.json"
	bench "http://127.0.0.1:$p0" colocated | tee "$log/bench-colocated.txt"
fi
kill $cpid; wait $cpid 2>/dev/null

# PD_VARIANTS: how the prefill pushes the KV, one 1P1D round each: "pass"
# (after each prefill pass) and/or "layer" (--disaggregation-push-by-layer).
for variant in ${PD_VARIANTS:-pass layer}; do
extra=""
[ "$variant" = layer ] && extra="--disaggregation-push-by-layer"
echo "=== 1P1D ($variant): prefill GPU 0, decode GPU 1, auto transport"
pp=$(port); dp=$(port); lp=$(port)
$mc serve $M --base-gpu-id 0 --port $pp --disaggregation-mode prefill --disaggregation-bootstrap-port 0 $extra >"$log/prefill-$variant.log" 2>&1 &
ppid=$!
$mc serve $M --base-gpu-id 1 --port $dp --disaggregation-mode decode >"$log/decode-$variant.log" 2>&1 &
dpid=$!
health "http://127.0.0.1:$pp" && health "http://127.0.0.1:$dp"
$mc lb --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" --port $lp --log-level warn >"$log/lb-$variant.log" 2>&1 &
lpid=$!
health "http://127.0.0.1:$lp"
greedy "http://127.0.0.1:$lp" "$w/pd-$variant.json"
python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); print("1P1D greedy outputs equal colocated:", a==b)' "$w/colocated.json" "$w/pd-$variant.json"
bench "http://127.0.0.1:$lp" "1P1D-$variant" | tee "$log/bench-pd-$variant.txt"
curl -s "http://127.0.0.1:$pp/metrics" >"$log/prefill-metrics-$variant.txt"
grep -E '^mooncake_transfer_bytes_total|^mooncake_disagg_transfer_seconds_(sum|count)|^mooncake_disagg_kv_tail_seconds_(sum|count)|^mooncake_disagg_pushes_total|^mooncake_disagg_transfer_bytes_total|^mooncake_disagg_requests_total' "$log/prefill-metrics-$variant.txt"
curl -s "http://127.0.0.1:$dp/metrics" | grep -E '^mooncake_engine_prefill_tokens_total|^mooncake_disagg_requests_total'
kill $lpid $ppid $dpid; wait 2>/dev/null
tail -3 "$log/prefill-$variant.log" "$log/decode-$variant.log"
done
