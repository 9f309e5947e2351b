"""allreduce_bench.py: torch.distributed all_reduce (NCCL) bus bandwidth on
GPUs 0..N-1, the reference for internal/collective/nccl's
BenchmarkAllReduce2GPU (same sizes, float32, in place; for two ranks the bus
bandwidth is bytes / time). Run on the GPU machine:
    python3 scripts/py/allreduce_bench.py [ranks]
"""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES_MIB = [1, 4, 16, 64]


def run(rank, world):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    for mib in SIZES_MIB:
        x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        iters = max(20, 2000 // mib)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        el = time.perf_counter() - t0
        if rank == 0:
            bus = x.numel() * 4 * 2 * (world - 1) / world * iters / el / 1e9
            print(f"torch all_reduce {mib:3d} MiB: {el / iters * 1e6:9.1f} us  busGB/s {bus:7.1f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    mp.spawn(run, args=(world,), nprocs=world)
