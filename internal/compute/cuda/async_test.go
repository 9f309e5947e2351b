package cuda

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// TestQueuedPasses: decode passes queued one ahead, each with its tokens
// taken on the device from the pass before, give the tokens and logprobs of
// ForwardSample passes fed from the host (the same logits: batch-invariant
// f32), step for step, across every kind of pass between: after an eager
// prefill (tokens read on the host), a shape's first pass (eager, then
// captured), graph replays, and an eager mixed pass with a prompt chunk.
// Then the misuses are refused by name.
func TestQueuedPasses(t *testing.T) {
	const V, ps, per = 32000, 16, 8
	b := sampleBackend(t, V, Options{PageSize: ps, Pages: 512, BatchInvariant: true, TimeSteps: true})
	const steps = 24
	queuedVsFed(t, b, V, per, steps, b.ResetStepTimes)
	gs, st := b.GraphStats(), b.StepTimes()
	if gs.Replays < steps-6 {
		t.Fatalf("queued decode passes did not replay graphs: %+v", gs)
	}
	if st.Passes != steps+1 {
		t.Fatalf("%d passes timed, want %d", st.Passes, steps+1)
	}
	t.Logf("graphs %+v; queued: %d passes, GPU gap mean %v max %v", gs, st.Passes, st.GapMean(), st.GapMax)

	// Misuses.
	ctx := context.Background()
	st0, err := b.NewSamplerState(sampling.Params{}, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer st0.Close()
	samp := func(step int) []compute.Sample { return []compute.Sample{{State: st0, Step: uint64(step)}} }
	res := make([]compute.Sampled, 1)
	one := []compute.Seq{{Tokens: []int32{3}, Pos: 100, Pages: pagesFor(0, per), Logits: true}}
	s1 := samp(steps + 1)
	expect := func(what string, err error, sub string) {
		t.Helper()
		if err == nil || !strings.Contains(err.Error(), sub) {
			t.Fatalf("%s: error %v, want one saying %q", what, err, sub)
		}
	}
	_, err = b.StartSample(ctx, one, s1, []int{0, 0})
	expect("token sources of the wrong length", err, "token sources for")
	_, err = b.StartSample(ctx, one, s1, []int{5})
	expect("a token from a seq the last pass did not have", err, "which sampled none")
	p1, err := b.StartSample(ctx, one, s1, nil)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := b.StartSample(ctx, one, samp(steps+2), []int{0})
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.StartSample(ctx, one, samp(steps+3), []int{0})
	expect("a third pending pass", err, "two sampling passes are pending")
	expect("waiting out of order", p2.Wait(res), "out of order")
	if err := p1.Wait(res); err != nil {
		t.Fatal(err)
	}
	if err := p2.Wait(res); err != nil {
		t.Fatal(err)
	}
	expect("waiting twice", p1.Wait(res), "twice")
}

// queuedSampler is what queuedVsFed drives: a Backend or a TP.
type queuedSampler interface {
	compute.DeviceSampler
	compute.AsyncSampler
}

// queuedVsFed runs TestQueuedPasses's comparison over m (steps decode
// steps of 4 seqs, seqs on pages of per pages each); reset runs between
// the fed passes and the queued ones.
func queuedVsFed(t *testing.T, b queuedSampler, V, per, steps int, reset func()) {
	t.Helper()
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(5, 9))
	params := []sampling.Params{
		{},
		{Temperature: 0.9, TopP: 0.95},
		{Temperature: 1.1, TopK: 50, FrequencyPenalty: 0.7, PresencePenalty: 0.3},
		{RepetitionPenalty: 1.4, LogitBias: map[int]float64{7: 3, 8: -100}},
	}
	n := len(params)
	prompts := make([][]int32, n)
	stA, stB := make([]compute.SamplerState, n), make([]compute.SamplerState, n)
	for i, p := range params {
		prompts[i] = randPrompt(rng, 9+5*i, V)
		seed := rng.Uint64()
		var err error
		if stA[i], err = b.NewSamplerState(p, seed, prompts[i]); err != nil {
			t.Fatal(err)
		}
		if stB[i], err = b.NewSamplerState(p, seed, prompts[i]); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { stA[i].Close(); stB[i].Close() })
	}
	extra := randPrompt(rng, 40, V) // prefilled in chunks beside step mixStep's decodes
	mixStep := steps / 2
	samp := func(st []compute.SamplerState, step int) []compute.Sample {
		s := make([]compute.Sample, len(st), len(st)+1)
		for i := range st {
			s[i] = compute.Sample{State: st[i], Step: uint64(step), Logprob: i%2 == 1, TopLogprobs: []int{0, 3}[i%2]}
		}
		return s
	}
	// B: the reference, fed from the host.
	seqsB := make([]compute.Seq, n)
	for i := range n {
		seqsB[i] = compute.Seq{Tokens: prompts[i], Pages: pagesFor(n+i, per), Logits: true}
	}
	want := make([][]compute.Sampled, steps+1)
	for step := 0; step <= steps; step++ {
		want[step] = make([]compute.Sampled, n)
		if err := b.ForwardSample(ctx, seqsB, samp(stB, step), want[step]); err != nil {
			t.Fatalf("reference step %d: %v", step, err)
		}
		for i := range n {
			pos := seqsB[i].Pos + len(seqsB[i].Tokens)
			seqsB[i] = compute.Seq{Tokens: []int32{int32(want[step][i].Token)}, Pos: pos, Pages: seqsB[i].Pages, Logits: true}
		}
	}
	reset()

	// A: each pass started before the one before it is read.
	ident := make([]int, n)
	for i := range ident {
		ident[i] = i
	}
	passA := func(step int) compute.Pending {
		seqs := make([]compute.Seq, n, n+1)
		from := ident
		for i := range n {
			if step == 0 {
				seqs[i] = compute.Seq{Tokens: prompts[i], Pages: pagesFor(i, per), Logits: true}
			} else {
				seqs[i] = compute.Seq{Tokens: []int32{-5}, Pos: len(prompts[i]) + step - 1, Pages: pagesFor(i, per), Logits: true}
			}
		}
		if step == 0 {
			from = nil
		}
		sm := samp(stA, step)
		if step == mixStep || step == mixStep+1 {
			half := len(extra) / 2
			c := extra[:half]
			pos := 0
			if step == mixStep+1 {
				c, pos = extra[half:], half
			}
			seqs = append(seqs, compute.Seq{Tokens: c, Pos: pos, Pages: pagesFor(2*n, per)})
			sm = append(sm, compute.Sample{})
			from = append(from[:n:n], -1)
		}
		p, err := b.StartSample(ctx, seqs, sm, from)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		return p
	}
	res := make([]compute.Sampled, n+1)
	p := passA(0)
	for step := 0; step <= steps; step++ {
		var next compute.Pending
		if step < steps {
			next = passA(step + 1)
		}
		if err := p.Wait(res); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for i := range n {
			g, w := res[i], want[step][i]
			if g.Token != w.Token || g.Logprob != w.Logprob || len(g.Top) != len(w.Top) {
				t.Fatalf("step %d seq %d: queued %+v, fed from the host %+v", step, i, g, w)
			}
			for k := range w.Top {
				if g.Top[k] != w.Top[k] {
					t.Fatalf("step %d seq %d top %d: queued %+v, fed from the host %+v", step, i, k, g.Top[k], w.Top[k])
				}
			}
		}
		p = next
	}
}

// TestQueuedPassesTP: at tp 2 (ranks sharing GPU 0) StartSample runs each
// pass to its end with the tokens taken from the pass before, and gives
// ForwardSample's results fed from the host.
func TestQueuedPassesTP(t *testing.T) {
	c, err := model.RandomConfig("tiny")
	if err != nil {
		t.Fatal(err)
	}
	c.Vocab, c.BOS, c.EOS = 32000, 1, []int{2}
	tp := newTPOrSkip(t, &model.Model{Config: c, Random: true}, Options{DType: "float32", RandomWeights: true, Seed: 3,
		PageSize: 16, Pages: 512, BatchInvariant: true}, 2, TPOptions{})
	queuedVsFed(t, tp, c.Vocab, 8, 12, func() {})
}
