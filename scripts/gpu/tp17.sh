#!/usr/bin/env bash
# tp17.sh: the two-GPU tensor-parallel checks (issue 17), run ON an
# nvidia-h200-x2 machine from the repo root, bundle carried:
#   GPU_TEST_PKGS="./internal/compute/cuda ./internal/collective/nccl" scripts/gpu-bundle.sh
#   run(command="bash scripts/gpu/tp17.sh", carry=["gpu-bundle"], kind="nvidia-h200-x2")
# Stages (STAGES, default all): nccl (TestTwoRanksGPU: sums, gathers,
# broadcast, the abort releasing a waiting rank), allreduce (our binding's
# BenchmarkAllReduce2GPU beside torch.distributed's, scripts/py/allreduce_bench.py),
# tp (TestTPNCCL: stories260K at tp 2 equal to llama2.c and tp 1, graphs
# replayed, a failing rank released), bench (TestBenchTP8B: decode b1/b32 and
# prefill 4K at tp 1 and 2), pd (scripts/gpu/pd-tcp.sh across TP layouts over
# nvlink: P tp 2 on GPUs 0-1 -> D tp 1 on GPU 1, and P tp 1 on GPU 0 -> D tp 2
# on GPUs 0-1 (a server sharing a GPU), stories260K float32 and the 8B shape:
# greedy equal colocated tp 1). Logs in $OUT.
set -u
DEF_OUT=/tmp/tp17 DEF_LIMIT=560
. "$(dirname "$0")/common.sh"
unpack_bins
want() { case " ${STAGES:-nccl allreduce tp bench pd} " in *" $1 "*) return 0 ;; esac; return 1; }
nvidia-smi topo -m 2>&1 | head -6 | tee -a "$O/run.log"
if want nccl && left 60 nccl; then
	(cd internal/collective/nccl && timeout 60 "$w/internal.collective.nccl.test" -test.v -test.run 'TestTwoRanksGPU|TestOneRankGPU') >"$O/nccl.log" 2>&1
	log "nccl rc $?"
	grep -E "^(--- |ok|FAIL)|released" "$O/nccl.log" | tee -a "$O/run.log"
fi
if want allreduce && left 120 allreduce; then
	(cd internal/collective/nccl && timeout 60 "$w/internal.collective.nccl.test" -test.run '^$' -test.bench BenchmarkAllReduce2GPU -test.benchtime 200x) >"$O/ar.log" 2>&1
	log "our all-reduce rc $?"
	grep -E "Benchmark" "$O/ar.log" | tee -a "$O/run.log"
	timeout 90 python3 scripts/py/allreduce_bench.py 2 >"$O/ar-torch.log" 2>&1
	log "torch all_reduce rc $?"
	grep -E "torch all_reduce|Error" "$O/ar-torch.log" | tee -a "$O/run.log"
fi
if want tp && left 120 tp; then
	(cd internal/compute/cuda && timeout 120 "$w/internal.compute.cuda.test" -test.v -test.run 'TestTPNCCL|TestStories260KTP') >"$O/tp.log" 2>&1
	log "tp rc $?"
	grep -E "^\s*--- (PASS|FAIL|SKIP)|tp_test.go" "$O/tp.log" | head -20 | cut -c1-220 | tee -a "$O/run.log"
fi
if want bench && left 150 bench; then
	(cd internal/compute/cuda && MOONCAKE_BENCH=1 BENCH_OUT=$O/bench-tp.txt timeout 150 "$w/internal.compute.cuda.test" -test.v -test.run 'TestBenchTP8B$') >"$O/bench-tp.log" 2>&1
	log "bench tp rc $?"
	cat "$O/bench-tp.txt" 2>/dev/null | tee -a "$O/run.log"
	grep -E "FAIL|panic" "$O/bench-tp.log" | head -5 | tee -a "$O/run.log"
fi
if want pd; then
	small="--model-path gpu-bundle/shared/models/stories260K/stories260K.bin --tokenizer-path gpu-bundle/shared/models/stories260K/tok512.bin --dtype float32"
	for m in small 8b; do
		M=$small
		[ $m = 8b ] && M="--random-weights llama3-8b --random-seed 7"
		for pair in "--tp 2 --base-gpu-id 0|--tp 1 --base-gpu-id 1" "--tp 1 --base-gpu-id 0|--tp 2 --base-gpu-id 0"; do
			left 100 "pd $m $pair" || break
			pf=${pair%%|*} df=${pair##*|}
			OUT=$O/pd-$m MODEL=$M P_FLAGS=$pf D_FLAGS=$df BACKENDS=nvlink LENS="20 100 400" TTFT_LENS=4096 timeout 150 \
				bash scripts/gpu/pd-tcp.sh >>"$O/pd.log" 2>&1
			log "pd $m ($pf -> $df) rc $?"
			grep -E "equal colocated|^ttft|FAIL" "$O/pd.log" | tail -3 | tee -a "$O/run.log"
		done
	done
fi
log done
