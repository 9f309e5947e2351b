package lb

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// check verifies t's invariants: the size is the nodes' sum; the list holds
// every node once; each node is behind its ancestors in it (so its last
// node is a leaf); edges are non-empty and siblings differ in their first
// byte.
func (t *prefixTree) check(tb testing.TB) {
	tb.Helper()
	pos := map[*ptNode]int{}
	i := 0
	for n := t.lru.next; n != &t.lru; n = n.next {
		if _, dup := pos[n]; dup {
			tb.Fatal("a node is twice in the list")
		}
		if n.next.prev != n {
			tb.Fatal("list links broken")
		}
		pos[n] = i
		i++
	}
	var size int64
	nodes := 0
	var walk func(n *ptNode)
	walk = func(n *ptNode) {
		first := map[byte]bool{}
		for _, c := range n.children {
			nodes++
			if len(c.edge) == 0 || first[c.edge[0]] {
				tb.Fatalf("child edge %q empty or sharing its first byte", c.edge)
			}
			first[c.edge[0]] = true
			if c.parent != n {
				tb.Fatal("parent link broken")
			}
			p, ok := pos[c]
			if !ok {
				tb.Fatal("a node is not in the list")
			}
			if n != &t.root && pos[n] > p {
				tb.Fatalf("node at %d is behind its child at %d", pos[n], p)
			}
			size += int64(len(c.edge)) + nodeBytes
			walk(c)
		}
	}
	walk(&t.root)
	if nodes != len(pos) {
		tb.Fatalf("%d nodes in the tree, %d in the list", nodes, len(pos))
	}
	if size != t.size {
		tb.Fatalf("size %d, nodes sum to %d", t.size, size)
	}
	if t.size > t.max {
		tb.Fatalf("size %d over the bound %d", t.size, t.max)
	}
	if back := t.lru.prev; back != &t.lru && len(back.children) != 0 {
		tb.Fatal("the least recently used node is not a leaf")
	}
}

func TestPrefixTreeMatchesLongestInsertedPrefix(t *testing.T) {
	tr := newPrefixTree(1 << 30)
	for _, k := range []string{"hello world", "hello there", "help", "hello", "x"} {
		tr.Insert([]byte(k))
		tr.check(t)
	}
	for _, c := range []struct {
		key  string
		want int
	}{
		{"hello world!", 11}, {"hello wo", 8}, {"hello", 5}, {"helpful", 4}, {"hex", 2}, {"y", 0}, {"", 0}, {"xylophone", 1},
	} {
		if got := tr.Match([]byte(c.key)); got != c.want {
			t.Errorf("Match(%q) = %d, want %d", c.key, got, c.want)
		}
	}
}

// TestPrefixTreeModel compares Match with the longest common prefix over
// every key inserted, on random keys with shared prefixes.
func TestPrefixTreeModel(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	tr := newPrefixTree(1 << 30)
	var keys [][]byte
	randKey := func() []byte {
		if len(keys) > 0 && rng.IntN(3) > 0 { // extend or cut an old key
			k := keys[rng.IntN(len(keys))]
			k = append([]byte(nil), k[:rng.IntN(len(k)+1)]...)
			for range rng.IntN(6) {
				k = append(k, "ab,["[rng.IntN(4)])
			}
			return k
		}
		k := make([]byte, rng.IntN(12))
		for i := range k {
			k[i] = "ab,["[rng.IntN(4)]
		}
		return k
	}
	for range 2000 {
		k := randKey()
		want := 0
		for _, x := range keys {
			want = max(want, commonPrefix(k, x))
		}
		if got := tr.Match(k); got != want {
			t.Fatalf("Match(%q) = %d, want %d", k, got, want)
		}
		tr.Insert(k)
		if len(k) > 0 {
			keys = append(keys, k)
		}
		tr.check(t)
	}
}

// TestPrefixTreeEvictsLeastRecentlyUsed: the tree stays within its bound;
// what goes first is what was used least recently; a prefix in use
// survives its siblings.
func TestPrefixTreeEvictsLeastRecentlyUsed(t *testing.T) {
	key := func(group, i int) []byte {
		return []byte(fmt.Sprintf("%c: system prompt of group %d, question %d", 'A'+group, group, i))
	}
	// Room for four groups and a second question of group 0.
	probe := newPrefixTree(1 << 30)
	for g := range 4 {
		probe.Insert(key(g, 0))
	}
	probe.Insert(key(0, 1))
	tr := newPrefixTree(probe.Size() + 10)
	for g := range 4 {
		tr.Insert(key(g, 0))
	}
	tr.check(t)
	tr.Insert(key(0, 1)) // group 0 used again: shares its prefix
	tr.check(t)
	if tr.Evicted() != 0 {
		t.Fatalf("evicted %d bytes within the bound", tr.Evicted())
	}
	tr.Insert(key(4, 0)) // over the bound: group 1 is the least recent
	tr.check(t)
	if tr.Evicted() == 0 {
		t.Fatal("nothing evicted over the bound")
	}
	// The least recently used: question 0's last byte (question 1 shares
	// the rest), then group 1.
	full := len(key(1, 0))
	for _, c := range []struct {
		g, q, want int
	}{{0, 0, full - 1}, {0, 1, full}, {1, 0, 0}, {2, 0, full}, {3, 0, full}, {4, 0, full}} {
		if n := tr.Match(key(c.g, c.q)); n != c.want {
			t.Errorf("group %d question %d matched %d of %d bytes after eviction, want %d", c.g, c.q, n, full, c.want)
		}
	}
	// A storm of distinct keys keeps the bound and the invariants.
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 3000 {
		b := make([]byte, 1+rng.IntN(200))
		for j := range b {
			b[j] = byte('a' + rng.IntN(3))
		}
		tr.Insert(b)
		if i%97 == 0 {
			tr.check(t)
		}
		// The key just inserted goes last: only when the rest is gone.
		if n := tr.Match(b); n != len(b) {
			for x := &tr.root; len(x.children) > 0; x = x.children[0] {
				if len(x.children) > 1 {
					t.Fatalf("the key just inserted matched %d of %d bytes, and other keys are left", n, len(b))
				}
			}
		}
	}
	tr.check(t)
	// A key larger than the bound leaves the tree within it.
	tr.Insert(make([]byte, 10*tr.max))
	tr.check(t)
	tr.Reset()
	tr.check(t)
	if tr.Size() != 0 || tr.Match(key(0, 0)) != 0 {
		t.Fatalf("after Reset: size %d", tr.Size())
	}
}

func BenchmarkPrefixTree(b *testing.B) {
	// 1K-token prompts as input_ids JSON, 8 groups sharing 768 tokens.
	prompt := func(g, i int) []byte {
		s := []byte("[")
		for j := range 1024 {
			id := 1000 + g*7919 + j*13
			if j >= 768 {
				id = 5000 + i*31 + j
			}
			s = fmt.Appendf(s, "%d,", id)
		}
		return s
	}
	tr := newPrefixTree(DefaultMaxTreeBytes)
	keys := make([][]byte, 64)
	for i := range keys {
		keys[i] = prompt(i%8, i)
		tr.Insert(keys[i])
	}
	b.SetBytes(int64(len(keys[0])))
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		k := keys[i%len(keys)]
		tr.Match(k)
		tr.Insert(k)
		i++
	}
}
