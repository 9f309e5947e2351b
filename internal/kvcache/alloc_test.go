package kvcache

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestAllocator(t *testing.T) {
	a := NewAllocator(8)
	p, err := a.Alloc(3)
	if err != nil || len(p) != 3 || a.Free() != 5 {
		t.Fatalf("alloc 3: %v %v free=%d", p, err, a.Free())
	}
	if p[0] != 0 || p[1] != 1 || p[2] != 2 {
		t.Fatalf("fresh pool should hand out pages in order, got %v", p)
	}
	if _, err := a.Alloc(6); !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("alloc beyond free: %v", err)
	}
	if a.Free() != 5 {
		t.Fatalf("failed alloc changed free count: %d", a.Free())
	}
	if err := a.Retain(p[:1]); err != nil {
		t.Fatal(err)
	}
	if err := a.Release(p); err != nil {
		t.Fatal(err)
	}
	if a.Free() != 7 {
		t.Fatalf("page with two refs was freed: free=%d", a.Free())
	}
	if err := a.Release(p[1:2]); err == nil {
		t.Fatal("double release accepted")
	}
	if err := a.Release([]int32{p[0], 99}); err == nil || a.Free() != 7 {
		t.Fatalf("bad release changed state: %v free=%d", err, a.Free())
	}
	if err := a.Release(p[:1]); err != nil || a.Free() != 8 {
		t.Fatalf("final release: %v free=%d", err, a.Free())
	}
}

func TestTable(t *testing.T) {
	a := NewAllocator(8)
	tb, err := a.Take(3)
	if err != nil || tb.Len() != 3 || a.Free() != 5 {
		t.Fatalf("take 3: %v len=%d free=%d", err, tb.Len(), a.Free())
	}
	if err := tb.Grow(2); err != nil || tb.Len() != 5 || a.Free() != 3 {
		t.Fatalf("grow 2: %v len=%d free=%d", err, tb.Len(), a.Free())
	}
	if err := tb.Grow(4); !errors.Is(err, ErrOutOfPages) || tb.Len() != 5 {
		t.Fatalf("grow past the pool: %v len=%d", err, tb.Len())
	}
	ch := a.Changed()
	if err := tb.Release(); err != nil || a.Free() != 8 {
		t.Fatalf("release: %v free=%d", err, a.Free())
	}
	select {
	case <-ch:
	default:
		t.Fatal("Changed was not closed by a release")
	}
	if err := tb.Release(); err != nil || a.Free() != 8 {
		t.Fatalf("second release: %v free=%d", err, a.Free())
	}
	if err := tb.Grow(1); err == nil {
		t.Fatal("grow of a released table succeeded")
	}
	var nilTable *Table
	if nilTable.Release() != nil {
		t.Fatal("nil release failed")
	}
}

func TestTakeWaitFIFO(t *testing.T) {
	a := NewAllocator(8)
	hold1, _ := a.Take(3)
	hold2, _ := a.Take(3)
	ctx := context.Background()
	got := map[string]chan *Table{"big": make(chan *Table, 1), "small": make(chan *Table, 1)}
	start := func(name string, n, waiting int) {
		go func() {
			tb, err := a.TakeWait(ctx, n)
			if err != nil {
				t.Error(name, err)
			}
			got[name] <- tb
		}()
		for a.Waiting() < waiting {
			time.Sleep(time.Millisecond)
		}
	}
	start("big", 5, 1)   // does not fit in 2
	start("small", 1, 2) // would fit, but must not overtake big
	if _, err := a.Alloc(1); !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("Alloc overtook the waiting reservations: %v", err)
	}
	hold1.Release() // 5 free: big is served, small still waits
	big := <-got["big"]
	if big.Len() != 5 || a.Waiting() != 1 || a.Free() != 0 {
		t.Fatalf("big=%d waiting=%d free=%d, want 5, 1, 0", big.Len(), a.Waiting(), a.Free())
	}
	select {
	case <-got["small"]:
		t.Fatal("small was served with no page free")
	case <-time.After(20 * time.Millisecond):
	}
	hold2.Release()
	small := <-got["small"]
	big.Release()
	small.Release()
	if small == nil || a.Free() != 8 || a.Waiting() != 0 {
		t.Fatalf("free=%d waiting=%d", a.Free(), a.Waiting())
	}
}

func TestTakeWaitCancel(t *testing.T) {
	a := NewAllocator(4)
	hold, _ := a.Take(3)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := a.TakeWait(ctx, 4); errc <- err }()
	for a.Waiting() == 0 {
		time.Sleep(time.Millisecond)
	}
	small := make(chan *Table, 1)
	go func() { tb, _ := a.TakeWait(context.Background(), 1); small <- tb }()
	for a.Waiting() < 2 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-errc; !errors.Is(err, ErrOutOfPages) || !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled wait: %v", err)
	}
	// The canceled head no longer blocks the small one, which fits.
	tb := <-small
	if tb.Len() != 1 || a.Waiting() != 0 {
		t.Fatalf("small after cancel: len=%d waiting=%d", tb.Len(), a.Waiting())
	}
	tb.Release()
	hold.Release()
	if a.Free() != 4 {
		t.Fatalf("free=%d after everything was released", a.Free())
	}
	if _, err := a.TakeWait(context.Background(), 5); !errors.Is(err, ErrOutOfPages) {
		t.Fatalf("a wait beyond the pool: %v", err)
	}
}
