package cli

import (
	"context"
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/nvlink"
)

// gpuTransports are the GPU transports this process can install, in
// preference order: nvlink (same machine), then mnnvl (which decides in
// Start whether the NVLink fabric is usable, and logs why not). None when no
// CUDA driver or GPU is present (gpuUnavailable says why).
func gpuTransports() []transfer.Transport {
	nv, err := nvlink.New(nvlink.Config{})
	if err != nil {
		return nil
	}
	ts := []transfer.Transport{nv}
	if mn, err := nvlink.NewMNNVL(nvlink.Config{}); err == nil {
		ts = append(ts, mn)
	}
	return ts
}

// gpuUnavailable says why no GPU transport is installed.
func gpuUnavailable() string {
	if err := nvlink.Available(); err != nil {
		return "no GPU transport: " + err.Error()
	}
	return "GPU transports are available"
}

// allocDevice allocates a VMM pool of size bytes on GPU gpu (POSIX-FD
// shareable, or FABRIC where a trial allocation succeeds) and registers it
// as cuda:<gpu>, read-write (nvlink shares it, tcp stages it): what bench
// --use-vram uses. The release function unregisters and frees it.
func allocDevice(ctx context.Context, e *transfer.Engine, size int64, gpu int) (uintptr, func(), error) {
	if ok, why := gpuPresent(); !ok {
		return 0, nil, fmt.Errorf("--use-vram: no usable GPU: %s", why)
	}
	if size <= 0 {
		return 0, nil, fmt.Errorf("--use-vram: size %d", size)
	}
	d, err := cuda.GetDevice(gpu)
	if err != nil {
		return 0, nil, fmt.Errorf("--use-vram --gpu-id %d: %w", gpu, err)
	}
	c, err := d.Retain()
	if err != nil {
		return 0, nil, fmt.Errorf("--use-vram --gpu-id %d: %w", gpu, err)
	}
	pool, err := c.NewPool(cuda.PoolConfig{Size: uint64(size), Logger: e.Logger()})
	if err != nil {
		c.Release()
		return 0, nil, fmt.Errorf("--use-vram --gpu-id %d: %w", gpu, err)
	}
	// Fill with a pattern: never measure on zeros.
	if err := fillPool(c, pool); err != nil {
		pool.Close()
		c.Release()
		return 0, nil, fmt.Errorf("--use-vram --gpu-id %d: %w", gpu, err)
	}
	err = e.RegisterMemory(ctx, uintptr(pool.Ptr()), uint64(size), transfer.Location{Kind: transfer.CUDA, Index: gpu},
		transfer.AccessReadWrite, transfer.WithMemory(pool))
	if err != nil {
		pool.Close()
		c.Release()
		return 0, nil, err
	}
	return uintptr(pool.Ptr()), func() {
		e.UnregisterMemory(context.Background(), uintptr(pool.Ptr()))
		pool.Close()
		c.Release()
	}, nil
}

// fillPool writes a non-zero byte pattern over the pool.
func fillPool(c *cuda.Context, p *cuda.Pool) error {
	return c.MemsetD8(p.Ptr(), byte(0x5A+p.Context().Device()), p.Size())
}
