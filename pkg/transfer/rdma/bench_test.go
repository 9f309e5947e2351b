package rdma_test

import (
	"context"
	"testing"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// BenchmarkFakeWrite measures the transport's own cost per batch on the
// fake HCA (which copies at post time): slicing, credits, posting lists,
// polling and reporting. It bounds what the Go side can feed a real HCA.
func BenchmarkFakeWrite(b *testing.B) {
	for _, c := range []struct {
		name        string
		block, reqs int
	}{{"4KiBx1024", 4096, 1024}, {"256KiBx32", 256 << 10, 32}, {"1MiBx8", 1 << 20, 8}} {
		b.Run(c.name, func(b *testing.B) {
			a, d := pair(b, rdma.Config{}, 0, "mlx5_0")
			ctx := context.Background()
			seg, err := a.n.E.OpenSegment(ctx, d.n.E.Name())
			if err != nil {
				b.Fatal(err)
			}
			src := a.m.Bytes()
			reqs := make([]transfer.Request, c.reqs)
			for i := range reqs {
				off := i * c.block
				reqs[i] = transfer.Request{Op: transfer.Write, Local: uintptr(unsafe.Pointer(&src[off])), Len: uint64(c.block), Segment: seg, Remote: d.m.Addr() + uint64(off)}
			}
			b.SetBytes(int64(c.block * c.reqs))
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := a.n.E.Transfer(ctx, reqs); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkFakeStagedWrite is BenchmarkFakeWrite with staged GPU memory
// (transfertest's fake devices: a goroutine per copy) on the initiator,
// the target or both: the pipeline's own cost on top of the memcpys.
func BenchmarkFakeStagedWrite(b *testing.B) {
	for _, side := range []string{"local", "remote", "both"} {
		for _, c := range []struct {
			name        string
			block, reqs int
		}{{"4KiBx1024", 4096, 1024}, {"256KiBx32", 256 << 10, 32}} {
			b.Run(side+"/"+c.name, func(b *testing.B) {
				a, d := pair(b, rdma.Config{}, 0, "mlx5_0")
				src, dst := a.m.Addr(), d.m.Addr()
				if side != "remote" {
					src = a.n.AllocDevice(b, transfertest.FakeDevices, memSize, transfer.AccessReadWrite).Addr
				}
				if side != "local" {
					dst = d.n.AllocDevice(b, transfertest.FakeDevices, memSize, transfer.AccessReadWrite).Addr
				}
				ctx := context.Background()
				seg, err := a.n.E.OpenSegment(ctx, d.n.E.Name())
				if err != nil {
					b.Fatal(err)
				}
				reqs := make([]transfer.Request, c.reqs)
				for i := range reqs {
					off := uint64(i * c.block)
					reqs[i] = transfer.Request{Op: transfer.Write, Local: uintptr(src + off), Len: uint64(c.block), Segment: seg, Remote: dst + off}
				}
				b.SetBytes(int64(c.block * c.reqs))
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					if err := a.n.E.Transfer(ctx, reqs); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
