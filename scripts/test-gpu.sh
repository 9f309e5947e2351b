#!/usr/bin/env bash
# test-gpu.sh: run ON the GPU machine from the repo root, after
# scripts/gpu-bundle.sh built gpu-bundle/ here and the call carried it.
# Unpacks the bundle, prints the GPUs and their topology, runs each test
# binary with -test.v in its package directory, writes logs to $OUT (if set,
# else gpu-bundle/logs), and ends with a summary. Exit status: non-zero if
# any test binary failed.
#   GPU_TEST_RUN=regexp   passed as -test.run
#   GPU_BENCH=1           also run the benchmarks (-test.bench=. -test.benchtime=${GPU_BENCHTIME:-20x})
#   GPU_TEST_TIMEOUT=300s per binary
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=${GPU_BUNDLE:-gpu-bundle}
log=${OUT:-$bundle/logs}
mkdir -p "$log"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

for f in "$bundle"/bin/*.xz; do
	[ -e "$f" ] || continue
	b=$(basename "${f%.xz}")
	xz -dc "$f" >"$work/$b" && chmod +x "$work/$b"
done
export MOONCAKE_SHARED=${MOONCAKE_SHARED:-$PWD/$bundle/shared}

{
	date -u
	nvidia-smi -L
	nvidia-smi topo -m
	nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv
	if [ -x "$work/mooncake-go" ]; then
		echo "--- mooncake-go topo"
		"$work/mooncake-go" topo
	fi
} 2>&1 | tee "$log/system.txt"

rc=0
for t in "$work"/*.test; do
	[ -e "$t" ] || continue
	name=$(basename "$t" .test)
	dir=$(echo "$name" | tr '.' '/')
	[ -d "$dir" ] || dir=.
	args=(-test.v -test.timeout "${GPU_TEST_TIMEOUT:-300s}")
	[ -n "${GPU_TEST_RUN:-}" ] && args+=(-test.run "$GPU_TEST_RUN")
	echo "=== $name"
	(cd "$dir" && "$t" "${args[@]}") >"$log/$name.log" 2>&1
	r=$?
	[ $r -ne 0 ] && rc=1
	grep -E '^(--- |ok|PASS|FAIL|panic)' "$log/$name.log" | grep -v -- '--- PASS' | head -40
	echo "exit $r"
	if [ "${GPU_BENCH:-0}" = 1 ]; then
		(cd "$dir" && "$t" -test.run '^$' -test.bench . -test.benchtime "${GPU_BENCHTIME:-20x}") >"$log/$name.bench.log" 2>&1 || rc=1
		grep -E '^Benchmark|ok|FAIL' "$log/$name.bench.log"
	fi
done
echo "logs in $log"
exit $rc
