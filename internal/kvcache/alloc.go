package kvcache

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// ErrOutOfPages is returned when the pool has fewer free pages than asked for.
var ErrOutOfPages = errors.New("kvcache: out of pages")

// Allocator hands out pages of a pool with reference counts, so that a page can
// later be shared between sequences (prefix sharing). It is safe for
// concurrent use.
type Allocator struct {
	mu   sync.Mutex
	refs []int32 // per page; 0 = free
	free []int32 // stack of free pages
	// waiters are TakeWait calls in arrival order; while any waits, Alloc
	// does not overtake them.
	waiters []*waiter
	// changed is closed (and replaced) whenever pages become free.
	changed chan struct{}
	// reclaim, if set, is asked to give n pages back (a prefix cache
	// evicting) when an allocation falls short; it returns how many it freed.
	reclaim func(n int) int
}

type waiter struct {
	n     int
	ready chan struct{} // closed once pages is set
	pages []int32
}

// NewAllocator returns an allocator over pages 0..n-1, all free.
func NewAllocator(n int) *Allocator {
	a := &Allocator{refs: make([]int32, n), free: make([]int32, n), changed: make(chan struct{})}
	for i := range a.free {
		a.free[i] = int32(n - 1 - i) // pop order 0,1,2,...
	}
	return a
}

// Alloc takes n free pages, each with a reference count of one. It takes all
// or nothing, and fails while TakeWait calls are waiting (no overtaking).
// When the pool is short it asks the reclaimer (SetReclaim) first.
func (a *Allocator) Alloc(n int) ([]int32, error) {
	if n < 0 {
		return nil, fmt.Errorf("kvcache: alloc of %d pages", n)
	}
	for try := 0; ; try++ {
		a.mu.Lock()
		if len(a.waiters) > 0 {
			err := fmt.Errorf("%w: want %d, %d free of %d, %d reservations waiting ahead", ErrOutOfPages, n, len(a.free), len(a.refs), len(a.waiters))
			a.mu.Unlock()
			return nil, err
		}
		if n <= len(a.free) {
			p := a.allocLocked(n)
			a.mu.Unlock()
			return p, nil
		}
		short, rec := n-len(a.free), a.reclaim
		err := fmt.Errorf("%w: want %d, %d free of %d", ErrOutOfPages, n, len(a.free), len(a.refs))
		a.mu.Unlock()
		if try > 0 || rec == nil || rec(short) == 0 {
			return nil, err
		}
	}
}

// SetReclaim installs the function asked for pages when the pool falls
// short (NewRadix installs its Evict). It runs without the allocator's lock.
func (a *Allocator) SetReclaim(f func(n int) int) {
	a.mu.Lock()
	a.reclaim = f
	a.mu.Unlock()
}

// trailingSole counts, from the end of pages, up to max pages whose only
// reference is the caller's (releasing them frees them).
func (a *Allocator) trailingSole(pages []int32, max int) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	k := 0
	for i := len(pages) - 1; i >= 0 && k < max && a.refs[pages[i]] == 1; i-- {
		k++
	}
	return k
}

// sole counts the pages whose only reference is the caller's.
func (a *Allocator) sole(pages []int32) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, p := range pages {
		if a.refs[p] == 1 {
			n++
		}
	}
	return n
}

// headDeficit is how many pages the first waiting TakeWait lacks.
func (a *Allocator) headDeficit() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	if len(a.waiters) == 0 {
		return 0
	}
	return max(0, a.waiters[0].n-len(a.free))
}

func (a *Allocator) allocLocked(n int) []int32 {
	k := len(a.free) - n
	pages := make([]int32, n)
	for i := range pages {
		p := a.free[len(a.free)-1-i]
		a.refs[p] = 1
		pages[i] = p
	}
	a.free = a.free[:k]
	if invariants {
		a.checkLocked()
	}
	return pages
}

// Changed returns a channel closed the next time pages become free: a
// caller that found the pool full waits on it instead of polling.
func (a *Allocator) Changed() <-chan struct{} {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.changed
}

// Waiting is the number of TakeWait calls waiting for pages.
func (a *Allocator) Waiting() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.waiters)
}

// freedLocked serves waiting TakeWait calls in order while the head fits,
// then tells Changed's waiters.
func (a *Allocator) freedLocked() {
	for len(a.waiters) > 0 && a.waiters[0].n <= len(a.free) {
		w := a.waiters[0]
		a.waiters[0] = nil
		a.waiters = a.waiters[1:]
		w.pages = a.allocLocked(w.n)
		close(w.ready)
	}
	if len(a.waiters) == 0 {
		a.waiters = nil
	}
	close(a.changed)
	a.changed = make(chan struct{})
}

// Retain adds a reference to each page, which must be in use.
func (a *Allocator) Retain(pages []int32) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, p := range pages {
		if err := a.check(p); err != nil {
			return err
		}
	}
	for _, p := range pages {
		a.refs[p]++
	}
	return nil
}

// Release drops a reference to each page; a page whose count reaches zero is
// free again. Releasing a free page is an error and changes nothing.
func (a *Allocator) Release(pages []int32) error {
	short, err := a.release(pages)
	if short > 0 {
		// Pages the cache alone holds now may serve a waiting reservation.
		a.reclaim(short)
	}
	return err
}

// release drops the references; when a reservation still waits and a
// reclaimer is set, it returns how many pages the first one lacks.
func (a *Allocator) release(pages []int32) (short int, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, p := range pages {
		if err := a.check(p); err != nil {
			return 0, err
		}
	}
	freed := false
	for _, p := range pages {
		a.refs[p]--
		if a.refs[p] == 0 {
			a.free = append(a.free, p)
			freed = true
		}
	}
	if invariants {
		a.checkLocked()
	}
	if freed {
		a.freedLocked()
	}
	if len(a.waiters) > 0 && a.reclaim != nil {
		short = max(0, a.waiters[0].n-len(a.free))
	}
	return short, nil
}

// checkLocked panics if the free list and the reference counts disagree:
// every page is either free (count 0, on the list once) or in use.
func (a *Allocator) checkLocked() {
	onList := make([]bool, len(a.refs))
	for _, p := range a.free {
		if onList[p] || a.refs[p] != 0 {
			panic(fmt.Sprintf("kvcache: page %d on the free list twice or with %d references", p, a.refs[p]))
		}
		onList[p] = true
	}
	for p, r := range a.refs {
		if r < 0 || (r == 0) != onList[p] {
			panic(fmt.Sprintf("kvcache: page %d has %d references, on free list %v", p, r, onList[p]))
		}
	}
}

func (a *Allocator) check(p int32) error {
	if p < 0 || int(p) >= len(a.refs) {
		return fmt.Errorf("kvcache: page %d out of range [0,%d)", p, len(a.refs))
	}
	if a.refs[p] == 0 {
		return fmt.Errorf("kvcache: page %d is not allocated", p)
	}
	return nil
}

// Free is the number of free pages.
func (a *Allocator) Free() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.free)
}

// Total is the number of pages in the pool.
func (a *Allocator) Total() int { return len(a.refs) }

// Table is a page table with one owner: the pages it holds stay allocated
// until Release, which is idempotent. Whoever holds a *Table answers for it;
// handing the pointer on (to the engine, with a request) hands on that duty.
// A Table is safe for concurrent use.
type Table struct {
	a    *Allocator
	mu   sync.Mutex
	ids  []int32
	done bool
}

// Take reserves n free pages as a new table, without waiting.
func (a *Allocator) Take(n int) (*Table, error) {
	ids, err := a.Alloc(n)
	if err != nil {
		return nil, err
	}
	return &Table{a: a, ids: ids}, nil
}

// TakeWait reserves n pages as a new table, waiting for them in arrival
// order (a request that does not fit yet keeps its place; later ones do not
// overtake it) until ctx ends. n beyond the pool fails at once.
func (a *Allocator) TakeWait(ctx context.Context, n int) (*Table, error) {
	if n < 0 || n > len(a.refs) {
		return nil, fmt.Errorf("%w: want %d pages, the pool has %d", ErrOutOfPages, n, len(a.refs))
	}
	a.mu.Lock()
	if len(a.waiters) == 0 && n > len(a.free) && a.reclaim != nil {
		short, rec := n-len(a.free), a.reclaim
		a.mu.Unlock()
		rec(short)
		a.mu.Lock()
	}
	if len(a.waiters) == 0 && n <= len(a.free) {
		ids := a.allocLocked(n)
		a.mu.Unlock()
		return &Table{a: a, ids: ids}, nil
	}
	w := &waiter{n: n, ready: make(chan struct{})}
	a.waiters = append(a.waiters, w)
	a.mu.Unlock()
	select {
	case <-w.ready:
		return &Table{a: a, ids: w.pages}, nil
	case <-ctx.Done():
	}
	a.mu.Lock()
	select {
	case <-w.ready: // granted meanwhile: give the pages back
		a.mu.Unlock()
		a.Release(w.pages)
	default:
		for i, x := range a.waiters {
			if x == w {
				a.waiters = append(a.waiters[:i], a.waiters[i+1:]...)
				break
			}
		}
		if len(a.waiters) > 0 {
			a.freedLocked() // the next ones may fit now that this one left
		}
		a.mu.Unlock()
	}
	return nil, fmt.Errorf("%w: waited for %d pages: %w", ErrOutOfPages, n, context.Cause(ctx))
}

// NewTable returns an empty table of a's pages.
func (a *Allocator) NewTable() *Table { return &Table{a: a} }

// Grow appends n fresh pages, without waiting; all or nothing.
func (t *Table) Grow(n int) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return errors.New("kvcache: grow of a released page table")
	}
	ids, err := t.a.Alloc(n)
	if err != nil {
		return err
	}
	t.ids = append(t.ids, ids...)
	return nil
}

// Share appends pages another owner holds (a cached prefix), taking a
// reference on each.
func (t *Table) Share(pages []int32) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		return errors.New("kvcache: share into a released page table")
	}
	if err := t.a.Retain(pages); err != nil {
		return err
	}
	t.ids = append(t.ids, pages...)
	return nil
}

// Adopt moves other's pages to the end of t; other is left empty and
// released (its pages are t's now).
func (t *Table) Adopt(other *Table) error {
	other.mu.Lock()
	ids, done := other.ids, other.done
	other.ids, other.done = nil, true
	other.mu.Unlock()
	if done {
		return errors.New("kvcache: adopt of a released page table")
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.done {
		t.a.Release(ids)
		return errors.New("kvcache: adopt into a released page table")
	}
	t.ids = append(t.ids, ids...)
	return nil
}

// IDs are the table's pages in order. The slice is shared: do not modify
// it, and do not use it after Release.
func (t *Table) IDs() []int32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.ids
}

// Len is the number of pages.
func (t *Table) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.ids)
}

// Release hands every page back (once; later calls and a nil table do
// nothing).
func (t *Table) Release() error {
	if t == nil {
		return nil
	}
	t.mu.Lock()
	ids, done := t.ids, t.done
	t.ids, t.done = nil, true
	t.mu.Unlock()
	if done || len(ids) == 0 {
		return nil
	}
	return t.a.Release(ids)
}
