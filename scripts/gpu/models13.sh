#!/usr/bin/env bash
# models13.sh: issue 13 on one H200 (nvidia-h200): Qwen3 and Qwen3-MoE at the
# widths of qwen3-32b and qwen3-30b-a3b.
#   1 the 8-layer HF directories (convert --random) against transformers on
#     the same files: bf16 logits vs transformers' bf16 and float32
#     (torch_reference.py --f32-ref, then TestHFvsTorch)
#   2 full size, random bf16 weights made on the GPU: prefill 1K/4K/8K and
#     decode steps at batch 1 and 32, ctx 1K, against the floor (TestBench8B
#     with MOONCAKE_BENCH_SHAPE)
# Build here first, then run there with the bundle carried:
#   GPU_TEST_PKGS=./internal/compute/cuda scripts/gpu-bundle.sh
#   run(command="bash scripts/gpu/models13.sh", carry=["gpu-bundle"], timeout_s=600)
# STAGES picks stages (default: hf bench), HF_SHAPES and BENCH_SHAPES the
# shapes; T_CONVERT, T_TORCH, T_OURS, T_BENCH bound each step (s). Logs in
# $OUT (run.log appended to).
set -u
O=${OUT:-/tmp/models13}
mkdir -p "$O"
root=$PWD
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
export XDG_CACHE_HOME=$w/cache MOONCAKE_SHARED=$root/gpu-bundle/shared
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$O/run.log"; }
for b in internal.compute.cuda.test mooncake-go; do
	xz -dc "gpu-bundle/bin/$b.xz" >"$w/$b" && chmod +x "$w/$b" || log "FAIL unpack $b"
done
want() { case " ${STAGES:-hf bench} " in *" $1 "*) return 0 ;; esac; return 1; }
cd "$root/internal/compute/cuda" || exit 1
if want hf; then
	for s in ${HF_SHAPES:-qwen3-32b-8l qwen3-30b-a3b-8l}; do
		d=/tmp/$s
		timeout "${T_CONVERT:-120}" "$w/mooncake-go" convert --random --config "$s" --output "$d" >"$O/convert-$s.log" 2>&1
		log "convert $s rc $? ($(du -sh "$d" 2>/dev/null | cut -f1))"
		PYTHONUNBUFFERED=1 timeout "${T_TORCH:-150}" python3 "$root/scripts/py/torch_reference.py" --model "$d" --out "/tmp/ref-$s" --f32-ref >"$O/torch-$s.log" 2>&1
		log "transformers $s rc $?: $(tail -1 "$O/torch-$s.log" | cut -c1-200)"
		MOONCAKE_HF_DIR=$d MOONCAKE_TORCH_REF=/tmp/ref-$s/torch_ref.json timeout "${T_OURS:-150}" "$w/internal.compute.cuda.test" -test.v \
			-test.run 'TestHFvsTorch$' >"$O/hf-$s.log" 2>&1
		log "ours vs transformers $s rc $?"
		grep -hE "rel err|worst|FAIL|LoadHF" "$O/hf-$s.log" | cut -c1-200 | tee -a "$O/run.log"
		rm -rf "$d" "/tmp/ref-$s"
	done
fi
if want bench; then
	for s in ${BENCH_SHAPES:-qwen3-32b qwen3-30b-a3b}; do
		MOONCAKE_BENCH=1 MOONCAKE_BENCH_SHAPE=$s MOONCAKE_BENCH_VARIANTS=v2 BENCH_OUT=$O/bench-$s.txt timeout "${T_BENCH:-200}" \
			"$w/internal.compute.cuda.test" -test.v -test.run 'TestBench8B$' >"$O/bench-$s.log" 2>&1
		log "bench $s rc $?"
		grep -hE "loaded|HBM|prefill|decode batch|FAIL|panic" "$O/bench-$s.log" | cut -c1-260 | tee -a "$O/run.log"
	done
fi
log done
