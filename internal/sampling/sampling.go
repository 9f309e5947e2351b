// Package sampling picks the next token from a row of host float32 logits:
// greedy argmax, temperature, top-k, top-p (nucleus), min-p, OpenAI-style
// frequency and presence penalties over the tokens generated so far, and a
// repetition penalty over the prompt and the tokens generated so far.
//
// Order of operations (SGLang's): penalties on the logits (repetition first,
// then frequency and presence), then temperature,
// softmax over the whole vocabulary, then top-k, top-p and min-p filters
// (top-p and min-p measured against the unfiltered distribution), then one
// draw from what is left, renormalised.
//
// A Sampler is deterministic: the same seed, logits and accepted tokens give
// the same choices. Every Sample call consumes exactly one random draw, greedy
// or not, so a stream can be resumed elsewhere by skipping the draws already
// made (Skip): that is how a decode server continues a request whose first
// token was sampled by a prefill server.
package sampling

import (
	"cmp"
	"container/heap"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
)

// ErrBadParams is wrapped by Params.Validate.
var ErrBadParams = errors.New("sampling: bad parameters")

// Params are one request's sampling parameters. Zero values mean off
// (Temperature 0 is greedy).
type Params struct {
	Temperature      float64 // 0: greedy
	TopP             float64 // 0 or 1: off
	TopK             int     // 0 or -1: off; 1 is greedy
	MinP             float64 // 0: off
	FrequencyPenalty float64 // subtracted once per earlier occurrence of a token
	PresencePenalty  float64 // subtracted once if a token occurred at all
	// RepetitionPenalty divides the positive logits and multiplies the
	// negative ones of every token in the prompt or the output so far
	// (0 or 1: off; > 1 discourages repeats).
	RepetitionPenalty float64
}

// Validate reports parameters outside their ranges, naming the value.
func (p Params) Validate() error {
	switch {
	case math.IsNaN(p.Temperature) || p.Temperature < 0:
		return fmt.Errorf("%w: temperature %v must be >= 0", ErrBadParams, p.Temperature)
	case math.IsNaN(p.TopP) || p.TopP < 0 || p.TopP > 1:
		return fmt.Errorf("%w: top_p %v must be in [0, 1]", ErrBadParams, p.TopP)
	case p.TopK < -1:
		return fmt.Errorf("%w: top_k %d must be -1, 0 or positive", ErrBadParams, p.TopK)
	case math.IsNaN(p.MinP) || p.MinP < 0 || p.MinP > 1:
		return fmt.Errorf("%w: min_p %v must be in [0, 1]", ErrBadParams, p.MinP)
	case math.IsNaN(p.FrequencyPenalty) || p.FrequencyPenalty < -2 || p.FrequencyPenalty > 2:
		return fmt.Errorf("%w: frequency_penalty %v must be in [-2, 2]", ErrBadParams, p.FrequencyPenalty)
	case math.IsNaN(p.PresencePenalty) || p.PresencePenalty < -2 || p.PresencePenalty > 2:
		return fmt.Errorf("%w: presence_penalty %v must be in [-2, 2]", ErrBadParams, p.PresencePenalty)
	case math.IsNaN(p.RepetitionPenalty) || p.RepetitionPenalty < 0 || p.RepetitionPenalty > 2:
		return fmt.Errorf("%w: repetition_penalty %v must be in (0, 2]", ErrBadParams, p.RepetitionPenalty)
	}
	return nil
}

// Greedy reports whether the parameters always pick the (penalised) argmax.
func (p Params) Greedy() bool { return p.Temperature == 0 || p.TopK == 1 }

func (p Params) penalised() bool { return p.FrequencyPenalty != 0 || p.PresencePenalty != 0 }

func (p Params) repeats() bool { return p.RepetitionPenalty != 0 && p.RepetitionPenalty != 1 }

// Sampler samples one request's tokens. It is not safe for concurrent use.
type Sampler struct {
	p      Params
	rng    *rand.Rand
	counts map[int]int  // occurrences of each accepted (output) token
	prompt map[int]bool // the prompt's tokens, for the repetition penalty

	work  []float32 // penalised logits
	probs []float64 // unnormalised probabilities
	cand  []int32   // candidate ids
}

// New returns a sampler whose random stream is fixed by seed.
func New(p Params, seed uint64) *Sampler {
	return &Sampler{
		p:      p,
		rng:    rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		counts: map[int]int{},
	}
}

// SetPrompt records the prompt's tokens for the repetition penalty (a no-op
// when it is off).
func (s *Sampler) SetPrompt(ids []int32) {
	if !s.p.repeats() {
		return
	}
	s.prompt = make(map[int]bool, len(ids))
	for _, id := range ids {
		s.prompt[int(id)] = true
	}
}

// Accept records an output token for the penalties.
func (s *Sampler) Accept(tok int) { s.counts[tok]++ }

// Skip consumes the random draw of one Sample call without sampling.
func (s *Sampler) Skip() { s.rng.Float64() }

// Sample picks a token from logits, which it does not modify. It does not
// Accept the token.
func (s *Sampler) Sample(logits []float32) int {
	u := s.rng.Float64() // exactly one draw per call, greedy or not
	l := logits
	rep := s.p.repeats() && len(s.prompt)+len(s.counts) > 0
	if rep || (s.p.penalised() && len(s.counts) > 0) {
		s.work = append(s.work[:0], logits...)
		l = s.work
	}
	if rep {
		r := float32(s.p.RepetitionPenalty)
		repeat := func(tok int) {
			if tok >= 0 && tok < len(l) {
				if l[tok] > 0 {
					l[tok] /= r
				} else {
					l[tok] *= r
				}
			}
		}
		for tok := range s.prompt {
			repeat(tok)
		}
		for tok := range s.counts {
			if !s.prompt[tok] { // once per token, seen in the prompt or not
				repeat(tok)
			}
		}
	}
	if s.p.penalised() && len(s.counts) > 0 {
		for tok, n := range s.counts {
			if tok >= 0 && tok < len(l) {
				l[tok] -= float32(s.p.FrequencyPenalty*float64(n) + s.p.PresencePenalty)
			}
		}
	}
	if s.p.Greedy() {
		return Argmax(l)
	}
	return s.sample(l, u)
}

func (s *Sampler) sample(l []float32, u float64) int {
	V := len(l)
	invT := 1 / s.p.Temperature
	mx := float32(math.Inf(-1))
	for _, x := range l {
		mx = max(mx, x)
	}
	if math.IsInf(float64(mx), -1) || math.IsNaN(float64(mx)) {
		return Argmax(l)
	}
	if cap(s.probs) < V {
		s.probs = make([]float64, V)
	}
	probs := s.probs[:V]
	var sum float64
	for i, x := range l {
		e := math.Exp(float64(x-mx) * invT)
		probs[i] = e
		sum += e
	}
	// probs are now relative to the max (which has 1); normalise lazily.
	topK := s.p.TopK
	if topK <= 0 || topK > V {
		topK = V
	}
	topP := s.p.TopP
	if topP == 0 {
		topP = 1
	}
	cand := s.cand[:0]
	switch {
	case topK < V:
		cand = topKIDs(probs, topK, cand)
	case topP < 1:
		// Exact prefilter: tokens below t = (1-p)/V together hold less than
		// 1-p of the mass, so the nucleus lies within the tokens at or above t.
		t := (1 - topP) / float64(V) / 2 * sum
		for i, p := range probs {
			if p >= t {
				cand = append(cand, int32(i))
			}
		}
		sortDesc(probs, cand)
	default:
		for i := range probs {
			cand = append(cand, int32(i))
		}
	}
	// top-p on the sorted prefix (cand is sorted whenever topK < V or topP < 1).
	if topP < 1 {
		limit := topP * sum
		var before float64
		n := 0
		for _, id := range cand {
			if before > limit {
				break
			}
			before += probs[id]
			n++
		}
		cand = cand[:max(n, 1)]
	}
	if s.p.MinP > 0 {
		thr := s.p.MinP // relative to the max prob, which is 1 here
		k := 0
		for _, id := range cand {
			if probs[id] >= thr {
				cand[k] = id
				k++
			}
		}
		cand = cand[:k] // the argmax (1.0) always survives
	}
	s.cand = cand
	var tot float64
	for _, id := range cand {
		tot += probs[id]
	}
	target := u * tot
	var c float64
	for _, id := range cand {
		c += probs[id]
		if c > target {
			return int(id)
		}
	}
	return int(cand[len(cand)-1])
}

// sortDesc sorts ids by probability, highest first, lower id first on ties.
func sortDesc(probs []float64, ids []int32) {
	slices.SortFunc(ids, func(a, b int32) int {
		if c := cmp.Compare(probs[b], probs[a]); c != 0 {
			return c
		}
		return cmp.Compare(a, b)
	})
}

// topKIDs appends the k most probable ids to dst, sorted as sortDesc.
func topKIDs(probs []float64, k int, dst []int32) []int32 {
	h := &minHeap{probs: probs, ids: make([]int32, 0, k)}
	for i := range probs {
		id := int32(i)
		if len(h.ids) < k {
			heap.Push(h, id)
		} else if h.less(h.ids[0], id) { // id beats the weakest kept
			h.ids[0] = id
			heap.Fix(h, 0)
		}
	}
	dst = append(dst, h.ids...)
	sortDesc(probs, dst)
	return dst
}

// minHeap keeps the weakest id on top: lower probability, or higher id on ties.
type minHeap struct {
	probs []float64
	ids   []int32
}

func (h *minHeap) less(a, b int32) bool { // a weaker than b
	if h.probs[a] != h.probs[b] {
		return h.probs[a] < h.probs[b]
	}
	return a > b
}
func (h *minHeap) Len() int           { return len(h.ids) }
func (h *minHeap) Less(i, j int) bool { return h.less(h.ids[i], h.ids[j]) }
func (h *minHeap) Swap(i, j int)      { h.ids[i], h.ids[j] = h.ids[j], h.ids[i] }
func (h *minHeap) Push(x any)         { h.ids = append(h.ids, x.(int32)) }
func (h *minHeap) Pop() any {
	x := h.ids[len(h.ids)-1]
	h.ids = h.ids[:len(h.ids)-1]
	return x
}

// Argmax returns the index of the largest value, the lowest index on ties.
// NaNs are never chosen unless every value is NaN (then 0).
func Argmax(l []float32) int {
	best := 0
	bv := float32(math.Inf(-1))
	found := false
	for i, x := range l {
		if x > bv || (!found && x == bv) {
			best, bv, found = i, x, true
		}
	}
	return best
}

// Logprob is log softmax(logits)[id] at temperature 1, computed in float64.
func Logprob(logits []float32, id int) float32 {
	lp, _ := Logprobs(logits, id, 0)
	return lp
}

// Logprobs is Logprob(logits, id) and TopLogprobs(logits, n) with one
// normalisation of the row (an exp per vocabulary entry) for both.
func Logprobs(logits []float32, id, n int) (float32, []TopLogprob) {
	if len(logits) == 0 {
		return float32(math.Inf(-1)), nil
	}
	mx := float32(math.Inf(-1))
	for _, x := range logits {
		mx = max(mx, x)
	}
	var sum float64
	for _, x := range logits {
		sum += math.Exp(float64(x - mx))
	}
	lse := math.Log(sum)
	of := func(x float32) float32 { return float32(float64(x-mx) - lse) }
	lp := float32(math.Inf(-1))
	if id >= 0 && id < len(logits) {
		lp = of(logits[id])
	}
	top := topIDs(logits, n)
	for i := range top {
		top[i].Logprob = of(logits[top[i].Token])
	}
	return lp, top
}

// MaxTopLogprobs bounds TopLogprobs' n (OpenAI's limit).
const MaxTopLogprobs = 20

// TopLogprob is one of a position's most likely tokens.
type TopLogprob struct {
	Token   int
	Logprob float32
}

// TopLogprobs returns the n most likely tokens under log softmax(logits) at
// temperature 1 (the distribution Logprob uses, before penalties and
// filters), most likely first, ties to the lower id. The logprobs equal
// Logprob's for the same ids.
func TopLogprobs(logits []float32, n int) []TopLogprob {
	_, top := Logprobs(logits, -1, n)
	return top
}

// topIDs returns the ids of the n largest logits, largest first, ties to
// the lower id (Logprob unset). A logit enters the kept, sorted n only if
// it beats the weakest of them, so most of a vocabulary costs one compare.
func topIDs(logits []float32, n int) []TopLogprob {
	n = min(n, len(logits))
	if n <= 0 {
		return nil
	}
	top := make([]TopLogprob, 0, n)
	vals := make([]float32, 0, n)
	for id, x := range logits {
		if len(vals) == n && x <= vals[n-1] {
			continue
		}
		i := len(vals)
		for i > 0 && x > vals[i-1] {
			i--
		}
		if len(vals) < n {
			vals = append(vals, 0)
			top = append(top, TopLogprob{})
		}
		copy(vals[i+1:], vals[i:len(vals)-1])
		copy(top[i+1:], top[i:len(top)-1])
		vals[i], top[i] = x, TopLogprob{Token: id}
	}
	return top
}
