package transfer

import (
	"context"
	"encoding/json"
	"testing"
	"unsafe"
)

// nopTransport completes every task at once: it measures the engine's own
// cost per request.
type nopTransport struct{}

func (nopTransport) Name() string                                     { return "nop" }
func (nopTransport) Reach() Reach                                     { return ReachNetwork }
func (nopTransport) Start(Host) error                                 { return nil }
func (nopTransport) Info() json.RawMessage                            { return json.RawMessage(`{}`) }
func (nopTransport) RegisterRegion(*Region) (json.RawMessage, error)  { return nil, nil }
func (nopTransport) UnregisterRegion(*Region)                         {}
func (nopTransport) CanServe(Location, *Descriptor, *RegionInfo) bool { return true }
func (nopTransport) DropPeer(*Descriptor)                             {}
func (nopTransport) Close() error                                     { return nil }
func (nopTransport) PageLists() bool                                  { return true }
func (nopTransport) Submit(_ context.Context, _ *Descriptor, tasks []*Task) {
	for _, t := range tasks {
		t.Done(nil)
	}
}

// BenchmarkSubmit is the engine's cost per page of a 65536-page batch
// (loopback segment, no bytes moved): one request per page, or the pages as
// one page-list request.
func BenchmarkSubmit(b *testing.B) {
	ctx := context.Background()
	e, err := New(ctx, Config{Transports: []Transport{nopTransport{}}})
	if err != nil {
		b.Fatal(err)
	}
	defer e.Close()
	const n, page = 65536, 4096
	buf := make([]byte, 2*n*page)
	base := uintptr(unsafe.Pointer(&buf[0]))
	if err := e.RegisterMemory(ctx, base, uint64(len(buf)), Location{Kind: CPU}, AccessReadWrite); err != nil {
		b.Fatal(err)
	}
	reqs := make([]Request, n)
	pages := make([]PageOffset, n)
	for i := range reqs {
		reqs[i] = Request{Op: Write, Local: base + uintptr(i*page), Len: page, Segment: LocalSegment, Remote: uint64(base) + uint64((n+i)*page)}
		pages[i] = PageOffset{Local: uint64(i * page), Remote: uint64((n - 1 - i) * page)}
	}
	list := []Request{{Op: Write, Local: base, Len: page, Segment: LocalSegment, Remote: uint64(base) + n*page, Pages: pages}}
	for _, c := range []struct {
		name string
		reqs []Request
	}{{"requests", reqs}, {"pagelist", list}} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := e.Transfer(ctx, c.reqs); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/page")
		})
	}
}
