package tokenizer

import (
	"strings"
	"sync"
	"unicode/utf8"
)

// mergeLookup reports whether adjacent symbols a and b merge, into which id, and with what
// priority (lower merges first; ties go to the leftmost pair).
type mergeLookup func(a, b int) (merged int, prio float64, ok bool)

type bpeSym struct {
	id         int
	prev, next int // indices into the symbol slice, -1 at the ends
	dead       bool
}

type bpeCand struct {
	prio        float64
	pos         int // index of the left symbol
	left, right int // ids expected at pos and pos's next (stale check)
}

func candLess(a, b bpeCand) bool {
	if a.prio != b.prio {
		return a.prio < b.prio
	}
	return a.pos < b.pos
}

// candHeap is a binary min-heap of merge candidates.
type candHeap []bpeCand

func (h *candHeap) push(c bpeCand) {
	*h = append(*h, c)
	s := *h
	i := len(s) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !candLess(s[i], s[p]) {
			break
		}
		s[i], s[p] = s[p], s[i]
		i = p
	}
}

func (h *candHeap) pop() bpeCand {
	s := *h
	top := s[0]
	n := len(s) - 1
	s[0] = s[n]
	s = s[:n]
	i := 0
	for {
		l, r, m := 2*i+1, 2*i+2, i
		if l < n && candLess(s[l], s[m]) {
			m = l
		}
		if r < n && candLess(s[r], s[m]) {
			m = r
		}
		if m == i {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return top
}

// mergeSymbols applies merges to ids until none applies, always taking the pair with the
// lowest priority (leftmost on ties), as HF tokenizers' BPE and llama2.c's encoder do.
// It runs in O(n log n) and appends the result to dst.
func mergeSymbols(dst []int, ids []int, look mergeLookup) []int {
	if len(ids) < 2 {
		return append(dst, ids...)
	}
	syms := make([]bpeSym, len(ids))
	for i, id := range ids {
		syms[i] = bpeSym{id: id, prev: i - 1, next: i + 1}
	}
	syms[len(syms)-1].next = -1
	h := make(candHeap, 0, len(ids))
	for i := 0; i+1 < len(ids); i++ {
		if m, p, ok := look(ids[i], ids[i+1]); ok {
			_ = m
			h.push(bpeCand{prio: p, pos: i, left: ids[i], right: ids[i+1]})
		}
	}
	for len(h) > 0 {
		c := h.pop()
		l := &syms[c.pos]
		if l.dead || l.id != c.left || l.next < 0 {
			continue
		}
		r := &syms[l.next]
		if r.id != c.right {
			continue
		}
		merged, _, ok := look(l.id, r.id)
		if !ok {
			continue
		}
		l.id = merged
		r.dead = true
		l.next = r.next
		if r.next >= 0 {
			syms[r.next].prev = c.pos
		}
		if l.prev >= 0 {
			p := &syms[l.prev]
			if _, pr, ok := look(p.id, l.id); ok {
				h.push(bpeCand{prio: pr, pos: l.prev, left: p.id, right: l.id})
			}
		}
		if l.next >= 0 {
			n := &syms[l.next]
			if _, pr, ok := look(l.id, n.id); ok {
				h.push(bpeCand{prio: pr, pos: c.pos, left: l.id, right: n.id})
			}
		}
	}
	for i := 0; i >= 0; i = syms[i].next {
		dst = append(dst, syms[i].id)
	}
	return dst
}

type bpeMerge struct {
	rank int32
	id   int32
}

// bpeModel is an HF tokenizer.json "BPE" model: merges by rank over the characters of a
// pre-tokenized word, with optional byte fallback (<0xNN> tokens) and an unknown token.
type bpeModel struct {
	vocab        map[string]int
	merges       map[uint64]bpeMerge
	byteFallback bool
	byteIDs      [256]int // id of <0xNN>, -1 if absent
	unk          int      // -1 if none
	fuseUnk      bool
	ignoreMerges bool

	mu    sync.Mutex
	cache map[string][]int
}

const (
	bpeCacheMaxWord    = 256
	bpeCacheMaxEntries = 1 << 16
)

func pairKey(a, b int) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

func (m *bpeModel) look(a, b int) (int, float64, bool) {
	mg, ok := m.merges[pairKey(a, b)]
	if !ok {
		return 0, 0, false
	}
	return int(mg.id), float64(mg.rank), true
}

// encodeWord appends the ids of one pre-tokenized word to dst.
func (m *bpeModel) encodeWord(dst []int, w string) []int {
	if w == "" {
		return dst
	}
	if m.ignoreMerges {
		if id, ok := m.vocab[w]; ok {
			return append(dst, id)
		}
	}
	cacheable := len(w) <= bpeCacheMaxWord
	if cacheable {
		m.mu.Lock()
		c, ok := m.cache[w]
		m.mu.Unlock()
		if ok {
			return append(dst, c...)
		}
	}
	syms := make([]int, 0, len(w))
	lastUnk := false
	for i := 0; i < len(w); {
		r, n := utf8.DecodeRuneInString(w[i:])
		ch := w[i : i+n]
		i += n
		if id, ok := m.vocab[ch]; ok && !(r == utf8.RuneError && n == 1) {
			syms = append(syms, id)
			lastUnk = false
			continue
		}
		if m.byteFallback {
			all := true
			for j := 0; j < len(ch); j++ {
				if m.byteIDs[ch[j]] < 0 {
					all = false
				}
			}
			if all {
				for j := 0; j < len(ch); j++ {
					syms = append(syms, m.byteIDs[ch[j]])
				}
				lastUnk = false
				continue
			}
		}
		if m.unk < 0 {
			continue // no unk token: the character is dropped, as HF does
		}
		if m.fuseUnk && lastUnk {
			continue
		}
		syms = append(syms, m.unk)
		lastUnk = true
	}
	start := len(dst)
	dst = mergeSymbols(dst, syms, m.look)
	if cacheable {
		c := append([]int(nil), dst[start:]...)
		m.mu.Lock()
		if len(m.cache) >= bpeCacheMaxEntries {
			clear(m.cache)
		}
		m.cache[strings.Clone(w)] = c
		m.mu.Unlock()
	}
	return dst
}
