set -u
O=$OUT; w=$(mktemp -d)
for f in mooncake-go internal.compute.cuda.test; do xz -dc gpu-bundle/bin/$f.xz > $w/$f; chmod +x $w/$f; done
export XDG_CACHE_HOME=$w/cache
cd internal/compute/cuda
MOONCAKE_SHARED=$OLDPWD/gpu-bundle/shared timeout 120 $w/internal.compute.cuda.test -test.v -test.run 'TestStories260K|TestVsCPU|TestFlashPrefill|TestBatchInvariance|TestKernelsV2|TestSmallKernels|TestLaunchShapes' > $O/tests.log 2>&1
rc=$?
echo "tests rc $rc: $(grep -cE '^--- PASS' $O/tests.log) pass, $(grep -cE '^--- FAIL' $O/tests.log) fail"
grep -E '^(--- FAIL|panic)|rel err|max abs|FAIL' $O/tests.log | head -20
[ $rc -eq 0 ] || exit 1
MOONCAKE_BENCH=1 BENCH_OUT=$O/bench.txt timeout 110 $w/internal.compute.cuda.test -test.v -test.run TestBench8B > $O/bench.log 2>&1
echo "bench rc $?"; grep -E "prefill|decode|HBM|floor" $O/bench.log | cut -c1-200 | head -30
cd $OLDPWD
OUT=$(mktemp -d) timeout 200 bash scripts/gpu-pd.sh 2>&1 | grep -E "colocated input|1P1D input|equal|transfer_seconds|transfer_bytes_total"
