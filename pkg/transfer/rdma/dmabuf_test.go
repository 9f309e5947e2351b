package rdma_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// gpuMem stands for GPU memory with a dma-buf: a memfd (the fake HCA maps
// it) at a device address range the CPU does not use.
type gpuMem struct {
	fd    int
	base  uint64
	size  uint64
	view  []byte // the test's own mapping, to check bytes
	noBuf bool   // offers no dma-buf
}

func newGPUMem(t *testing.T, base, size uint64) *gpuMem {
	fd, err := unix.MemfdCreate("fake-gpu", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		t.Fatal(err)
	}
	v, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	g := &gpuMem{fd: fd, base: base, size: size, view: v}
	t.Cleanup(func() { unix.Munmap(v); unix.Close(fd) })
	return g
}

func (g *gpuMem) Base() uint64 { return g.base }
func (g *gpuMem) Size() uint64 { return g.size }
func (g *gpuMem) Share() (transfer.SharedHandle, error) {
	return transfer.SharedHandle{FD: -1}, transfer.ErrNotShareable
}

func (g *gpuMem) DMABuf(addr, n uint64) (int, uint64, error) {
	if g.noBuf {
		return -1, 0, errors.New("cuMemGetHandleForAddressRange: CUDA_ERROR_NOT_SUPPORTED")
	}
	fd, err := unix.Dup(g.fd)
	return fd, addr - g.base, err
}

var _ rdma.DMABufMemory = (*gpuMem)(nil)

// GPU memory registered through dma-buf on both sides: writes and reads
// between host memory and GPU memory, and GPU to GPU, every byte checked
// through the memory's own mapping.
func TestDMABufGPUMemory(t *testing.T) {
	fab := fake.NewFabric()
	nt := func() []transfer.Transport {
		return []transfer.Transport{rdma.New(rdma.Config{Provider: fab.NewHost("mlx5_0", "mlx5_1"), SliceSize: 64 << 10})}
	}
	a, b := transfertest.NewNode(t, nt, nil), transfertest.NewNode(t, nt, nil)
	const size = 4 << 20
	ctx := context.Background()
	ag, bg := newGPUMem(t, 0x10_0000_0000, size), newGPUMem(t, 0x20_0000_0000, size)
	for _, c := range []struct {
		e *transfer.Engine
		g *gpuMem
	}{{a.E, ag}, {b.E, bg}} {
		if err := c.e.RegisterMemory(ctx, uintptr(c.g.base), size, transfer.Location{Kind: transfer.CUDA, Index: 0}, transfer.AccessReadWrite,
			transfer.WithMemory(c.g)); err != nil {
			t.Fatalf("register GPU memory: %v", err)
		}
		defer c.e.UnregisterMemory(ctx, uintptr(c.g.base))
	}
	ah, bh := a.Alloc(t, size, transfer.AccessReadWrite), b.Alloc(t, size, transfer.AccessReadWrite)
	seg, err := a.E.OpenSegment(ctx, b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(20, 21))
	for _, c := range []struct {
		name   string
		op     transfer.Op
		local  uint64
		lbuf   []byte
		remote uint64
		rbuf   []byte
	}{
		{"host->gpu write", transfer.Write, ah.Addr(), ah.Bytes(), bg.base, bg.view},
		{"gpu->host write", transfer.Write, ag.base, ag.view, bh.Addr(), bh.Bytes()},
		{"gpu->gpu write", transfer.Write, ag.base, ag.view, bg.base, bg.view},
		{"gpu<-host read", transfer.Read, ag.base, ag.view, bh.Addr(), bh.Bytes()},
		{"host<-gpu read", transfer.Read, ah.Addr(), ah.Bytes(), bg.base, bg.view},
	} {
		src, dst := c.lbuf, c.rbuf
		if c.op == transfer.Read {
			src, dst = c.rbuf, c.lbuf
		}
		fillAndPoison(rng, src, dst)
		want := bytes.Repeat([]byte{transfertest.Poison}, size)
		var reqs []transfer.Request
		for k := 0; k < 32; k++ {
			off := uint64(k)*(size/32) + uint64(rng.IntN(1000))
			n := uint64(50<<10 + rng.IntN(60<<10))
			reqs = append(reqs, transfer.Request{Op: c.op, Local: uintptr(c.local + off), Len: n, Segment: seg, Remote: c.remote + off})
			copy(want[off:off+n], src[off:off+n])
		}
		tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := a.E.Transfer(tctx, reqs)
		cancel()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if !bytes.Equal(dst, want) {
			t.Fatalf("%s: destination differs", c.name)
		}
	}
}

// GPU memory without a dma-buf: rdma refuses it at registration, naming
// why, and the engine's error names the transports tried.
func TestGPUMemoryWithoutDMABuf(t *testing.T) {
	fab := fake.NewFabric()
	n := transfertest.NewNode(t, func() []transfer.Transport {
		return []transfer.Transport{rdma.New(rdma.Config{Provider: fab.NewHost("mlx5_0")})}
	}, nil)
	g := newGPUMem(t, 0x30_0000_0000, 1<<20)
	g.noBuf = true
	err := n.E.RegisterMemory(context.Background(), uintptr(g.base), g.size, transfer.Location{Kind: transfer.CUDA, Index: 1}, transfer.AccessReadWrite, transfer.WithMemory(g))
	if !errors.Is(err, transfer.ErrCannotRegister) || !strings.Contains(err.Error(), "rdma") || !strings.Contains(err.Error(), "dma-buf") {
		t.Fatalf("GPU memory without a dma-buf: %v", err)
	}
	err = n.E.RegisterMemory(context.Background(), uintptr(g.base), g.size, transfer.Location{Kind: transfer.CUDA, Index: 1}, transfer.AccessReadWrite)
	if !errors.Is(err, transfer.ErrCannotRegister) || !strings.Contains(err.Error(), "rdma: cuda:1 memory: offers no dma-buf") {
		t.Fatalf("GPU memory given as no memory: %v", err)
	}
}

// fillAndPoison fills src with random bytes and dst with the poison byte.
func fillAndPoison(rng *rand.Rand, src, dst []byte) {
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	for i := range dst {
		dst[i] = transfertest.Poison
	}
}
