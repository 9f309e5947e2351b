package shm

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func TestMain(m *testing.M) {
	if os.Getenv(targetEnv) == "1" {
		os.Exit(runTarget())
	}
	transfertest.TargetMain(shmThenTCP)
	goleak.VerifyTestMain(m)
}

type engineOpt func(*transfer.Config)

func withToken(tok string) engineOpt {
	return func(c *transfer.Config) { c.Secret = transfertest.Secret(tok) }
}
func withListen(a string) engineOpt { return func(c *transfer.Config) { c.Listen = a } }

// withShm replaces the engine's shm transport by one with cfg.
func withShm(cfg Config) engineOpt {
	return func(c *transfer.Config) { c.Transports = []transfer.Transport{New(cfg)} }
}

// newEngine starts an engine whose only transport is shm.
func newEngine(t testing.TB, opts ...engineOpt) (*transfer.Engine, *Transport) {
	t.Helper()
	tr := New(Config{})
	cfg := transfer.Config{Transports: []transfer.Transport{tr}, Timeout: 3 * time.Second, Logger: zap.NewNop()}
	for _, o := range opts {
		o(&cfg)
	}
	e, err := transfer.New(context.Background(), cfg)
	if err != nil {
		t.Fatalf("new engine: %v", err)
	}
	t.Cleanup(func() { e.Close() })
	if x, ok := cfg.Transports[0].(*Transport); ok {
		tr = x
	}
	return e, tr
}

// alloc allocates shareable memory registered for same-machine peers.
func alloc(t testing.TB, e *transfer.Engine, size int64, access transfer.Access) *transfer.HostMemory {
	t.Helper()
	m, err := e.AllocHost(context.Background(), size, 0, access, transfer.WithScope(transfer.ScopeSameMachine))
	if err != nil {
		t.Fatalf("alloc %d bytes: %v", size, err)
	}
	t.Cleanup(func() { e.FreeHost(context.Background(), m) })
	return m
}

func fill(b []byte, v byte) {
	for i := range b {
		b[i] = v
	}
}

func random(t testing.TB, b []byte) {
	t.Helper()
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
}

// checkEqual compares every byte and names the first difference.
func checkEqual(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d bytes, want %d", what, len(got), len(want))
	}
	if bytes.Equal(got, want) {
		return
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("%s: byte %d is %#x, want %#x", what, i, got[i], want[i])
		}
	}
}

// requests cuts [0, n) into blocks at the two addresses.
func requests(op transfer.Op, seg transfer.SegmentID, local uint64, remote uint64, n, block uint64) []transfer.Request {
	var rs []transfer.Request
	for off := uint64(0); off < n; off += block {
		l := min(block, n-off)
		rs = append(rs, transfer.Request{Op: op, Local: uintptr(local + off), Len: l, Segment: seg, Remote: remote + off})
	}
	return rs
}

func TestTransferEveryByte(t *testing.T) {
	for _, tc := range []struct {
		name        string
		size, block uint64
		offset      uint64 // unaligned start inside both regions
	}{
		{"one-byte", 1, 1, 0},
		{"small-inline", 64 << 10, 4 << 10, 3},
		{"odd-blocks", 1<<20 + 777, 12345, 17},
		{"parallel", 8 << 20, 64 << 10, 0},
		{"one-big-task", 16 << 20, 16 << 20, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			target, _ := newEngine(t)
			init, _ := newEngine(t)
			rsize := int64(tc.size + tc.offset)
			rmem := alloc(t, target, rsize, transfer.AccessReadWrite)
			src := alloc(t, init, rsize, transfer.AccessRead)
			dst := alloc(t, init, rsize, transfer.AccessRead)
			ctx := context.Background()
			seg, err := init.OpenSegment(ctx, target.Name())
			if err != nil {
				t.Fatal(err)
			}
			fill(rmem.Bytes(), 0xAB)
			random(t, src.Bytes())
			reqs := requests(transfer.Write, seg, src.Addr()+tc.offset, rmem.Addr()+tc.offset, tc.size, tc.block)
			if err := init.Transfer(ctx, reqs); err != nil {
				t.Fatalf("write: %v", err)
			}
			got := rmem.Bytes()
			checkEqual(t, "target after write", got[tc.offset:], src.Bytes()[tc.offset:])
			for i := uint64(0); i < tc.offset; i++ {
				if got[i] != 0xAB {
					t.Fatalf("byte %d before the written range changed to %#x", i, got[i])
				}
			}

			random(t, rmem.Bytes())
			fill(dst.Bytes(), 0xCD)
			reqs = requests(transfer.Read, seg, dst.Addr()+tc.offset, rmem.Addr()+tc.offset, tc.size, tc.block)
			if err := init.Transfer(ctx, reqs); err != nil {
				t.Fatalf("read: %v", err)
			}
			checkEqual(t, "initiator after read", dst.Bytes()[tc.offset:], rmem.Bytes()[tc.offset:])
		})
	}
}

func TestLoopback(t *testing.T) {
	e, _ := newEngine(t)
	a := alloc(t, e, 1<<20, transfer.AccessReadWrite)
	b := alloc(t, e, 1<<20, transfer.AccessReadWrite)
	random(t, a.Bytes())
	fill(b.Bytes(), 0xEE)
	reqs := requests(transfer.Write, transfer.LocalSegment, a.Addr(), b.Addr(), 1<<20, 64<<10)
	if err := e.Transfer(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	checkEqual(t, "loopback", b.Bytes(), a.Bytes())
}

func TestRegisterRefusesNonMemfd(t *testing.T) {
	e, _ := newEngine(t)
	buf := make([]byte, 1<<20)
	addr := uintptr(bytesAddr(buf))
	for _, scope := range []transfer.Scope{transfer.ScopeAny, transfer.ScopeSameMachine} {
		err := e.RegisterMemory(context.Background(), addr, uint64(len(buf)), transfer.Location{Kind: transfer.CPU}, transfer.AccessReadWrite, transfer.WithScope(scope))
		if !errors.Is(err, transfer.ErrCannotRegister) {
			t.Fatalf("scope %v: register Go memory with shm only: %v, want ErrCannotRegister", scope, err)
		}
		if !strings.Contains(err.Error(), "not memfd-backed") {
			t.Errorf("error does not say why: %v", err)
		}
	}
	// The direct check, including device memory.
	tr := New(Config{})
	_, err := tr.RegisterRegion(&transfer.Region{RegionInfo: transfer.RegionInfo{Addr: 1 << 20, Len: 4096, Location: transfer.Location{Kind: transfer.CUDA}}})
	if !errors.Is(err, transfer.ErrCannotRegister) {
		t.Fatalf("cuda region: %v, want ErrCannotRegister", err)
	}
	tr.Close()
}

// connected sets up a target with one region and an initiator that wrote to
// it once (so the shm connection and mapping exist).
type pair struct {
	target, init *transfer.Engine
	tt, it       *Transport
	rmem, src    *transfer.HostMemory
	seg          transfer.SegmentID
}

func newPair(t *testing.T, size int64, opts ...engineOpt) *pair {
	t.Helper()
	p := &pair{}
	p.target, p.tt = newEngine(t, opts...)
	p.init, p.it = newEngine(t)
	p.rmem = alloc(t, p.target, size, transfer.AccessReadWrite)
	p.src = alloc(t, p.init, size, transfer.AccessReadWrite)
	var err error
	if p.seg, err = p.init.OpenSegment(context.Background(), p.target.Name()); err != nil {
		t.Fatal(err)
	}
	return p
}

func (p *pair) write(size uint64) error {
	return p.init.Transfer(context.Background(), requests(transfer.Write, p.seg, p.src.Addr(), p.rmem.Addr(), size, 64<<10))
}

func TestDeadPeerFailsBatch(t *testing.T) {
	for _, size := range []uint64{4 << 10, 4 << 20} { // inline and goroutine paths
		p := newPair(t, 4<<20)
		if err := p.write(size); err != nil {
			t.Fatal(err)
		}
		p.target.Close()
		start := time.Now()
		err := p.write(size)
		if !errors.Is(err, transfer.ErrPeerDead) {
			t.Fatalf("%d bytes to a closed peer: %v, want ErrPeerDead", size, err)
		}
		if el := time.Since(start); el > time.Second {
			t.Errorf("failing took %v", el)
		}
	}
}

func TestRestartedPeerGetsFreshMappings(t *testing.T) {
	target, _ := newEngine(t)
	addr := target.Addr()
	init, it := newEngine(t)
	rmem := alloc(t, target, 1<<20, transfer.AccessReadWrite)
	src := alloc(t, init, 1<<20, transfer.AccessReadWrite)
	ctx := context.Background()
	seg, err := init.OpenSegment(ctx, addr)
	if err != nil {
		t.Fatal(err)
	}
	random(t, src.Bytes())
	if err := init.Transfer(ctx, requests(transfer.Write, seg, src.Addr(), rmem.Addr(), 1<<20, 64<<10)); err != nil {
		t.Fatal(err)
	}
	oldInc := target.Incarnation()
	if it.peerState(oldInc) == nil {
		t.Fatal("no state for the first incarnation")
	}
	target.Close()

	// Same name and address, new process state.
	target2, _ := newEngine(t, withListen(addr))
	rmem2 := alloc(t, target2, 1<<20, transfer.AccessReadWrite)
	fill(rmem2.Bytes(), 0x11)
	random(t, src.Bytes())
	// The first batch may fail (the peer died); the engine then refreshes
	// the descriptor, sees the new incarnation and drops the old state.
	var werr error
	for range 3 {
		werr = init.Transfer(ctx, requests(transfer.Write, seg, src.Addr(), rmem2.Addr(), 1<<20, 64<<10))
		if werr == nil {
			break
		}
	}
	if werr != nil {
		t.Fatalf("write to the restarted peer: %v", werr)
	}
	checkEqual(t, "restarted target", rmem2.Bytes(), src.Bytes())
	if it.peerState(oldInc) != nil {
		t.Error("mappings of the old incarnation are still cached")
	}
	if ps := it.peerState(target2.Incarnation()); ps == nil || ps.mapCount() != 1 {
		t.Errorf("new incarnation state: %v", ps)
	}
}

func TestClusterToken(t *testing.T) {
	target, _ := newEngine(t, withToken("s3cret-s3cret-s3cret"))
	rmem := alloc(t, target, 1<<20, transfer.AccessReadWrite)
	good, _ := newEngine(t, withToken("s3cret-s3cret-s3cret"))
	src := alloc(t, good, 1<<20, transfer.AccessReadWrite)
	ctx := context.Background()
	seg, err := good.OpenSegment(ctx, target.Name())
	if err != nil {
		t.Fatal(err)
	}
	random(t, src.Bytes())
	if err := good.Transfer(ctx, requests(transfer.Write, seg, src.Addr(), rmem.Addr(), 1<<20, 64<<10)); err != nil {
		t.Fatal(err)
	}
	checkEqual(t, "with token", rmem.Bytes(), src.Bytes())

	bad, _ := newEngine(t, withToken("wrong-wrong-wrong-wrong"))
	if _, err := bad.OpenSegment(ctx, target.Name()); !errors.Is(err, transfer.ErrAuth) {
		t.Fatalf("open with the wrong token: %v, want ErrAuth", err)
	}

	// Skipping the engine's handshake: the unix socket wants a ticket.
	var info Info
	if err := jsonUnmarshal(target.Self().Transports[Name], &info); err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("unixpacket", info.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var buf [fdshare.MaxPacket + 1]byte
	hello := fdshare.Packet{Type: fdshare.TypeHello, Text: "intruder"}
	random(t, hello.Key[:32])
	if _, err := c.Write(wire.Append(buf[:0], &hello)); err != nil {
		t.Fatal(err)
	}
	w, err := wire.Read(c.(*net.UnixConn), buf[:wire.MaxPacket()+1])
	if err != nil {
		t.Fatal(err)
	}
	if w.Type != fdshare.TypeWelcome || w.Status == 0 {
		t.Fatalf("forged ticket accepted: %+v", w)
	}
	// Asking for a region anyway gets nothing: the server hung up.
	req := fdshare.Packet{Type: fdshare.TypeMapReq, Req: 1, Region: 1}
	c.Write(wire.Append(buf[:0], &req))
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if n, err := c.Read(buf[:]); err == nil && n > 0 {
		t.Fatalf("server answered after refusing: %d bytes", n)
	}
}

func TestReadOnlyRegionIsSharedReadOnly(t *testing.T) {
	target, _ := newEngine(t)
	init, it := newEngine(t)
	rmem := alloc(t, target, 1<<20, transfer.AccessRead)
	dst := alloc(t, init, 1<<20, transfer.AccessReadWrite)
	ctx := context.Background()
	seg, err := init.OpenSegment(ctx, target.Name())
	if err != nil {
		t.Fatal(err)
	}
	random(t, rmem.Bytes())
	if err := init.Transfer(ctx, requests(transfer.Read, seg, dst.Addr(), rmem.Addr(), 1<<20, 64<<10)); err != nil {
		t.Fatal(err)
	}
	checkEqual(t, "read", dst.Bytes(), rmem.Bytes())
	err = init.Transfer(ctx, requests(transfer.Write, seg, dst.Addr(), rmem.Addr(), 4096, 4096))
	if !errors.Is(err, transfer.ErrAccessDenied) {
		t.Fatalf("write into a read-only region: %v, want ErrAccessDenied", err)
	}
	ps := it.peerState(target.Incarnation())
	if ps == nil || ps.mapCount() != 1 || ps.anyWritable() {
		t.Fatal("the read-only region should be mapped once, not writable")
	}
}

func TestUnregisterRevokesMapping(t *testing.T) {
	p := newPair(t, 1<<20)
	if err := p.write(1 << 20); err != nil {
		t.Fatal(err)
	}
	ps := p.it.peerState(p.target.Incarnation())
	if ps.mapCount() != 1 {
		t.Fatalf("%d mappings, want 1", ps.mapCount())
	}
	if err := p.target.UnregisterMemory(context.Background(), uintptr(p.rmem.Addr())); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Second)
	for ps.mapCount() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("mapping not revoked")
		}
		time.Sleep(time.Millisecond)
	}
	// The initiator's descriptor still lists the region: the transport
	// refuses it rather than writing into orphaned memory.
	if err := p.write(4096); !errors.Is(err, transfer.ErrOutOfBounds) {
		t.Fatalf("write into an unregistered region: %v, want ErrOutOfBounds", err)
	}
}

func TestNoFDLeakAfterClose(t *testing.T) {
	before := countFDs(t)
	func() {
		target, _ := newEngine(t)
		init, _ := newEngine(t)
		ctx := context.Background()
		for _, access := range []transfer.Access{transfer.AccessReadWrite, transfer.AccessRead} {
			rmem, err := target.AllocHost(ctx, 1<<20, 0, access, transfer.WithScope(transfer.ScopeSameMachine))
			if err != nil {
				t.Fatal(err)
			}
			src, err := init.AllocHost(ctx, 1<<20, 0, transfer.AccessReadWrite, transfer.WithScope(transfer.ScopeSameMachine))
			if err != nil {
				t.Fatal(err)
			}
			seg, err := init.OpenSegment(ctx, target.Name())
			if err != nil {
				t.Fatal(err)
			}
			if err := init.Transfer(ctx, requests(transfer.Read, seg, src.Addr(), rmem.Addr(), 1<<20, 64<<10)); err != nil {
				t.Fatal(err)
			}
			init.FreeHost(ctx, src)
			target.FreeHost(ctx, rmem)
		}
		init.Close()
		target.Close()
	}()
	if after := countFDs(t); after != before {
		t.Fatalf("%d fds open before, %d after", before, after)
	}
}

func countFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(ents)
}
