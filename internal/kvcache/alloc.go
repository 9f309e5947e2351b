package kvcache

import (
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
}

// NewAllocator returns an allocator over pages 0..n-1, all free.
func NewAllocator(n int) *Allocator {
	a := &Allocator{refs: make([]int32, n), free: make([]int32, n)}
	for i := range a.free {
		a.free[i] = int32(n - 1 - i) // pop order 0,1,2,...
	}
	return a
}

// Alloc takes n free pages, each with a reference count of one. It takes all
// or nothing.
func (a *Allocator) Alloc(n int) ([]int32, error) {
	if n < 0 {
		return nil, fmt.Errorf("kvcache: alloc of %d pages", n)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if n > len(a.free) {
		return nil, fmt.Errorf("%w: want %d, %d free of %d", ErrOutOfPages, n, len(a.free), len(a.refs))
	}
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
	return pages, nil
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
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, p := range pages {
		if err := a.check(p); err != nil {
			return err
		}
	}
	for _, p := range pages {
		a.refs[p]--
		if a.refs[p] == 0 {
			a.free = append(a.free, p)
		}
	}
	if invariants {
		a.checkLocked()
	}
	return nil
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
