package nvlink

import (
	"errors"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// ownedPool is a pool that releases its context when closed.
type ownedPool struct {
	*cuda.Pool
	ctx *cuda.Context
}

func (p ownedPool) Close() error { return errors.Join(p.Pool.Close(), p.ctx.Release()) }

func gpuPool(t testing.TB, size int) transfer.DeviceMemory {
	t.Helper()
	needGPU(t)
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
	return ownedPool{p, c}
}

// TestConformanceDevice runs the device cases of the conformance suite for
// nvlink between two engines of this process on GPU 0, the pools given
// WithMemory (skips without a GPU).
func TestConformanceDevice(t *testing.T) {
	needGPU(t)
	transfertest.RunDevice(t, func() []transfer.Transport {
		nv, err := New(Config{})
		if err != nil {
			t.Fatal(err)
		}
		return []transfer.Transport{nv}
	}, gpuPool)
}
