package kvcache

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"
)

// seqOf makes a token sequence from block labels: block b is ps tokens
// b*1000+0 .. b*1000+ps-1.
func seqOf(ps int, blocks ...int) []int32 {
	var out []int32
	for _, b := range blocks {
		for i := range ps {
			out = append(out, int32(b*1000+i))
		}
	}
	return out
}

// compute plays a request: it takes pages for its blocks (reusing a cached
// prefix), then caches the whole sequence and lets its table go.
func compute(t *testing.T, a *Allocator, r *Radix, tokens []int32) (cached int) {
	t.Helper()
	m := r.Lookup(tokens)
	defer m.Done()
	tb := a.NewTable()
	if err := tb.Share(m.Pages); err != nil {
		t.Fatal(err)
	}
	need := len(tokens)/r.pageSize - len(m.Pages)
	if err := tb.Grow(need); err != nil {
		t.Fatalf("grow %d: %v", need, err)
	}
	r.Insert(tokens, tb.IDs())
	tb.Release()
	return m.Tokens()
}

func TestRadixShare(t *testing.T) {
	const ps = 4
	a := NewAllocator(32)
	r := NewRadix(a, ps)
	if c := compute(t, a, r, seqOf(ps, 1, 2, 3)); c != 0 {
		t.Fatalf("empty cache matched %d tokens", c)
	}
	if r.Pages() != 3 || a.Free() != 29 {
		t.Fatalf("after one sequence: tree %d pages, %d free", r.Pages(), a.Free())
	}
	// Same first two blocks, a partial third: 8 tokens cached, the split
	// keeps block 3 as its own node.
	seq := append(seqOf(ps, 1, 2, 4), 7, 7)
	if c := compute(t, a, r, seq); c != 2*ps {
		t.Fatalf("shared prefix matched %d tokens, want %d", c, 2*ps)
	}
	if r.Pages() != 4 || a.Free() != 28 {
		t.Fatalf("after the second: tree %d pages (want 4: blocks 1, 2, 3, 4), %d free", r.Pages(), a.Free())
	}
	m := r.Lookup(seqOf(ps, 1, 2, 3, 9))
	if m.Tokens() != 3*ps {
		t.Fatalf("lookup through the split: %d tokens", m.Tokens())
	}
	m2 := r.Lookup(seqOf(ps, 1, 2, 4))
	if !slices.Equal(m.Pages[:2], m2.Pages[:2]) || m.Pages[2] == m2.Pages[2] {
		t.Fatalf("pages %v and %v: the shared blocks must share pages, the others not", m.Pages, m2.Pages)
	}
	// In use: not evicted.
	if got := r.Evict(32); got != 0 {
		t.Fatalf("evicted %d pages in use", got)
	}
	m.Done()
	m.Done() // once only
	if got := r.Evict(1); got != 1 || r.Pages() != 3 {
		t.Fatalf("evict 1 with block 3 unused: released %d, tree %d", got, r.Pages())
	}
	m2.Done()
	if got := r.Flush(); got != 3 || r.Pages() != 0 || a.Free() != 32 {
		t.Fatalf("flush: released %d, tree %d, free %d", got, r.Pages(), a.Free())
	}
	if c := compute(t, a, r, seqOf(ps, 1)); c != 0 {
		t.Fatalf("after flush matched %d", c)
	}
}

// TestRadixSameFirstToken: blocks that start with the same token but
// differ later are different edges.
func TestRadixSameFirstToken(t *testing.T) {
	a := NewAllocator(8)
	r := NewRadix(a, 2)
	compute(t, a, r, []int32{5, 1, 5, 2})
	if c := compute(t, a, r, []int32{5, 1, 5, 3}); c != 2 {
		t.Fatalf("matched %d tokens, want 2", c)
	}
	if c := compute(t, a, r, []int32{5, 2, 5, 2}); c != 0 {
		t.Fatalf("a block sharing only its first token matched %d tokens", c)
	}
	if r.Pages() != 5 {
		t.Fatalf("tree holds %d pages, want 5", r.Pages())
	}
}

// TestRadixLRU: eviction takes the least recently used leaf first.
func TestRadixLRU(t *testing.T) {
	const ps = 2
	a := NewAllocator(16)
	r := NewRadix(a, ps)
	compute(t, a, r, seqOf(ps, 1, 2))
	compute(t, a, r, seqOf(ps, 1, 3))
	compute(t, a, r, seqOf(ps, 1, 4))
	r.Lookup(seqOf(ps, 1, 2)).Done() // 2 is now the newest
	r.Evict(2)
	for _, c := range []struct {
		block int
		want  int
	}{{2, 2 * ps}, {3, ps}, {4, ps}} {
		if got := r.Lookup(seqOf(ps, 1, c.block)); got.Tokens() != c.want {
			t.Errorf("block %d: %d tokens cached, want %d", c.block, got.Tokens(), c.want)
		} else {
			got.Done()
		}
	}
}

// TestRadixRandom checks the tree against a brute-force model: the longest
// cached prefix is the longest whole-block prefix shared with a sequence
// inserted and not evicted, and every page is accounted for.
func TestRadixRandom(t *testing.T) {
	const ps = 3
	rng := rand.New(rand.NewPCG(1, 2))
	a := NewAllocator(64)
	r := NewRadix(a, ps)
	cachedBlocks := map[string]bool{} // every cached prefix, in whole blocks, as a key
	prefixKey := func(s []int32, blocks int) string {
		b := make([]byte, 0, blocks*ps)
		for _, x := range s[:blocks*ps] {
			b = append(b, byte(x))
		}
		return string(b)
	}
	for step := 0; step < 3000; step++ {
		n := 1 + rng.IntN(6)
		seq := make([]int32, n*ps+rng.IntN(ps))
		for i := range seq {
			seq[i] = int32(rng.IntN(3))
		}
		switch rng.IntN(4) {
		case 0, 1:
			if a.Free() < n {
				r.Evict(n - a.Free())
				// The model: drop every prefix whose pages are gone; simplest to
				// rebuild it from the tree's own answers below.
				cachedBlocks = map[string]bool{}
				for k := range rebuild(r) {
					cachedBlocks[k] = true
				}
			}
			compute(t, a, r, seq)
			for b := 1; b <= n; b++ {
				cachedBlocks[prefixKey(seq, b)] = true
			}
		case 2:
			want := 0
			for b := 1; b <= n; b++ {
				if cachedBlocks[prefixKey(seq, b)] {
					want = b
				}
			}
			m := r.Lookup(seq)
			if len(m.Pages) != want {
				t.Fatalf("step %d: matched %d blocks, model says %d", step, len(m.Pages), want)
			}
			m.Done()
		case 3:
			r.Evict(rng.IntN(8))
			cachedBlocks = map[string]bool{}
			for k := range rebuild(r) {
				cachedBlocks[k] = true
			}
		}
		if got := a.Free() + r.Pages(); got != 64 {
			t.Fatalf("step %d: %d free + %d cached = %d, want 64", step, a.Free(), r.Pages(), got)
		}
	}
	r.Flush()
	if a.Free() != 64 {
		t.Fatalf("after flush %d free", a.Free())
	}
}

// rebuild lists every whole-block prefix the tree holds, keyed as the
// random test keys them.
func rebuild(r *Radix) map[string]bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string]bool{}
	var walk func(n *radixNode, prefix []byte)
	walk = func(n *radixNode, prefix []byte) {
		for _, c := range n.children {
			p := slices.Clone(prefix)
			for i, x := range c.tokens {
				p = append(p, byte(x))
				if (i+1)%r.pageSize == 0 {
					out[string(p)] = true
				}
			}
			walk(c, p)
		}
	}
	walk(r.root, nil)
	return out
}

// TestRadixReclaim: allocations that fall short evict from the cache, a
// waiting reservation is served as cached pages become evictable, and a
// cached page a table still holds is not counted as freed.
func TestRadixReclaim(t *testing.T) {
	const ps = 2
	a := NewAllocator(8)
	r := NewRadix(a, ps)
	compute(t, a, r, seqOf(ps, 1, 2, 3, 4, 5, 6)) // 6 pages cached, 2 free
	p, err := a.Alloc(4)
	if err != nil || r.Pages() != 4 {
		t.Fatalf("alloc 4 with 2 free and 6 cached: %v, tree %d pages (want 4)", err, r.Pages())
	}
	a.Release(p)

	// A table holding the cached prefix: its pages are not evictable.
	m := r.Lookup(seqOf(ps, 1, 2, 3, 4))
	tb := a.NewTable()
	tb.Share(m.Pages)
	m.Done()
	if got := r.Evict(8); got != 0 {
		t.Fatalf("evicted %d pages a table holds", got)
	}
	if r.Idle() != 0 || r.Pages() != 4 {
		t.Fatalf("idle %d of %d cached pages, want 0: a table holds them", r.Idle(), r.Pages())
	}
	// A reservation of all 8 pages waits; when the table lets go, the cache
	// gives its pages up to it.
	res := make(chan *Table, 1)
	go func() {
		w, err := a.TakeWait(t.Context(), 8)
		if err != nil {
			t.Error(err)
		}
		res <- w
	}()
	for a.Waiting() == 0 {
		time.Sleep(time.Millisecond)
	}
	tb.Release() // the cache alone holds those pages now: it gives them up
	select {
	case w := <-res:
		if w.Len() != 8 || r.Pages() != 0 {
			t.Fatalf("waiter got %d pages, tree holds %d", w.Len(), r.Pages())
		}
		w.Release()
	case <-time.After(2 * time.Second):
		t.Fatalf("waiter not served: %d free, tree %d pages", a.Free(), r.Pages())
	}
}
