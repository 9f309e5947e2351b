#!/usr/bin/env bash
# gpu-next.sh: the run on the two-GPU machine (nvidia-h200-x2) that checks
# what the CPU-only session of 2026-11-29 built blind:
#   nvlink: the nvlink tests (TestGPUPageList among them: page-list requests,
#     every byte checked) and the speed table, which now has the kernel rate
#     with eight batches back to back and the engine rate of page lists, plus
#     `bench transfer --scatter [--page-list]` at 4, 16 and 64 KiB pages;
#   pd: gpu-pd.sh with QUICK=1 and both ways of pushing the KV (by pass, by
#     layer): greedy equality, TTFT at 1K/4K, KV tail.
# PART=nvlink or PART=pd runs one half (each fits a 10-minute call alone);
# both together take about 9 minutes.
# Build here first: bash scripts/gpu-bundle.sh (its default packages are the
# ones needed); then run with carry ["gpu-bundle"]: bash scripts/gpu-next.sh
set -u
cd "$(dirname "$0")/.."
final=${OUT:-/tmp/out}
mkdir -p "$final"
L=$(mktemp -d)
part=${PART:-all}
if [ "$part" != pd ]; then
	echo "##### nvlink [$SECONDS s]"
	OUT=$L/nvlink BENCH_SPECS="${BENCH_SPECS:-4096 65536 --scatter;4096 65536 --scatter --page-list;16384 16384 --scatter --page-list;65536 4096 --scatter --page-list}" \
		timeout 300 bash pkg/transfer/nvlink/testdata/gpu-run.sh 2>&1 | tail -70
fi
if [ "$part" != nvlink ]; then
	echo "##### disaggregation, push by pass and by layer [$SECONDS s]"
	OUT=$L/pd QUICK=1 PD_SPECS="${PD_SPECS:-1024 1 5|4096 1 3}" timeout 270 bash scripts/gpu-pd.sh 2>&1 | tail -40
fi
echo "##### done [$SECONDS s]"
tar cJf "$final/logs.tar.xz" -C "$L" . 2>/dev/null
