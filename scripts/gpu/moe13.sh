#!/usr/bin/env bash
# moe13.sh: one device call (nvidia-h200) for the MoE on-device routing and
# grouped expert GEMMs (issue 13) and the nvlink/tcp PD check (issue 12),
# each step bounded and skipped once LIMIT seconds are spent:
#   tests   internal/compute/cuda: TestGraphMoE (MoE decode captured, replay
#           == padded eager, one pass == chunks), TestConformance,
#           TestGolden, TestGraphEqualsEager, TestFusedDecode, TestFusedMoE,
#           TestKernelsV2
#   extra   EXTRA_TESTS="dir bin regexp; ..." (other bundled test binaries)
#   vram    scripts/gpu/tcp-vram.sh: bench transfer --use-vram over tcp against
#           raw TCP (BIN_B=gpu-bundle/bin/X.xz: X and the bundle's CLI in turn)
#   graph   TestBenchGraph8B at qwen3-30b-a3b (decode steps, graphs; VARIANTS
#           picks its kernel variants, default new)
#   prefill TestBench8B at qwen3-30b-a3b (prefill TFLOP/s, eager decode)
#   bench8b TestBench8B at llama3-8b (prefill 1K/4K/8K, eager decode;
#           BENCH8B_VARIANTS, default v2,v2-fa2)
#   pd      scripts/gpu/pd-tcp.sh, 8B shape, tcp and nvlink pairs (TTFT)
#   rdma    serve --disaggregation-transfer-backend rdma with the real
#           libibverbs and no HCA: the start-up error
#   profile ncu over TestProfile8B at PROFILE_SHAPE (qwen3-30b-a3b): kernel
#           time by kernel of one eager decode step at each of PROFILE_BATCHES
#           (1 32), and a 4K prefill with PROFILE_PREFILL=1; PROFILE_TIMEOUT (120 s)
#   detail  ncu's full sections over DETAIL_COUNT (1) launches of the kernels
#           matching DETAIL_KERNEL (regex) in TestProfile8B at PROFILE_SHAPE,
#           PROFILE_BATCHES and PROFILE_PREFILL
#   peak    host memory while loading a bf16 HF directory (qwen3-30b-a3b-8l,
#           convert --random) onto the GPU: TestLoadPeakHF
#   kprof   ncu (memory, stalls, occupancy) over single kernels of TestKernelBench8B:
#           KPROF="part:BxC:regex:count ..." (default: the decode attention at
#           128x1K and 32x1K, gemv2_plain, gemv2_silu)
#   kernels TestKernelBench8B: the 8B shape's decode kernels one by one
#           (us and % of HBM; attention at batch 1..256, ctx 1K..32K)
#   dense   TestBenchGraph8B at llama3-8b, new kernels (no regression; DENSE_VARIANTS, DENSE_TIMEOUT)
#   sass    nvcc -Xptxas -v over attn.cu for sm_90a: registers, spills and
#           ptxas's warnings (wgmma serialised) for attn_prefill4
# TESTS overrides the tests stage's -test.run pattern (TESTS_TIMEOUT its 200 s in all);
# each |-separated part runs in a process of its own, as each graph variant does.
# Build: GPU_TEST_PKGS="./internal/compute/cuda" scripts/gpu-bundle.sh
# Run:   run(command="bash scripts/gpu/moe13.sh", carry=["gpu-bundle"], timeout_s=600)
set -u
DEF_OUT=/tmp/moe13 DEF_LIMIT=540
. "$(dirname "$0")/common.sh"
unpack_bins
want() { case " ${STAGES:-tests extra vram profile graph prefill pd rdma peak kprof kernels dense} " in *" $1 "*) return 0 ;; esac; return 1; }
t() { # name dir bin timeout run
	(cd "$root/$2" && timeout "$4" "$w/$3" -test.v -test.run "$5") >"$O/$1.log" 2>&1
	log "$1 rc $?: $(grep -cE '^\s*--- PASS' "$O/$1.log") pass, $(grep -cE '^\s*--- FAIL' "$O/$1.log") fail, $(grep -cE '^\s*--- SKIP' "$O/$1.log") skip"
	grep -hE '^\s*--- (FAIL|SKIP)|_test.go:[0-9]+: .*(rel|skip|FAIL|mismatch|differ|graphs|rejected|error)' "$O/$1.log" | head -14 | cut -c1-220 | tee -a "$O/run.log"
}
if want tests; then
	# Each of TESTS' |-separated patterns in a process of its own: a kernel
	# fault poisons its CUDA context, and only that process's tests.
	pats=${TESTS:-TestGraphMoE|TestConformance|TestGolden|TestGraphEqualsEager|TestFusedDecode|TestFusedMoE|TestKernelsV2}
	t0=$SECONDS
	IFS='|' read -ra each <<<"$pats"
	for p in "${each[@]}"; do
		rest=$((${TESTS_TIMEOUT:-200} - (SECONDS - t0)))
		[ "$rest" -gt 5 ] || { log "SKIP $p: tests time spent"; continue; }
		t "cuda-${p//[^A-Za-z0-9]/}" internal/compute/cuda internal.compute.cuda.test "$rest" "$p"
	done
	grep -h "second-generation kernels rejected" "$O"/cuda-*.log | head -3 | cut -c1-600 | tee -a "$O/run.log"
fi
if want sass; then
	NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null | head -1)
	timeout 120 $NVCC -cubin -arch=sm_90a -DHEAD_DIM=128 -DUSE_BF16=1 -DGQA_GROUP=4 -DATT_SPLIT=128 -DTC_WARPS=4 \
		-Xptxas -v -o "$w/attn90a.cubin" "$root/csrc/llama/attn.cu" >"$O/sass.log" 2>&1
	log "nvcc attn.cu sm_90a rc $?"
	grep -iE -A2 "warn|error|'attn_prefill4'|'wgmma_probe'|'gemm_wg" "$O/sass.log" | grep -vE "^--$" | head -24 | cut -c1-250 | tee -a "$O/run.log"
fi
if want rdma && [ -x "$w/mooncake-go" ]; then
	timeout 20 "$w/mooncake-go" serve --log-level error --disaggregation-transfer-backend rdma >"$O/rdma.log" 2>&1
	log "serve rdma without an HCA rc $?: $(tail -3 "$O/rdma.log" | cut -c1-400)"
	ls /dev/infiniband /sys/class/infiniband 2>&1 | head -3 | tee -a "$O/run.log"
fi
if want extra && [ -n "${EXTRA_TESTS:-}" ]; then
	i=0
	IFS=';' read -ra specs <<<"$EXTRA_TESTS"
	for spec in "${specs[@]}"; do
		set -- $spec
		i=$((i + 1))
		t "extra$i-$(basename "$1")" "$1" "$2" 90 "$3"
	done
fi
if want vram && left 130 vram; then
	if [ -n "${BIN_B:-}" ]; then # A/B: BIN_B (a bundled .xz) against the bundle's CLI, alternately
		xz -dc "$BIN_B" >"$w/mc-b" && chmod +x "$w/mc-b"
		for i in 1 2; do
			for v in "$w/mc-b" "$w/mooncake-go"; do
				echo "== $(basename "$v") round $i" >>"$O/vram.log"
				BIN=$v DUR=2s BLOCKS=${BLOCKS:-65536} timeout 60 bash scripts/gpu/tcp-vram.sh >>"$O/vram.log" 2>&1
			done
		done
		log "vram A/B (mc-b: $(basename "$BIN_B"))"
		grep -E "^==|ratio" "$O/vram.log" | tee -a "$O/run.log"
	else
		DUR=3s timeout 120 bash scripts/gpu/tcp-vram.sh >"$O/vram.log" 2>&1
		log "vram rc $?"
		tail -12 "$O/vram.log" | tee -a "$O/run.log"
	fi
fi
if want profile && left ${PROFILE_TIMEOUT:-120} profile; then
	NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
	(cd "$root/internal/compute/cuda" && MOONCAKE_PROFILE=1 MOONCAKE_PROFILE_PREFILL=${PROFILE_PREFILL:-0} MOONCAKE_BENCH_SHAPE=${PROFILE_SHAPE:-qwen3-30b-a3b} \
		MOONCAKE_PROFILE_BATCHES="${PROFILE_BATCHES:-1 32}" timeout ${PROFILE_TIMEOUT:-120} \
		$NCU --clock-control none --metrics gpu__time_duration.sum,launch__grid_size -f -o "$w/prof" "$w/internal.compute.cuda.test" -test.run 'TestProfile8B$') >"$O/ncu.log" 2>&1
	log "ncu rc $? $(tail -1 "$O/ncu.log" | cut -c1-200)"
	$NCU -i "$w/prof.ncu-rep" --csv --page raw --metrics gpu__time_duration.sum,launch__grid_size >"$w/prof.csv" 2>>"$O/ncu.log"
	log "profile ${PROFILE_SHAPE:-qwen3-30b-a3b}, batches ${PROFILE_BATCHES:-1 32}"
	python3 - "$w/prof.csv" ${PROFILE_BATCHES:-1 32} <<'PY' | tee -a "$O/run.log"
import csv, collections, sys
rows = list(csv.reader(open(sys.argv[1])))
h = rows[0]
ki = h.index('Kernel Name'); ti = [i for i, x in enumerate(h) if x.startswith('gpu__time_duration')][0]
gi = [i for i, x in enumerate(h) if x.startswith('launch__grid_size')][0]
sc = {'ms': 1.0, 'msecond': 1.0, 'us': 1e-3, 'usecond': 1e-3, 'ns': 1e-6, 'nsecond': 1e-6}.get(rows[1][ti], 1.0)
phase, names = -1, ['load'] + ['decode_b' + b for b in sys.argv[2:]]
acc = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
for r in rows[1:]:
    try: t = float(r[ti])
    except ValueError: continue
    k = r[ki].split('(')[0][:48] + ' grid ' + r[gi]
    if k.startswith('read_bw'): phase += 1; continue
    acc[names[phase + 1] if phase + 1 < len(names) else 'other'][k][0] += 1
    acc[names[phase + 1] if phase + 1 < len(names) else 'other'][k][1] += t
for ph, ks in acc.items():
    if ph == 'load': continue
    tot = sum(v[1] for v in ks.values())
    print(f'== {ph}: {tot*sc:.3f} ms of kernel time, {sum(v[0] for v in ks.values())} kernels')
    for k, v in sorted(ks.items(), key=lambda x: -x[1][1])[:22]:
        print(f'  {v[1]*sc:8.3f} ms {100*v[1]/tot:5.1f}% {v[0]:5d}x {1000*v[1]*sc/v[0]:7.2f} us/launch {k}')
PY
fi
if want detail && [ -n "${DETAIL_KERNEL:-}" ] && left 120 detail; then
	NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
	(cd "$root/internal/compute/cuda" && MOONCAKE_PROFILE=1 MOONCAKE_PROFILE_PREFILL=${PROFILE_PREFILL:-0} MOONCAKE_BENCH_SHAPE=${PROFILE_SHAPE:-qwen3-30b-a3b} \
		MOONCAKE_PROFILE_BATCHES="${PROFILE_BATCHES:-1}" timeout ${PROFILE_TIMEOUT:-120} \
		$NCU --clock-control none -k "regex:$DETAIL_KERNEL" -c ${DETAIL_COUNT:-1} --set full "$w/internal.compute.cuda.test" -test.run 'TestProfile8B$') >"$O/detail.log" 2>&1
	log "ncu detail $DETAIL_KERNEL rc $?"
	grep -vE '^\s*$|^==PROF==|----' "$O/detail.log" | grep -E 'Duration|Throughput|Pipe|Eligible|Warp Cycles|Issued|Occupancy|Registers|Shared Memory|Stall|Bank|L1|L2|DRAM|Block Size|Grid Size|Waves|Executed Ipc|OPT|est' | cut -c1-200 | head -90 | tee -a "$O/run.log"
fi
# graphs shape variants timeout out: TestBenchGraph8B, each variant in a
# process of its own (a fault in one leaves the others' figures), the
# tables appended to $O/out.txt.
graphs() {
	local t0=$SECONDS v rest
	for v in ${2//,/ }; do
		rest=$(($3 - (SECONDS - t0)))
		[ "$rest" -gt 5 ] || { log "SKIP graph $1 $v: time spent"; continue; }
		(cd "$root/internal/compute/cuda" && MOONCAKE_BENCH=1 MOONCAKE_BENCH_SHAPE=$1 MOONCAKE_BENCH_VARIANTS=$v \
			BENCH_OUT=$O/$4-$v.txt timeout "$rest" "$w/internal.compute.cuda.test" -test.v -test.run 'TestBenchGraph8B$') >>"$O/$4.log" 2>&1
		log "graph $1 $v rc $?"
		cat "$O/$4-$v.txt" >>"$O/$4.txt" 2>/dev/null
		rm -f "$O/$4-$v.txt"
	done
	grep -hE "loaded|FAIL|panic|captured" "$O/$4.log" | head -4 | cut -c1-300 | tee -a "$O/run.log"
	cat "$O/$4.txt" 2>/dev/null | tee -a "$O/run.log"
}
if want graph && left ${GRAPH_TIMEOUT:-150} graph; then
	graphs qwen3-30b-a3b "${VARIANTS:-new}" "${GRAPH_TIMEOUT:-220}" graph-moe
fi
if want pd && left 150 pd; then
	OUT=$O/pd-8b BACKENDS=${PD_BACKENDS:-tcp nvlink} LENS=${PD_LENS:-100 1000} timeout 150 bash scripts/gpu/pd-tcp.sh >"$O/pd-8b.log" 2>&1
	log "pd-tcp 8B rc $?"
	grep -E "equal colocated|^ttft|FAIL" "$O/pd-8b.log" | tee -a "$O/run.log"
fi
if want prefill && left 100 prefill; then
	(cd "$root/internal/compute/cuda" && MOONCAKE_BENCH=1 MOONCAKE_BENCH_SHAPE=qwen3-30b-a3b MOONCAKE_BENCH_VARIANTS=v2 \
		BENCH_OUT=$O/bench-moe.txt timeout 100 "$w/internal.compute.cuda.test" -test.v -test.run 'TestBench8B$') >"$O/bench-moe.log" 2>&1
	log "prefill qwen3-30b-a3b rc $?"
	grep -hE "loaded|HBM|prefill|decode batch|FAIL|panic" "$O/bench-moe.log" | cut -c1-260 | tee -a "$O/run.log"
fi
if want bench8b && left 100 bench8b; then
	(cd "$root/internal/compute/cuda" && MOONCAKE_BENCH=1 MOONCAKE_BENCH_VARIANTS=${BENCH8B_VARIANTS:-v2,v2-fa2} \
		BENCH_OUT=$O/bench-8b.txt timeout ${BENCH8B_TIMEOUT:-200} "$w/internal.compute.cuda.test" -test.v -test.run 'TestBench8B$') >"$O/bench-8b.log" 2>&1
	log "bench llama3-8b rc $?"
	grep -hE "loaded|HBM|prefill|decode batch|FAIL|panic" "$O/bench-8b.log" | cut -c1-260 | tee -a "$O/run.log"
fi
if want peak && left 150 peak; then
	d=/tmp/peak-hf
	timeout 100 "$w/mooncake-go" convert --random --config qwen3-30b-a3b-8l --output "$d" >"$O/convert-peak.log" 2>&1
	log "convert qwen3-30b-a3b-8l rc $? ($(du -sh "$d" 2>/dev/null | cut -f1))"
	(cd "$root/internal/compute/cuda" && MOONCAKE_LOAD_PEAK=1 MOONCAKE_HF_DIR=$d timeout 90 "$w/internal.compute.cuda.test" -test.v \
		-test.run 'TestLoadPeakHF$') >"$O/peak.log" 2>&1
	log "load peak rc $?"
	grep -hE "host peak|FAIL|panic" "$O/peak.log" | cut -c1-400 | tee -a "$O/run.log"
	rm -rf "$d"
fi
if want kprof && left 120 kprof; then
	NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
	i=0
	for spec in ${KPROF:-attention:128x1024:^(attn_decode_tc|attn_decode2)$:3 attention:32x1024:^(attn_decode_tc|attn_decode2)$:3 gemvs:-:^gemv2_plain$:1 gemvs:-:^gemv2_silu$:1}; do
		IFS=: read -r part attn re cnt <<<"$spec"
		i=$((i + 1))
		(cd "$root/internal/compute/cuda" && MOONCAKE_BENCH=1 MOONCAKE_KBENCH_PARTS=$part MOONCAKE_KBENCH_ATTN=${attn#-} timeout 120 \
			$NCU --clock-control none --kernel-name "regex:$re" --launch-count "$cnt" --section SpeedOfLight \
			--section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
			--section SchedulerStats -f -o "$w/kprof$i" "$w/internal.compute.cuda.test" -test.run 'TestKernelBench8B$') >"$O/kprof$i.log" 2>&1
		log "kprof $spec rc $?"
		$NCU -i "$w/kprof$i.ncu-rep" --page details >"$O/kprof$i.txt" 2>&1
		grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Memory Throughput|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit|Eligible Warps|Issued Warp|No Eligible|Active Warps Per" \
			"$O/kprof$i.txt" | cut -c1-160 | tee -a "$O/run.log"
	done
fi
if want kernels && left 90 kernels; then
	(cd "$root/internal/compute/cuda" && MOONCAKE_BENCH=1 BENCH_OUT=$O/kbench.txt timeout 90 "$w/internal.compute.cuda.test" -test.v \
		-test.run 'TestKernelBench8B$') >"$O/kbench.log" 2>&1
	log "kernel bench rc $?"
	grep -hE "FAIL|panic" "$O/kbench.log" | head -5 | cut -c1-300 | tee -a "$O/run.log"
	cat "$O/kbench.txt" 2>/dev/null | tee -a "$O/run.log"
fi
if want dense && left ${DENSE_TIMEOUT:-80} dense; then
	graphs llama3-8b "${DENSE_VARIANTS:-new}" "${DENSE_TIMEOUT:-80}" graph-8b
fi
(cd "$O" && find . -mindepth 1 -maxdepth 1 ! -name run.log >"$w/list" && tar cJf "$w/logs.tar.xz" --remove-files -T "$w/list" && mv "$w/logs.tar.xz" .)
log done
