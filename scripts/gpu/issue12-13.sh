#!/usr/bin/env bash
# issue12-13.sh: one device call (nvidia-h200) for the GPU checks of issues
# 12, 13 and 11, each step bounded and skipped once LIMIT seconds are spent:
#   tests   pkg/transfer/nvlink TestConformanceDevice and (cuda) internal/cuda
#           TestPoolOverTCP/TestPoolCopies (GPU memory over tcp, every byte
#           checked), internal/collective/nccl (a 1-rank all-reduce)
#   vram    scripts/gpu/tcp-vram.sh: bench transfer --use-vram over tcp,
#           GPU->GPU and GPU->host, against raw TCP in the same run
#   pdtcp   scripts/gpu/pd-tcp.sh on stories260K f32 (and, after models, the
#           8B shape bf16): GPU prefill and decode forced to tcp behind the
#           LB == colocated
#   models  scripts/gpu/models13.sh: the Qwen3 widths vs transformers and
#           (bench) at full size
#   graph   TestBenchGraph8B, new kernels only (llama3-8b, no regression)
# Build: GPU_TEST_PKGS="./internal/compute/cuda ./pkg/transfer/nvlink ./internal/collective/nccl" scripts/gpu-bundle.sh
# Run:   run(command="bash scripts/gpu/issue12-13.sh", carry=["gpu-bundle"], timeout_s=600)
set -u
DEF_OUT=/tmp/i1213 DEF_LIMIT=520
. "$(dirname "$0")/common.sh"
for b in internal.cuda.test pkg.transfer.nvlink.test internal.collective.nccl.test internal.compute.cuda.test; do
	xz -dc "gpu-bundle/bin/$b.xz" >"$w/$b" 2>/dev/null && chmod +x "$w/$b" || log "no $b in the bundle"
done
want() { case " ${STAGES:-tests cuda vram pdtcp models bench graph} " in *" $1 "*) return 0 ;; esac; return 1; }
t() { # name dir bin timeout run
	(cd "$root/$2" && timeout "$4" "$w/$3" -test.v -test.run "$5") >"$O/$1.log" 2>&1
	log "$1 rc $?: $(grep -cE '^--- PASS' "$O/$1.log") pass, $(grep -cE '^--- FAIL' "$O/$1.log") fail, $(grep -cE '^--- SKIP' "$O/$1.log") skip"
	grep -hE '^\s*--- (FAIL|SKIP)|_test.go:[0-9]+: .*(GB/s|skip|FAIL|mismatch|differ)' "$O/$1.log" | head -8 | cut -c1-200 | tee -a "$O/run.log"
}
if want tests; then
	want cuda && t cuda-tcp internal/cuda internal.cuda.test 60 'TestPoolOverTCP|TestPoolCopies'
	t nvlink-dev pkg/transfer/nvlink pkg.transfer.nvlink.test 60 'TestConformanceDevice'
	want cuda && t nccl internal/collective/nccl internal.collective.nccl.test 40 '.'
fi
if want vram && left 90 vram; then
	DUR=3s timeout 120 bash scripts/gpu/tcp-vram.sh >"$O/vram.log" 2>&1
	log "vram rc $?"
	tail -12 "$O/vram.log" | tee -a "$O/run.log"
fi
if want pdtcp && left 80 pdtcp; then
	OUT=$O/pd-small LENS="20 100 400" MODEL="--model-path gpu-bundle/shared/models/stories260K/stories260K.bin --tokenizer-path gpu-bundle/shared/models/stories260K/tok512.bin --dtype float32" \
		timeout 90 bash scripts/gpu/pd-tcp.sh >"$O/pdtcp-small.log" 2>&1
	log "pd-tcp stories260K rc $?"
	tail -6 "$O/pdtcp-small.log" | tee -a "$O/run.log"
fi
if want models; then
	m() { # stage shape worst-case seconds: each step bounded inside
		left "$3" "models $1 $2" || return 0
		OUT=$O/models STAGES=$1 HF_SHAPES=$2 BENCH_SHAPES=$2 T_CONVERT=50 T_TORCH=80 T_OURS=60 T_BENCH=80 \
			bash scripts/gpu/models13.sh >>"$O/models.log" 2>&1
		log "models $1 $2 rc $?"
	}
	m hf qwen3-32b-8l 190
	want bench && m bench qwen3-32b 85
	m hf qwen3-30b-a3b-8l 190
	want bench && m bench qwen3-30b-a3b 85
	cut -c1-260 "$O/models/run.log" 2>/dev/null | tee -a "$O/run.log"
fi
if want pdtcp && left 150 pdtcp8b; then
	OUT=$O/pd-8b BACKENDS="tcp nvlink" timeout 150 bash scripts/gpu/pd-tcp.sh >"$O/pdtcp-8b.log" 2>&1
	log "pd-tcp 8B rc $?"
	grep -E "equal colocated|^ttft|FAIL" "$O/pdtcp-8b.log" | tee -a "$O/run.log"
fi
if want graph && left 60 graph; then
	(cd "$root/internal/compute/cuda" && MOONCAKE_BENCH=1 MOONCAKE_BENCH_VARIANTS=new BENCH_OUT=$O/graph.txt timeout 60 \
		"$w/internal.compute.cuda.test" -test.v -test.run 'TestBenchGraph8B$') >"$O/graph.log" 2>&1
	log "graph rc $?"
	cat "$O/graph.txt" 2>/dev/null | tee -a "$O/run.log"
fi
(cd "$O" && find . -mindepth 1 -maxdepth 1 ! -name run.log >"$w/list" && tar cJf "$w/logs.tar.xz" --remove-files -T "$w/list" && mv "$w/logs.tar.xz" .)
log done
