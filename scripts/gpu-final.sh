#!/usr/bin/env bash
# gpu-final.sh: one run on the two-GPU machine (repo root, bundle carried):
# the nvlink transport's tests and benchmarks, the disaggregation checks of
# gpu-pd.sh, and the 8B-shape logits against PyTorch (bf16 and float32).
# All logs are packed into $OUT/logs.tar.xz; summaries go to stdout.
set -u
cd "$(dirname "$0")/.."
final=${OUT:-/tmp/out}
mkdir -p "$final"
L=$(mktemp -d)
w=$(mktemp -d)
xz -dc gpu-bundle/bin/mooncake-go.xz >"$w/mc" && chmod +x "$w/mc"
xz -dc gpu-bundle/bin/internal.compute.cuda.test.xz >"$w/cudamodel.test" && chmod +x "$w/cudamodel.test"
HF=/tmp/llama3-8b-random
(t=$SECONDS; GOMAXPROCS=8 taskset -c 16-31 "$w/mc" convert --random --config llama3-8b --output $HF >"$L/convert.log" 2>&1
 echo "convert rc $? in $((SECONDS - t)) s" >>"$L/convert.log") &
conv=$!
echo "##### nvlink [$SECONDS s]"
OUT=$L/nvlink timeout 180 bash pkg/transfer/nvlink/testdata/gpu-run.sh 2>&1 | tail -60
echo "##### disaggregation [$SECONDS s]"
OUT=$L/pd timeout 220 bash scripts/gpu-pd.sh 2>&1 | tail -40
echo "##### logits vs PyTorch [$SECONDS s]"
wait $conv; tail -1 "$L/convert.log"
PYTHONUNBUFFERED=1 timeout 90 python3 scripts/py/torch_reference.py --model $HF --out /tmp/ref --f32-ref >"$L/torch.log" 2>&1
echo "torch rc $?: $(tail -1 "$L/torch.log")"
MOONCAKE_HF_DIR=$HF MOONCAKE_TORCH_REF=/tmp/ref/torch_ref.json timeout 90 "$w/cudamodel.test" -test.v -test.run TestHFvsTorch >"$L/hf.log" 2>&1
echo "hf rc $?"
grep -E "rel err|worst|float32|FAIL|LoadHF" "$L/hf.log" | cut -c1-200
echo "##### done [$SECONDS s]"
tar cJf "$final/logs.tar.xz" -C "$L" . 2>/dev/null
