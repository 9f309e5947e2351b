#!/usr/bin/env bash
# gpu-run.sh: run ON the two-GPU machine from the repo root, after
# GPU_TEST_PKGS=./pkg/transfer/nvlink scripts/gpu-bundle.sh built gpu-bundle/
# here and the call carried it. Runs the nvlink GPU tests (correctness,
# fabric fallback, speed table, 100 GiB pool), the cuda copier tests, `topo`,
# and `bench transfer --protocol nvlink --use-vram` (target GPU 0, initiator
# GPU 1, separate processes). Logs go to $OUT (or gpu-bundle/logs).
set -uo pipefail
cd "$(dirname "$0")/../../../.."
log=${OUT:-gpu-bundle/logs}
mkdir -p "$log"
w=$(mktemp -d)
for f in gpu-bundle/bin/*.xz; do b=$(basename "${f%.xz}"); xz -dc "$f" >"$w/$b"; chmod +x "$w/$b"; done
export MOONCAKE_NVLINK_TEST_KERNELS=$w/kernels XDG_CACHE_HOME=$w/cache
mc=$w/mooncake-go
{ date -u; nvidia-smi -L; nvidia-smi topo -m; echo "--- topo"; $mc topo; } >"$log/system.txt" 2>&1
cat "$log/system.txt"
(cd internal/cuda && timeout 60 "$w/internal.cuda.test" -test.v -test.run 'CopierLocal|CopierVaried|CrossProcess') >"$log/cuda.log" 2>&1
echo "cuda tests exit $?"; grep -E '^(--- FAIL|FAIL|ok|PASS|panic)' "$log/cuda.log" | head
(cd pkg/transfer/nvlink && timeout 200 "$w/pkg.transfer.nvlink.test" -test.v -test.timeout 190s) >"$log/nvlink.log" 2>&1
echo "nvlink tests exit $?"
grep -E '^(--- FAIL|FAIL|ok|PASS|panic)|fabric check|log line|refused|after kill|CEILING|100 GiB' "$log/nvlink.log" | head -40
grep -c -- '--- PASS' "$log/nvlink.log"
sed -n '/=== nvlink speed summary/,/^---/p' "$log/nvlink.log" | head -20
# BENCH_SPECS: "block batch [flags]" per case, ';'-separated.
IFS=';' read -ra specs <<<"${BENCH_SPECS:-4096 65536;65536 4096;1048576 256;4096 65536 --scatter;4096 65536 --scatter --page-list;16384 16384 --scatter --page-list}"
for spec in "${specs[@]}"; do
	set -- $spec
	for op in write read; do
		$mc bench transfer --mode target --protocol nvlink --use-vram --gpu-id 0 --local-server-name 127.0.0.1:0 >"$w/target.txt" 2>&1 &
		tp=$!
		for i in $(seq 100); do grep -q '^listening on' "$w/target.txt" && break; sleep 0.1; done
		seg=$(sed -n 's/^listening on //p' "$w/target.txt")
		echo "=== bench $op block=$1 batch=$2 ${*:3} (target GPU0 $seg, initiator GPU1)"
		timeout 60 $mc bench transfer --mode initiator --protocol nvlink --use-vram --gpu-id 1 --segment-id "$seg" \
			--operation $op --block-size $1 --batch-size $2 "${@:3}" --threads 4 --duration 2s --buffer-size 1073741824 2>&1 | tee -a "$log/bench.txt" | grep -v '^{"level"' | tail -4
		kill $tp; wait $tp 2>/dev/null
	done
done
