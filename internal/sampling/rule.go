package sampling

import (
	"cmp"
	"container/heap"
	"math"
	"slices"
)

// blockSize is the block of the rule's blocked sums.
const blockSize = 256

// E's constants (see the package doc).
const (
	log2e   = float32(math.Log2E)
	ln2Hi   = float32(0x1.62e4p-1) // 0x3f317200: 15 significant bits, so k*ln2Hi is exact
	ln2Lo   = float32(math.Ln2 - 0x1.62e4p-1)
	shifter = float32(0x1.8p23) // adding and subtracting it rounds to an integer
	minExp  = -86               // below it E is 0 (and 2^k stays normal)
)

// weight is the rule's E(d), an e^d for d <= 0 that any IEEE machine
// computes to the same bits. The float32() conversions keep the compiler
// from fusing a product into the following addition.
func weight(d float32) float32 {
	if !(d >= minExp) {
		return 0
	}
	k := float32(float32(d*log2e)+shifter) - shifter
	r := float32(d-float32(k*ln2Hi)) - float32(k*ln2Lo)
	q := float32(1.0 / 5040)
	q = float32(q*r) + 1.0/720
	q = float32(q*r) + 1.0/120
	q = float32(q*r) + 1.0/24
	q = float32(q*r) + 1.0/6
	q = float32(q*r) + 1.0/2
	q = float32(q*r) + 1
	q = float32(q*r) + 1
	return q * math.Float32frombits(uint32(int32(k)+127)<<23)
}

// weigh sets w[i] = weight((z[i] - m) * invT) and returns their sum, added
// left to right from 0: one block of the rule's weights. It is weight's
// body inlined (the compiler would not); TestWeigh holds the two equal.
func weigh(z, w []float32, m, invT float32) float64 {
	w = w[:len(z)]
	var sum float64
	for i, x := range z {
		d := (x - m) * invT
		var e float32
		if d >= minExp {
			k := float32(float32(d*log2e)+shifter) - shifter
			r := float32(d-float32(k*ln2Hi)) - float32(k*ln2Lo)
			q := float32(1.0 / 5040)
			q = float32(q*r) + 1.0/720
			q = float32(q*r) + 1.0/120
			q = float32(q*r) + 1.0/24
			q = float32(q*r) + 1.0/6
			q = float32(q*r) + 1.0/2
			q = float32(q*r) + 1
			q = float32(q*r) + 1
			e = q * math.Float32frombits(uint32(int32(k)+127)<<23)
		}
		w[i] = e
		sum += float64(e)
	}
	return sum
}

// prefilterMargin: top_p prefilters only when 1-p exceeds it, far above the
// rounding of the blocked sums, so the prefilter never drops a token the
// rule keeps (see sample).
const prefilterMargin = 1e-9

// sample is steps 5 to 9 of the rule for a non-greedy request, on the
// adjusted logits z.
func (s *Sampler) sample(z []float32, u float64) int {
	V := len(z)
	m := float32(math.Inf(-1))
	for _, x := range z {
		m = max(m, x) // NaN if any is NaN
	}
	invT := float32(1 / s.p.Temperature)
	if V == 0 || math.IsNaN(float64(m)) || math.IsInf(float64(m), 0) {
		return Argmax(z)
	}
	s.w = slices.Grow(s.w[:0], V)[:V]
	nb := (V + blockSize - 1) / blockSize
	s.blocks = slices.Grow(s.blocks[:0], nb)[:nb]
	w, blocks := s.w, s.blocks
	var S float64 // P(b), then the blocked total
	for b := range blocks {
		lo, hi := b*blockSize, min((b+1)*blockSize, V)
		r := weigh(z[lo:hi], w[lo:hi:hi], m, invT)
		blocks[b] = r
		S += r
	}

	topK, topP, minP := s.p.TopK, s.p.TopP, s.p.MinP
	byK := topK > 0 && topK < V
	byP := topP > 0 && topP < 1
	cand := s.cand[:0]
	switch {
	case byK:
		cand = topKIDs(w, topK, cand)
	case byP:
		// Tokens below t = (1-p)/V/2 * S hold less than (1-p)/2 of the
		// mass, so each has more than (1+p)/2 of it before it in weight
		// order, beyond p * S: the nucleus lies within the tokens at or
		// above t, and keeping only those changes no sum below.
		t := math.Inf(-1)
		if 1-topP > prefilterMargin {
			t = (1 - topP) / float64(V) / 2 * S
		}
		for i, x := range w {
			if float64(x) >= t {
				cand = append(cand, int32(i))
			}
		}
		sortByWeight(w, cand)
	case minP > 0:
		for i, x := range w {
			if float64(x) >= minP {
				cand = append(cand, int32(i))
			}
		}
	default:
		return drawBlocks(w, blocks, u*S)
	}
	if byP {
		cand = cand[:nucleus(w, cand, topP*S)]
	}
	if minP > 0 && (byK || byP) {
		k := 0
		for _, id := range cand {
			if float64(w[id]) >= minP {
				cand[k] = id
				k++
			}
		}
		cand = cand[:k]
	}
	s.cand = cand
	return draw(w, cand, u)
}

// nucleus (step 7) is the length of the longest prefix of cand in which every
// candidate j has C(j-1) <= limit (at least 1).
func nucleus(w []float32, cand []int32, limit float64) int {
	var P, r, prev float64 // P(b), the block's running sum, C(j-1)
	for j, id := range cand {
		if j > 0 && prev > limit {
			return j
		}
		if j%blockSize == 0 {
			P += r
			r = 0
		}
		r += float64(w[id])
		prev = P + r
	}
	return len(cand)
}

// draw is step 9 over cand: the first candidate j with C(j) > u*W.
func draw(w []float32, cand []int32, u float64) int {
	var T, r float64
	for j, id := range cand {
		if j%blockSize == 0 {
			T += r
			r = 0
		}
		r += float64(w[id])
	}
	T += r
	target := u * T
	var P float64
	r = 0
	for j, id := range cand {
		if j%blockSize == 0 {
			P += r
			r = 0
		}
		r += float64(w[id])
		if P+r > target {
			return int(id)
		}
	}
	return int(cand[len(cand)-1]) // unreachable: C(n-1) = T > u*T
}

// drawBlocks is step 9 over every id in id order, whose block sums are
// known: a block whose end P(b+1) is at most the target holds no C(j)
// above it, so only the block where P first exceeds it is walked.
func drawBlocks(w []float32, blocks []float64, target float64) int {
	var P float64
	for b, R := range blocks {
		next := P + R
		if next <= target {
			P = next
			continue
		}
		lo, hi := b*blockSize, min((b+1)*blockSize, len(w))
		var r float64
		for i, x := range w[lo:hi] {
			r += float64(x)
			if P+r > target {
				return lo + i
			}
		}
		return hi - 1 // unreachable: P + R(b) = next > target
	}
	return len(w) - 1 // unreachable: P(nb) = S > u*S
}

// before reports whether id a comes before id b in weight order.
func before(w []float32, a, b int32) bool {
	if w[a] != w[b] {
		return w[a] > w[b]
	}
	return a < b
}

// sortByWeight sorts ids into weight order.
func sortByWeight(w []float32, ids []int32) {
	slices.SortFunc(ids, func(a, b int32) int {
		if w[a] != w[b] {
			return cmp.Compare(w[b], w[a])
		}
		return cmp.Compare(a, b)
	})
}

// topKIDs appends the first k ids in weight order to dst, in that order.
func topKIDs(w []float32, k int, dst []int32) []int32 {
	h := &minHeap{w: w, ids: make([]int32, 0, k)}
	for i := range w {
		id := int32(i)
		if len(h.ids) < k {
			heap.Push(h, id)
		} else if before(w, id, h.ids[0]) { // id beats the last kept
			h.ids[0] = id
			heap.Fix(h, 0)
		}
	}
	dst = append(dst, h.ids...)
	sortByWeight(w, dst)
	return dst
}

// minHeap keeps on top the id that comes last in weight order.
type minHeap struct {
	w   []float32
	ids []int32
}

func (h *minHeap) Len() int           { return len(h.ids) }
func (h *minHeap) Less(i, j int) bool { return before(h.w, h.ids[j], h.ids[i]) }
func (h *minHeap) Swap(i, j int)      { h.ids[i], h.ids[j] = h.ids[j], h.ids[i] }
func (h *minHeap) Push(x any)         { h.ids = append(h.ids, x.(int32)) }
func (h *minHeap) Pop() any {
	x := h.ids[len(h.ids)-1]
	h.ids = h.ids[:len(h.ids)-1]
	return x
}
