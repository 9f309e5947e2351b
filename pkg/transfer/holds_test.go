package transfer

import (
	"context"
	"errors"
	"testing"
	"time"
	"unsafe"
)

// gateTransport completes its tasks when the test says so (or never).
type gateTransport struct {
	nopTransport
	tasks chan []*Task
}

func (g gateTransport) Submit(_ context.Context, _ *Descriptor, tasks []*Task) { g.tasks <- tasks }

func newHoldEngine(t *testing.T, timeout time.Duration) (*Engine, gateTransport, uintptr) {
	t.Helper()
	g := gateTransport{tasks: make(chan []*Task, 16)}
	e, err := New(context.Background(), Config{Transports: []Transport{g}, Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	buf := make([]byte, 1<<20)
	t.Cleanup(func() { _ = buf[0] }) // keep it alive past the test's unregisters
	base := uintptr(unsafe.Pointer(&buf[0]))
	if err := e.RegisterMemory(context.Background(), base, 1<<19, Location{Kind: CPU}, AccessReadWrite); err != nil {
		t.Fatal(err)
	}
	if err := e.RegisterMemory(context.Background(), base+1<<19, 1<<19, Location{Kind: CPU}, AccessReadWrite); err != nil {
		t.Fatal(err)
	}
	return e, g, base
}

// unregisterAsync runs UnregisterMemory and reports its result and time.
func unregisterAsync(ctx context.Context, e *Engine, addr uintptr) chan error {
	ch := make(chan error, 1)
	go func() { ch <- e.UnregisterMemory(ctx, addr) }()
	return ch
}

func mustWait(t *testing.T, ch chan error, within time.Duration) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(within):
		t.Fatalf("UnregisterMemory did not return within %v", within)
		return nil
	}
}

func mustBlock(t *testing.T, ch chan error, d time.Duration) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("UnregisterMemory returned (%v) while a transfer still used the region", err)
	case <-time.After(d):
	}
}

// TestUnregisterWaitsForBatch: the local region of a batch in flight is
// released when the batch ends, not before.
func TestUnregisterWaitsForBatch(t *testing.T) {
	e, g, base := newHoldEngine(t, 5*time.Second)
	reqs := []Request{{Op: Write, Local: base, Len: 4096, Segment: LocalSegment, Remote: uint64(base) + 1<<19},
		{Op: Write, Local: base + 8192, Len: 4096, Segment: LocalSegment, Remote: uint64(base) + 1<<19 + 8192}}
	b, err := e.Submit(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	tasks := <-g.tasks
	ch := unregisterAsync(context.Background(), e, base)
	mustBlock(t, ch, 100*time.Millisecond)
	// New requests cannot use the region any more.
	if _, err := e.Submit(context.Background(), reqs[:1]); !errors.Is(err, ErrOutOfBounds) {
		t.Fatalf("submit on a region being unregistered: %v", err)
	}
	for _, k := range tasks {
		k.Done(nil)
	}
	if err := mustWait(t, ch, time.Second); err != nil {
		t.Fatal(err)
	}
	if err := b.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestUnregisterAfterTimeout: a batch that timed out may still have bytes
// in flight, so its memory is held one more Timeout, then let go.
func TestUnregisterAfterTimeout(t *testing.T) {
	const timeout = 200 * time.Millisecond
	e, g, base := newHoldEngine(t, timeout)
	b, err := e.Submit(context.Background(), []Request{{Op: Write, Local: base, Len: 4096, Segment: LocalSegment, Remote: uint64(base) + 1<<19}})
	if err != nil {
		t.Fatal(err)
	}
	<-g.tasks // never completed by the transport
	<-b.Done()
	if s := b.Status(0); s.State != TimedOut {
		t.Fatalf("task %v, want timed out", s.State)
	}
	start := time.Now()
	if err := mustWait(t, unregisterAsync(context.Background(), e, base), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el < timeout/2 {
		t.Fatalf("unregistered %v after the batch timed out; want about one Timeout (%v) later", el, timeout)
	}
}

// TestUnregisterAfterLateReport: a timed-out batch's memory goes as soon
// as its transport reports the tasks, without the extra Timeout.
func TestUnregisterAfterLateReport(t *testing.T) {
	const timeout = 300 * time.Millisecond
	e, g, base := newHoldEngine(t, timeout)
	b, err := e.Submit(context.Background(), []Request{{Op: Write, Local: base, Len: 4096, Segment: LocalSegment, Remote: uint64(base) + 1<<19}})
	if err != nil {
		t.Fatal(err)
	}
	tasks := <-g.tasks
	<-b.Done()
	ch := unregisterAsync(context.Background(), e, base)
	mustBlock(t, ch, 50*time.Millisecond)
	start := time.Now()
	tasks[0].Done(errors.New("late"))
	if err := mustWait(t, ch, time.Second); err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > timeout/2 {
		t.Fatalf("unregistered %v after the transport reported; want at once", el)
	}
	if s := b.Status(0); s.State != TimedOut {
		t.Fatalf("a late report changed the task to %v", s.State)
	}
}

// TestUnregisterInUse: a hold that is never released fails the unregister
// with ErrRegionInUse within the bound.
func TestUnregisterInUse(t *testing.T) {
	e, _, base := newHoldEngine(t, 5*time.Second)
	r, err := e.HoldLocal(uint64(base)+100, 100, AccessWrite)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
	defer cancel()
	err = mustWait(t, unregisterAsync(ctx, e, base), 2*time.Second)
	if !errors.Is(err, ErrRegionInUse) {
		t.Fatalf("unregister of a held region: %v, want ErrRegionInUse", err)
	}
	r.Release()
	// A region that held is gone from the table all the same.
	if _, err := e.CheckLocal(uint64(base)+100, 100, 0); !errors.Is(err, ErrOutOfBounds) {
		t.Fatalf("region still registered: %v", err)
	}
}

// TestFreeHostInUse: FreeHost leaves memory mapped that a transfer still
// holds, rather than unmapping it under the transfer.
func TestFreeHostInUse(t *testing.T) {
	e, err := New(context.Background(), Config{Transports: []Transport{nopTransport{}}, Timeout: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	m, err := e.AllocHost(context.Background(), 1<<20, 0, AccessReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	r, err := e.HoldLocal(m.Addr(), 64, AccessRead)
	if err != nil {
		t.Fatal(err)
	}
	if err := e.FreeHost(context.Background(), m); !errors.Is(err, ErrRegionInUse) {
		t.Fatalf("FreeHost of held memory: %v", err)
	}
	m.Bytes()[0] = 1 // still mapped
	r.Release()
}

// TestUnregisterAfterClose: once the engine is closed no transport touches
// memory, so a hold left behind does not delay the unregister.
func TestUnregisterAfterClose(t *testing.T) {
	e, _, base := newHoldEngine(t, 5*time.Second)
	if _, err := e.HoldLocal(uint64(base), 64, AccessRead); err != nil {
		t.Fatal(err)
	}
	e.Close()
	start := time.Now()
	if err := mustWait(t, unregisterAsync(context.Background(), e, base), 2*time.Second); err != nil {
		t.Fatalf("unregister after Close: %v", err)
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("unregister after Close took %v", el)
	}
}
