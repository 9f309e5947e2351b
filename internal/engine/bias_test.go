package engine

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// checkRawLogprobs fails unless every token's logprob and top list are
// those of the model's raw logits at its position (not of the biased or
// penalised distribution it was sampled from).
func checkRawLogprobs(t *testing.T, prompt []int, r result) {
	t.Helper()
	hist := i32(prompt)
	l := make([]float32, fakeVocab)
	for i, tok := range r.tokens {
		fakeLogits(hist, nil, l)
		lp, top := sampling.Logprobs(l, tok, 3)
		if r.logprobs[i] != lp || !slices.Equal(r.tops[i], top) {
			t.Fatalf("token %d (%d): logprob %v top %v, the raw logits give %v %v", i, tok, r.logprobs[i], r.tops[i], lp, top)
		}
		hist = append(hist, int32(tok))
	}
}

// TestLogitBias: -100 on the greedy token moves greedy decoding off it at
// every step, +100 forces a token, banning all but one token leaves only
// that one, and the logprobs stay those of the raw logits.
func TestLogitBias(t *testing.T) {
	te := startEngine(t, 256, 4, nil)
	prompt := ids("bias me")
	seed := int64(5)
	gen := func(p SamplingParams) result {
		p.MaxNewTokens, p.IgnoreEOS = 10, true
		return te.generate(t, &Request{InputIDs: prompt, Params: p, Logprobs: true, TopLogprobs: 3})
	}

	plain := gen(SamplingParams{})
	if want := expectGreedy(i32(prompt), nil, 10, true); !slices.Equal(plain.tokens, want) {
		t.Fatalf("unbiased greedy %v, want %v", plain.tokens, want)
	}
	banned := plain.tokens[0]
	r := gen(SamplingParams{LogitBias: map[int]float64{banned: -100}})
	// Greedy over the raw logits with the banned token pushed down.
	hist := i32(prompt)
	l := make([]float32, fakeVocab)
	var want []int
	for range 10 {
		fakeLogits(hist, nil, l)
		l[banned] -= 100
		want = append(want, sampling.Argmax(l))
		hist = append(hist, int32(want[len(want)-1]))
	}
	if !slices.Equal(r.tokens, want) || slices.Contains(r.tokens, banned) {
		t.Fatalf("banning %d: tokens %v, want %v", banned, r.tokens, want)
	}
	checkRawLogprobs(t, prompt, r)

	// +100 forces 'q', greedy or sampled hot with filters.
	for _, p := range []SamplingParams{
		{LogitBias: map[int]float64{'q': 100}},
		{Temperature: 1.5, TopP: 0.95, TopK: 50, Seed: &seed, LogitBias: map[int]float64{'q': 100}},
	} {
		r := gen(p)
		if slices.ContainsFunc(r.tokens, func(tok int) bool { return tok != 'q' }) {
			t.Fatalf("+100 on 'q' (%+v): tokens %v", p, r.tokens)
		}
		checkRawLogprobs(t, prompt, r)
	}

	// Banning every token but 'z', at a high temperature.
	all := map[int]float64{}
	for id := range fakeVocab {
		if id != 'z' {
			all[id] = -100
		}
	}
	r = gen(SamplingParams{Temperature: 2, Seed: &seed, LogitBias: all})
	if slices.ContainsFunc(r.tokens, func(tok int) bool { return tok != 'z' }) {
		t.Fatalf("all but 'z' banned: tokens %v", r.tokens)
	}
	checkRawLogprobs(t, prompt, r)
	if r.logprobs[0] > -1 {
		t.Fatalf("logprob of 'z' %v: the bias leaked into the logprobs", r.logprobs[0])
	}
}

func TestLogitBiasRefused(t *testing.T) {
	te := newTestEngine(t, 16, 4, nil)
	many := map[int]float64{}
	for id := range sampling.MaxLogitBias + 1 {
		many[id] = 1
	}
	for _, bias := range []map[int]float64{
		{fakeVocab: 1},   // outside the vocabulary
		{-1: 1},          // negative
		{3: 100.5},       // beyond 100
		{3: -101},        // beyond -100
		many,             // too many entries
		{2: 1, 9999: -1}, // one bad entry of two
	} {
		_, err := te.Submit(context.Background(), &Request{InputIDs: ids("x"), Params: SamplingParams{LogitBias: bias}})
		if !errors.Is(err, ErrBadRequest) {
			t.Fatalf("logit_bias with %d entries: %v, want ErrBadRequest", len(bias), err)
		}
	}
}
