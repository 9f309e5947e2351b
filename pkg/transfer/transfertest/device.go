package transfertest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// DeviceAlloc returns size bytes (or more) of device memory for the suite,
// or skips the test. The suite closes it (if it is an io.Closer) after the
// engine it was registered with.
type DeviceAlloc func(t testing.TB, size int) transfer.DeviceMemory

// Faulty is device memory whose copies can be slowed or made to fail, as
// FakeDevice's; RunDevice's fault cases run only with it.
type Faulty interface {
	SetDelay(time.Duration)
	SetFail(error)
}

// FakeDevices is a DeviceAlloc of FakeDevices.
func FakeDevices(t testing.TB, size int) transfer.DeviceMemory {
	t.Helper()
	f, err := NewFakeDevice(size)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// DeviceLocation is where the suite registers device memory.
var DeviceLocation = transfer.Location{Kind: transfer.CUDA, Index: 0}

// buffer is registered memory the suite fills and reads back: host memory
// directly, device memory through its own copies.
type buffer interface {
	addr() uint64
	load(t testing.TB, n int) []byte // the first n bytes
	store(t testing.TB, b []byte)    // at the start
}

type hostBuf struct{ m *transfer.HostMemory }

func (h hostBuf) addr() uint64                    { return h.m.Addr() }
func (h hostBuf) load(_ testing.TB, n int) []byte { return append([]byte(nil), h.m.Bytes()[:n]...) }
func (h hostBuf) store(_ testing.TB, b []byte)    { copy(h.m.Bytes(), b) }

// DeviceBuffer is device memory registered by AllocDevice.
type DeviceBuffer struct {
	Mem  transfer.DeviceMemory
	Addr uint64
	Len  int
	st   transfer.Staging
}

func (d *DeviceBuffer) addr() uint64 { return d.Addr }

func (d *DeviceBuffer) copyWait(t testing.TB, c transfer.Completion, err error) {
	t.Helper()
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		err = c.Wait(ctx)
		cancel()
	}
	if err != nil {
		t.Fatalf("device buffer at %#x: %v", d.Addr, err)
	}
}

func (d *DeviceBuffer) load(t testing.TB, n int) []byte {
	c, err := d.Mem.CopyToHost(d.st.Bytes()[:n], d.Addr)
	d.copyWait(t, c, err)
	return append([]byte(nil), d.st.Bytes()[:n]...)
}

func (d *DeviceBuffer) store(t testing.TB, b []byte) {
	n := copy(d.st.Bytes(), b)
	c, err := d.Mem.CopyFromHost(d.Addr, d.st.Bytes()[:n])
	d.copyWait(t, c, err)
}

// AllocDevice allocates device memory with alloc, registers size bytes of
// it at DeviceLocation with the given access (WithMemory), and fills it
// with Poison.
func (n *Node) AllocDevice(t testing.TB, alloc DeviceAlloc, size int, access transfer.Access) *DeviceBuffer {
	t.Helper()
	m := alloc(t, size)
	if c, ok := m.(io.Closer); ok {
		n.closers = append(n.closers, c.Close)
	}
	st, err := m.AllocStaging(size)
	if err != nil {
		t.Fatalf("AllocStaging(%d): %v", size, err)
	}
	n.closers = append(n.closers, st.Close)
	if err := n.E.RegisterMemory(context.Background(), uintptr(m.Base()), uint64(size), DeviceLocation, access, transfer.WithMemory(m)); err != nil {
		t.Fatalf("register %d bytes of device memory: %v", size, err)
	}
	d := &DeviceBuffer{Mem: m, Addr: m.Base(), Len: size, st: st}
	d.store(t, bytesOf(Poison, size))
	return d
}

// transferBufs moves spans between local and remote buffers and checks
// every byte of the destination.
func transferBufs(t testing.TB, a *transfer.Engine, seg transfer.SegmentID, local, remote buffer, size int,
	op transfer.Op, spans []span, rng *rand.Rand, asPages bool) {
	t.Helper()
	src, dst := local, remote
	if op == transfer.Read {
		src, dst = remote, local
	}
	data := make([]byte, size)
	fillRandom(rng, data)
	src.store(t, data)
	dst.store(t, bytesOf(Poison, size))
	want := bytesOf(Poison, size)
	reqs := make([]transfer.Request, len(spans))
	for i, s := range spans {
		copy(want[s.dst:s.dst+s.n], data[s.src:s.src+s.n])
		r := transfer.Request{Op: op, Len: uint64(s.n), Segment: seg}
		if op == transfer.Write {
			r.Local, r.Remote = uintptr(local.addr())+uintptr(s.src), remote.addr()+uint64(s.dst)
		} else {
			r.Local, r.Remote = uintptr(local.addr())+uintptr(s.dst), remote.addr()+uint64(s.src)
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
	checkBytes(t, fmt.Sprintf("%v of %d blocks", op, len(spans)), dst.load(t, size), want)
}

// RunDevice runs the in-process cases with device memory on either side:
// two engines in one process, each with the transports newTransports
// returns and device memory from alloc (registered at DeviceLocation).
func RunDevice(t *testing.T, newTransports func() []transfer.Transport, alloc DeviceAlloc) {
	t.Run("Data", func(t *testing.T) { testDeviceData(t, newTransports, alloc) })
	t.Run("Concurrent", func(t *testing.T) { testDeviceConcurrent(t, newTransports, alloc) })
	t.Run("OutOfBounds", func(t *testing.T) { testDeviceBounds(t, newTransports, alloc) })
	t.Run("UnregisteredAfterOpen", func(t *testing.T) { testDeviceUnregisteredAfterOpen(t, newTransports, alloc) })
	t.Run("ReadOnly", func(t *testing.T) { testDeviceReadOnly(t, newTransports, alloc) })
	t.Run("UnregisterAfterTransfers", func(t *testing.T) { testDeviceUnregister(t, newTransports, alloc) })
	t.Run("Faults", func(t *testing.T) { testDeviceFaults(t, newTransports, alloc) })
}

func testDeviceData(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	ad, bd := a.AllocDevice(t, alloc, bufSize, transfer.AccessReadWrite), b.AllocDevice(t, alloc, bufSize, transfer.AccessReadWrite)
	ah, bh := hostBuf{a.Alloc(t, bufSize, transfer.AccessReadWrite)}, hostBuf{b.Alloc(t, bufSize, transfer.AccessReadWrite)}
	seg := open(t, a.E, b.E.Name())
	rng := rand.New(rand.NewPCG(21, 22))
	for _, pair := range []struct {
		name          string
		local, remote buffer
	}{{"gpu-gpu", ad, bd}, {"gpu-host", ad, bh}, {"host-gpu", ah, bd}} {
		for _, c := range append(dataCases, pageCases()...) {
			for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
				t.Run(pair.name+"/"+c.name+"/"+op.String(), func(t *testing.T) {
					// Buffers sized to the case (each byte is staged twice
					// more to fill and check it).
					sizes := make([]int, c.count)
					size := 0
					for i := range sizes {
						sizes[i] = c.size(rng)
						size += sizes[i]
					}
					size = min(bufSize, max(1<<20, 2*size))
					k := 0
					spans := layout(rng, c.count, size, func() int { k++; return sizes[k-1] })
					transferBufs(t, a.E, seg, pair.local, pair.remote, size, op, spans, rng, c.pages)
				})
			}
		}
	}
	t.Run("loopback", func(t *testing.T) {
		ld := a.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite)
		spans := layout(rng, 50, 1<<20, func() int { return 1 + rng.IntN(8<<10) })
		src := &DeviceBuffer{Mem: ad.Mem, Addr: ad.Addr, Len: 1 << 20, st: ad.st}
		transferBufs(t, a.E, transfer.LocalSegment, src, ld, 1<<20, transfer.Write, spans, rng, false)
	})
}

// mustRefuse checks err wraps want and names an address in [addr, addr+n).
func mustRefuse(t testing.TB, err, want error, addr, n uint64) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("got %v, want an error wrapping %v", err, want)
	}
	if !namesRange(err.Error(), addr, n) {
		t.Errorf("error %q names no address in [%#x, %#x)", err, addr, addr+n)
	}
}

func testDeviceBounds(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	ad := a.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite)
	bd := b.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	ctx := context.Background()
	end := bd.Addr + 1<<20
	poison := bytesOf(Poison, 1<<20)
	ad.store(t, bytes.Repeat([]byte{1, 2, 3, 4}, 1<<18))
	for _, c := range []struct {
		name   string
		remote uint64
		n      uint64
	}{{"crosses end", end - 10, 20}, {"past end", end + 4096, 100}, {"before start", bd.Addr - 64, 64}} {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			t.Run(c.name+"/"+op.String(), func(t *testing.T) {
				before := ad.load(t, 1<<20)
				err := a.E.Transfer(ctx, []transfer.Request{
					{Op: op, Local: uintptr(ad.Addr), Len: 100, Segment: seg, Remote: bd.Addr},
					{Op: op, Local: uintptr(ad.Addr) + 100, Len: c.n, Segment: seg, Remote: c.remote},
				})
				mustRefuse(t, err, transfer.ErrOutOfBounds, c.remote, c.n)
				checkBytes(t, "remote device memory after a refused batch", bd.load(t, 1<<20), poison)
				checkBytes(t, "local device memory after a refused batch", ad.load(t, 1<<20), before)
			})
		}
	}
	t.Run("pages/page crosses end", func(t *testing.T) {
		err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: uintptr(ad.Addr), Len: 200, Segment: seg, Remote: bd.Addr,
			Pages: []transfer.PageOffset{{Local: 0, Remote: 0}, {Local: 4096, Remote: 1<<20 - 100}}}})
		if !errors.Is(err, transfer.ErrOutOfBounds) {
			t.Fatalf("got %v, want ErrOutOfBounds", err)
		}
		checkBytes(t, "remote device memory after a refused page list", bd.load(t, 1<<20), poison)
	})
	t.Run("local device range crosses end", func(t *testing.T) {
		err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Read, Local: uintptr(ad.Addr) + 1<<20 - 10, Len: 20, Segment: seg, Remote: bd.Addr}})
		mustRefuse(t, err, transfer.ErrOutOfBounds, ad.Addr+1<<20-10, 20)
	})
}

func testDeviceReadOnly(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	ad := a.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite)
	bd := b.AllocDevice(t, alloc, 1<<20, transfer.AccessRead)
	seg := open(t, a.E, b.E.Name())
	err := a.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Write, Local: uintptr(ad.Addr), Len: 4096, Segment: seg, Remote: bd.Addr + 10}})
	mustRefuse(t, err, transfer.ErrAccessDenied, bd.Addr+10, 4096)
	checkBytes(t, "read-only device memory", bd.load(t, 1<<20), bytesOf(Poison, 1<<20))
	rng := rand.New(rand.NewPCG(23, 24))
	spans := layout(rng, 20, 1<<20, func() int { return 1 + rng.IntN(20000) })
	transferBufs(t, a.E, seg, ad, bd, 1<<20, transfer.Read, spans, rng, false)
}

// testDeviceUnregister: after staged transfers neither side holds its
// device region: both unregister at once.
func testDeviceUnregister(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	ad, bd := a.AllocDevice(t, alloc, 4<<20, transfer.AccessReadWrite), b.AllocDevice(t, alloc, 4<<20, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	rng := rand.New(rand.NewPCG(25, 26))
	for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
		for _, pages := range []bool{false, true} {
			spans := layout(rng, 64, 4<<20, func() int { return 16 << 10 })
			transferBufs(t, a.E, seg, ad, bd, 4<<20, op, spans, rng, pages)
		}
	}
	for _, c := range []struct {
		e    *transfer.Engine
		addr uint64
	}{{b.E, bd.Addr}, {a.E, ad.Addr}} {
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

var errInjected = errors.New("injected device fault")

// testDeviceFaults: a device copy that fails, on either side, fails its
// task with an error wrapping ErrDeviceCopy well within the batch bound; one
// slower than the bound times its batch out; and the lanes serve the next
// batch once the device behaves again.
func testDeviceFaults(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	ad, bd := a.AllocDevice(t, alloc, 4<<20, transfer.AccessReadWrite), b.AllocDevice(t, alloc, 4<<20, transfer.AccessReadWrite)
	af, ok1 := ad.Mem.(Faulty)
	bf, ok2 := bd.Mem.(Faulty)
	if !ok1 || !ok2 {
		t.Skip("device memory cannot inject faults")
	}
	ah := hostBuf{a.Alloc(t, 4<<20, transfer.AccessReadWrite)}
	bh := hostBuf{b.Alloc(t, 4<<20, transfer.AccessReadWrite)}
	seg := open(t, a.E, b.E.Name())
	rng := rand.New(rand.NewPCG(27, 28))
	spans := func() []span { return layout(rng, 32, 4<<20, func() int { return 64<<10 + rng.IntN(64<<10) }) }
	const bound = 3 * time.Second // NewNode's Timeout
	healthy := func(t *testing.T) {
		t.Helper()
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			transferBufs(t, a.E, seg, ad, bd, 4<<20, op, spans(), rng, false)
		}
	}
	for _, c := range []struct {
		name          string
		dev           Faulty
		local, remote buffer
		faulty        *DeviceBuffer
	}{
		{"initiator", af, ad, bh, ad},
		{"target", bf, ah, bd, bd},
	} {
		for _, op := range []transfer.Op{transfer.Write, transfer.Read} {
			t.Run(c.name+"/"+op.String(), func(t *testing.T) {
				c.dev.SetFail(errInjected)
				reqs := []transfer.Request{{Op: op, Local: uintptr(c.local.addr()) + 4096, Len: 256 << 10, Segment: seg, Remote: c.remote.addr() + 8192}}
				start := time.Now()
				err := a.E.Transfer(context.Background(), reqs)
				el := time.Since(start)
				c.dev.SetFail(nil)
				if !errors.Is(err, transfer.ErrDeviceCopy) {
					t.Fatalf("got %v, want an error wrapping ErrDeviceCopy", err)
				}
				if c.name == "target" && !strings.Contains(err.Error(), errInjected.Error()) {
					t.Errorf("error %q does not carry the target's reason", err)
				}
				if el > bound/2 {
					t.Errorf("failed after %v, bound %v", el, bound)
				}
				healthy(t)
			})
		}
	}
	t.Run("slow", func(t *testing.T) {
		af.SetDelay(2 * time.Millisecond)
		bf.SetDelay(2 * time.Millisecond)
		defer af.SetDelay(0)
		defer bf.SetDelay(0)
		type peaker interface {
			ResetPeak()
			PeakCopies() int64
		}
		for _, f := range []Faulty{af, bf} {
			if p, ok := f.(peaker); ok {
				p.ResetPeak()
			}
		}
		healthy(t)
		// Pipelined: several copies of each side ran at once.
		for i, f := range []Faulty{af, bf} {
			if p, ok := f.(peaker); ok && p.PeakCopies() < 2 {
				t.Errorf("side %d: at most %d copy ran at once: staging is not pipelined", i, p.PeakCopies())
			}
		}
	})
	t.Run("slower than the bound", func(t *testing.T) {
		af.SetDelay(bound + time.Second)
		start := time.Now()
		err := a.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Write, Local: uintptr(ad.Addr), Len: 1 << 20, Segment: seg, Remote: bh.addr()}})
		af.SetDelay(0)
		if !errors.Is(err, transfer.ErrTimeout) {
			t.Fatalf("got %v, want ErrTimeout", err)
		}
		if el := time.Since(start); el > bound+time.Second {
			t.Errorf("timed out after %v, bound %v", el, bound)
		}
		healthy(t) // the late copies give their slots back
	})
}

// testDeviceConcurrent: batches from several goroutines at once, device to
// device, each over its own part of the buffers.
func testDeviceConcurrent(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	const size = 8 << 20
	ad, bd := a.AllocDevice(t, alloc, size, transfer.AccessReadWrite), b.AllocDevice(t, alloc, size, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	data := make([]byte, size)
	fillRandom(rand.New(rand.NewPCG(29, 30)), data)
	ad.store(t, data)
	const workers = 4
	part := size / workers
	errs := make(chan error, workers)
	for w := 0; w < workers; w++ {
		go func() {
			var reqs []transfer.Request
			for off := w * part; off+1000 <= (w+1)*part; off += 4099 {
				reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(ad.Addr) + uintptr(off), Len: 1000,
					Segment: seg, Remote: bd.Addr + uint64(off)})
			}
			for i := 0; i < 3; i++ {
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
	want := bytesOf(Poison, size)
	for w := 0; w < workers; w++ {
		for off := w * part; off+1000 <= (w+1)*part; off += 4099 {
			copy(want[off:off+1000], data[off:off+1000])
		}
	}
	checkBytes(t, "device memory after concurrent batches", bd.load(t, size), want)
}

// testDeviceUnregisteredAfterOpen: the target unregisters a device region
// the initiator still believes in; the target itself refuses the access.
func testDeviceUnregisteredAfterOpen(t *testing.T, nt func() []transfer.Transport, alloc DeviceAlloc) {
	a, b := NewNode(t, nt, nil), NewNode(t, nt, nil)
	ad := a.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite)
	b.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite) // keeps the peer's lanes in use
	gone := b.AllocDevice(t, alloc, 1<<20, transfer.AccessReadWrite)
	seg := open(t, a.E, b.E.Name())
	ctx := context.Background()
	if err := b.E.UnregisterMemory(ctx, uintptr(gone.Addr)); err != nil {
		t.Fatal(err)
	}
	remote := gone.Addr + 4096
	err := a.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: uintptr(ad.Addr), Len: 8192, Segment: seg, Remote: remote}})
	mustRefuse(t, err, transfer.ErrOutOfBounds, remote, 8192)
	checkBytes(t, "unregistered device memory", gone.load(t, 1<<20), bytesOf(Poison, 1<<20))
}
