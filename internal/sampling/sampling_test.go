package sampling

import (
	"cmp"
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"sort"
	"testing"
)

func randomLogits(seed uint64, n int) []float32 {
	r := rand.New(rand.NewPCG(seed, 1))
	l := make([]float32, n)
	for i := range l {
		l[i] = float32(r.NormFloat64() * 3)
	}
	return l
}

func softmax(l []float32, temp float64) []float64 {
	mx := math.Inf(-1)
	for _, x := range l {
		mx = math.Max(mx, float64(x))
	}
	p := make([]float64, len(l))
	var s float64
	for i, x := range l {
		p[i] = math.Exp((float64(x) - mx) / temp)
		s += p[i]
	}
	for i := range p {
		p[i] /= s
	}
	return p
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Params
		ok   bool
	}{
		{"zero", Params{}, true},
		{"typical", Params{Temperature: 0.7, TopP: 0.9, TopK: 40, MinP: 0.05, FrequencyPenalty: 1, PresencePenalty: -1}, true},
		{"top_k -1", Params{TopK: -1}, true},
		{"negative temperature", Params{Temperature: -0.1}, false},
		{"nan temperature", Params{Temperature: math.NaN()}, false},
		{"top_p above 1", Params{TopP: 1.5}, false},
		{"top_k -2", Params{TopK: -2}, false},
		{"min_p negative", Params{MinP: -0.1}, false},
		{"frequency penalty 3", Params{FrequencyPenalty: 3}, false},
		{"presence penalty -3", Params{PresencePenalty: -3}, false},
		{"repetition penalty 1.3", Params{RepetitionPenalty: 1.3}, true},
		{"repetition penalty 2.5", Params{RepetitionPenalty: 2.5}, false},
		{"repetition penalty negative", Params{RepetitionPenalty: -1}, false},
		{"repetition penalty nan", Params{RepetitionPenalty: math.NaN()}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			if (err == nil) != tc.ok {
				t.Fatalf("Validate(%+v) = %v, want ok=%v", tc.p, err, tc.ok)
			}
			if err != nil && !errors.Is(err, ErrBadParams) {
				t.Fatalf("error %v does not wrap ErrBadParams", err)
			}
		})
	}
}

func TestArgmaxTiesLowestID(t *testing.T) {
	for _, tc := range []struct {
		l    []float32
		want int
	}{
		{[]float32{1, 3, 3, 2}, 1},
		{[]float32{5, 5}, 0},
		{[]float32{float32(math.NaN()), 1, 1}, 1},
		{[]float32{float32(math.Inf(-1)), float32(math.Inf(-1))}, 0},
	} {
		if got := Argmax(tc.l); got != tc.want {
			t.Errorf("Argmax(%v) = %d, want %d", tc.l, got, tc.want)
		}
	}
}

func TestTopK1EqualsGreedy(t *testing.T) {
	for seed := range uint64(20) {
		l := randomLogits(seed, 500)
		greedy := New(Params{}, seed).Sample(0, l)
		k1 := New(Params{Temperature: 1.5, TopK: 1}, seed).Sample(0, l)
		if greedy != k1 || greedy != Argmax(l) {
			t.Fatalf("seed %d: greedy %d, top_k=1 %d, argmax %d", seed, greedy, k1, Argmax(l))
		}
	}
}

func TestSeedReproducible(t *testing.T) {
	l := randomLogits(7, 1000)
	p := Params{Temperature: 1, TopP: 0.95, TopK: 100, MinP: 0.01}
	draw := func(seed uint64) []int {
		s := New(p, seed)
		var out []int
		for k := range uint64(50) {
			out = append(out, s.Sample(k, l))
		}
		return out
	}
	a, b, c := draw(42), draw(42), draw(43)
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("same seed diverged at draw %d: %v vs %v", i, a, b)
		}
	}
	same := true
	for i := range a {
		same = same && a[i] == c[i]
	}
	if same {
		t.Fatalf("seeds 42 and 43 gave the same 50 draws")
	}
}

// TestStepIsStateless: a step's token depends on the step, not on the
// draws made before it, so a decode server resumes at step 1 with a fresh
// sampler; and it is the rule's token for Uniform(seed, step).
func TestStepIsStateless(t *testing.T) {
	l := randomLogits(3, 300)
	p := Params{Temperature: 1}
	a := New(p, 9)
	var got []int
	for k := range uint64(20) {
		got = append(got, a.Sample(k, l))
	}
	for k := uint64(19); k < 20; k-- { // backwards, each on a fresh sampler
		if y := New(p, 9).Sample(k, l); y != got[k] {
			t.Fatalf("step %d: %d after the earlier steps, %d alone", k, got[k], y)
		}
		if want := reference(p, l, nil, nil, Uniform(9, k)); got[k] != want {
			t.Fatalf("step %d: %d, the rule gives %d", k, got[k], want)
		}
	}
	if slices.Equal(got[:10], got[10:]) {
		t.Fatalf("steps 0-9 and 10-19 drew the same tokens %v", got)
	}
}

func TestSampleDoesNotModifyLogits(t *testing.T) {
	l := randomLogits(1, 100)
	orig := append([]float32(nil), l...)
	s := New(Params{Temperature: 1, TopP: 0.5, FrequencyPenalty: 1}, 1)
	s.Accept(3)
	s.Sample(0, l)
	for i := range l {
		if l[i] != orig[i] {
			t.Fatalf("logit %d changed", i)
		}
	}
}

func TestPenalties(t *testing.T) {
	l := []float32{0, 2, 1.5, 0}
	for _, tc := range []struct {
		name     string
		p        Params
		accepted []int
		want     int
	}{
		{"none", Params{}, []int{1, 1}, 1},
		{"frequency once", Params{FrequencyPenalty: 0.4}, []int{1}, 1},         // 1.6 > 1.5
		{"frequency twice", Params{FrequencyPenalty: 0.4}, []int{1, 1}, 2},     // 1.2 < 1.5
		{"presence", Params{PresencePenalty: 0.6}, []int{1, 1, 1}, 2},          // 1.4 < 1.5
		{"negative presence boosts", Params{PresencePenalty: -2}, []int{0}, 0}, // 2 ties with 1: lower id
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := New(tc.p, 0)
			for _, a := range tc.accepted {
				s.Accept(a)
			}
			if got := s.Sample(0, l); got != tc.want {
				t.Fatalf("got %d, want %d", got, tc.want)
			}
		})
	}
}

// TestRepetitionPenalty: tokens of the prompt or the output have positive
// logits divided and negative ones multiplied by the penalty, once each.
func TestRepetitionPenalty(t *testing.T) {
	l := []float32{2, 1.8, -1, -1.2, 0.5}
	for _, tc := range []struct {
		name     string
		p        float64
		prompt   []int32
		accepted []int
		want     int
	}{
		{"off", 1, []int32{0}, nil, 0},
		{"prompt token", 1.2, []int32{0}, nil, 1},             // 2/1.2 = 1.67 < 1.8
		{"output token", 1.2, nil, []int{0, 0, 0}, 1},         // once, however often
		{"both, counted once", 1.05, []int32{0}, []int{0}, 0}, // 2/1.05 = 1.90 > 1.8 (1.81 if applied twice)
		{"below 1 favours repeats", 0.8, []int32{1}, nil, 1},  // 1.8/0.8 = 2.25 > 2
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := New(Params{RepetitionPenalty: tc.p}, 0)
			s.SetPrompt(tc.prompt)
			for _, a := range tc.accepted {
				s.Accept(a)
			}
			if got := s.Sample(0, l); got != tc.want {
				t.Fatalf("got %d, want %d", got, tc.want)
			}
		})
	}
	// The exact values, read back from the sampler's work row: positive
	// logits divided, negative ones multiplied, others untouched.
	s := New(Params{RepetitionPenalty: 2}, 0)
	s.SetPrompt([]int32{0, 1})
	row := []float32{3, -3, 1}
	s.Sample(0, row)
	if want := []float32{1.5, -6, 1}; !slices.Equal(s.work, want) {
		t.Fatalf("penalised row %v, want %v", s.work, want)
	}
	if row[0] != 3 || row[1] != -3 {
		t.Fatal("Sample modified the caller's logits")
	}
}

// histogram draws n samples and returns the counts per id.
func histogram(p Params, seed uint64, l []float32, n int, accepted ...int) []int {
	s := New(p, seed)
	for _, a := range accepted {
		s.Accept(a)
	}
	h := make([]int, len(l))
	for k := range uint64(n) {
		h[s.Sample(k, l)]++
	}
	return h
}

func TestPenaltyShiftsDistribution(t *testing.T) {
	l := []float32{1, 1, 1, 1}
	h := histogram(Params{Temperature: 1, FrequencyPenalty: 2}, 5, l, 4000, 0, 0)
	// token 0 has logit 1-4 = -3: p = e^-4/(3+e^-4) ~ 0.006
	if h[0] > 80 {
		t.Fatalf("penalised token drawn %d/4000 times: %v", h[0], h)
	}
}

func TestTemperatureMatchesSoftmax(t *testing.T) {
	l := []float32{0, 1, 2, 0.5}
	const n = 20000
	for _, temp := range []float64{0.5, 1, 2} {
		h := histogram(Params{Temperature: temp}, 11, l, n)
		want := softmax(l, temp)
		for i := range l {
			got := float64(h[i]) / n
			if math.Abs(got-want[i]) > 0.02 {
				t.Fatalf("temperature %v: token %d frequency %.3f, want %.3f", temp, i, got, want[i])
			}
		}
	}
}

func TestFilters(t *testing.T) {
	// probabilities at temperature 1 ~ [0.64, 0.24, 0.09, 0.03, ...]
	l := []float32{4, 3, 2, 1, 0, -1}
	probs := softmax(l, 1)
	for _, tc := range []struct {
		name    string
		p       Params
		allowed []int
	}{
		{"top_k 2", Params{Temperature: 1, TopK: 2}, []int{0, 1}},
		{"top_p 0.5 keeps the first", Params{Temperature: 1, TopP: 0.5}, []int{0}},
		{"top_p 0.7", Params{Temperature: 1, TopP: 0.7}, []int{0, 1}},
		{"top_p 0.9", Params{Temperature: 1, TopP: 0.9}, []int{0, 1, 2}},
		{"min_p 0.3", Params{Temperature: 1, MinP: 0.3}, []int{0, 1}},
		{"min_p 0.1", Params{Temperature: 1, MinP: 0.1}, []int{0, 1, 2}},
		{"top_k 3 top_p 0.7", Params{Temperature: 1, TopK: 3, TopP: 0.7}, []int{0, 1}},
		{"top_k 2 min_p 0.5", Params{Temperature: 1, TopK: 2, MinP: 0.5}, []int{0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := histogram(tc.p, 3, l, 3000)
			ok := map[int]bool{}
			for _, a := range tc.allowed {
				ok[a] = true
				if h[a] == 0 {
					t.Errorf("allowed token %d (p=%.3f) never drawn: %v", a, probs[a], h)
				}
			}
			for i, c := range h {
				if c > 0 && !ok[i] {
					t.Errorf("token %d drawn %d times, outside %v", i, c, tc.allowed)
				}
			}
		})
	}
}

func TestTopPLargeVocabPrefilter(t *testing.T) {
	// The exact prefilter must keep the same nucleus as a full sort.
	l := randomLogits(99, 5000)
	probs := softmax(l, 1)
	s := New(Params{Temperature: 1, TopP: 0.8}, 1)
	seen := map[int]bool{}
	for k := range uint64(3000) {
		seen[s.Sample(k, l)] = true
	}
	// every drawn token must have cumulative-before <= 0.8 in sorted order
	var order []int
	for i := range probs {
		order = append(order, i)
	}
	sort.SliceStable(order, func(a, b int) bool { return probs[order[a]] > probs[order[b]] })
	var before float64
	nucleus := map[int]bool{}
	for _, id := range order {
		if before > 0.8 {
			break
		}
		nucleus[id] = true
		before += probs[id]
	}
	for id := range seen {
		if !nucleus[id] {
			t.Fatalf("token %d drawn outside the nucleus", id)
		}
	}
}

func TestLogprob(t *testing.T) {
	l := []float32{1, 2, 3}
	p := softmax(l, 1)
	for i := range l {
		if got := Logprob(l, i); math.Abs(float64(got)-math.Log(p[i])) > 1e-6 {
			t.Fatalf("Logprob(%d) = %v, want %v", i, got, math.Log(p[i]))
		}
	}
	if !math.IsInf(float64(Logprob(l, 5)), -1) {
		t.Fatalf("out of range id should be -Inf")
	}
}

func BenchmarkSample(b *testing.B) {
	l := randomLogits(1, 32000)
	for _, tc := range []struct {
		name string
		p    Params
	}{
		{"greedy", Params{}},
		{"temperature", Params{Temperature: 0.8}},
		{"top_k=40", Params{Temperature: 0.8, TopK: 40}},
		{"top_p=0.9", Params{Temperature: 0.8, TopP: 0.9}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			s := New(tc.p, 1)
			b.ReportAllocs()
			k := uint64(0)
			for b.Loop() {
				s.Sample(k, l)
				k++
			}
		})
	}
}

// BenchmarkSampleBatch is one engine step's sampling at batch 64 with a
// 128K vocabulary (Llama 3's 128256): a Sample per row, each row its own
// logits and sampler.
func BenchmarkSampleBatch(b *testing.B) {
	const batch, vocab = 64, 128256
	rows := make([][]float32, batch)
	for i := range rows {
		rows[i] = randomLogits(uint64(i), vocab)
	}
	for _, tc := range []struct {
		name string
		p    Params
	}{
		{"greedy", Params{}},
		{"temperature", Params{Temperature: 0.8}},
		{"top_k=40", Params{Temperature: 0.8, TopK: 40}},
		{"top_p=0.9", Params{Temperature: 0.8, TopP: 0.9}},
		{"min_p=0.05", Params{Temperature: 0.8, MinP: 0.05}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ss := make([]*Sampler, batch)
			for i := range ss {
				ss[i] = New(tc.p, uint64(i))
			}
			step := uint64(0)
			b.ReportAllocs()
			for b.Loop() {
				for i, s := range ss {
					s.Sample(step, rows[i])
				}
				step++
			}
		})
	}
}

// TestTopLogprobs: the n most likely tokens, in order, ties to the lower id,
// with Logprob's values; against a full sort.
func TestTopLogprobs(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 12))
	for trial := 0; trial < 200; trial++ {
		l := make([]float32, 1+rng.IntN(500))
		for i := range l {
			l[i] = float32(rng.IntN(40)) / 4 // many ties
		}
		n := rng.IntN(MaxTopLogprobs + 3)
		got := TopLogprobs(l, n)
		ids := make([]int, len(l))
		for i := range ids {
			ids[i] = i
		}
		slices.SortStableFunc(ids, func(a, b int) int { return cmp.Compare(l[b], l[a]) })
		want := min(n, len(l))
		if len(got) != want {
			t.Fatalf("trial %d: %d entries, want %d", trial, len(got), want)
		}
		for i, g := range got {
			if g.Token != ids[i] || g.Logprob != Logprob(l, ids[i]) {
				t.Fatalf("trial %d: entry %d = %+v, want token %d logprob %v", trial, i, g, ids[i], Logprob(l, ids[i]))
			}
		}
	}
}
