#!/usr/bin/env bash
# gpu-next.sh: the one run on the two-GPU machine (nvidia-h200-x2) that checks
# what the CPU-only session of 2026-11-29 built blind, in under 10 minutes:
#   1. the nvlink tests (TestGPUPageList among them: page-list requests, every
#      byte checked) and the speed table, which now has the kernel rate with
#      eight batches back to back and the engine rate of page lists, plus
#      `bench transfer --scatter [--page-list]` at 4 KiB and 16 KiB pages;
#   2. gpu-pd.sh with QUICK=1 and both ways of pushing the KV (by pass, by
#      layer): greedy equality, TTFT at 1K/4K, KV tail.
# Build here first:
#   bash scripts/gpu-bundle.sh   (its default packages are the ones needed)
# then run with carry ["gpu-bundle"]: bash scripts/gpu-next.sh
set -u
cd "$(dirname "$0")/.."
final=${OUT:-/tmp/out}
mkdir -p "$final"
L=$(mktemp -d)
echo "##### nvlink [$SECONDS s]"
OUT=$L/nvlink timeout 260 bash pkg/transfer/nvlink/testdata/gpu-run.sh 2>&1 | tail -70
echo "##### disaggregation, push by pass and by layer [$SECONDS s]"
OUT=$L/pd QUICK=1 PD_SPECS="1024 1 5|4096 1 3" timeout 300 bash scripts/gpu-pd.sh 2>&1 | tail -40
echo "##### done [$SECONDS s]"
tar cJf "$final/logs.tar.xz" -C "$L" . 2>/dev/null
