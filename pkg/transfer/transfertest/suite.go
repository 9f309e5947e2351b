// Package transfertest is the conformance suite every transfer.Transport
// must pass: the same body of tests, run against any set of transports, in
// one process (Run) and between two processes (RunProcess).
package transfertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Poison is the byte destinations hold before a transfer: any byte a test
// did not transfer must still be Poison afterwards.
const Poison = 0xA5

// Node is an engine with memory the suite allocated.
type Node struct {
	E       *transfer.Engine
	mems    []*transfer.HostMemory
	closers []func() error // device memory and its staging
}

// NewNode starts an engine on 127.0.0.1 with fresh transports; it is closed
// (and its memory freed) when the test ends.
func NewNode(t testing.TB, newTransports func() []transfer.Transport, mod func(*transfer.Config)) *Node {
	t.Helper()
	cfg := transfer.Config{Listen: "127.0.0.1:0", Transports: newTransports(), Timeout: 3 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	e, err := transfer.New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("transfer.New: %v", err)
	}
	n := &Node{E: e}
	t.Cleanup(n.Close)
	return n
}

// Close closes the engine, then frees the memory.
func (n *Node) Close() {
	n.E.Close()
	for _, m := range n.mems {
		m.Close()
	}
	n.mems = nil
	for i := len(n.closers) - 1; i >= 0; i-- {
		n.closers[i]()
	}
	n.closers = nil
}

// Alloc allocates and registers host memory with the given access, filled
// with Poison.
func (n *Node) Alloc(t testing.TB, size int64, access transfer.Access) *transfer.HostMemory {
	t.Helper()
	m, err := n.E.AllocHost(context.Background(), size, 0, access)
	if err != nil {
		t.Fatalf("AllocHost(%d): %v", size, err)
	}
	n.mems = append(n.mems, m)
	fill(m.Bytes(), Poison)
	return m
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

// span is a transfer of n bytes from src offset to dst offset.
type span struct{ src, dst, n int }

// layout places count blocks (sizes from size) at random, unaligned,
// non-overlapping offsets of two buffers of length total.
func layout(rng *rand.Rand, count, total int, size func() int) []span {
	sizes := make([]int, count)
	sum := 0
	for i := range sizes {
		sizes[i] = size()
		sum += sizes[i]
	}
	if sum > total {
		panic(fmt.Sprintf("transfertest: %d bytes do not fit in %d", sum, total))
	}
	place := func() []int {
		slack := total - sum
		// Random gaps that add up to at most slack, blocks in shuffled order.
		gaps := make([]int, count+1)
		for i := range gaps {
			gaps[i] = rng.IntN(slack/(count+1) + 1)
		}
		order := rng.Perm(count)
		offs := make([]int, count)
		pos := 0
		for k, i := range order {
			pos += gaps[k]
			offs[i] = pos
			pos += sizes[i]
		}
		return offs
	}
	src, dst := place(), place()
	s := make([]span, count)
	for i := range s {
		s[i] = span{src: src[i], dst: dst[i], n: sizes[i]}
	}
	return s
}

// Run runs the in-process suite: two engines in one process in P2P mode
// (no registry), each with the transports newTransports returns.
func Run(t *testing.T, newTransports func() []transfer.Transport) {
	t.Run("Data", func(t *testing.T) { testData(t, newTransports) })
	t.Run("Concurrent", func(t *testing.T) { testConcurrent(t, newTransports) })
	t.Run("OutOfBounds", func(t *testing.T) { testOutOfBounds(t, newTransports) })
	t.Run("UnregisteredAfterOpen", func(t *testing.T) { testUnregisteredAfterOpen(t, newTransports) })
	t.Run("ReadOnly", func(t *testing.T) { testReadOnly(t, newTransports) })
	t.Run("Auth", func(t *testing.T) { testAuth(t, newTransports) })
	t.Run("NotifyProbe", func(t *testing.T) { testNotifyProbe(t, newTransports) })
	t.Run("ConcurrentFirstNotifies", func(t *testing.T) { testConcurrentNotify(t, newTransports) })
	t.Run("Restart", func(t *testing.T) { testRestart(t, newTransports) })
	t.Run("UnregisterAfterTransfers", func(t *testing.T) { testUnregisterAfter(t, newTransports) })
}

// testUnregisterAfter: once batches (writes and reads, plain and
// page lists) are done, neither side holds the memory any more: both
// unregister at once (a hold left behind would make it wait, then fail).
func testUnregisterAfter(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am, bm := a.Alloc(t, 4<<20, transfer.AccessReadWrite), b.Alloc(t, 4<<20, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	rng := rand.New(rand.NewPCG(9, 10))
	for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
		for _, pages := range []bool{false, true} {
			spans := layout(rng, 64, 4<<20, func() int { return 16 << 10 })
			transferCheck(t, a.E, seg, am.Bytes(), bm.Bytes(), bm.Addr(), op, spans, rng, nil, pages)
		}
	}
	for _, c := range []struct {
		e    *transfer.Engine
		addr uint64
	}{{b.E, bm.Addr()}, {a.E, am.Addr()}} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		start := time.Now()
		err := c.e.UnregisterMemory(ctx, uintptr(c.addr))
		cancel()
		if err != nil {
			t.Fatalf("unregister %s after its transfers: %v", c.e.Name(), err)
		}
		if el := time.Since(start); el > 500*time.Millisecond {
			t.Errorf("unregister %s took %v after its transfers ended", c.e.Name(), el)
		}
	}
}

const bufSize = 16 << 20

type dataCase struct {
	name  string
	count int
	size  func(rng *rand.Rand) int
	pages bool // sent as one page-list request (set by pageCases)
}

func fixed(n int) func(*rand.Rand) int { return func(*rand.Rand) int { return n } }

// pageCases are the fixed-size data cases as page lists.
func pageCases() []dataCase {
	var out []dataCase
	for _, c := range dataCases {
		if c.name[0] != 'm' { // "mixed" sizes are no page list
			c.name, c.pages = "pages/"+c.name, true
			out = append(out, c)
		}
	}
	return out
}

var dataCases = []dataCase{
	{name: "1B", count: 1, size: fixed(1)},
	{name: "3Bx17", count: 17, size: fixed(3)},
	{name: "4095Bx64", count: 64, size: fixed(4095)},
	{name: "4KiBx1024", count: 1024, size: fixed(4096)},
	{name: "64KiB+1x100", count: 100, size: fixed(65537)},
	{name: "1MiB+7x6", count: 6, size: fixed(1<<20 + 7)},
	{name: "4MiBx3", count: 3, size: fixed(4 << 20)},
	{name: "mixed1..16KiBx1024", count: 1024, size: func(r *rand.Rand) int { return 1 + r.IntN(16<<10) }},
}

// transferCheck moves spans between a's src and b's dst (write) or b's src
// into a's dst (read) and checks every byte of the destination buffer.
func transferCheck(t testing.TB, a *transfer.Engine, seg transfer.SegmentID, local, remote []byte, remoteAddr uint64,
	op transfer.Op, spans []span, rng *rand.Rand, readRemote func() []byte, asPages bool) {
	t.Helper()
	// The source side gets random data, the destination side poison.
	src, dst := local, remote
	if op == transfer.Read {
		src, dst = remote, local
	}
	if readRemote == nil || op == transfer.Write {
		fillRandom(rng, src)
	}
	if op == transfer.Write || readRemote == nil {
		fill(dst, Poison)
	}
	want := bytes.Repeat([]byte{Poison}, len(dst))
	reqs := make([]transfer.Request, len(spans))
	for i, s := range spans {
		copy(want[s.dst:s.dst+s.n], src[s.src:s.src+s.n])
		r := transfer.Request{Op: op, Len: uint64(s.n), Segment: seg}
		if op == transfer.Write {
			r.Local, r.Remote = addrOf(local)+uintptr(s.src), remoteAddr+uint64(s.dst)
		} else {
			r.Local, r.Remote = addrOf(local)+uintptr(s.dst), remoteAddr+uint64(s.src)
		}
		reqs[i] = r
	}
	if asPages {
		reqs = PageList(reqs)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := a.Transfer(ctx, reqs); err != nil {
		t.Fatalf("%v of %d blocks: %v", op, len(spans), err)
	}
	got := dst
	if op == transfer.Write && readRemote != nil {
		got = readRemote()
	}
	checkBytes(t, fmt.Sprintf("%v of %d blocks", op, len(spans)), got, want)
}

func checkBytes(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if bytes.Equal(got, want) {
		return
	}
	for i := range want {
		if got[i] != want[i] {
			j := i
			for j < len(want) && got[j] != want[j] {
				j++
			}
			t.Fatalf("%s: bytes [%d, %d) differ: got %#x.., want %#x.. (poison is %#x)", what, i, j, got[i], want[i], Poison)
		}
	}
}

func fillRandom(rng *rand.Rand, b []byte) {
	for len(b) >= 8 {
		v := rng.Uint64()
		for k := 0; k < 8; k++ {
			b[k] = byte(v >> (8 * k))
		}
		b = b[8:]
	}
	for i := range b {
		b[i] = byte(rng.Uint32())
	}
}

func open(t testing.TB, a *transfer.Engine, name string) transfer.SegmentID {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, err := a.OpenSegment(ctx, name)
	if err != nil {
		t.Fatalf("OpenSegment(%s): %v", name, err)
	}
	return id
}

func testData(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am, bm := a.Alloc(t, bufSize, transfer.AccessReadWrite), b.Alloc(t, bufSize, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	rng := rand.New(rand.NewPCG(1, 2))
	for _, c := range append(dataCases, pageCases()...) {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			t.Run(c.name+"/"+op.String(), func(t *testing.T) {
				spans := layout(rng, c.count, bufSize, func() int { return c.size(rng) })
				transferCheck(t, a.E, seg, am.Bytes(), bm.Bytes(), bm.Addr(), op, spans, rng, nil, c.pages)
			})
		}
	}
	t.Run("loopback", func(t *testing.T) {
		// The engine's own segment goes through the same checks and transports.
		lm := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
		spans := layout(rng, 50, 1<<20, func() int { return 1 + rng.IntN(8<<10) })
		transferCheck(t, a.E, transfer.LocalSegment, am.Bytes()[:1<<20], lm.Bytes(), lm.Addr(), transfer.Write, spans, rng, nil, false)
	})
}

func testConcurrent(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am, bm := a.Alloc(t, bufSize, transfer.AccessReadWrite), b.Alloc(t, bufSize, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	const workers = 4
	part := bufSize / workers
	errs := make(chan error, workers)
	fillRandom(rand.New(rand.NewPCG(3, 4)), am.Bytes())
	for w := 0; w < workers; w++ {
		go func() {
			lo := w * part
			var reqs []transfer.Request
			for off := 0; off+1000 <= part; off += 4099 {
				reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: addrOf(am.Bytes()) + uintptr(lo+off),
					Len: 1000, Segment: seg, Remote: bm.Addr() + uint64(lo+off)})
			}
			for i := 0; i < 4; i++ {
				if err := a.E.Transfer(context.Background(), reqs); err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	for w := 0; w < workers; w++ {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for w := 0; w < workers; w++ {
		for off := 0; off+1000 <= part; off += 4099 {
			i := w*part + off
			if !bytes.Equal(am.Bytes()[i:i+1000], bm.Bytes()[i:i+1000]) {
				t.Fatalf("worker %d: block at %d differs", w, off)
			}
		}
	}
}

// PageList turns reqs (one segment and op, equal lengths) into one
// page-list request based at their lowest local and remote addresses.
func PageList(reqs []transfer.Request) []transfer.Request {
	if len(reqs) == 0 {
		return reqs
	}
	r := reqs[0]
	for _, q := range reqs {
		if q.Len != r.Len || q.Op != r.Op || q.Segment != r.Segment {
			panic("transfertest: PageList of unequal requests")
		}
		r.Local, r.Remote = min(r.Local, q.Local), min(r.Remote, q.Remote)
	}
	r.Pages = make([]transfer.PageOffset, len(reqs))
	for i, q := range reqs {
		r.Pages[i] = transfer.PageOffset{Local: uint64(q.Local - r.Local), Remote: q.Remote - r.Remote}
	}
	return []transfer.Request{r}
}

// mustFail checks err wraps want, names the range [addr, addr+n) and that
// nothing was written into dst.
func mustFail(t testing.TB, err, want error, addr, n uint64, dst []byte) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("got %v, want an error wrapping %v", err, want)
	}
	if !namesRange(err.Error(), addr, n) {
		t.Errorf("error %q names no address in [%#x, %#x)", err, addr, addr+n)
	}
	if dst != nil && bytes.IndexFunc(dst, func(r rune) bool { return r != Poison }) >= 0 {
		for i, c := range dst {
			if c != Poison {
				t.Fatalf("refused request wrote byte %d (%#x)", i, c)
			}
		}
	}
}

// namesRange reports whether msg names an address in [addr, addr+n) (a
// transport that splits a request may name the chunk it refused).
func namesRange(msg string, addr, n uint64) bool {
	for _, f := range strings.FieldsFunc(msg, func(r rune) bool { return !strings.ContainsRune("0123456789abcdefx", r) }) {
		if !strings.HasPrefix(f, "0x") {
			continue
		}
		v, err := strconv.ParseUint(f[2:], 16, 64)
		if err == nil && v >= addr && (v < addr+n || addr+n < addr || n == 0) {
			return true
		}
	}
	return false
}

func testOutOfBounds(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
	bm := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	fillRandom(rand.New(rand.NewPCG(5, 6)), am.Bytes())
	seg := open(t, a.E, b.E.Name())
	ctx := context.Background()
	end := bm.Addr() + uint64(bm.Size())
	cases := []struct {
		name   string
		remote uint64
		n      uint64
	}{
		{"crosses end", end - 10, 20},
		{"past end", end + 4096, 100},
		{"before start", bm.Addr() - 64, 64},
		{"unregistered", 0x1000, 16},
		{"wraps", ^uint64(0) - 3, 8},
	}
	for _, c := range cases {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			t.Run(c.name+"/"+op.String(), func(t *testing.T) {
				// One good request in the batch: a refused batch moves nothing.
				reqs := []transfer.Request{
					{Op: op, Local: addrOf(am.Bytes()), Len: 100, Segment: seg, Remote: bm.Addr()},
					{Op: op, Local: addrOf(am.Bytes()) + 100, Len: c.n, Segment: seg, Remote: c.remote},
				}
				before := append([]byte(nil), am.Bytes()...)
				err := a.E.Transfer(ctx, reqs)
				mustFail(t, err, transfer.ErrOutOfBounds, c.remote, c.n, bm.Bytes())
				if !bytes.Equal(before, am.Bytes()) {
					t.Fatal("refused read changed local memory")
				}
			})
		}
	}
	// A page list is refused whole when one page leaves the region.
	for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
		for _, c := range []struct {
			name  string
			pages []transfer.PageOffset
			n     uint64
			want  error
		}{
			{"page crosses end", []transfer.PageOffset{{Local: 0, Remote: 0}, {Local: 4096, Remote: uint64(bm.Size()) - 100}}, 200, transfer.ErrOutOfBounds},
			{"local page outside", []transfer.PageOffset{{Local: 0, Remote: 0}, {Local: uint64(am.Size()), Remote: 4096}}, 64, transfer.ErrOutOfBounds},
			{"wrapping offset", []transfer.PageOffset{{Local: 0, Remote: ^uint64(0) - 10}}, 64, transfer.ErrOutOfBounds},
			{"empty list", []transfer.PageOffset{}, 64, transfer.ErrOutOfBounds},
			{"zero length", []transfer.PageOffset{{Local: 0, Remote: 0}}, 0, transfer.ErrOutOfBounds},
		} {
			t.Run("pages/"+c.name+"/"+op.String(), func(t *testing.T) {
				fill(bm.Bytes(), Poison)
				before := append([]byte(nil), am.Bytes()...)
				err := a.E.Transfer(ctx, []transfer.Request{
					{Op: op, Local: addrOf(am.Bytes()), Len: 100, Segment: seg, Remote: bm.Addr()},
					{Op: op, Local: addrOf(am.Bytes()), Len: c.n, Segment: seg, Remote: bm.Addr(), Pages: c.pages},
				})
				if !errors.Is(err, c.want) {
					t.Fatalf("got %v, want an error wrapping %v", err, c.want)
				}
				if !strings.Contains(err.Error(), "request 1") {
					t.Errorf("error %q does not name request 1", err)
				}
				checkBytes(t, "remote memory after a refused batch", bm.Bytes(), bytes.Repeat([]byte{Poison}, len(bm.Bytes())))
				if !bytes.Equal(before, am.Bytes()) {
					t.Fatal("refused read changed local memory")
				}
			})
		}
	}
	t.Run("local unregistered", func(t *testing.T) {
		local := make([]byte, 64)
		heapSink = local // on the heap: a stack slice could move
		err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: addrOf(local), Len: 64, Segment: seg, Remote: bm.Addr()}})
		mustFail(t, err, transfer.ErrOutOfBounds, uint64(addrOf(local)), 64, bm.Bytes())
	})
}

// testUnregisteredAfterOpen: the target unregisters a region the initiator
// still believes in; the target itself must refuse the access.
func testUnregisteredAfterOpen(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
	b.Alloc(t, 1<<20, transfer.AccessReadWrite) // keeps tcp lanes in use
	gone, err := transfer.AllocHost(1<<20, "gone")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gone.Close() }) // runs before the engines close: it is unregistered by then
	fill(gone.Bytes(), Poison)
	ctx := context.Background()
	if err := b.E.RegisterMemory(ctx, uintptr(gone.Addr()), uint64(gone.Size()), transfer.Location{Kind: transfer.CPU},
		transfer.AccessReadWrite, transfer.WithHostMemory(gone, 0)); err != nil {
		t.Fatal(err)
	}
	seg := open(t, a.E, b.E.Name())
	if err := b.E.UnregisterMemory(ctx, uintptr(gone.Addr())); err != nil {
		t.Fatal(err)
	}
	fillRandom(rand.New(rand.NewPCG(7, 8)), am.Bytes())
	remote := gone.Addr() + 4096
	err = a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: addrOf(am.Bytes()), Len: 8192, Segment: seg, Remote: remote}})
	mustFail(t, err, transfer.ErrOutOfBounds, remote, 8192, gone.Bytes())
}

func testReadOnly(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
	bm := b.Alloc(t, 1<<20, transfer.AccessRead)
	rng := rand.New(rand.NewPCG(9, 10))
	fillRandom(rng, am.Bytes())
	seg := open(t, a.E, b.E.Name())
	ctx := context.Background()
	remote := bm.Addr() + 10
	err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: addrOf(am.Bytes()), Len: 4096, Segment: seg, Remote: remote}})
	mustFail(t, err, transfer.ErrAccessDenied, remote, 4096, bm.Bytes())
	// Reads are allowed.
	fillRandom(rng, bm.Bytes())
	spans := layout(rng, 20, 1<<20, func() int { return 1 + rng.IntN(20000) })
	transferCheck(t, a.E, seg, am.Bytes(), bm.Bytes(), bm.Addr(), transfer.Read, spans, rng, nil, false)
}

// testAuth: only peers holding the same cluster secret (or both running
// without one) reach each other's memory; every other pair fails to open
// the segment with ErrAuth, and no byte moves.
func testAuth(t *testing.T, nt func() []transfer.Transport) {
	withTok := func(tok string) func(*transfer.Config) {
		return func(c *transfer.Config) { c.Secret = Secret(tok) }
	}
	insecure := func(c *transfer.Config) { c.Insecure = true }
	b := NewNode(t, nt, withTok("secret-secret-secret"))
	bm := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	ctx := context.Background()
	for name, mod := range map[string]func(*transfer.Config){
		"wrong token":       withTok("wrong-wrong-wrong-wrong"),
		"per-user secret":   nil,
		"no authentication": insecure,
	} {
		a := NewNode(t, nt, mod)
		_, err := a.E.OpenSegment(ctx, b.E.Name())
		if !errors.Is(err, transfer.ErrAuth) || !strings.Contains(err.Error(), "authentication failed") || !strings.Contains(err.Error(), "--cluster-token") {
			t.Errorf("%s: OpenSegment = %v, want ErrAuth saying what to do", name, err)
		}
	}
	// An engine without authentication refuses peers that have a secret.
	c := NewNode(t, nt, insecure)
	if _, err := NewNode(t, nt, nil).E.OpenSegment(ctx, c.E.Name()); !errors.Is(err, transfer.ErrAuth) {
		t.Errorf("per-user secret vs none: OpenSegment = %v, want ErrAuth", err)
	}
	checkBytes(t, "target memory after refused peers", bm.Bytes(), bytesOf(Poison, 1<<20))
	rng := rand.New(rand.NewPCG(11, 12))
	for name, pair := range map[string][2]*Node{
		"same token":           {NewNode(t, nt, withTok("secret-secret-secret")), b},
		"both unauthenticated": {NewNode(t, nt, insecure), c},
	} {
		a, tg := pair[0], pair[1]
		am := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
		tm := bm
		if tg != b {
			tm = tg.Alloc(t, 1<<20, transfer.AccessReadWrite)
		}
		seg := open(t, a.E, tg.E.Name())
		spans := layout(rng, 10, 1<<20, func() int { return 1 + rng.IntN(50000) })
		t.Logf("%s", name)
		transferCheck(t, a.E, seg, am.Bytes(), tm.Bytes(), tm.Addr(), transfer.Write, spans, rng, nil, false)
	}
}

// testConcurrentNotify: many notifications at once to a peer with no
// control connection yet (as rooms finishing together) all arrive and all
// succeed: concurrent dials must not close each other's connection.
func testConcurrentNotify(t *testing.T, nt func() []transfer.Transport) {
	const n = 32
	var mu sync.Mutex
	seen := map[string]bool{}
	b := NewNode(t, nt, func(c *transfer.Config) {
		c.OnNotify = func(x transfer.Notification) { mu.Lock(); seen[string(x.Data)] = true; mu.Unlock() }
	})
	for round := 0; round < 5; round++ {
		a := NewNode(t, nt, nil)
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			wg.Go(func() {
				if err := a.E.Notify(context.Background(), b.E.Name(), "room", []byte(fmt.Sprint(round, "/", i))); err != nil {
					errs <- err
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatalf("round %d: Notify: %v", round, err)
		}
		a.Close()
	}
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 5*n {
		t.Fatalf("%d of %d notifications arrived", len(seen), 5*n)
	}
}

func testNotifyProbe(t *testing.T, nt func() []transfer.Transport) {
	got := make(chan transfer.Notification, 1)
	b := NewNode(t, nt, func(c *transfer.Config) { c.OnNotify = func(n transfer.Notification) { got <- n } })
	a := NewNode(t, nt, nil)
	ctx := context.Background()
	if err := a.E.Probe(ctx, b.E.Name()); err != nil {
		t.Fatalf("Probe: %v", err)
	}
	if err := a.E.Notify(ctx, b.E.Name(), "room/7", []byte("done")); err != nil {
		t.Fatalf("Notify: %v", err)
	}
	select {
	case n := <-got:
		if n.From != a.E.Name() || n.Topic != "room/7" || string(n.Data) != "done" {
			t.Fatalf("notification %+v", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("notification not delivered")
	}
	b.Close()
	if err := a.E.Probe(ctx, b.E.Name()); err == nil {
		t.Fatal("Probe of a closed peer succeeded")
	}
}

// testRestart: B closes and a new engine starts under the same name and
// address; A must see a new incarnation (an error wrapping ErrPeerRestarted
// or ErrPeerDead once, or a transparent re-open) and then reach the new one.
func testRestart(t *testing.T, nt func() []transfer.Transport) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	am := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
	bm := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	rng := rand.New(rand.NewPCG(13, 14))
	spans := layout(rng, 10, 1<<20, func() int { return 1 + rng.IntN(50000) })
	transferCheck(t, a.E, seg, am.Bytes(), bm.Bytes(), bm.Addr(), transfer.Write, spans, rng, nil, false)
	name, oldInc := b.E.Name(), b.E.Incarnation()
	b.Close()

	var b2 *Node
	deadline := time.Now().Add(5 * time.Second)
	for {
		var err error
		b2, err = tryNode(nt, name)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("restart on %s: %v", name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Cleanup(b2.Close)
	bm2 := b2.Alloc(t, 1<<20, transfer.AccessReadWrite)
	ctx := context.Background()
	// The old region address may or may not exist in the new process: write
	// to the old one first; it must fail (or, if re-opened transparently,
	// land in the new incarnation's checked memory).
	err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: addrOf(am.Bytes()), Len: 100, Segment: seg, Remote: bm.Addr()}})
	if err != nil && !errors.Is(err, transfer.ErrPeerRestarted) && !errors.Is(err, transfer.ErrPeerDead) && !errors.Is(err, transfer.ErrOutOfBounds) {
		t.Fatalf("first transfer after restart: %v", err)
	}
	perr := a.E.Probe(ctx, name)
	if perr != nil && !errors.Is(perr, transfer.ErrPeerRestarted) {
		t.Fatalf("Probe after restart: %v", perr)
	}
	if _, err := a.E.OpenSegment(ctx, name); err != nil {
		t.Fatal(err)
	}
	d, err := a.E.SegmentDescriptor(seg)
	if err != nil {
		t.Fatal(err)
	}
	if d.Incarnation == oldInc || d.Incarnation != b2.E.Incarnation() {
		t.Fatalf("incarnation after restart %s (old %s, new %s)", d.Incarnation, oldInc, b2.E.Incarnation())
	}
	spans = layout(rng, 10, 1<<20, func() int { return 1 + rng.IntN(50000) })
	transferCheck(t, a.E, seg, am.Bytes(), bm2.Bytes(), bm2.Addr(), transfer.Write, spans, rng, nil, false)
}

func tryNode(nt func() []transfer.Transport, listen string) (*Node, error) {
	e, err := transfer.New(context.Background(), transfer.Config{Listen: listen, Transports: nt(), Timeout: 3 * time.Second})
	if err != nil {
		return nil, err
	}
	return &Node{E: e}, nil
}

var heapSink []byte

// addrOf is the address of b's first byte.
func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// Secret is the cluster secret of token for tests; "" is the zero secret
// (the engine then uses the per-user one).
func Secret(token string) auth.Secret {
	if token == "" {
		return auth.Secret{}
	}
	s, err := auth.New(token, "test token")
	if err != nil {
		panic(err)
	}
	return s
}
