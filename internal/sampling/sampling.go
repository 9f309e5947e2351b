// Package sampling picks the next token from a row of host float32 logits:
// greedy argmax, temperature, top-k, top-p (nucleus), min-p, OpenAI's
// logit_bias, OpenAI-style frequency and presence penalties over the tokens
// generated so far, and a repetition penalty over the prompt and the tokens
// generated so far.
//
// Randomness: the draw of output step k (0 for a request's first token) of
// a request with seed s is Uniform(s, k), Philox4x32-10 keyed by the seed and
// counted by the step (philox.go). A Sampler keeps no stream: a decode
// server continuing a request whose first token a prefill server sampled
// samples step 1 on, as the colocated server does, and a GPU kernel that
// follows the rule below with Uniform(s, k) picks the same token from the
// same logits.
//
// # The sampling rule
//
// The token of one step, from logits l[0..V) (float32), the parameters,
// the prompt, the output so far and u = Uniform(seed, step). Steps 1-3 make the
// adjusted logits z (float32, from l), each listed token once, in vLLM's
// order (SGLang adds logit_bias after the penalties, which differs only
// where the repetition penalty meets a biased token):
//
//  1. Logit bias: z[t] += float32(bias[t]).
//  2. Repetition penalty r, tokens in the prompt or the output: z[t] /=
//     float32(r) if z[t] > 0, else z[t] *= float32(r).
//  3. Frequency f and presence p, tokens in the output (n[t] times):
//     z[t] -= float32(f*n[t] + p), the product and then the sum in float64.
//  4. Greedy (temperature below 1e-6, SGLang's epsilon, or top_k 1): the
//     argmax of z, the lowest id among equal maxima, never a NaN (0 if all
//     are). Likewise when the max m of z is NaN (some z is) or infinite.
//  5. Weights (float32): w[i] = E((z[i] - m) * float32(1/T)), T the
//     temperature, E below; a maximum has w = 1 exactly.
//  6. Candidates, a sequence of ids, "weight order" being w descending,
//     then id ascending: with top_k k, 0 < k < V, the first k ids in weight
//     order; else with top_p p, 0 < p < 1, every id in weight order; else
//     every id in id order.
//  7. top_p p, 0 < p < 1: keep the longest prefix in which every candidate
//     j has C(j-1) <= p*S (C(-1) = 0: the first stays), C the blocked
//     cumulative sum of the candidates' w and S the blocked total of all w
//     in id order (below).
//  8. min_p q > 0: drop the candidates with float64(w) < q, keeping the
//     order (a w of 1 stays).
//  9. Draw: the first candidate j with C(j) > u*W, C the blocked cumulative
//     sum of the remaining candidates' w and W their blocked total. W >= 1
//     and u*W < W, so one exists, and a weight of 0 is never drawn.
//
// Blocked sums, float64, so that a GPU can add blocks in parallel and get
// the same bits: a sequence a[0..n) is cut into blocks of 256 consecutive
// entries; R(b) is block b's sum, added left to right from 0; P(0) = 0 and
// P(b+1) = P(b) + R(b); the cumulative sum C(j) of entry j of block b is
// P(b) + (its block's entries up to and including j, added left to right
// from 0); the total is C(n-1). Every + above is one float64 addition and
// p*S, u*W one float64 multiplication, rounded to nearest even.
//
// E(d), every operation one float32 operation rounded to nearest even: no
// fused multiply-add (Go: an explicit float32() around each product; CUDA:
// __fmul_rn and __fadd_rn), no flush to zero:
//
//	d < -86 or NaN:  E = 0
//	k = (d*log2e + 0x1.8p23) - 0x1.8p23   d*log2e rounded to an integer, ties to even
//	r = (d - k*ln2hi) - k*ln2lo           k*ln2hi is exact
//	q = (((((((c7*r + c6)*r + c5)*r + c4)*r + c3)*r + c2)*r + c1)*r + c0
//	E = q * 2^k                           2^k built from its exponent bits
//
// with the float32 constants log2e = float32(log2(e)), ln2hi = 0x1.62e4p-1,
// ln2lo = float32(ln(2) - ln2hi) and cn = float32(1/n!) (each the nearest
// float32). E is within one float32 ulp of e^d, and its own definition, not
// a libm's, so every machine computes the same weights. Everything outside the rule (the
// heap for top_k, a prefilter for top_p) only saves work.
//
// logit_bias, the penalties, temperature and the filters shape the draw
// only: Logprob and TopLogprobs are of the raw logits.
package sampling

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
)

// ErrBadParams is wrapped by Params.Validate.
var ErrBadParams = errors.New("sampling: bad parameters")

// MaxLogitBias bounds the entries of Params.LogitBias.
const MaxLogitBias = 4096

// MaxBias bounds the magnitude of a logit bias (OpenAI's range).
const MaxBias = 100

// GreedyTemperature: temperatures below it sample greedily (SGLang's
// epsilon).
const GreedyTemperature = 1e-6

// Params are one request's sampling parameters. Zero values mean off
// (Temperature 0 is greedy).
type Params struct {
	Temperature      float64 // below GreedyTemperature: greedy
	TopP             float64 // 0 or 1: off
	TopK             int     // 0 or -1: off; 1 is greedy
	MinP             float64 // 0: off
	FrequencyPenalty float64 // subtracted once per earlier occurrence of a token
	PresencePenalty  float64 // subtracted once if a token occurred at all
	// RepetitionPenalty divides the positive logits and multiplies the
	// negative ones of every token in the prompt or the output so far
	// (0 or 1: off; > 1 discourages repeats).
	RepetitionPenalty float64
	// LogitBias is added to the logits of its token ids before the
	// penalties: at most MaxLogitBias entries, each in [-MaxBias, MaxBias];
	// ids beyond the logits row are ignored (the engine refuses them).
	LogitBias map[int]float64
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
	case len(p.LogitBias) > MaxLogitBias:
		return fmt.Errorf("%w: logit_bias has %d entries, at most %d", ErrBadParams, len(p.LogitBias), MaxLogitBias)
	}
	for _, id := range slices.Sorted(maps.Keys(p.LogitBias)) {
		if id < 0 {
			return fmt.Errorf("%w: logit_bias token id %d is negative", ErrBadParams, id)
		}
		if v := p.LogitBias[id]; !(v >= -MaxBias && v <= MaxBias) {
			return fmt.Errorf("%w: logit_bias %v for token id %d must be in [-%d, %d]", ErrBadParams, v, id, MaxBias, MaxBias)
		}
	}
	return nil
}

// Greedy reports whether the parameters always pick the (adjusted) argmax.
func (p Params) Greedy() bool { return p.Temperature < GreedyTemperature || p.TopK == 1 }

func (p Params) penalised() bool { return p.FrequencyPenalty != 0 || p.PresencePenalty != 0 }

func (p Params) repeats() bool { return p.RepetitionPenalty != 0 && p.RepetitionPenalty != 1 }

// tokenBias is one logit_bias entry, as the rule adds it.
type tokenBias struct {
	id int
	v  float32
}

// biasList is m as entries sorted by id.
func biasList(m map[int]float64) []tokenBias {
	if len(m) == 0 {
		return nil
	}
	out := make([]tokenBias, 0, len(m))
	for id, v := range m {
		out = append(out, tokenBias{id, float32(v)})
	}
	slices.SortFunc(out, func(a, b tokenBias) int { return cmp.Compare(a.id, b.id) })
	return out
}

// Sampler samples one request's tokens. It is not safe for concurrent use.
type Sampler struct {
	p      Params
	seed   uint64
	bias   []tokenBias
	counts map[int]int  // occurrences of each accepted (output) token
	prompt map[int]bool // the prompt's tokens, for the repetition penalty

	work   []float32 // adjusted logits
	w      []float32 // weights
	blocks []float64 // block sums of w in id order
	cand   []int32   // candidate ids
}

// New returns a sampler whose draws are fixed by seed: step k draws
// Uniform(seed, k).
func New(p Params, seed uint64) *Sampler {
	return &Sampler{p: p, seed: seed, bias: biasList(p.LogitBias), counts: map[int]int{}}
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

// Sample picks the token of output step step (0 for the first) from
// logits, which it does not modify, by the package's rule with
// u = Uniform(seed, step). It does not Accept the token. The same step,
// logits and accepted tokens give the same token, on any server.
func (s *Sampler) Sample(step uint64, logits []float32) int {
	z := s.adjust(logits)
	if s.p.Greedy() {
		return Argmax(z)
	}
	return s.sample(z, Uniform(s.seed, step))
}

// adjust is steps 1-3 of the rule: logits, or the work row holding them with
// the bias and penalties applied.
func (s *Sampler) adjust(logits []float32) []float32 {
	rep := s.p.repeats() && len(s.prompt)+len(s.counts) > 0
	pen := s.p.penalised() && len(s.counts) > 0
	if len(s.bias) == 0 && !rep && !pen {
		return logits
	}
	s.work = append(s.work[:0], logits...)
	l := s.work
	for _, b := range s.bias {
		if b.id < len(l) {
			l[b.id] += b.v
		}
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
	if pen {
		for tok, n := range s.counts {
			if tok >= 0 && tok < len(l) {
				l[tok] -= float32(float64(s.p.FrequencyPenalty*float64(n)) + s.p.PresencePenalty) // no FMA
			}
		}
	}
	return l
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
