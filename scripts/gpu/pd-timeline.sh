#!/usr/bin/env bash
# pd-timeline.sh: where does 1P1D spend the time a colocated server does not?
# Prefill on GPU 0, decode on GPU 1 (8B shape, random weights), five 1K-token
# requests one after another through the LB, then the per-room log lines of
# both servers (debug level) side by side.
set -u
cd "$(dirname "$0")/../.."
w=$(mktemp -d)
xz -dc gpu-bundle/bin/mooncake-go.xz >"$w/mc" && chmod +x "$w/mc"
mc=$w/mc
export XDG_CACHE_HOME=$w/cache
M="--device cuda --random-weights llama3-8b --random-seed 7 --chunked-prefill-size 8192 --max-total-tokens 100000 --log-level debug"
$mc serve $M --base-gpu-id 0 --port 31000 --disaggregation-mode prefill --disaggregation-bootstrap-port 0 >"$w/prefill.log" 2>&1 &
$mc serve $M --base-gpu-id 1 --port 31001 --disaggregation-mode decode >"$w/decode.log" 2>&1 &
for p in 31000 31001; do for _ in $(seq 300); do curl -sf localhost:$p/health >/dev/null && break; sleep 0.2; done; done
$mc lb --prefill http://127.0.0.1:31000 --decode http://127.0.0.1:31001 --port 31002 --log-level warn >"$w/lb.log" 2>&1 &
for _ in $(seq 100); do curl -sf localhost:31002/health >/dev/null && break; sleep 0.1; done
python3 - <<'PY'
import json, random, time, urllib.request
random.seed(3)
for i in range(6):
    ids = [random.randint(3, 250) for _ in range(1024)]
    body = json.dumps({"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}).encode()
    t0 = time.time()
    r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:31002/generate", body, {"Content-Type": "application/json"}))
    first = None
    for line in r:
        if line.startswith(b"data: ") and first is None:
            first = time.time() - t0
    print(f"request {i}: TTFT {first*1e3:.2f} ms, total {(time.time()-t0)*1e3:.2f} ms", flush=True)
PY
sleep 0.5
echo "=== prefill"; grep -E "admitted|pushed|prefill computed|room done|first token" "$w/prefill.log" | tail -12 | cut -c1-200
echo "=== decode"; grep -E "admitted|kv in place|room result|first token|request\s" "$w/decode.log" | tail -10 | cut -c1-200
kill %1 %2 %3 2>/dev/null; wait 2>/dev/null
