package engine

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// devFake is the fake model with the device-sampling capability, done by
// the host sampler: each state keeps its own sampling.Sampler fed only by
// what the engine hands it (Accept lists) and by the tokens it samples, as
// a device's counts are. So the engine's bookkeeping (steps, pending
// accepts, the fallback to host steps, the PD step contract) decides its
// tokens, and must give the host path's.
type devFake struct {
	*fakeModel
	refuse func(p sampling.Params) bool // NewSamplerState fails for these

	mu          sync.Mutex
	open        int // states not closed
	made        int
	devPasses   int // ForwardSample calls
	hostPasses  int // Forward calls with logits (host sampling)
	devTokens   int
	passes      []devPass // every sampled row, in order
	outOfStates bool      // NewSamplerState fails for every request
}

// devPass is one sampled row of a ForwardSample pass.
type devPass struct {
	state  *fakeState
	step   uint64
	accept []int32
	token  int
}

type fakeState struct {
	f      *devFake
	s      *sampling.Sampler
	p      sampling.Params
	closed bool
}

func (st *fakeState) Close() error {
	st.f.mu.Lock()
	defer st.f.mu.Unlock()
	if st.closed {
		return errors.New("fake: state closed twice")
	}
	st.closed = true
	st.f.open--
	return nil
}

func (d *devFake) NewSamplerState(p sampling.Params, seed uint64, prompt []int32) (compute.SamplerState, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.outOfStates || (d.refuse != nil && d.refuse(p)) {
		return nil, errors.New("fake: no device state for these parameters")
	}
	s := sampling.New(p, seed)
	s.SetPrompt(prompt)
	d.open++
	d.made++
	return &fakeState{f: d, s: s, p: p}, nil
}

func (d *devFake) Forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	if slices.ContainsFunc(seqs, func(s compute.Seq) bool { return s.Logits }) {
		d.mu.Lock()
		d.hostPasses++
		d.mu.Unlock()
	}
	return d.fakeModel.Forward(ctx, seqs, out)
}

func (d *devFake) ForwardSample(ctx context.Context, seqs []compute.Seq, samp []compute.Sample, res []compute.Sampled) error {
	out := make([][]float32, len(seqs))
	for i, s := range seqs {
		if s.Logits {
			out[i] = make([]float32, fakeVocab)
		}
	}
	if err := d.fakeModel.Forward(ctx, seqs, out); err != nil {
		return err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.devPasses++
	for i, s := range seqs {
		if !s.Logits {
			continue
		}
		sm := samp[i]
		st, ok := sm.State.(*fakeState)
		if !ok || st.closed {
			return errors.New("fake: sampling with a closed or foreign state")
		}
		for _, tok := range sm.Accept {
			st.s.Accept(int(tok))
		}
		tok := st.s.Sample(sm.Step, out[i])
		st.s.Accept(tok)
		r := compute.Sampled{Token: tok}
		if sm.Logprob || sm.TopLogprobs > 0 {
			lp, top := sampling.Logprobs(out[i], tok, sm.TopLogprobs)
			if sm.Logprob {
				r.Logprob = lp
			}
			r.Top = top
		}
		res[i] = r
		d.devTokens++
		d.passes = append(d.passes, devPass{state: st, step: sm.Step, accept: slices.Clone(sm.Accept), token: tok})
	}
	return nil
}

func (d *devFake) counts() (open, made, devPasses, hostPasses, devTokens int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.open, d.made, d.devPasses, d.hostPasses, d.devTokens
}

// withDevice makes the engine's model a devFake (returned through *dst).
func withDevice(dst **devFake, mut func(*Config)) func(*Config) {
	return func(c *Config) {
		d := &devFake{fakeModel: c.Model.(*fakeModel)}
		c.Model = d
		*dst = d
		if mut != nil {
			mut(c)
		}
	}
}

// samplingModes cover every sampling mode of the rule: greedy, seeded with
// each filter, the penalties, logit_bias, and their mixes.
func samplingModes() []SamplingParams {
	seed := func(s int64) *int64 { return &s }
	return []SamplingParams{
		{},
		{TopK: 1, Temperature: 0.8, Seed: seed(3)},
		{Temperature: 1, Seed: seed(11)},
		{Temperature: 0.7, TopP: 0.9, Seed: seed(12)},
		{Temperature: 1.3, TopK: 40, Seed: seed(13)},
		{Temperature: 1.1, MinP: 0.05, Seed: seed(14)},
		{Temperature: 0.9, TopK: 50, TopP: 0.8, MinP: 0.02, Seed: seed(15)},
		{Temperature: 1, FrequencyPenalty: 0.7, PresencePenalty: -0.3, Seed: seed(16)},
		{Temperature: 1, RepetitionPenalty: 1.3, Seed: seed(17)},
		{RepetitionPenalty: 1.5, FrequencyPenalty: 1.2}, // greedy with penalties
		{LogitBias: map[int]float64{'e': 4, 'a': -100, ' ': 2.5}},
		{Temperature: 1.2, TopP: 0.95, LogitBias: map[int]float64{'x': 3, 'y': 3}, FrequencyPenalty: 0.5, Seed: seed(18)},
		{Temperature: 2, RepetitionPenalty: 0.8, PresencePenalty: 1, TopK: 100, LogitBias: map[int]float64{'q': 1.5}, Seed: seed(19)},
		{Temperature: 0.8}, // no seed: the engine's counter seeds it
	}
}

// runModes submits one request per mode at once (so batches mix them, and
// prompts are chunked beside decodes) and returns the results in mode order.
func runModes(t *testing.T, te *testEngine, modes []SamplingParams, lp bool, top int) []result {
	t.Helper()
	chs := make([]<-chan Event, len(modes))
	for i, p := range modes {
		p.MaxNewTokens, p.IgnoreEOS = 14+i%5, i%2 == 0
		ch, err := te.Submit(context.Background(), &Request{InputIDs: ids("sample the same here " + string(rune('a'+i))),
			Params: p, Logprobs: lp, TopLogprobs: top})
		if err != nil {
			t.Fatal(err)
		}
		chs[i] = ch
	}
	out := make([]result, len(modes))
	for i, ch := range chs {
		out[i] = collect(t, ch)
	}
	return out
}

func sameResults(t *testing.T, what string, got, want []result) {
	t.Helper()
	for i := range want {
		g, w := got[i], want[i]
		if !slices.Equal(g.tokens, w.tokens) || g.text != w.text || !slices.Equal(g.logprobs, w.logprobs) {
			t.Fatalf("%s, request %d: tokens %v %q logprobs %v\nhost path: %v %q %v", what, i, g.tokens, g.text, g.logprobs,
				w.tokens, w.text, w.logprobs)
		}
		for j := range w.tops {
			if !slices.Equal(g.tops[j], w.tops[j]) {
				t.Fatalf("%s, request %d token %d: top logprobs %v, host path %v", what, i, j, g.tops[j], w.tops[j])
			}
		}
		if *g.finish != *w.finish {
			t.Fatalf("%s, request %d: finish %+v, host path %+v", what, i, g.finish, w.finish)
		}
	}
}

// TestDeviceSamplingMatchesHost: every sampling mode, with and without
// logprobs and top logprobs, in mixed batches with chunked prompts, gives
// the same tokens, text, logprobs and finish through the device path as
// through the host path; every step sampled on the device, and every state
// was closed.
func TestDeviceSamplingMatchesHost(t *testing.T) {
	modes := samplingModes()
	for _, tc := range []struct {
		name string
		lp   bool
		top  int
	}{{"plain", false, 0}, {"logprobs", true, 0}, {"top logprobs", false, 4}, {"both", true, sampling.MaxTopLogprobs}} {
		t.Run(tc.name, func(t *testing.T) {
			small := func(c *Config) { c.ChunkedPrefillSize = 7; c.DefaultSeed = 99 }
			host := startEngine(t, 512, 4, func(c *Config) { small(c); c.HostSampling = true })
			var d *devFake
			dev := startEngine(t, 512, 4, withDevice(&d, small))
			want := runModes(t, host, modes, tc.lp, tc.top)
			got := runModes(t, dev, modes, tc.lp, tc.top)
			sameResults(t, "device path", got, want)
			// Seeded modes really sample: some differ from greedy.
			if slices.Equal(want[2].tokens, want[0].tokens) && slices.Equal(want[3].tokens, want[0].tokens) {
				t.Fatalf("seeded requests gave greedy's tokens %v", want[0].tokens)
			}
			open, made, devPasses, hostPasses, devTokens := d.counts()
			total := 0
			for _, r := range got {
				total += len(r.tokens)
			}
			if made != len(modes) || open != 0 || hostPasses != 0 || devPasses == 0 || devTokens != total {
				t.Fatalf("states made %d open %d; passes %d on the device, %d on the host; %d of %d tokens on the device",
					made, open, devPasses, hostPasses, devTokens, total)
			}
			if tc.lp || tc.top > 0 {
				for i, r := range got {
					if tc.top > 0 && len(r.tops[0]) != tc.top {
						t.Fatalf("request %d: %d top logprobs, want %d", i, len(r.tops[0]), tc.top)
					}
					if tc.lp && r.logprobs[0] >= 0 {
						t.Fatalf("request %d: logprob %v", i, r.logprobs[0])
					}
				}
			}
		})
	}
}

// TestDeviceSamplingFallback: requests whose device state is refused make
// their batches sample on the host; the others' device states are handed
// the host-sampled tokens, so every output still equals the host path's.
func TestDeviceSamplingFallback(t *testing.T) {
	modes := samplingModes()
	host := startEngine(t, 512, 4, func(c *Config) { c.ChunkedPrefillSize = 7; c.DefaultSeed = 99; c.HostSampling = true })
	var d *devFake
	dev := startEngine(t, 512, 4, withDevice(&d, func(c *Config) { c.ChunkedPrefillSize = 7; c.DefaultSeed = 99 }))
	// Refuse the logit_bias-only request: short-lived beside the others,
	// so batches go host while it runs and device after.
	d.refuse = func(p sampling.Params) bool { return len(p.LogitBias) == 3 && p.Temperature == 0 }
	want := runModes(t, host, modes, true, 2)
	got := runModes(t, dev, modes, true, 2)
	sameResults(t, "mixed paths", got, want)
	open, made, devPasses, hostPasses, _ := d.counts()
	if made != len(modes)-1 || open != 0 || devPasses == 0 || hostPasses == 0 {
		t.Fatalf("states made %d open %d; passes %d on the device, %d on the host", made, open, devPasses, hostPasses)
	}
	// Some device pass was handed tokens sampled on the host.
	handed := false
	for _, p := range d.passes {
		handed = handed || len(p.accept) > 0
	}
	if !handed {
		t.Fatal("no device pass was handed host-sampled tokens: the fallback was not exercised")
	}

	// No state at all: every pass on the host, same tokens.
	var d2 *devFake
	none := startEngine(t, 512, 4, withDevice(&d2, func(c *Config) { c.ChunkedPrefillSize = 7; c.DefaultSeed = 99 }))
	d2.outOfStates = true
	sameResults(t, "no device states", runModes(t, none, modes, true, 2), want)
	if _, made, devPasses, _, _ := d2.counts(); made != 0 || devPasses != 0 {
		t.Fatalf("states made %d, device passes %d", made, devPasses)
	}
}

// TestDeviceSamplingDisaggregated: a prefill-only request samples its first
// token at step 0 on the device; the decode side's state is handed that
// token before its first pass, which samples step 1; the output equals the
// colocated host path's, penalties and bias included.
func TestDeviceSamplingDisaggregated(t *testing.T) {
	seed := int64(4321)
	prompt := ids("disaggregated on the device")
	for _, tc := range []struct {
		name   string
		params SamplingParams
	}{
		{"greedy", SamplingParams{MaxNewTokens: 10}},
		{"seeded penalties", SamplingParams{MaxNewTokens: 10, Temperature: 1.3, TopP: 0.95, FrequencyPenalty: 1.5,
			PresencePenalty: 0.5, Seed: &seed}},
		{"repetition and bias", SamplingParams{MaxNewTokens: 10, Temperature: 0.9, TopK: 40, MinP: 0.02,
			RepetitionPenalty: 1.4, Seed: &seed, LogitBias: map[int]float64{'e': 2, 'o': -3}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			colo := startEngine(t, 64, 4, func(c *Config) { c.ChunkedPrefillSize = 4; c.HostSampling = true })
			var dp, dd *devFake
			pre := startEngine(t, 64, 4, withDevice(&dp, func(c *Config) { c.ChunkedPrefillSize = 4 }))
			dec := startEngine(t, 32, 4, withDevice(&dd, nil))
			want := colo.generate(t, &Request{InputIDs: prompt, Params: tc.params, Logprobs: true, TopLogprobs: 3})

			h := newRecHook()
			pre.generate(t, &Request{InputIDs: prompt, Params: tc.params, Logprobs: true, TopLogprobs: 3, Prefill: h, Room: 9})
			h.wait(t)
			if h.err != nil || h.first != want.tokens[0] || h.logprob != want.logprobs[0] || !slices.Equal(h.top, want.tops[0]) {
				t.Fatalf("prefill: first %d (%v %v) err %v; colocated %d (%v %v)", h.first, h.logprob, h.top, h.err,
					want.tokens[0], want.logprobs[0], want.tops[0])
			}
			if len(dp.passes) != 1 || dp.passes[0].step != 0 || len(dp.passes[0].accept) != 0 {
				t.Fatalf("prefill side sampled %+v, want one row at step 0", dp.passes)
			}
			dreq := &Request{InputIDs: prompt, Params: tc.params, Logprobs: true, TopLogprobs: 3, Room: 9}
			need, err := dec.KVPages(dreq)
			if err != nil {
				t.Fatal(err)
			}
			dtable, err := dec.pages.Take(need)
			if err != nil {
				t.Fatal(err)
			}
			dec.fake.preload(dtable.IDs(), i32(prompt))
			h.release()
			dreq.Preloaded = &Preloaded{Table: dtable, FirstToken: h.first, FirstLogprob: h.logprob, FirstTop: h.top}
			got := dec.generate(t, dreq)
			sameResults(t, "disaggregated", []result{got}, []result{want})
			dd.mu.Lock()
			passes := slices.Clone(dd.passes)
			dd.mu.Unlock()
			if len(passes) != len(want.tokens)-1 {
				t.Fatalf("decode side sampled %d rows, want %d", len(passes), len(want.tokens)-1)
			}
			for i, p := range passes {
				wantAccept := []int32(nil)
				if i == 0 {
					wantAccept = []int32{int32(h.first)}
				}
				if p.step != uint64(i+1) || !slices.Equal(p.accept, wantAccept) {
					t.Fatalf("decode pass %d: step %d accept %v, want step %d accept %v", i, p.step, p.accept, i+1, wantAccept)
				}
			}
			if open, _, _, hostPasses, _ := dd.counts(); open != 0 || hostPasses != 0 {
				t.Fatalf("decode side: %d states open, %d host passes", open, hostPasses)
			}
		})
	}
}

// TestDeviceSamplingStatesClosed: aborted requests and requests running at
// Close close their device states.
func TestDeviceSamplingStatesClosed(t *testing.T) {
	for _, how := range []string{"cancel", "close"} {
		t.Run(how, func(t *testing.T) {
			var d *devFake
			te := startEngine(t, 64, 4, withDevice(&d, nil))
			gate := make(chan struct{})
			te.fake.gate = gate // before Submit: the loop reads it after admission
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ch, err := te.Submit(ctx, &Request{InputIDs: ids("abort me"), Params: SamplingParams{MaxNewTokens: 200,
				IgnoreEOS: true, Temperature: 1, FrequencyPenalty: 1}})
			if err != nil {
				t.Fatal(err)
			}
			gate <- struct{}{} // the prefill pass
			<-ch               // its token: the state exists
			if how == "cancel" {
				cancel()
				close(gate)
			} else {
				go func() { te.Close(); close(gate) }()
			}
			if r := collect(t, ch); r.finish.Type != "abort" {
				t.Fatalf("finish %+v", r.finish)
			}
			waitFor(t, "the state to close", func() bool { open, made, _, _, _ := d.counts(); return open == 0 && made == 1 })
		})
	}
}
