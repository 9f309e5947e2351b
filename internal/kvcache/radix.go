package kvcache

import (
	"container/heap"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"
)

// Radix is a prefix cache over KV pages: a radix tree whose edges are runs
// of page-sized token blocks, each block backed by the page that holds its
// KV. It keeps one allocator reference on every page it holds; a request
// that reuses a prefix takes its own reference on those pages (Table.Share)
// and marks the path in use until it ends, so in-use pages are never
// evicted. Eviction takes least recently used leaves nobody uses.
//
// Only whole pages are cached: a block is PageSize tokens and the KV of all
// of them. Radix is safe for concurrent use.
type Radix struct {
	a        *Allocator
	pageSize int

	mu      sync.Mutex
	root    *radixNode
	pages   int    // pages the tree holds
	clock   uint64 // LRU time
	evicted atomic.Int64
}

type radixNode struct {
	parent   *radixNode
	children map[string]*radixNode // by the first block of the child's edge (blockKey)
	tokens   []int32               // the edge: len(pages)*pageSize tokens
	pages    []int32
	users    int // matches in use through this node
	used     uint64
}

// NewRadix returns an empty prefix cache over a's pages, and makes it a's
// reclaimer: an allocation that falls short evicts from it, and pages the
// cache no longer needs go to waiting reservations.
func NewRadix(a *Allocator, pageSize int) *Radix {
	r := &Radix{a: a, pageSize: pageSize, root: &radixNode{children: map[string]*radixNode{}}}
	a.SetReclaim(r.Evict)
	return r
}

// serveWaiters evicts what the first waiting reservation lacks, once pages
// may have become evictable (mu not held).
func (r *Radix) serveWaiters() {
	if d := r.a.headDeficit(); d > 0 {
		r.Evict(d)
	}
}

// Evicted is the number of pages eviction has freed so far.
func (r *Radix) Evicted() int64 { return r.evicted.Load() }

// Pages is the number of pages the cache holds.
func (r *Radix) Pages() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.pages
}

// Idle is the number of cached pages nothing but the cache holds: the
// pages eviction could free now.
func (r *Radix) Idle() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	var walk func(x *radixNode)
	walk = func(x *radixNode) {
		n += r.a.sole(x.pages)
		for _, c := range x.children {
			walk(c)
		}
	}
	walk(r.root)
	return n
}

// Match is a matched prefix in use: its pages, and the path that keeps them
// from eviction until Done.
type Match struct {
	r     *Radix
	node  *radixNode // deepest node of the path (nil: nothing matched)
	Pages []int32    // the pages of the matched blocks, in order
}

// Tokens is the number of prompt tokens the match covers.
func (m *Match) Tokens() int { return len(m.Pages) * m.r.pageSize }

// Done ends the match's use of its path (once; nil-safe).
func (m *Match) Done() {
	if m == nil || m.node == nil {
		return
	}
	m.r.mu.Lock()
	for n := m.node; n != m.r.root; n = n.parent {
		n.users--
	}
	m.node = nil
	m.r.mu.Unlock()
	m.r.serveWaiters()
}

// Lookup finds the longest cached prefix of tokens in whole pages, marks
// it in use and returns it. The caller takes its own references on
// m.Pages (Table.Share) before it calls Done.
func (r *Radix) Lookup(tokens []int32) *Match {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clock++
	m := &Match{r: r}
	n := r.root
	tokens = tokens[:len(tokens)/r.pageSize*r.pageSize]
	for len(tokens) > 0 {
		c := n.children[r.key(tokens)]
		if c == nil {
			break
		}
		k := r.common(c.tokens, tokens) // >= 1: the first blocks are equal
		if k < len(c.pages) {
			c = r.split(c, k)
		}
		m.Pages = append(m.Pages, c.pages...)
		tokens = tokens[len(c.tokens):]
		n = c
	}
	if n != r.root {
		m.node = n
		for x := n; x != r.root; x = x.parent {
			x.users++
			x.used = r.clock
		}
	}
	return m
}

// key is the map key of an edge: its first block's tokens as bytes.
func (r *Radix) key(tokens []int32) string {
	b := tokens[:r.pageSize]
	return string(unsafe.Slice((*byte)(unsafe.Pointer(&b[0])), 4*len(b)))
}

// common is how many whole blocks a and b share from their start.
func (r *Radix) common(a, b []int32) int {
	ps := r.pageSize
	k := 0
	for (k+1)*ps <= len(a) && (k+1)*ps <= len(b) && slices.Equal(a[k*ps:(k+1)*ps], b[k*ps:(k+1)*ps]) {
		k++
	}
	return k
}

// split cuts c after k blocks and returns the upper part (mu held).
func (r *Radix) split(c *radixNode, k int) *radixNode {
	ps := r.pageSize
	up := &radixNode{parent: c.parent, children: map[string]*radixNode{}, tokens: c.tokens[: k*ps : k*ps],
		pages: c.pages[:k:k], users: c.users, used: c.used}
	c.parent.children[r.key(up.tokens)] = up
	c.tokens, c.pages, c.parent = c.tokens[k*ps:], c.pages[k:], up
	up.children[r.key(c.tokens)] = c
	return up
}

// Insert caches the whole pages of a sequence: pages[i] holds the KV of
// tokens[i*PageSize : (i+1)*PageSize]; a partial last block is ignored.
// Blocks the tree already has keep its page. The tree takes a reference of
// its own on every page it adds; it returns how many pages it added.
func (r *Radix) Insert(tokens []int32, pages []int32) int {
	defer r.serveWaiters()
	nb := min(len(tokens)/r.pageSize, len(pages))
	tokens, pages = tokens[:nb*r.pageSize], pages[:nb]
	r.mu.Lock()
	defer r.mu.Unlock()
	r.clock++
	n := r.root
	for len(pages) > 0 {
		n.used = r.clock
		c := n.children[r.key(tokens)]
		if c == nil {
			c = &radixNode{parent: n, children: map[string]*radixNode{}, tokens: slices.Clone(tokens), pages: slices.Clone(pages), used: r.clock}
			if err := r.a.Retain(c.pages); err != nil {
				return 0 // pages not allocated: a caller bug; cache nothing
			}
			n.children[r.key(tokens)] = c
			r.pages += len(c.pages)
			return len(c.pages)
		}
		k := r.common(c.tokens, tokens)
		if k < len(c.pages) {
			c = r.split(c, k)
		}
		tokens, pages = tokens[k*r.pageSize:], pages[k:]
		n = c
	}
	n.used = r.clock
	return 0
}

// Evict drops least recently used leaves that nobody uses until want pages
// went back to the allocator (or nothing more can go); it returns how many
// pages it freed. Blocks whose pages a table still holds stay: dropping them
// would free nothing.
func (r *Radix) Evict(want int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	var h leafHeap
	var walk func(n *radixNode)
	walk = func(n *radixNode) {
		for _, c := range n.children {
			walk(c)
		}
		if n != r.root && len(n.children) == 0 && n.users == 0 {
			h = append(h, n)
		}
	}
	walk(r.root)
	heap.Init(&h)
	got := 0
	for got < want && h.Len() > 0 {
		n := heap.Pop(&h).(*radixNode)
		// Drop the leaf's last blocks first, as many as still needed and
		// as free up a page: a page a table still holds would stay
		// allocated, so it stays cached.
		k := r.a.trailingSole(n.pages, want-got)
		if k == 0 {
			continue
		}
		r.a.release(n.pages[len(n.pages)-k:]) // not Release: it may call back into Evict
		got += k
		r.pages -= k
		r.evicted.Add(int64(k))
		if k < len(n.pages) {
			n.pages = n.pages[:len(n.pages)-k]
			n.tokens = n.tokens[:len(n.pages)*r.pageSize]
			continue
		}
		p := n.parent
		delete(p.children, r.key(n.tokens))
		if p != r.root && len(p.children) == 0 && p.users == 0 {
			heap.Push(&h, p)
		}
	}
	return got
}

// Flush drops every block nobody uses and no table holds; it returns how
// many pages it freed.
func (r *Radix) Flush() int { return r.Evict(int(^uint(0) >> 1)) }

type leafHeap []*radixNode

func (h leafHeap) Len() int           { return len(h) }
func (h leafHeap) Less(i, j int) bool { return h[i].used < h[j].used }
func (h leafHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *leafHeap) Push(x any)        { *h = append(*h, x.(*radixNode)) }
func (h *leafHeap) Pop() any {
	old := *h
	n := old[len(old)-1]
	*h = old[:len(old)-1]
	return n
}
