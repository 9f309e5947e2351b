#!/usr/bin/env bash
# issue9.sh: issue 9 on one H200 (nvidia-h200): the explicit stream, pass
# plans and CUDA graphs for decode, sampling on the GPU, and the decode
# kernels (item 4). STAGES picks the stages (default all); the limits of all
# of them add up to more than one device call allows, so run it twice:
#   STAGES="cuda core fused sample rest"   correctness (~5 minutes at most)
#   STAGES="kernels bench"                 timings (~4 minutes at most)
# Build here first, then run there with the bundle carried:
#   GPU_TEST_PKGS=./internal/compute/cuda scripts/gpu-bundle.sh
#   run(command="STAGES='...' bash scripts/gpu/issue9.sh", carry=["gpu-bundle"], timeout_s=600)
# Stages, each independent (a failing or hanging one does not stop the
# others), each ending in a PASS or FAIL line:
#   1 cuda   internal/cuda GPU tests (graph capture/replay/update among them)
#   2 core   internal/compute/cuda: graph == eager (f32, bit for bit), capture
#            fallback, step timing, stories260K exactness, batch invariance
#   3 fused  the decode kernels of item 4 against the old ones (TestFusedDecode:
#            bit for bit where the arithmetic is the same, near elsewhere;
#            programmatic launches; TestKernelsV2: every kernel loads)
#   4 sample sampling on the GPU: the GPU sampler picks the CPU sampler's
#            token for every mode, seeds, steps, batches 1..256, vocabularies
#            32000 and 128256, logprobs and top ids equal (TestSampleMatchesCPU);
#            Philox and E bit for bit (TestSamplePhiloxExp); ForwardSample
#            through sampling graphs == Forward + CPU sampler, with a host
#            step handed back (TestForwardSampleMatchesHost)
#   5 rest   the other internal/compute/cuda tests (vs CPU, flash prefill,
#            kernel sets, small kernels, plan tests)
#   6 kernels TestKernelBench8B: the decode kernels one by one at the 8B
#            shape, old and new side by side (fused GEMVs at 1-4 tokens,
#            gemm_sk vs cuBLAS at 1-32, attention at batch 1-256 x ctx
#            1K-32K as a one-layer benchmark), outputs checked old vs new
#   7 bench  TestBenchGraph8B: llama3-8b decode with and without graphs at
#            batch 1/32/128 ctx 1K and batch 8 ctx 8K, the step gap, and the
#            HBM read floor measured in the same run: new kernels, new with
#            programmatic dependent launch, old kernels; sampling on the host
#            vs on the GPU (step time and gap)
# Logs in $OUT (10 files); the summary, the kernel tables and the bench table
# print last.
set -u
O=${OUT:-/tmp/issue9}
mkdir -p "$O"
root=$PWD
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
export XDG_CACHE_HOME=$w/cache
export MOONCAKE_SHARED=$root/gpu-bundle/shared
sum=$O/summary.txt
: >"$sum"
note() { echo "$*" | tee -a "$sum"; }

{
	date -u
	nvidia-smi -L
	nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem --format=csv
	uname -r
} >"$O/system.txt" 2>&1
note "$(head -3 "$O/system.txt" | tr '\n' ' ')"

for b in internal.cuda.test internal.compute.cuda.test; do
	if ! { xz -dc "gpu-bundle/bin/$b.xz" >"$w/$b" && chmod +x "$w/$b"; }; then
		note "FAIL unpack $b (build the bundle with GPU_TEST_PKGS=./internal/compute/cuda)"
	fi
done

# stage NAME LIMIT_S PKGDIR BINARY ARGS...: runs a test binary in its
# package directory, logs to $O/NAME.log, prints PASS or FAIL with counts.
stage() {
	local name=$1 limit=$2 dir=$3 bin=$4
	shift 4
	local log=$O/$name.log t0=$SECONDS rc
	if [ ! -x "$w/$bin" ]; then
		note "FAIL $name: no binary $bin"
		return
	fi
	(cd "$root/$dir" && timeout -k 10 "$limit" "$w/$bin" -test.v -test.timeout "$((limit - 5))s" "$@") >"$log" 2>&1
	rc=$?
	local pass fail skip
	pass=$(grep -cE '^--- PASS' "$log")
	fail=$(grep -cE '^--- FAIL' "$log")
	skip=$(grep -cE '^--- SKIP' "$log")
	local nogpu
	nogpu=$(grep -m1 -oE '(no usable GPU|no CUDA): .*' "$log" | cut -c1-160)
	if [ $rc -eq 0 ] && [ -n "$nogpu" ]; then
		note "FAIL $name: GPU tests skipped: $nogpu"
	elif [ $rc -eq 0 ]; then
		note "PASS $name: $pass passed, $skip skipped, $((SECONDS - t0)) s"
	else
		local why=""
		[ $rc -ge 124 ] && why=" (timed out or killed after ${limit} s)"
		note "FAIL $name: rc $rc$why, $pass passed, $fail failed, $skip skipped, $((SECONDS - t0)) s"
		grep -E '^\s*--- FAIL|^panic|FATAL' "$log" | head -15 | tee -a "$sum"
		grep -E '_test\.go:[0-9]+:' "$log" | grep -vE 'skip|no usable GPU' | tail -10 | tee -a "$sum"
	fi
}

core='TestGraph|TestStepTimes|TestStories260K|TestBatchInvariance'
fused='TestFusedDecode|TestFusedMoE|TestKernelsV2'
samp='TestSampleMatchesCPU|TestSamplePhiloxExp|TestForwardSampleMatchesHost'
want() { case " ${STAGES:-cuda core fused sample rest kernels bench} " in *" $1 "*) return 0 ;; esac; return 1; }
want cuda && stage cuda 50 internal/cuda internal.cuda.test
want core && stage core 130 internal/compute/cuda internal.compute.cuda.test -test.run "$core"
want fused && stage fused 90 internal/compute/cuda internal.compute.cuda.test -test.run "$fused"
want sample && stage sample 60 internal/compute/cuda internal.compute.cuda.test -test.run "$samp"
want rest && stage rest ${REST_LIMIT:-90} internal/compute/cuda internal.compute.cuda.test -test.skip "$core|$fused|$samp|TestSampleKernelsEmulated|TestBench|TestKernelBench|TestProfile|TestHFvsTorch"
want kernels && MOONCAKE_BENCH=1 BENCH_OUT=$O/kbench.txt stage kernels 80 internal/compute/cuda internal.compute.cuda.test -test.run 'TestKernelBench8B$'
want bench && MOONCAKE_BENCH=1 BENCH_OUT=$O/bench.txt stage bench 250 internal/compute/cuda internal.compute.cuda.test -test.run 'TestBenchGraph8B$'

echo
echo "=== key lines"
grep -hE 'graph vs|graphs: |long run|step times|float32: max abs|float32-invariant: max abs|capture failed|CUDA graph|topology change|broken capture|fused|new kernels vs|kernel .*: [0-9]+ registers|device sampling|sampling buffers' \
	"$O"/core.log "$O"/cuda.log "$O"/fused.log "$O"/sample.log 2>/dev/null | cut -c1-220 | head -60
grep -hE 'loaded in|HBM read' "$O/bench.log" 2>/dev/null | cut -c1-220
echo
echo "=== decode kernels, llama3-8b shape (kbench.txt; register counts in the file)"
grep -vE '^kernel ' "$O/kbench.txt" 2>/dev/null || echo "no kernel tables (see kernels.log)"
echo
echo "=== summary"
cat "$sum"
grep -h 'FAIL ' "$O/kbench.txt" 2>/dev/null | head -10
echo
echo "=== decode step, llama3-8b shape (bench.txt)"
cat "$O/bench.txt" 2>/dev/null || echo "no bench table (see bench.log)"
