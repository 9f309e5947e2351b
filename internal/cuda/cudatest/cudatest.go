// Package cudatest gives tests real CUDA memory; each helper skips the test
// without a GPU.
package cudatest

import (
	"errors"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Pool is a VMM pool on GPU 0 that releases its context when closed.
type Pool struct {
	*cuda.Pool
	ctx *cuda.Context
}

// Close frees the pool and releases its context.
func (p Pool) Close() error { return errors.Join(p.Pool.Close(), p.ctx.Release()) }

// NewPool makes a pool of size bytes on GPU 0 (a Pool, as
// transfer.DeviceMemory, the form transfertest.RunDevice takes), skipping
// the test without a driver or a GPU.
func NewPool(t testing.TB, size int) transfer.DeviceMemory {
	t.Helper()
	if err := cuda.Init(); err != nil {
		t.Skipf("no CUDA: %v", err)
	}
	if n, err := cuda.DeviceCount(); err != nil || n == 0 {
		t.Skipf("no GPU (%d, %v)", n, err)
	}
	d, err := cuda.GetDevice(0)
	if err != nil {
		t.Fatal(err)
	}
	c, err := d.Retain()
	if err != nil {
		t.Fatal(err)
	}
	p, err := c.NewPool(cuda.PoolConfig{Size: uint64(size)})
	if err != nil {
		c.Release()
		t.Fatal(err)
	}
	return Pool{p, c}
}
