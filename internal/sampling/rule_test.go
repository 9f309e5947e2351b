package sampling

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// reference is the package's sampling rule written out plainly: the full
// vocabulary sorted, every cumulative sum materialised, nothing skipped.
// Sampler.Sample must agree with it exactly.
func reference(p Params, l []float32, prompt []int32, accepted []int, u float64) int {
	V := len(l)
	z := slices.Clone(l)
	// 1. logit bias, repetition penalty, frequency and presence.
	for id, b := range p.LogitBias {
		if id < V {
			z[id] += float32(b)
		}
	}
	if r := p.RepetitionPenalty; r != 0 && r != 1 {
		seen := map[int]bool{}
		for _, t := range prompt {
			seen[int(t)] = true
		}
		for _, t := range accepted {
			seen[t] = true
		}
		for t := range seen {
			if t < V {
				if z[t] > 0 {
					z[t] /= float32(r)
				} else {
					z[t] *= float32(r)
				}
			}
		}
	}
	if p.FrequencyPenalty != 0 || p.PresencePenalty != 0 {
		n := map[int]int{}
		for _, t := range accepted {
			n[t]++
		}
		for t, c := range n {
			if t < V {
				z[t] -= float32(float64(p.FrequencyPenalty*float64(c)) + p.PresencePenalty)
			}
		}
	}
	// 2. greedy: the lowest id of the largest non-NaN z.
	greedy := func() int {
		best := -1
		for i, x := range z {
			if x == x && (best < 0 || x > z[best]) {
				best = i
			}
		}
		return max(best, 0)
	}
	if p.Temperature < 1e-6 || p.TopK == 1 {
		return greedy()
	}
	m := float32(math.Inf(-1))
	for _, x := range z {
		if x != x {
			return greedy()
		}
		m = max(m, x)
	}
	if V == 0 || math.IsInf(float64(m), 0) {
		return greedy()
	}
	// 3. weights.
	invT := float32(1 / p.Temperature)
	w := make([]float64, V)
	ids := make([]int, V)
	for i := range z {
		w[i] = float64(weight((z[i] - m) * invT))
		ids[i] = i
	}
	weights := func(c []int) []float64 {
		out := make([]float64, len(c))
		for j, id := range c {
			out[j] = w[id]
		}
		return out
	}
	S := blockedCum(w)[V-1]
	// 4. candidates.
	order := slices.Clone(ids)
	slices.SortStableFunc(order, func(a, b int) int {
		switch {
		case w[a] > w[b]:
			return -1
		case w[a] < w[b]:
			return 1
		}
		return 0 // stable: ids ascending
	})
	byK, byP := p.TopK > 0 && p.TopK < V, p.TopP > 0 && p.TopP < 1
	cand := ids
	switch {
	case byK:
		cand = order[:p.TopK]
	case byP:
		cand = order
	}
	if byP {
		C := blockedCum(weights(cand))
		n := 1
		for n < len(cand) && C[n-1] <= p.TopP*S {
			n++
		}
		cand = cand[:n]
	}
	if p.MinP > 0 {
		var kept []int
		for _, id := range cand {
			if w[id] >= p.MinP {
				kept = append(kept, id)
			}
		}
		cand = kept
	}
	// 5. the draw.
	C := blockedCum(weights(cand))
	target := u * C[len(C)-1]
	for j, c := range C {
		if c > target {
			return cand[j]
		}
	}
	panic("reference: no candidate above the target")
}

// blockedCum is the rule's cumulative sum: blocks of 256, each summed from
// 0, and each entry its block's start P(b) plus its block's running sum.
func blockedCum(a []float64) []float64 {
	c := make([]float64, len(a))
	var P float64
	for lo := 0; lo < len(a); lo += 256 {
		var r float64
		for j := lo; j < min(lo+256, len(a)); j++ {
			r += a[j]
			c[j] = P + r
		}
		P += r
	}
	return c
}

// tiedLogits has few distinct values (many ties, in and across blocks),
// some -Inf, and a wide range.
func tiedLogits(rng *rand.Rand, V int) []float32 {
	l := make([]float32, V)
	levels := 2 + rng.IntN(30)
	scale := []float32{0.05, 0.5, 2, 8}[rng.IntN(4)]
	for i := range l {
		l[i] = float32(rng.IntN(levels)) * scale
		if rng.IntN(50) == 0 {
			l[i] = float32(math.Inf(-1))
		}
	}
	return l
}

// ruleModes are every combination of the filters, plain and penalised.
func ruleModes() []Params {
	var out []Params
	for _, k := range []int{0, 1, 3, 40, 300} {
		for _, p := range []float64{0, 0.3, 0.9, 1 - 1e-12} {
			for _, mp := range []float64{0, 0.05, 0.6} {
				for _, temp := range []float64{0, 0.7, 1.3} {
					out = append(out, Params{Temperature: temp, TopK: k, TopP: p, MinP: mp})
				}
			}
		}
	}
	out = append(out,
		Params{Temperature: 1, FrequencyPenalty: 0.7, PresencePenalty: -0.3, RepetitionPenalty: 1.3},
		Params{Temperature: 0.9, TopP: 0.8, RepetitionPenalty: 0.8, LogitBias: map[int]float64{0: 5, 3: -100, 7: 2.5, 100000: 1}},
		Params{Temperature: 2, TopK: 20, MinP: 0.01, LogitBias: map[int]float64{1: 100}},
		Params{LogitBias: map[int]float64{2: 3.25}, FrequencyPenalty: 1},
	)
	return out
}

// TestRuleMatchesReference: for random logits with many ties, every mode,
// several seeds and steps, Sample picks the reference's token; and so does
// the rule at the extreme uniforms 0 and 1-2^-53.
func TestRuleMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(2024, 7))
	modes := ruleModes()
	cases := 0
	for trial := range 36 {
		V := []int{1, 2, 7, 255, 256, 257, 600, 1300, 5000}[trial%9]
		l := tiedLogits(rng, V)
		prompt := []int32{int32(rng.IntN(V)), int32(rng.IntN(V))}
		accepted := []int{rng.IntN(V), rng.IntN(V), rng.IntN(V)}
		accepted = append(accepted, accepted[0])
		for mi, p := range modes {
			seed := rng.Uint64()
			s := New(p, seed)
			s.SetPrompt(prompt)
			for _, a := range accepted {
				s.Accept(a)
			}
			for _, step := range []uint64{0, 1, uint64(trial) + 2} {
				got := s.Sample(step, l)
				if want := reference(p, l, prompt, accepted, Uniform(seed, step)); got != want {
					t.Fatalf("trial %d (V %d) mode %d %+v seed %#x step %d: Sample %d, the rule %d",
						trial, V, mi, p, seed, step, got, want)
				}
				cases++
			}
			if p.Greedy() {
				continue
			}
			for _, u := range []float64{0, 1 - 0x1p-53, 0.5} {
				z := s.adjust(l)
				if got, want := s.sample(z, u), reference(p, l, prompt, accepted, u); got != want {
					t.Fatalf("trial %d (V %d) mode %d %+v u %v: sample %d, the rule %d", trial, V, mi, p, u, got, want)
				}
			}
		}
	}
	t.Logf("%d cases", cases)
}

// TestRuleTies: equal weights are ordered by id everywhere.
func TestRuleTies(t *testing.T) {
	flat := make([]float32, 1000)
	// top_k 3 of a flat row is ids 0, 1, 2, whatever the draw.
	for k := range uint64(200) {
		if got := New(Params{Temperature: 1, TopK: 3}, 5).Sample(k, flat); got > 2 {
			t.Fatalf("top_k 3 of equal logits drew %d", got)
		}
	}
	// The draw walks ids in order: u = 0 is id 0, u just below 1 the last.
	s := New(Params{Temperature: 1}, 0)
	if a, b := s.sample(flat, 0), s.sample(flat, 1-0x1p-53); a != 0 || b != len(flat)-1 {
		t.Fatalf("flat row: u=0 drew %d, u=1- drew %d", a, b)
	}
	// Greedy among equal maxima: the lowest id.
	l := []float32{1, 5, 2, 5, 5}
	if got := New(Params{}, 0).Sample(0, l); got != 1 {
		t.Fatalf("greedy of %v = %d, want 1", l, got)
	}
	// top_p 0.5 of four equal weights: S = 4, C(1) = 2 <= 0.5*S keeps the
	// third, C(2) = 3 drops the fourth; the draw runs over ids 0, 1, 2.
	l = []float32{4, 4, 4, 4}
	s = New(Params{Temperature: 1, TopP: 0.5}, 0)
	if a, b := s.sample(l, 0), s.sample(l, 1-0x1p-53); a != 0 || b != 2 {
		t.Fatalf("top_p 0.5 of 4 equal: u=0 drew %d, u=1- drew %d; want 0 and 2", a, b)
	}
	// min_p 1 keeps exactly the maxima (w = 1 >= 1), in id order, or in
	// weight order after top_k.
	l = []float32{3, 7, 1, 7}
	for _, p := range []Params{{Temperature: 1, MinP: 1}, {Temperature: 1, MinP: 1, TopK: 3}} {
		s = New(p, 0)
		if a, b := s.sample(l, 0), s.sample(l, 1-0x1p-53); a != 1 || b != 3 {
			t.Fatalf("%+v: u=0 drew %d, u=1- drew %d; want 1 and 3", p, a, b)
		}
	}
	// A target equal to a block's end P(1) = 256 is drawn by the next
	// block's first entry (C(256) = 257 is the first above it).
	flat = make([]float32, 512)
	for _, p := range []Params{{Temperature: 1}, {Temperature: 1, MinP: 0.5}} {
		if got := New(p, 0).sample(flat, 0.5); got != 256 {
			t.Fatalf("%+v: u=0.5 over 512 equal weights drew %d, want 256", p, got)
		}
	}
}

// TestWeight: E(0) = 1 exactly, E is within one float32 ulp of e^d, and 0
// below -86 and for NaN.
func TestWeight(t *testing.T) {
	if weight(0) != 1 {
		t.Fatalf("E(0) = %v", weight(0))
	}
	for _, d := range []float32{-86.0001, -1000, float32(math.Inf(-1)), float32(math.NaN())} {
		if e := weight(d); e != 0 {
			t.Fatalf("E(%v) = %v, want 0", d, e)
		}
	}
	rng := rand.New(rand.NewPCG(1, 2))
	worst := 0.0
	for i := range 1_000_000 {
		d := -rng.Float32() * 86
		if i%2 == 0 {
			d = -rng.Float32() * 4
		}
		e, want := float64(weight(d)), math.Exp(float64(d))
		if rel := math.Abs(e-want) / want; rel > worst {
			worst = rel
		}
	}
	if worst > 0x1p-23 {
		t.Fatalf("E is off e^d by %g relative (> 1 float32 ulp)", worst)
	}
}

// TestWeigh: the row loop computes weight's bits for every d, from -90 to
// 0 in steps of a float32 ulp near 0 and coarser below, and sums them left
// to right.
func TestWeigh(t *testing.T) {
	var z []float32
	for d := float32(0); d > -90; d = -math.Nextafter32(-d, 1) * 1.0001 {
		z = append(z, d)
		if d == 0 {
			d = -1e-30
		}
	}
	z = append(z, float32(math.Inf(-1)), float32(math.NaN()))
	w := make([]float32, len(z))
	sum := weigh(z, w, 0, 1)
	var want float64
	for i, d := range z {
		if math.Float32bits(w[i]) != math.Float32bits(weight(d)) {
			t.Fatalf("weigh(%v) = %v, weight = %v", d, w[i], weight(d))
		}
		want += float64(weight(d))
	}
	if sum != want {
		t.Fatalf("sum %v, want %v", sum, want)
	}
	t.Logf("%d points", len(z))
}

// TestWeightBits pins E's exact bits at a few points (computed from this
// implementation), so a change to E, which would break agreement with a
// GPU implementation of the rule, fails here; a kernel can check itself
// against the same table.
func TestWeightBits(t *testing.T) {
	for _, tc := range []struct {
		d    float32
		bits uint32
	}{
		{-0.5, 0x3f1b4598},
		{-1, 0x3ebc5ab2},
		{-2.75, 0x3d82ec9c},
		{-10, 0x383e6bce},
		{-85.9, 0x018698a0},
		{-1e-7, 0x3f7ffffe},
	} {
		if got := math.Float32bits(weight(tc.d)); got != tc.bits {
			t.Errorf("E(%v) = %#08x (%v), want %#08x", tc.d, got, weight(tc.d), tc.bits)
		}
	}
}

// TestTopPPrefilterExact: on a large row the prefiltered nucleus equals
// the reference's full sort for p near 0 and near 1.
func TestTopPPrefilterExact(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	l := make([]float32, 20000)
	for i := range l {
		l[i] = float32(rng.NormFloat64() * 2)
	}
	for _, p := range []float64{0.01, 0.5, 0.99, 0.999999} {
		prm := Params{Temperature: 1, TopP: p}
		s := New(prm, 11)
		for k := range uint64(12) {
			if got, want := s.Sample(k, l), reference(prm, l, nil, nil, Uniform(11, k)); got != want {
				t.Fatalf("top_p %v step %d: %d, the rule %d", p, k, got, want)
			}
		}
	}
}
