package cuda

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// TestSampleParams: the parameter image a pass writes for its rows (GPU-free).
func TestSampleParams(t *testing.T) {
	const V = 1000
	st := []*samplerState{
		{p: sampling.Params{}, seed: 7},
		{p: sampling.Params{Temperature: 0.7, TopK: 1000, TopP: 1, MinP: 0.1}, seed: 1 << 40, slot: 0x10000, nbias: 2},
		{p: sampling.Params{Temperature: 2, TopK: 40, TopP: 0.9, FrequencyPenalty: 0.5, PresencePenalty: -1,
			RepetitionPenalty: 1.25}, seed: 9, slot: 0x20000},
		{p: sampling.Params{Temperature: 1, TopK: 1}, seed: 3},
	}
	j := &sampleJob{states: st}
	for i := range st {
		j.reqs = append(j.reqs, compute.Sample{State: st[i], Step: uint64(10 + i), Logprob: i == 2, TopLogprobs: 5 * i})
	}
	img := make([]byte, 6*sampleRowBytes)
	for i := range img {
		img[i] = 0xee // padding rows must come out zero
	}
	sampleParams(img, j, 6, V, 4096)
	row := func(r int) []byte { return img[r*sampleRowBytes : (r+1)*sampleRowBytes] }
	u64 := func(r, off int) uint64 { return binary.LittleEndian.Uint64(row(r)[off:]) }
	u32 := func(r, off int) uint32 { return binary.LittleEndian.Uint32(row(r)[off:]) }
	f64 := func(r, off int) float64 { return math.Float64frombits(u64(r, off)) }
	f32 := func(r, off int) float32 { return math.Float32frombits(u32(r, off)) }
	for _, c := range []struct {
		name      string
		got, want any
	}{
		{"greedy row flags", u32(0, 72), uint32(sfActive | sfGreedy)},
		{"greedy row seed", u64(0, 24), uint64(7)},
		{"no state: no words", u64(0, 0), uint64(0)},
		{"step", u64(1, 32), uint64(11)},
		{"top_k = V is off", u32(1, 76), uint32(0)},
		{"top_p 1 is off", f64(1, 40), 0.0},
		{"min_p", f64(1, 48), 0.1},
		{"words", u64(1, 0), uint64(0x10000)},
		{"bias ids", u64(1, 8), uint64(0x10000 + 4096)},
		{"bias values", u64(1, 16), uint64(0x10000 + 4096 + sampling.MaxLogitBias*4)},
		{"n_bias", u32(1, 84), uint32(2)},
		{"inv_t", f32(1, 88), float32(1 / 0.7)},
		{"penalties flags", u32(2, 72), uint32(sfActive | sfLogprob | sfPen | sfRep)},
		{"top_k", u32(2, 76), uint32(40)},
		{"top_p", f64(2, 40), 0.9},
		{"frequency", f64(2, 56), 0.5},
		{"presence", f64(2, 64), -1.0},
		{"repetition", f32(2, 92), float32(1.25)},
		{"top logprobs", u32(2, 80), uint32(10)},
		{"top_k 1 is greedy", u32(3, 72), uint32(sfActive | sfGreedy)},
		{"padding row", u32(4, 72), uint32(0)},
		{"padding row words", u64(5, 0), uint64(0)},
	} {
		if c.got != c.want {
			t.Errorf("%s: %v, want %v", c.name, c.got, c.want)
		}
	}
}

// sampleBackend is a small random model with vocabulary V on the GPU.
func sampleBackend(t *testing.T, V int, o Options) *Backend {
	t.Helper()
	c, err := model.RandomConfig("tiny")
	if err != nil {
		t.Fatal(err)
	}
	c.Vocab, c.BOS, c.EOS = V, 1, []int{2}
	o.RandomWeights, o.Seed = true, 3
	if o.DType == "" {
		o.DType = "float32"
	}
	if o.Pages == 0 {
		o.Pages = 256
	}
	if o.PageSize == 0 {
		o.PageSize = 16
	}
	b := newOrSkip(t, &model.Model{Config: c, Random: true}, o)
	if b.smp.err != nil {
		t.Fatalf("device sampling off: %v", b.smp.err)
	}
	return b
}

// sampleRows runs the sampling kernels alone over host logits (rows of
// the backend's vocabulary), for samp's states.
func (b *Backend) sampleRows(logits [][]float32, samp []compute.Sample) ([]compute.Sampled, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return nil, err
	}
	V, rows := b.cfg.Vocab, len(logits)
	seqs := make([]compute.Seq, rows)
	for i := range seqs {
		seqs[i] = compute.Seq{Logits: true}
	}
	j, err := b.newSampleJob(seqs, samp)
	if err != nil {
		return nil, err
	}
	sb, err := b.eagerSampleBufs(rows)
	if err != nil {
		return nil, err
	}
	flat := make([]float32, 0, rows*V)
	for _, l := range logits {
		flat = append(flat, l...)
	}
	d, err := b.cx.MemAlloc(uint64(len(flat)) * 4)
	if err != nil {
		return nil, err
	}
	defer b.cx.MemFree(d)
	if err := b.cx.MemcpyHtoD(d, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(flat))), len(flat)*4)); err != nil {
		return nil, err
	}
	if err := b.samplePrep(j, sb, rows); err != nil {
		return nil, err
	}
	if err := b.sampleLaunch(sb, d, rows); err != nil {
		return nil, err
	}
	if err := b.sampleCopyOut(sb, j, rows); err != nil {
		return nil, err
	}
	if err := b.stream.Synchronize(); err != nil {
		return nil, err
	}
	res := make([]compute.Sampled, rows)
	return res, j.results(b.smp.hostOut[j.slot].Bytes(), V, res)
}

// TestSampleMatchesCPU: for random logits with many ties (and smooth
// ones), every sampling mode, several seeds and three steps (with tokens
// handed in before each, and the kernels counting their own), batches of 1
// to 256 rows, vocabularies 32000 and 128256: the GPU picks the CPU
// sampler's token, its logprobs are the CPU's within float32 rounding and
// its top ids equal.
func TestSampleMatchesCPU(t *testing.T) {
	for _, V := range []int{32000, 128256} {
		t.Run(fmt.Sprint("V", V), func(t *testing.T) {
			b := sampleBackend(t, V, Options{DisableCUDAGraph: true})
			rng := rand.New(rand.NewPCG(uint64(V), 1))
			modes := sampleModes(V)
			offset := 0
			for _, bs := range []int{1, 3, 64, 256} {
				if V > 100000 && bs == 3 {
					continue
				}
				states := make([]compute.SamplerState, bs)
				cpus := make([]*sampling.Sampler, bs)
				ps := make([]sampling.Params, bs)
				lp, top := make([]bool, bs), make([]int, bs)
				for r := range bs {
					p := modes[(offset+r)%len(modes)]
					seed := rng.Uint64()
					prompt := randPrompt(rng, 1+rng.IntN(40), V)
					st, err := b.NewSamplerState(p, seed, prompt)
					if err != nil {
						t.Fatal(err)
					}
					states[r], ps[r] = st, p
					cpus[r] = sampling.New(p, seed)
					cpus[r].SetPrompt(prompt)
					lp[r], top[r] = r%4 == 1, []int{0, 0, 5, 20}[r%4]
				}
				offset += bs
				for step := range 3 {
					logits := make([][]float32, bs)
					samp := make([]compute.Sample, bs)
					for r := range bs {
						logits[r] = tiedLogits(rng, V)
						if r%3 == 2 {
							logits[r] = smoothLogits(rng, V)
						}
						var acc []int32
						for range []int{2, 0, 1}[step] {
							acc = append(acc, int32(rng.IntN(V)))
						}
						samp[r] = compute.Sample{State: states[r], Step: uint64(step), Accept: acc, Logprob: lp[r], TopLogprobs: top[r]}
					}
					got, err := b.sampleRows(logits, samp)
					if err != nil {
						t.Fatal(err)
					}
					for r := range bs {
						for _, a := range samp[r].Accept {
							cpus[r].Accept(int(a))
						}
						want := cpus[r].Sample(uint64(step), logits[r])
						cpus[r].Accept(want)
						checkSampled(t, fmt.Sprintf("bs %d row %d step %d %+v", bs, r, step, ps[r]), got[r], want, logits[r], lp[r], top[r])
					}
				}
				for _, st := range states {
					if err := st.Close(); err != nil {
						t.Fatal(err)
					}
				}
			}
			if n := b.SamplerStates(); n != 0 {
				t.Fatalf("%d sampler states open after closing all", n)
			}
		})
	}
}

// ruleExp is sampling's weight (unexported there), for the kernel check.
func ruleExp(d float32) float32 {
	if !(d >= -86) {
		return 0
	}
	log2e, ln2Hi, ln2Lo, shifter := float32(math.Log2E), float32(0x1.62e4p-1), float32(math.Ln2-0x1.62e4p-1), float32(0x1.8p23)
	k := float32(float32(d*log2e)+shifter) - shifter
	r := float32(d-float32(k*ln2Hi)) - float32(k*ln2Lo)
	q := float32(1.0 / 5040)
	for _, c := range []float32{1.0 / 720, 1.0 / 120, 1.0 / 24, 1.0 / 6, 1.0 / 2, 1, 1} {
		q = float32(q*r) + c
	}
	return q * math.Float32frombits(uint32(int32(k)+127)<<23)
}

// TestSamplePhiloxExp: the kernels' Philox uniform equals sampling.Uniform
// and their E equals the rule's bit for bit (sampling's pinned bits too).
func TestSamplePhiloxExp(t *testing.T) {
	b := sampleBackend(t, 320, Options{DisableCUDAGraph: true})
	rng := rand.New(rand.NewPCG(4, 4))
	const n = 1 << 14
	seeds, steps := make([]uint64, n), make([]uint64, n)
	ds := make([]float32, n)
	for i := range seeds {
		seeds[i], steps[i] = rng.Uint64(), uint64(rng.IntN(1<<20))
		if i%7 == 0 {
			steps[i] = rng.Uint64()
		}
		ds[i] = -rng.Float32() * 90
		if i%2 == 0 {
			ds[i] = -rng.Float32() * 2
		}
	}
	copy(ds, []float32{0, -0.5, -1, -2.75, -10, -85.9, -1e-7, -86, -86.0001, float32(math.Inf(-1)), float32(math.NaN())})
	u := make([]float64, n)
	e := make([]float32, n)
	err := b.withGPU(func() error {
		bytes := func(p unsafe.Pointer, n int) []byte { return unsafe.Slice((*byte)(p), n) }
		dev := make([]cu.DevicePtr, 5)
		for i, sz := range []int{8 * n, 8 * n, 8 * n, 4 * n, 4 * n} {
			p, err := b.cx.MemAlloc(uint64(sz))
			if err != nil {
				return err
			}
			defer b.cx.MemFree(p)
			dev[i] = p
		}
		for _, c := range []struct {
			p   cu.DevicePtr
			src []byte
		}{{dev[1], bytes(unsafe.Pointer(&seeds[0]), 8*n)}, {dev[2], bytes(unsafe.Pointer(&steps[0]), 8*n)},
			{dev[3], bytes(unsafe.Pointer(&ds[0]), 4*n)}} {
			if err := b.cx.MemcpyHtoD(c.p, c.src); err != nil {
				return err
			}
		}
		if err := b.stream.Launch(b.smp.fns.philox, cu.D1(n/256), cu.D1(256), 0, dev[0], dev[1], dev[2], int32(n)); err != nil {
			return err
		}
		if err := b.stream.Launch(b.smp.fns.exp, cu.D1(n/256), cu.D1(256), 0, dev[4], dev[3], int32(n)); err != nil {
			return err
		}
		if err := b.stream.Synchronize(); err != nil {
			return err
		}
		if err := b.cx.MemcpyDtoH(bytes(unsafe.Pointer(&u[0]), 8*n), dev[0]); err != nil {
			return err
		}
		return b.cx.MemcpyDtoH(bytes(unsafe.Pointer(&e[0]), 4*n), dev[4])
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if want := sampling.Uniform(seeds[i], steps[i]); math.Float64bits(u[i]) != math.Float64bits(want) {
			t.Fatalf("Uniform(%#x, %d): GPU %v, CPU %v", seeds[i], steps[i], u[i], want)
		}
		if want := ruleExp(ds[i]); math.Float32bits(e[i]) != math.Float32bits(want) {
			t.Fatalf("E(%v): GPU %#08x, CPU %#08x", ds[i], math.Float32bits(e[i]), math.Float32bits(want))
		}
	}
	for _, c := range []struct {
		d    float32
		bits uint32
	}{{-0.5, 0x3f1b4598}, {-1, 0x3ebc5ab2}, {-2.75, 0x3d82ec9c}, {-10, 0x383e6bce}, {-85.9, 0x018698a0}, {-1e-7, 0x3f7ffffe}} {
		i := slices.Index(ds, c.d)
		if i < 0 || math.Float32bits(e[i]) != c.bits {
			t.Fatalf("E(%v) on the GPU is not sampling's pinned %#08x", c.d, c.bits)
		}
	}
}

// withGPU runs f with the backend's context current on a locked thread.
func (b *Backend) withGPU(f func() error) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return err
	}
	return f()
}

// TestForwardSampleMatchesHost runs the same requests twice on one backend
// (each copy on its own pages): one copy through ForwardSample (the prefill
// eager, the decode steps replaying sampling graphs, one step sampled on
// the host and handed back through Accept), the other through Forward and
// the CPU sampler. Every token must be equal, the logprobs within float32
// rounding; the states close.
func TestForwardSampleMatchesHost(t *testing.T) {
	const V, ps = 32000, 16
	b := sampleBackend(t, V, Options{PageSize: ps, Pages: 512, BatchInvariant: true})
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(8, 8))
	seed := func() uint64 { return rng.Uint64() }
	params := []sampling.Params{
		{},
		{Temperature: 0.8, TopP: 0.9},
		{Temperature: 1.2, TopK: 40, MinP: 0.02, FrequencyPenalty: 0.8, PresencePenalty: 0.4},
		{Temperature: 1, RepetitionPenalty: 1.3, LogitBias: map[int]float64{5: 4, 6: -100, 70: 2}},
		{RepetitionPenalty: 1.5, LogitBias: map[int]float64{9: 3}},
		{Temperature: 0.6, TopK: 3000, TopP: 0.97},
	}
	n := len(params)
	const per = 8 // pages per seq
	prompts := make([][]int32, n)
	dev, host := make([]compute.SamplerState, n), make([]*sampling.Sampler, n)
	hostA := make([]*sampling.Sampler, n) // the device copy's host sampler, for its host step
	seeds := make([]uint64, n)
	for i, p := range params {
		prompts[i] = randPrompt(rng, 5+7*i, V)
		seeds[i] = seed()
		st, err := b.NewSamplerState(p, seeds[i], prompts[i])
		if err != nil {
			t.Fatal(err)
		}
		dev[i] = st
		host[i], hostA[i] = sampling.New(p, seeds[i]), sampling.New(p, seeds[i])
		host[i].SetPrompt(prompts[i])
		hostA[i].SetPrompt(prompts[i])
	}
	seqsA, seqsB := make([]compute.Seq, n), make([]compute.Seq, n)
	for i := range n {
		seqsA[i] = compute.Seq{Tokens: prompts[i], Pages: pagesFor(i, per), Logits: true}
		seqsB[i] = compute.Seq{Tokens: prompts[i], Pages: pagesFor(n+i, per), Logits: true}
	}
	out := make([][]float32, n)
	for i := range out {
		out[i] = make([]float32, V)
	}
	res := make([]compute.Sampled, n)
	pending := make([][]int32, n)
	const hostStep = 6
	for step := range 20 {
		samp := make([]compute.Sample, n)
		for i := range n {
			samp[i] = compute.Sample{State: dev[i], Step: uint64(step), Accept: pending[i], Logprob: i%2 == 0, TopLogprobs: []int{0, 4}[i%2]}
		}
		var tokA []int
		if step == hostStep {
			if err := b.Forward(ctx, seqsA, out); err != nil {
				t.Fatal(err)
			}
			for i := range n {
				tok := hostA[i].Sample(uint64(step), out[i])
				tokA = append(tokA, tok)
				pending[i] = []int32{int32(tok)}
			}
		} else {
			if err := b.ForwardSample(ctx, seqsA, samp, res); err != nil {
				t.Fatal(err)
			}
			for i := range n {
				tokA = append(tokA, res[i].Token)
				pending[i] = nil
			}
		}
		if err := b.Forward(ctx, seqsB, out); err != nil {
			t.Fatal(err)
		}
		for i := range n {
			want := host[i].Sample(uint64(step), out[i])
			host[i].Accept(want)
			hostA[i].Accept(tokA[i])
			if step != hostStep {
				checkSampled(t, fmt.Sprintf("step %d seq %d %+v", step, i, params[i]), res[i], want, out[i], samp[i].Logprob, samp[i].TopLogprobs)
			} else if tokA[i] != want {
				t.Fatalf("host step %d seq %d: %d vs %d", step, i, tokA[i], want)
			}
			pos := seqsA[i].Pos + len(seqsA[i].Tokens)
			seqsA[i] = compute.Seq{Tokens: []int32{int32(tokA[i])}, Pos: pos, Pages: seqsA[i].Pages, Logits: true}
			seqsB[i] = compute.Seq{Tokens: []int32{int32(want)}, Pos: pos, Pages: seqsB[i].Pages, Logits: true}
		}
	}
	gs := b.GraphStats()
	if gs.Replays == 0 || gs.Captures < 2 {
		t.Fatalf("decode steps did not replay graphs (sampling and logits ones): %+v", gs)
	}
	for _, st := range dev {
		if err := st.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if err := dev[0].Close(); err == nil {
		t.Fatal("a second Close succeeded")
	}
	if n := b.SamplerStates(); n != 0 {
		t.Fatalf("%d states open", n)
	}
	t.Logf("graphs %+v", gs)
}
