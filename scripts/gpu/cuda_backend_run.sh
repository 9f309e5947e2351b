#!/bin/bash
# One device run for the CUDA backend (internal/compute/cuda/NOTES.md):
# correctness tests, 8B-shape benchmark variants, the PyTorch peer on the same
# random-weight HF directory, logits agreement, and an ncu kernel profile.
# Needs build/gpu/{cudamodel.test,mooncake-go,shared/} (carried) and $OUT.
set -u
B=$PWD/build/gpu; O=${OUT:-/tmp/out}; mkdir -p $O
log() { echo "[$(date +%T) +$((SECONDS))s] $*" | tee -a $O/run.log; }
log "$(nvidia-smi -L; uname -r)"
HF=/tmp/llama3-8b-random
( t=$SECONDS; GOMAXPROCS=8 taskset -c 8-15 $B/mooncake-go convert --random --config llama3-8b --output $HF > $O/convert.log 2>&1; echo "convert rc $? in $((SECONDS-t)) s" >> $O/convert.log ) &
CONV=$!
cd $B
log "correctness"
MOONCAKE_SHARED=$B/shared timeout 100 taskset -c 0-7 ./cudamodel.test -test.v -test.run 'TestStories260K|TestVsCPU|TestFlashPrefill|TestBatchInvariance|TestKernelsV2|TestFlashPrefillV1V2' > $O/tests.log 2>&1
log "tests rc $?: $(grep -cE '^--- PASS' $O/tests.log) pass, $(grep -cE '^--- FAIL' $O/tests.log) fail"
wait $CONV; log "$(tail -2 $O/convert.log | tr '\n' ' '); $(du -sh $HF)"
log "bench variants (random weights made on the GPU)"
MOONCAKE_BENCH=1 BENCH_OUT=$O/bench_variants.txt timeout 110 ./cudamodel.test -test.v -test.run TestBench8B >> $O/bench.log 2>&1
log "bench rc $?"
log "pytorch peer"
PYTHONUNBUFFERED=1 timeout 150 python3 $B/../../scripts/py/torch_reference.py --model $HF --out /tmp/ref --bench --f32-ref >> $O/torch.log 2>&1
log "torch rc $?: $(tail -1 $O/torch.log)"
cp /tmp/ref/torch_ref.json $O/ 2>/dev/null
log "ours on the same HF directory"
MOONCAKE_BENCH=1 BENCH_OUT=$O/bench_hf.txt MOONCAKE_HF_DIR=$HF MOONCAKE_TORCH_REF=/tmp/ref/torch_ref.json timeout 150 ./cudamodel.test -test.v -test.run TestHFvsTorch >> $O/hf.log 2>&1
log "hf rc $?"
log "ncu"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
MOONCAKE_PROFILE=1 timeout 70 $NCU --clock-control none --metrics gpu__time_duration.sum -f -o /tmp/prof ./cudamodel.test -test.run TestProfile8B > /tmp/ncu.log 2>&1
log "ncu rc $? $(tail -2 /tmp/ncu.log | tr '\n' ' ')"
$NCU -i /tmp/prof.ncu-rep --csv --page raw --metrics gpu__time_duration.sum > /tmp/prof.csv 2>>/tmp/ncu.log
python3 - <<'PY' > $O/profile.txt 2>&1
import csv, collections
rows = list(csv.reader(open('/tmp/prof.csv')))
h = rows[0]; print('columns', len(h))
ki = h.index('Kernel Name'); ti = [i for i, x in enumerate(h) if x.startswith('gpu__time_duration')][0]
print('unit', rows[1][ti])
phase, names, acc = -1, ['load', 'decode_b1', 'decode_b32', 'prefill_4096'], collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
for r in rows[1:]:
    try: t = float(r[ti])
    except ValueError: continue
    k = r[ki].split('(')[0][:60]
    if k.startswith('read_bw'): phase += 1; continue
    a = acc[names[phase + 1] if phase + 1 < len(names) else 'other'][k]; a[0] += 1; a[1] += t
for ph, ks in acc.items():
    if ph == 'load': continue
    tot = sum(v[1] for v in ks.values())
    sc = {'ms': 1.0, 'us': 1e-3, 'usecond': 1e-3, 'ns': 1e-6, 'nsecond': 1e-6, 'msecond': 1.0}.get(rows[1][ti], 1.0)
    print(f'== {ph}: {tot*sc:.3f} ms of kernel time, {sum(v[0] for v in ks.values())} kernels')
    for k, v in sorted(ks.items(), key=lambda x: -x[1][1])[:14]:
        print(f'  {v[1]*sc:9.3f} ms {100*v[1]/tot:5.1f}% {v[0]:5d}x {k}')
PY
tail -2 /tmp/ncu.log >> $O/profile.txt
cp /tmp/ref/torch_logits*.f32 $O/ 2>/dev/null
(cd $O && tar cJf logs.tar.xz --remove-files convert.log bench_hf.txt torch.log torch_ref.json torch_logits*.f32 2>/dev/null)
log "done"
grep -hE "rel err|worst|PyTorch|prefill|decode|HBM|kernel |FAIL|loaded|LoadHF|not used" $O/tests.log $O/bench.log $O/hf.log | cut -c1-230 | tail -60
cat $O/profile.txt | head -50
