package lb

import (
	"bytes"
	"encoding/binary"
	"math/bits"
	"sync"
)

// nodeBytes is what a tree node costs besides its edge's bytes (the
// struct, its place in the parent's child list, allocation rounding),
// counted in a tree's size so the bound holds for many short edges too.
const nodeBytes = 96

// prefixTree is the cache_aware policy's approximate record of what one
// server holds: a radix tree over the bytes of the prompts routed to it.
// Its size (edge bytes plus nodeBytes per node) stays at most max: an
// insert that goes over evicts least recently used leaves.
//
// The nodes are in one list by last use, most recent first, and a path is
// moved to the front leaf first, so every node is ahead of its
// descendants: the list's last node is always a leaf, and eviction takes
// O(1) per node. It is safe for concurrent use.
type prefixTree struct {
	mu      sync.Mutex
	root    ptNode
	lru     ptNode // sentinel: lru.next is the most recent node, lru.prev the least
	size    int64
	max     int64
	evicted int64 // bytes evicted, nodeBytes included
}

type ptNode struct {
	edge       []byte // owned: no other node shares its array
	parent     *ptNode
	children   []*ptNode // by the first byte of their edge, unordered
	prev, next *ptNode
}

func newPrefixTree(max int64) *prefixTree {
	t := &prefixTree{max: max}
	t.lru.prev, t.lru.next = &t.lru, &t.lru
	return t
}

func (n *ptNode) child(c byte) *ptNode {
	for _, x := range n.children {
		if x.edge[0] == c {
			return x
		}
	}
	return nil
}

// commonPrefix is the length of a's and b's common prefix: blocks of 64
// bytes by bytes.Equal (vector compares), then eight bytes at a time.
func commonPrefix(a, b []byte) int {
	n := min(len(a), len(b))
	i := 0
	for i+64 <= n && bytes.Equal(a[i:i+64], b[i:i+64]) {
		i += 64
	}
	for ; i+8 <= n; i += 8 {
		if x := binary.LittleEndian.Uint64(a[i:]) ^ binary.LittleEndian.Uint64(b[i:]); x != 0 {
			return i + bits.TrailingZeros64(x)/8
		}
	}
	for ; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// Match returns the length of the longest prefix of key in the tree.
func (t *prefixTree) Match(key []byte) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n, i := &t.root, 0
	for i < len(key) {
		c := n.child(key[i])
		if c == nil {
			break
		}
		k := commonPrefix(c.edge, key[i:])
		i += k
		if k < len(c.edge) {
			break
		}
		n = c
	}
	return i
}

// Insert records key as used now, then evicts down to the bound.
func (t *prefixTree) Insert(key []byte) {
	if len(key) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	n, i := &t.root, 0
	for i < len(key) {
		c := n.child(key[i])
		if c == nil {
			leaf := &ptNode{edge: clone(key[i:]), parent: n}
			n.children = append(n.children, leaf)
			t.link(leaf)
			t.size += int64(len(leaf.edge)) + nodeBytes
			n = leaf
			break
		}
		k := commonPrefix(c.edge, key[i:])
		if k < len(c.edge) { // split c: n -> mid -> c
			mid := &ptNode{edge: clone(c.edge[:k]), parent: n, children: []*ptNode{c}}
			c.edge, c.parent = clone(c.edge[k:]), mid
			for j, x := range n.children {
				if x == c {
					n.children[j] = mid
				}
			}
			t.link(mid)
			t.size += nodeBytes
			c = mid
		}
		n = c
		i += k
	}
	for ; n != &t.root; n = n.parent {
		t.unlink(n)
		t.link(n)
	}
	t.evict()
}

// evict drops least recently used leaves until the tree is within its
// bound.
func (t *prefixTree) evict() {
	for t.size > t.max && t.lru.prev != &t.lru {
		n := t.lru.prev // a leaf: its children are behind it in the list
		t.unlink(n)
		p := n.parent
		for j, x := range p.children {
			if x == n {
				last := len(p.children) - 1
				p.children[j], p.children[last] = p.children[last], nil
				p.children = p.children[:last]
				break
			}
		}
		freed := int64(len(n.edge)) + nodeBytes
		t.size -= freed
		t.evicted += freed
	}
}

// Reset empties the tree.
func (t *prefixTree) Reset() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.root.children = nil
	t.lru.prev, t.lru.next = &t.lru, &t.lru
	t.size = 0
}

// Size is the tree's size in bytes, nodeBytes per node included.
func (t *prefixTree) Size() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.size
}

// Evicted is the bytes evicted so far.
func (t *prefixTree) Evicted() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.evicted
}

// link puts n at the front of the list.
func (t *prefixTree) link(n *ptNode) {
	n.prev, n.next = &t.lru, t.lru.next
	t.lru.next.prev = n
	t.lru.next = n
}

func (t *prefixTree) unlink(n *ptNode) {
	n.prev.next, n.next.prev = n.next, n.prev
	n.prev, n.next = nil, nil
}

func clone(b []byte) []byte { return append([]byte(nil), b...) }
