package tcp_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func dialLane(t *testing.T, a, b *transfertest.Node) net.Conn {
	t.Helper()
	conn, err := a.E.Dial(context.Background(), b.E.Self(), tcp.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	return conn
}

// TestServerChecksVectors speaks vector requests directly: the target
// checks every entry before a byte moves, refuses the whole request naming
// the failing entry (the lane stays usable), serves host and device
// entries, and closes the lane on a malformed vector.
func TestServerChecksVectors(t *testing.T) {
	b := transfertest.NewNode(t, newTransports, nil)
	rw := b.Alloc(t, 1<<16, transfer.AccessReadWrite)
	ro := b.Alloc(t, 1<<16, transfer.AccessRead)
	dev := b.AllocDevice(t, transfertest.FakeDevices, 1<<16, transfer.AccessReadWrite)
	a := transfertest.NewNode(t, newTransports, nil)
	conn := dialLane(t, a, b)
	w, d := rw.Addr(), dev.Addr
	cases := []struct {
		name    string
		op      uint8
		ents    [][2]uint64
		payload string
		status  uint8
		errHas  string
	}{
		{"write", tcp.OpWrite, [][2]uint64{{w + 100, 5}, {w + 1000, 3}, {w + 50, 2}}, "abcdefghij", tcp.StatusOK, ""},
		{"read", tcp.OpRead, [][2]uint64{{w + 1000, 3}, {w + 100, 5}, {w + 50, 2}}, "", tcp.StatusOK, "fghabcdeij"},
		{"write crosses end", tcp.OpWrite, [][2]uint64{{w + 200, 2}, {w + 300, 2}, {w + 1<<16 - 1, 2}}, "012345", tcp.StatusOutOfBounds, "entry 2"},
		{"write read-only", tcp.OpWrite, [][2]uint64{{w + 400, 2}, {ro.Addr(), 2}}, "0123", tcp.StatusDenied, "entry 1"},
		{"read unregistered", tcp.OpRead, [][2]uint64{{0x10000, 4}, {w, 4}}, "", tcp.StatusOutOfBounds, "entry 0"},
		{"host and device", tcp.OpWrite, [][2]uint64{{w + 500, 2}, {d, 2}}, "0123", tcp.StatusDevice, "entry 1"},
		{"device write", tcp.OpWrite, [][2]uint64{{d + 10, 4}, {d + 14, 4}, {d + 100, 2}}, "0123456789", tcp.StatusOK, ""},
		{"device read", tcp.OpRead, [][2]uint64{{d + 100, 2}, {d + 10, 8}}, "", tcp.StatusOK, "8901234567"},
		{"device read out of bounds", tcp.OpRead, [][2]uint64{{d + 100, 2}, {d + 1<<16 - 1, 8}}, "", tcp.StatusOutOfBounds, "entry 1"},
	}
	for i, c := range cases {
		var total uint64
		for _, e := range c.ents {
			total += e[1]
		}
		if _, err := conn.Write(append(tcp.EncodeVector(c.op, uint64(i), total, c.ents), c.payload...)); err != nil {
			t.Fatal(err)
		}
		status, id, body, err := tcp.ReadResponse(conn)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if status != c.status || id != uint64(i) {
			t.Fatalf("%s: status %d id %d (%q), want %d id %d", c.name, status, id, body, c.status, i)
		}
		if c.status == tcp.StatusOK && c.op == tcp.OpRead && string(body) != c.errHas {
			t.Errorf("%s: read %q, want %q", c.name, body, c.errHas)
		}
		if c.status != tcp.StatusOK && !strings.Contains(string(body), c.errHas) {
			t.Errorf("%s: error %q does not name %q", c.name, body, c.errHas)
		}
	}
	want := bytes.Repeat([]byte{transfertest.Poison}, 1<<16)
	copy(want[50:], "ij")
	copy(want[100:], "abcde")
	copy(want[1000:], "fgh")
	if !bytes.Equal(rw.Bytes(), want) {
		t.Error("host region: refused vectors wrote, or the vector write is wrong")
	}
	f := dev.Mem.(*transfertest.FakeDevice)
	if got := string(f.Data()[10:18]) + string(f.Data()[100:102]); got != "0123456789" {
		t.Errorf("device region holds %q", got)
	}
	// The lane still serves; then a malformed vector closes it.
	if _, err := conn.Write(append(tcp.EncodeRequest(tcp.OpWrite, 50, w, 2), "zz"...)); err != nil {
		t.Fatal(err)
	}
	if status, _, body, err := tcp.ReadResponse(conn); err != nil || status != tcp.StatusOK {
		t.Fatalf("single write after the vectors: status %d %q %v", status, body, err)
	}
	mustClose := func(conn net.Conn, req []byte, has string) {
		t.Helper()
		conn.Write(req)
		status, _, body, err := tcp.ReadResponse(conn)
		if err != nil || status != tcp.StatusBadRequest || !strings.Contains(string(body), has) {
			t.Fatalf("status %d %q %v, want bad request naming %q", status, body, err, has)
		}
		if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			t.Fatalf("lane not closed after a bad vector: %v", err)
		}
	}
	mustClose(conn, tcp.EncodeVector(tcp.OpRead, 51, 10, [][2]uint64{{w, 4}, {w + 8, 4}}), "sum to 8")
	many := make([][2]uint64, 257)
	for i := range many {
		many[i] = [2]uint64{w + uint64(i), 1}
	}
	mustClose(dialLane(t, a, b), tcp.EncodeVector(tcp.OpRead, 52, 257, many), "257 entries")
	mustClose(dialLane(t, a, b), tcp.EncodeVector(tcp.OpRead, 53, 8, [][2]uint64{{w, 8}, {w + 8, 0}}), "entry 1: length 0")
	// A target with vectors off takes them as an older version does: a
	// bad frame.
	old := transfertest.NewNode(t, func() []transfer.Transport { return []transfer.Transport{tcp.New(tcp.Config{NoVectors: true})} }, nil)
	om := old.Alloc(t, 1<<12, transfer.AccessReadWrite)
	mustClose(dialLane(t, a, old), tcp.EncodeVector(tcp.OpRead, 54, 4, [][2]uint64{{om.Addr(), 4}}), "flags")
}

// side is one end's memory in the end-to-end vector tests: host memory, or
// a fake device whose bytes the test reaches directly (no copy runs then).
type side struct {
	addr uint64
	data []byte
	dev  *transfertest.FakeDevice // nil for host memory
}

func (s side) copies() int64 {
	if s.dev == nil {
		return 0
	}
	return s.dev.Copies()
}

func newSide(t *testing.T, n *transfertest.Node, device bool, size int) side {
	if !device {
		m := n.Alloc(t, int64(size), transfer.AccessReadWrite)
		return side{addr: m.Addr(), data: m.Bytes()}
	}
	d := n.AllocDevice(t, transfertest.FakeDevices, size, transfer.AccessReadWrite)
	f := d.Mem.(*transfertest.FakeDevice)
	return side{addr: d.Addr, data: f.Data()[:size], dev: f}
}

const (
	vecPages   = 300
	vecPageLen = 4000
	vecSize    = 2 * vecPages * vecPageLen
)

// pageOffsets places vecPages pages: in order, back to back, or scattered
// (a permutation of twice as many slots).
func pageOffsets(seed uint64, scattered bool) []uint64 {
	offs := make([]uint64, vecPages)
	for i := range offs {
		offs[i] = uint64(i) * vecPageLen
	}
	if scattered {
		for i := range offs {
			offs[i] = ((uint64(i)*7919 + seed) % (2 * vecPages)) * vecPageLen // 7919 is prime: distinct slots
		}
	}
	return offs
}

// movePages moves a page list of vecPages pages between local and remote
// and checks every byte of the destination: the pages' bytes, poison
// elsewhere.
func movePages(t *testing.T, a *transfertest.Node, seg transfer.SegmentID, op transfer.Op, local, remote side, lo, ro []uint64, seed byte) {
	t.Helper()
	src, dst, so, do := local, remote, lo, ro
	if op == transfer.Read {
		src, dst, so, do = remote, local, ro, lo
	}
	for i := range src.data {
		src.data[i] = byte(i*31) + seed
	}
	for i := range dst.data {
		dst.data[i] = transfertest.Poison
	}
	want := bytes.Repeat([]byte{transfertest.Poison}, len(dst.data))
	pages := make([]transfer.PageOffset, vecPages)
	for i := range pages {
		pages[i] = transfer.PageOffset{Local: lo[i], Remote: ro[i]}
		copy(want[do[i]:do[i]+vecPageLen], src.data[so[i]:so[i]+vecPageLen])
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	err := a.E.Transfer(ctx, []transfer.Request{{Op: op, Local: uintptr(local.addr), Len: vecPageLen, Segment: seg, Remote: remote.addr, Pages: pages}})
	if err != nil {
		t.Fatalf("%v of %d pages: %v", op, vecPages, err)
	}
	if !bytes.Equal(dst.data, want) {
		for i := range want {
			if dst.data[i] != want[i] {
				t.Fatalf("%v: byte %d is %#x, want %#x", op, i, dst.data[i], want[i])
			}
		}
	}
}

// TestVectorPages: page lists of many small scattered pages, host or
// device memory on either side, every byte checked. Where the device
// side's pages lie back to back, vectors make its copies few: one per run
// of contiguous pages in a request, not one per page.
func TestVectorPages(t *testing.T) {
	a, b := transfertest.NewNode(t, newTransports, nil), transfertest.NewNode(t, newTransports, nil)
	seg, err := a.E.OpenSegment(context.Background(), b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[bool]string{false: "host", true: "device"}
	for _, ld := range []bool{false, true} {
		for _, rd := range []bool{false, true} {
			local, remote := newSide(t, a, ld, vecSize), newSide(t, b, rd, vecSize)
			for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
				for _, scattered := range []bool{false, true} {
					name := kinds[ld] + "-" + kinds[rd] + "/" + op.String()
					if scattered {
						name += "/scattered"
					}
					t.Run(name, func(t *testing.T) {
						// Back to back: the device sides' pages in order, the
						// host sides' scattered.
						lo, ro := pageOffsets(3, scattered || !ld), pageOffsets(11, scattered || !rd)
						c0 := local.copies() + remote.copies()
						movePages(t, a, seg, op, local, remote, lo, ro, byte(len(name)))
						if n := local.copies() + remote.copies() - c0; !scattered && (ld || rd) && n > vecPages/10 {
							t.Errorf("%d device copies for %d pages back to back: not vectored", n, vecPages)
						}
					})
				}
			}
		}
	}
}

// TestVectorOldPeer: against a peer that does not advertise vectors (and
// takes one as a bad frame, as an older version does) the initiator sends
// single requests, and an initiator with vectors off sends them to a peer
// that has them: either way every byte arrives, one device copy per page.
func TestVectorOldPeer(t *testing.T) {
	old := func() []transfer.Transport { return []transfer.Transport{tcp.New(tcp.Config{NoVectors: true})} }
	for _, c := range []struct {
		name  string
		a, b  func() []transfer.Transport
		pages int64 // device copies on b per transfer
	}{
		{"old target", newTransports, old, vecPages},
		{"old initiator", old, newTransports, vecPages},
		{"both new", newTransports, newTransports, vecPages / 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			a, b := transfertest.NewNode(t, c.a, nil), transfertest.NewNode(t, c.b, nil)
			seg, err := a.E.OpenSegment(context.Background(), b.E.Name())
			if err != nil {
				t.Fatal(err)
			}
			local, host, dev := newSide(t, a, false, vecSize), newSide(t, b, false, vecSize), newSide(t, b, true, vecSize)
			lo, ro := pageOffsets(5, true), pageOffsets(0, false)
			for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
				movePages(t, a, seg, op, local, host, lo, pageOffsets(9, true), 1)
				c0 := dev.copies()
				movePages(t, a, seg, op, local, dev, lo, ro, 2)
				n := dev.copies() - c0
				if (c.pages == vecPages && n != vecPages) || (c.pages < vecPages && n > c.pages) {
					t.Errorf("%v: %d device copies on the target for %d pages, want %s %d", op, n, vecPages,
						map[bool]string{true: "exactly", false: "at most"}[c.pages == vecPages], c.pages)
				}
			}
		})
	}
}

// TestVectorFailsItsPieces: a request whose region the target no longer
// has fails (naming the entry) while the requests of the same batch around
// it, in a live region, complete: vectors never mix regions.
func TestVectorFailsItsPieces(t *testing.T) {
	for _, device := range []bool{false, true} {
		t.Run(map[bool]string{false: "host", true: "device"}[device], func(t *testing.T) {
			a, b := transfertest.NewNode(t, newTransports, nil), transfertest.NewNode(t, newTransports, nil)
			local := newSide(t, a, false, vecSize)
			live, gone := newSide(t, b, device, vecSize), newSide(t, b, device, vecSize)
			ctx := context.Background()
			seg, err := a.E.OpenSegment(ctx, b.E.Name())
			if err != nil {
				t.Fatal(err)
			}
			if err := b.E.UnregisterMemory(ctx, uintptr(gone.addr)); err != nil {
				t.Fatal(err)
			}
			for i := range local.data {
				local.data[i] = byte(i)
			}
			var reqs []transfer.Request
			for _, to := range []side{live, gone, live} {
				pages := make([]transfer.PageOffset, 64)
				for i := range pages {
					off := uint64(len(reqs)*64+i) * 2 * vecPageLen
					pages[i] = transfer.PageOffset{Local: off, Remote: off}
				}
				reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(local.addr), Len: vecPageLen, Segment: seg, Remote: to.addr, Pages: pages})
			}
			bt, err := a.E.Submit(ctx, reqs)
			if err != nil {
				t.Fatal(err)
			}
			bt.Wait(ctx)
			st := bt.Statuses()
			if st[0].State != transfer.Completed || st[2].State != transfer.Completed {
				t.Fatalf("requests to the live region: %v (%v), %v (%v)", st[0].State, st[0].Err, st[2].State, st[2].Err)
			}
			if !errors.Is(st[1].Err, transfer.ErrOutOfBounds) || !strings.Contains(st[1].Err.Error(), "entry") {
				t.Fatalf("request to the unregistered region: %v, want ErrOutOfBounds naming the entry", st[1].Err)
			}
			for _, r := range []int{0, 2} {
				for i := range 64 {
					off := uint64(r*64+i) * 2 * vecPageLen
					if !bytes.Equal(live.data[off:off+vecPageLen], local.data[off:off+vecPageLen]) {
						t.Fatalf("request %d page %d not written", r, i)
					}
				}
			}
		})
	}
}

// TestVectorCancel: a batch whose context ends while its vectors' device
// copies run (on the initiator or the target, writes and reads) fails in
// about its bound; the copies that outlive it give their staging back, and
// the lanes serve the next batch.
func TestVectorCancel(t *testing.T) {
	a, b := transfertest.NewNode(t, newTransports, nil), transfertest.NewNode(t, newTransports, nil)
	seg, err := a.E.OpenSegment(context.Background(), b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	ad, bh := newSide(t, a, true, vecSize), newSide(t, b, false, vecSize)
	ah, bd := newSide(t, a, false, vecSize), newSide(t, b, true, vecSize)
	lo, ro := pageOffsets(0, false), pageOffsets(1, true)
	for _, c := range []struct {
		name          string
		slow          *transfertest.FakeDevice
		local, remote side
	}{
		{"initiator", ad.dev, ad, bh},
		{"target", bd.dev, ah, bd},
	} {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			t.Run(c.name+"/"+op.String(), func(t *testing.T) {
				c.slow.SetDelay(500 * time.Millisecond)
				pages := make([]transfer.PageOffset, vecPages)
				for i := range pages {
					pages[i] = transfer.PageOffset{Local: lo[i], Remote: ro[i]}
				}
				ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
				start := time.Now()
				err := a.E.Transfer(ctx, []transfer.Request{{Op: op, Local: uintptr(c.local.addr), Len: vecPageLen, Segment: seg, Remote: c.remote.addr, Pages: pages}})
				el := time.Since(start)
				cancel()
				c.slow.SetDelay(0)
				if err == nil {
					t.Fatal("a batch past its context succeeded")
				}
				if el > 2*time.Second {
					t.Errorf("failed after %v", el)
				}
				time.Sleep(600 * time.Millisecond) // the late copies end
				movePages(t, a, seg, op, c.local, c.remote, lo, ro, 7)
			})
		}
	}
}
