package shm

import (
	"context"
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// BenchmarkTransfer moves 32 MiB per batch from an initiator into a target
// engine's region, in blocks of the given size, through shm; the memcpy
// baseline copies the same blocks between the same two buffers in one
// goroutine, in the same run. copiers=1 is shm restricted to one copying
// goroutine, the like-for-like comparison with that baseline.
func BenchmarkTransfer(b *testing.B) {
	const total = 32 << 20
	target, _ := newEngine(b)
	init, _ := newEngine(b)
	rmem := alloc(b, target, total, transfer.AccessReadWrite)
	src := alloc(b, init, total, transfer.AccessReadWrite)
	random(b, src.Bytes())
	fill(rmem.Bytes(), 1) // fault the pages in before timing
	ctx := context.Background()
	seg, err := init.OpenSegment(ctx, target.Name())
	if err != nil {
		b.Fatal(err)
	}
	// The same batches through an initiator whose shm copies in one goroutine.
	init1, _ := newEngine(b, withShm(Config{Copiers: 1}))
	src1 := alloc(b, init1, total, transfer.AccessReadWrite)
	random(b, src1.Bytes())
	seg1, err := init1.OpenSegment(ctx, target.Name())
	if err != nil {
		b.Fatal(err)
	}
	for _, bs := range []struct {
		name string
		n    uint64
	}{{"4KiB", 4 << 10}, {"64KiB", 64 << 10}, {"256KiB", 256 << 10}, {"1MiB", 1 << 20}, {"4MiB", 4 << 20}} {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			sub := "/block=" + bs.name + "/op=" + op.String()
			shm := func(e *transfer.Engine, reqs []transfer.Request) func(b *testing.B) {
				return func(b *testing.B) {
					b.SetBytes(total)
					b.ReportAllocs()
					for b.Loop() {
						if err := e.Transfer(ctx, reqs); err != nil {
							b.Fatal(err)
						}
					}
				}
			}
			b.Run("transport=shm"+sub, shm(init, requests(op, seg, src.Addr(), rmem.Addr(), total, bs.n)))
			b.Run("transport=shm"+sub+"/copiers=1", shm(init1, requests(op, seg1, src1.Addr(), rmem.Addr(), total, bs.n)))
			b.Run("transport=memcpy"+sub, func(b *testing.B) {
				b.SetBytes(total)
				b.ReportAllocs()
				l, r := src.Bytes(), rmem.Bytes()
				for b.Loop() {
					for off := uint64(0); off < total; off += bs.n {
						if op == transfer.Write {
							copy(r[off:off+bs.n], l[off:off+bs.n])
						} else {
							copy(l[off:off+bs.n], r[off:off+bs.n])
						}
					}
				}
			})
		}
	}
}

// BenchmarkRegister16GiB allocates and registers a 16 GiB shareable host
// region (no page is touched), then frees it.
func BenchmarkRegister16GiB(b *testing.B) {
	e, _ := newEngine(b)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		m, err := e.AllocHost(ctx, 16<<30, 0, transfer.AccessReadWrite, transfer.WithScope(transfer.ScopeSameMachine))
		if err != nil {
			b.Fatal(err)
		}
		if err := e.FreeHost(ctx, m); err != nil {
			b.Fatal(err)
		}
	}
}
