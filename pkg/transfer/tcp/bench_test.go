package tcp_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"sync"
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// BenchmarkTransfer writes batches of 128 blocks between two engines in
// this process over loopback (transport=tcp; tcp-novector: one request per
// block, as before vector requests), and streams the same bytes
// in 1 MiB writes over as many plain connections as tcp has lanes
// (transport=raw): the baseline in the same run. Two-process numbers come
// from `mooncake-go bench transfer --baseline`.
func BenchmarkTransfer(b *testing.B) {
	const batch = 128
	for _, block := range []int{4 << 10, 64 << 10, 256 << 10, 1 << 20} {
		size := int64(batch * block)
		name := fmt.Sprintf("%dKiB", block>>10)
		for _, tr := range []struct {
			name string
			cfg  tcp.Config
		}{{"tcp", tcp.Config{}}, {"tcp-novector", tcp.Config{NoVectors: true}}} {
			b.Run("transport="+tr.name+"/block="+name, func(b *testing.B) {
				nt := func() []transfer.Transport { return []transfer.Transport{tcp.New(tr.cfg)} }
				benchTCP(b, nt, batch, block)
			})
		}
		b.Run("transport=raw/block="+name, func(b *testing.B) {
			a, t := transfertest.NewNode(b, newTransports, nil), transfertest.NewNode(b, newTransports, nil)
			am, tm := a.Alloc(b, size, transfer.AccessReadWrite), t.Alloc(b, size, transfer.AccessReadWrite)
			lanes := 4
			t.E.Handle("raw", func(c net.Conn, _ transfer.Hello) {
				for {
					if _, err := io.ReadFull(c, tm.Bytes()[:min(1<<20, len(tm.Bytes()))]); err != nil {
						return
					}
				}
			})
			conns := make([]net.Conn, lanes)
			for i := range conns {
				c, err := a.E.Dial(context.Background(), t.E.Self(), "raw")
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close()
				conns[i] = c
			}
			chunk := min(1<<20, int(size))
			b.SetBytes(size)
			b.ReportAllocs()
			for b.Loop() {
				// The same bytes as one batch, in 1 MiB writes over the lanes.
				var wg sync.WaitGroup
				per := int(size) / lanes
				for _, c := range conns {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for sent := 0; sent < per; sent += chunk {
							c.Write(am.Bytes()[:min(chunk, per-sent)])
						}
					}()
				}
				wg.Wait()
			}
		})
	}
}

// benchTCP writes batches of batch blocks between two engines with the
// transports nt returns.
func benchTCP(b *testing.B, nt func() []transfer.Transport, batch, block int) {
	size := int64(batch * block)
	a, t := transfertest.NewNode(b, nt, nil), transfertest.NewNode(b, nt, nil)
	am, tm := a.Alloc(b, size, transfer.AccessReadWrite), t.Alloc(b, size, transfer.AccessReadWrite)
	b.ReportAllocs()
	loopBatch(b, a, t, transfer.Write, am.Addr(), tm.Addr(), batch, block)
}

// loopBatch transfers batch blocks of block bytes from local to remote (on
// t's segment, op) until the benchmark ends.
func loopBatch(b *testing.B, a, t *transfertest.Node, op transfer.Op, local, remote uint64, batch, block int) {
	seg, err := a.E.OpenSegment(context.Background(), t.E.Name())
	if err != nil {
		b.Fatal(err)
	}
	reqs := make([]transfer.Request, batch)
	for i := range reqs {
		off := uint64(i * block)
		reqs[i] = transfer.Request{Op: op, Local: uintptr(local + off), Len: uint64(block), Segment: seg, Remote: remote + off}
	}
	b.SetBytes(int64(batch * block))
	for b.Loop() {
		if err := a.E.Transfer(context.Background(), reqs); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkTransferDevice moves batches of 128 blocks of 64 KiB between
// fake device memory on both sides (transfertest.FakeDevice: host memory
// behind the staging interface, a goroutine per copy), with and without
// vector requests: the staging's per-piece costs on the CPU, not a GPU's.
func BenchmarkTransferDevice(b *testing.B) {
	const batch, block = 128, 64 << 10
	for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
		for _, tr := range []struct {
			name string
			cfg  tcp.Config
		}{{"tcp", tcp.Config{}}, {"tcp-novector", tcp.Config{NoVectors: true}}} {
			b.Run("transport="+tr.name+"/op="+op.String(), func(b *testing.B) {
				nt := func() []transfer.Transport { return []transfer.Transport{tcp.New(tr.cfg)} }
				a, t := transfertest.NewNode(b, nt, nil), transfertest.NewNode(b, nt, nil)
				ad := a.AllocDevice(b, transfertest.FakeDevices, batch*block, transfer.AccessReadWrite)
				td := t.AllocDevice(b, transfertest.FakeDevices, batch*block, transfer.AccessReadWrite)
				loopBatch(b, a, t, op, uint64(ad.Addr), td.Addr, batch, block)
			})
		}
	}
}
