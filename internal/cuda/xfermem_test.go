package cuda_test

// GPU tests of a Pool as transfer.DeviceMemory; each skips without a GPU.

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/internal/cuda/cudatest"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// TestPoolOverTCP moves real GPU memory over tcp between two engines of
// this process (GPU->GPU, GPU->host, host->GPU, page lists, bounds),
// checking every byte.
func TestPoolOverTCP(t *testing.T) {
	cudatest.NewPool(t, 1<<20).(cudatest.Pool).Close() // skip early without a GPU
	transfertest.RunDevice(t, func() []transfer.Transport { return []transfer.Transport{tcp.New(tcp.Config{})} }, cudatest.NewPool)
}

// TestPoolOverRDMAFakeHCA moves real GPU memory over rdma on the fake HCA
// between two engines of this process, every byte checked. The fake maps a
// dma-buf with mmap, which GPU dma-bufs normally refuse: the pools then
// fall back to host staging (the path a NIC without dma-buf support takes),
// and this checks staging through pinned memory and the pool's copy
// streams. It logs which path a pool took.
func TestPoolOverRDMAFakeHCA(t *testing.T) {
	m := cudatest.NewPool(t, 1<<20)
	t.Cleanup(func() { m.(cudatest.Pool).Close() }) // after the engine's cleanup
	fab := fake.NewFabric()
	core, logs := observer.New(zap.DebugLevel)
	n := transfertest.NewNode(t, func() []transfer.Transport {
		return []transfer.Transport{rdma.New(rdma.Config{Provider: fab.NewHost("mlx5_0")})}
	}, func(c *transfer.Config) { c.Logger = zap.New(core) })
	if err := n.E.RegisterMemory(context.Background(), uintptr(m.Base()), 1<<20, transfertest.DeviceLocation, transfer.AccessReadWrite, transfer.WithMemory(m)); err != nil {
		t.Fatal(err)
	}
	for _, e := range logs.FilterMessageSnippet("stages GPU memory").All() {
		t.Logf("%s: %v", e.Message, e.ContextMap())
	}
	transfertest.RunDevice(t, func() []transfer.Transport {
		return []transfer.Transport{rdma.New(rdma.Config{Provider: fab.NewHost("mlx5_0")})}
	}, cudatest.NewPool)
}

// TestPoolCopies: the pool's copies round-trip bytes, refuse ranges
// outside the pool, and its handle is shareable.
func TestPoolCopies(t *testing.T) {
	m := cudatest.NewPool(t, 4<<20)
	defer m.(cudatest.Pool).Close()
	st, err := m.AllocStaging(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	b := st.Bytes()
	for i := range b[:1<<20] {
		b[i] = byte(i*7 + 3)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	wait := func(c transfer.Completion, err error) {
		t.Helper()
		if err == nil {
			err = c.Wait(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	base := m.Base()
	wait(m.CopyFromHost(base+4096, b[:1<<20]))
	wait(m.CopyToHost(b[1<<20:], base+4096))
	for i := 0; i < 1<<20; i++ {
		if b[1<<20+i] != b[i] {
			t.Fatalf("byte %d: %#x, want %#x", i, b[1<<20+i], b[i])
		}
	}
	for _, addr := range []uint64{base - 1, base + m.Size() - 10} {
		if _, err := m.CopyToHost(b[:100], addr); !errors.Is(err, transfer.ErrDeviceCopy) {
			t.Errorf("copy of 100 bytes at %#x: %v, want ErrDeviceCopy", addr, err)
		}
	}
	h, err := m.Share()
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if h.Kind != transfer.HandlePosixFD && h.Kind != transfer.HandleFabric || h.Size < 4<<20 || h.Device != 0 {
		t.Fatalf("handle %+v", h)
	}
}
