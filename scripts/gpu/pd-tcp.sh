#!/usr/bin/env bash
# pd-tcp.sh: run ON a GPU machine from the repo root (bundle carried). One
# GPU: a colocated server, then a prefill and a decode server both on GPU 0
# (--mem-fraction-static 0.4 each) forced to tcp
# (--disaggregation-transfer-backend tcp: what a second host would get),
# behind the LB; greedy outputs must equal colocated. MODEL picks the model
# flags (default: the random 8B shape in bf16), LENS the prompt lengths,
# BACKENDS the transfer backends of the pairs (default tcp; "tcp nvlink"
# also times TTFT, TTFT_LENS, of each, max_new_tokens 1, median of 3);
# P_FLAGS and D_FLAGS are more flags for the prefill and the decode server
# (e.g. "--tp 2 --base-gpu-id 0": prefill and decode of other TP sizes, on
# other GPUs); logs in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${OUT:-/tmp/pd-tcp}
mkdir -p "$log"
w=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$w"' EXIT
xz -dc gpu-bundle/bin/mooncake-go.xz >"$w/mc" && chmod +x "$w/mc" || { echo "FAIL no CLI in the bundle"; exit 1; }
mc=$w/mc
export XDG_CACHE_HOME=$w/cache
M=${MODEL:-"--random-weights llama3-8b --random-seed 7"}
M="--device cuda $M --mem-fraction-static 0.4 --log-level warn"
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
health() { for _ in $(seq 900); do curl -sf "$1/health" >/dev/null && return 0; sleep 0.2; done; echo "FAIL no health at $1"; return 1; }
LENS=${LENS:-100 1000 3000}
greedy() { # url out
	python3 - "$1" "$2" $LENS <<'PY'
import json, random, sys, urllib.request
url, out, lens = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
random.seed(11)
res = []
for n in lens:
    ids = [random.randint(3, 250) for _ in range(n)]
    body = json.dumps({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}).encode()
    r = json.load(urllib.request.urlopen(urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"}), timeout=120))
    res.append(r["output_ids"])
json.dump(res, open(out, "w"))
print("greedy outputs:", [x[:6] for x in res])
PY
}
ttft() { # url backend
	python3 - "$1" "$2" ${TTFT_LENS:-1024 4096} <<'PY'
import json, random, statistics, sys, time, urllib.request
url, be, lens = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
for n in lens:
    ts = []
    for rep in range(4):
        ids = [random.randint(3, 250) for _ in range(n)]  # fresh prompts: no prefix cache hit
        body = json.dumps({"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}).encode()
        t0 = time.perf_counter()
        urllib.request.urlopen(urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"}), timeout=120).read()
        if rep:
            ts.append(time.perf_counter() - t0)
    print(f"ttft {be} {n} tokens: median {1e3 * statistics.median(ts):.1f} ms of {len(ts)} (through the LB, 1P1D on one GPU)")
PY
}
echo "=== colocated"
p0=$(port)
$mc serve $M --port $p0 >"$log/colocated.log" 2>&1 &
c=$!
health "http://127.0.0.1:$p0" && greedy "http://127.0.0.1:$p0" "$w/colocated.json"
kill $c; wait $c 2>/dev/null
rc=0
for be in ${BACKENDS:-tcp}; do
	echo "=== 1P1D over $be (prefill: ${P_FLAGS:-GPU 0}; decode: ${D_FLAGS:-GPU 0})"
	pp=$(port); dp=$(port); lp=$(port)
	$mc serve $M ${P_FLAGS:-} --port $pp --disaggregation-mode prefill --disaggregation-bootstrap-port 0 --disaggregation-transfer-backend $be >"$log/prefill-$be.log" 2>&1 &
	pid_p=$!
	$mc serve $M ${D_FLAGS:-} --port $dp --disaggregation-mode decode --disaggregation-transfer-backend $be >"$log/decode-$be.log" 2>&1 &
	pid_d=$!
	if ! health "http://127.0.0.1:$pp" || ! health "http://127.0.0.1:$dp"; then
		tail -5 "$log/prefill-$be.log" "$log/decode-$be.log"
		exit 1
	fi
	$mc lb --prefill "http://127.0.0.1:$pp" --decode "http://127.0.0.1:$dp" --port $lp --log-level warn >"$log/lb-$be.log" 2>&1 &
	pid_l=$!
	health "http://127.0.0.1:$lp"
	rm -f "$w/pd.json" # a failed run must not compare the last backend's outputs
	greedy "http://127.0.0.1:$lp" "$w/pd.json" || { echo "FAIL greedy requests over $be"; rc=1; }
	[ -f "$w/pd.json" ] && python3 -c 'import json,sys; a=json.load(open(sys.argv[1])); b=json.load(open(sys.argv[2])); print("1P1D over", sys.argv[3], "greedy outputs equal colocated:", a==b); sys.exit(a!=b)' "$w/colocated.json" "$w/pd.json" $be || rc=1
	curl -s "http://127.0.0.1:$pp/metrics" | grep -E '^mooncake_transfer_bytes_total|^mooncake_disagg_transfer_seconds_(sum|count)|^mooncake_disagg_requests_total'
	[ "${BACKENDS:-tcp}" != tcp ] && ttft "http://127.0.0.1:$lp" $be
	kill $pid_l $pid_p $pid_d; wait $pid_l $pid_p $pid_d 2>/dev/null
done
exit $rc
