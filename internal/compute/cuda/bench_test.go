package cuda

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// readBandwidth measures HBM read bandwidth (bytes/s) with the read_bw
// kernel over a buffer of n bytes (random contents), median of reps.
func (b *Backend) readBandwidth(n uint64, reps int) (float64, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	p, err := b.cx.MemAlloc(n)
	if err != nil {
		return 0, err
	}
	defer b.cx.MemFree(p)
	sink, err := b.cx.MemAlloc(256)
	if err != nil {
		return 0, err
	}
	defer b.cx.MemFree(sink)
	if err := b.fill(b.fn.fillF, p, n/4, 99, 1, 0); err != nil {
		return 0, err
	}
	st := b.stream
	e0, _ := b.cx.NewEvent(cu.EventDefault)
	e1, _ := b.cx.NewEvent(cu.EventDefault)
	defer e0.Destroy()
	defer e1.Destroy()
	sms, _ := b.cx.MultiprocessorCount()
	var ts []float64
	for i := 0; i < reps+1; i++ {
		e0.Record(st)
		if err := st.Launch(b.fn.readBW, cu.D1(uint32(sms*8)), cu.D1(512), 0, p, int64(n/16), sink); err != nil {
			return 0, err
		}
		e1.Record(st)
		if err := e1.Synchronize(); err != nil {
			return 0, err
		}
		ms, err := cu.ElapsedMs(e0, e1)
		if err != nil {
			return 0, err
		}
		if i > 0 {
			ts = append(ts, float64(ms))
		}
	}
	slices.Sort(ts)
	return float64(n) / (ts[len(ts)/2] / 1e3), nil
}

func median(f func() error, warm, reps int) (time.Duration, error) {
	for i := 0; i < warm; i++ {
		if err := f(); err != nil {
			return 0, err
		}
	}
	var ds []time.Duration
	for i := 0; i < reps; i++ {
		t0 := time.Now()
		if err := f(); err != nil {
			return 0, err
		}
		ds = append(ds, time.Since(t0))
	}
	slices.Sort(ds)
	return ds[len(ds)/2], nil
}

// TestBench8B times the llama3-8b shape (random bf16 weights made on the
// GPU): prefill of 1K/4K/8K tokens, decode steps at batch 1 and 32 with 1K
// of context, against the floor of reading weights + KV once at the HBM read
// bandwidth measured here. Runs only with MOONCAKE_BENCH=1.
func TestBench8B(t *testing.T) {
	if os.Getenv("MOONCAKE_BENCH") == "" {
		t.Skip("set MOONCAKE_BENCH=1 to run the 8B-shape benchmark")
	}
	shape := cmp.Or(os.Getenv("MOONCAKE_BENCH_SHAPE"), "llama3-8b")
	cfg, err := model.RandomConfig(shape)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, v := range []struct {
		name string
		tu   tuning
	}{
		{"v2", tuning{}},
		{"v2-fa2", tuning{flashV2: true}},
		{"v2-p3", tuning{flashV3: true}},
		{"v2-cublas-decode", tuning{gemvMax: -1}},
		{"v1", tuning{noV2: true, split: 256}},
	} {
		if only := os.Getenv("MOONCAKE_BENCH_VARIANTS"); only != "" && !slices.Contains(strings.Split(only, ","), v.name) {
			continue
		}
		t.Run(v.name, func(t *testing.T) {
			lines = append(lines, "shape "+shape)
			lines = append(lines, "variant "+v.name+fmt.Sprintf(" %+v", v.tu))
			lines = append(lines, bench8B(t, cfg, v.tu)...)
		})
	}
	if d := os.Getenv("BENCH_OUT"); d != "" {
		f, err := os.Create(d)
		if err == nil {
			for _, l := range lines {
				fmt.Fprintln(f, l)
			}
			f.Close()
		}
	}
}

func bench8B(t *testing.T, cfg model.Config, tu tuning) []string {
	const ps, batch = 64, 32
	pagesPer := (8192+64)/ps + 1
	t0 := time.Now()
	b := newOrSkip(t, &model.Model{Config: cfg, Random: true}, Options{PageSize: ps, Pages: batch * pagesPer, RandomWeights: true, Seed: 1, tune: tu})
	defer b.Close()
	t.Logf("loaded (random bf16 weights on the GPU, %.2f GB; KV pool %.2f GB) in %v; flash prefill %v",
		float64(b.WeightBytes())/1e9, float64(b.KVSize())/1e9, time.Since(t0), b.flash)
	return benchOn(t, b, cfg)
}

// benchOn times prefill 1K/4K/8K and decode steps at batch 1 and 32 (ctx
// 1K) on b, whose pool must hold 32 sequences of 130 pages of 64.
func benchOn(t *testing.T, b *Backend, cfg model.Config) []string {
	const ps, batch, ctxLen = 64, 32, 1024
	pagesPer := (8192+64)/ps + 1
	if b.fn.v2Err != nil {
		t.Logf("second-generation kernels not used: %v", b.fn.v2Err)
	}
	t.Logf("kernels: flash2 %v (%d warps), decode2 %v, decode %v, gemv<=%d %v, fused %v", b.fn.attnFlash2 != nil, b.fn.flash2Threads/32,
		b.fn.attnDecode2 != nil, b.fn.attnDecode != nil, b.fn.gemvMax, b.fn.gemvF32 != nil, b.fn.g2QKV != nil)
	for _, f := range []*cu.Function{b.fn.attnFlash, b.fn.attnFlash2, b.fn.attnSplit, b.fn.attnDecode, b.fn.attnDecode2,
		b.fn.gemvF32, b.fn.g2QKV, b.fn.g2SiLU, b.fn.ropeKV, b.fn.gemmF32} {
		if f == nil {
			continue
		}
		regs, _ := f.Attribute(cu.FuncAttrNumRegs)
		local, _ := f.Attribute(cu.FuncAttrLocalSizeBytes)
		shared, _ := f.Attribute(cu.FuncAttrSharedSizeBytes)
		t.Logf("kernel %s: %d registers, %d bytes local (spills), %d bytes shared", f.Name, regs, local, shared)
	}
	own, err := b.readBandwidth(4<<30, 10)
	if err != nil {
		t.Fatal(err)
	}
	// The floor is the machine's: the best read bandwidth any backend of
	// this process measured (a later backend measured 12% less in some
	// calls, 2026-12-02, with its steps as fast).
	bestBW = max(bestBW, own)
	bw := bestBW
	ctx := context.Background()
	V := cfg.Vocab
	r := rand.New(rand.NewPCG(1, 1))
	out := make([][]float32, batch)
	for i := range out {
		out[i] = make([]float32, V)
	}
	var lines []string
	add := func(f string, a ...any) {
		s := fmt.Sprintf(f, a...)
		lines = append(lines, s)
		t.Log(s)
	}
	add("HBM read bandwidth: %.0f GB/s (4 GiB, median of 10)", bw/1e9)
	// FLOPs a token costs outside attention: the projections and the MLP
	// it runs (of an MoE layer: the router, its k experts, the shared one).
	nonEmbed := 0.0
	for i := range cfg.Layers {
		mlp := 3 * cfg.Dim * cfg.HiddenDim
		if cfg.MoELayer(i) {
			mlp = cfg.Dim*cfg.Experts + cfg.TopK*3*cfg.Dim*cfg.ExpertDim + 3*cfg.Dim*cfg.SharedExpertDim
		}
		nonEmbed += 2 * float64(cfg.Dim*(cfg.Heads*cfg.HeadDim+2*cfg.KVHeads*cfg.HeadDim)+cfg.Heads*cfg.HeadDim*cfg.Dim+mlp)
	}
	peer := ""
	if cfg.Experts == 0 && cfg.Dim == 4096 && cfg.Layers == 32 {
		peer = "; PyTorch peer 31/125/262 ms at 1K/4K/8K"
	}
	for _, L := range []int{1024, 4096, 8192} {
		seq := []compute.Seq{{Tokens: randPrompt(r, L, V), Pos: 0, Pages: pagesFor(0, pagesPer), Logits: true}}
		d, err := median(func() error { return b.Forward(ctx, seq, out[:1]) }, 1, 3)
		if err != nil {
			t.Fatal(err)
		}
		attn := 4 * float64(L) * float64(L) / 2 * float64(cfg.HeadDim*cfg.Heads*cfg.Layers)
		fl := nonEmbed*float64(L) + attn
		add("prefill %5d tokens: %8.2f ms  (%.0f TFLOP/s counted%s)", L, ms(d), fl/d.Seconds()/1e12, peer)
	}
	kvTok := float64(cfg.Layers * 2 * cfg.KVHeads * cfg.HeadDim * 2)
	for i := 0; i < batch; i++ {
		seq := []compute.Seq{{Tokens: randPrompt(r, ctxLen, V), Pos: 0, Pages: pagesFor(i, pagesPer)}}
		if err := b.Forward(ctx, seq, nil); err != nil {
			t.Fatal(err)
		}
	}
	for _, bs := range []int{1, batch} {
		seqs := make([]compute.Seq, bs)
		for i := range seqs {
			seqs[i] = compute.Seq{Tokens: []int32{int32(r.IntN(V))}, Pos: ctxLen, Pages: pagesFor(i, pagesPer), Logits: true}
		}
		full, err := median(func() error { return b.Forward(ctx, seqs, out[:bs]) }, 3, 20)
		if err != nil {
			t.Fatal(err)
		}
		dev, err := median(func() error { return b.forwardOpt(ctx, seqs, out[:bs], false) }, 3, 20)
		if err != nil {
			t.Fatal(err)
		}
		wb := stepWeightBytes(cfg, b.WeightBytes(), b.eb, bs)
		floorAll := (wb + float64(bs)*float64(ctxLen+1)*kvTok) / bw
		floorNoEmb := (wb - float64(cfg.Vocab*cfg.Dim*2) + float64(bs)*float64(ctxLen+1)*kvTok) / bw
		add("decode batch %2d ctx %d: %6.2f ms/step with logits to host, %6.2f ms without; floor %.2f ms (weights read %.2f GB + KV %.2f GB; %.2f ms without the embedding table) -> %.2fx / %.2fx of floor",
			bs, ctxLen, ms(full), ms(dev), floorAll*1e3, wb/1e9, float64(bs)*float64(ctxLen+1)*kvTok/1e9,
			floorNoEmb*1e3, full.Seconds()/floorAll, dev.Seconds()/floorAll)
	}
	return lines
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1e3 }

// TestBenchGraph8B times decode steps of the llama3-8b shape (random bf16
// weights and KV made on the GPU) with and without CUDA graphs: batch 1,
// 32 and 128 at 1K of context and batch 8 at 8K, against the floor (weights
// + KV read once at the HBM read bandwidth measured in the same run), with
// the GPU time per step and the GPU idle gap between consecutive steps
// (events on the stream). Step times are host wall times of Forward, the
// logits copied to the host or not. Kernel sets, one backend each: the new
// (fused decode GEMVs to 4 tokens, gemm_sk to 32, attn_decode2), the same
// with programmatic dependent launch, and the old (separate rmsnorm, gemv,
// rope_kv, silu_mul; cuBLAS; attn_decode). The sampling columns (new kernels
// only): temperature 0.7, top_k 50, top_p 0.9 sampled on the host (Forward,
// then the Go sampler over the rows one after the other, as the engine does)
// or on the GPU (ForwardSample, replaying sampling graphs), and greedy on the
// GPU, with the gap between steps. Runs only with MOONCAKE_BENCH=1;
// BENCH_OUT=file receives the table; MOONCAKE_BENCH_VARIANTS picks kernel
// sets and MOONCAKE_BENCH_RUNS runs ("1x1024,8x8192").
func TestBenchGraph8B(t *testing.T) {
	if os.Getenv("MOONCAKE_BENCH") == "" {
		t.Skip("set MOONCAKE_BENCH=1 to run the 8B-shape benchmark")
	}
	shape := cmp.Or(os.Getenv("MOONCAKE_BENCH_SHAPE"), "llama3-8b")
	cfg, err := model.RandomConfig(shape)
	if err != nil {
		t.Fatal(err)
	}
	floorIs := "weights + KV"
	if cfg.Experts > 0 {
		floorIs = "the weights a step reads (attention, router, the experts its tokens choose: all k at batch 1, E(1-(1-k/E)^b) expected at batch b under uniform routing) + KV"
	}
	lines := []string{shape + " bf16, random weights and KV; floor = " + floorIs + " read once at the HBM read bandwidth of the same backend",
		"| kernels | batch | ctx | floor ms | eager ms (x floor) | graph ms (x floor) | graph, no logits copy ms (x floor) | GPU busy ms/step (graph) | gap us mean / max (graph) | gap us, no logits copy | host sampling ms (gap us) | GPU sampling ms (x floor, gap us) | GPU greedy ms (gap us) | GPU greedy, queued ms (x floor, gap us mean / max) |",
		"| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"}
	for _, v := range []struct {
		name string
		tu   tuning
	}{{"new", tuning{}}, {"new-notc", tuning{noTC: true}}, {"new-tcnarrow", tuning{tcNarrow: true}}, {"new+pdl", tuning{pdl: true}}, {"new+skinny+merge", tuning{skinnyMax: skMaxN, fuseCombine: true}},
		{"new-nofused", tuning{noFused: true}}, {"new+wg", tuning{wg: true}}, {"new-nomoeadd", tuning{noMoEAdd: true}}, {"new+routesilu", tuning{routeSiLU: true}}, {"new+combwo", tuning{combWo: true}},
		{"new+routesilu+combwo", tuning{routeSiLU: true, combWo: true}}, {"new+qkn", tuning{qknFold: true}},
		{"new+all3", tuning{routeSiLU: true, combWo: true, qknFold: true}},
		{"new+g2ks2", tuning{g2Split: 2}}, {"new+g2ks8", tuning{g2Split: 8}},
		{"new-da4pre", tuning{blocksDefs: "-DDA_P=8 -DDA_PRE=0"}}, {"new-silu1", tuning{blocksDefs: "-DS1_OFF=1"}},
		{"new+s1ch8", tuning{blocksDefs: "-DS1_CH=8"}}, {"new+s1b4", tuning{blocksDefs: "-DS1_MINB=4"}},
		{"new+s1ch2", tuning{blocksDefs: "-DS1_CH=2"}}, {"new+s1ch2b6", tuning{blocksDefs: "-DS1_CH=2 -DS1_MINB=6"}},
		{"old", tuning{noFused: true, decodeV1: true}}} {
		if only := os.Getenv("MOONCAKE_BENCH_VARIANTS"); only != "" && !slices.Contains(strings.Split(only, ","), v.name) {
			continue
		}
		t.Run(v.name, func(t *testing.T) { lines = append(lines, benchGraph(t, cfg, v.name, v.tu, v.name == "new")...) })
	}
	for _, l := range lines {
		t.Log(l)
	}
	if d := os.Getenv("BENCH_OUT"); d != "" {
		if err := os.WriteFile(d, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
			t.Error(err)
		}
	}
}

// bestBW is the best HBM read bandwidth a benchGraph backend measured.
var bestBW float64

func benchGraph(t *testing.T, cfg model.Config, name string, tu tuning, withSampling bool) []string {
	const ps = 64
	runs := []struct{ bs, ctx int }{{1, 1024}, {32, 1024}, {64, 1024}, {128, 1024}, {8, 8192}}
	if only := os.Getenv("MOONCAKE_BENCH_RUNS"); only != "" { // e.g. "1x1024,8x8192"
		runs = slices.DeleteFunc(runs, func(r struct{ bs, ctx int }) bool {
			return !slices.Contains(strings.Split(only, ","), fmt.Sprintf("%dx%d", r.bs, r.ctx))
		})
	}
	per1K, per8K := ceilDiv(1024+1, ps), ceilDiv(8192+1, ps)
	pages := 128*per1K + 8*per8K
	t0 := time.Now()
	b := newOrSkip(t, &model.Model{Config: cfg, Random: true}, Options{PageSize: ps, Pages: pages, RandomWeights: true,
		Seed: 1, TimeSteps: true, CUDAGraphMaxBS: 128, tune: tu})
	defer b.Close()
	if err := b.fill(b.fn.fillT, b.kvBase, uint64(b.layout.TotalBytes())/uint64(b.eb), 7, 1, 0); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: loaded in %v: weights %.2f GB, KV pool %.2f GB (random), graph buffers %.1f MiB, buckets %v; fused %v, skinny %v, decode2 %v, tc %v, decode %v, pdl %v",
		name, time.Since(t0), float64(b.WeightBytes())/1e9, float64(b.KVSize())/1e9, float64(b.graphs.sizes.total())/(1<<20),
		b.graphs.buckets, b.fn.g2QKV != nil, b.fn.skPlain != nil, b.fn.attnDecode2 != nil, b.fn.attnTC != nil, b.fn.attnDecode != nil, b.fn.pdl)
	if tu.pdl && !b.fn.pdl {
		t.Errorf("%s: programmatic dependent launch not available", name)
	}
	own, err := b.readBandwidth(4<<30, 10)
	if err != nil {
		t.Fatal(err)
	}
	// The floor is the machine's: the best read bandwidth any backend of
	// this process measured (a later backend measured 12% less in some
	// calls, 2026-12-02, with its steps as fast).
	bestBW = max(bestBW, own)
	bw := bestBW
	ctx := context.Background()
	V := cfg.Vocab
	r := rand.New(rand.NewPCG(2, 2))
	out := make([][]float32, 128)
	for i := range out {
		out[i] = make([]float32, V)
	}
	kvTok := float64(cfg.Layers * 2 * cfg.KVHeads * cfg.HeadDim * 2)
	lines := []string{fmt.Sprintf("%s: HBM read bandwidth %.0f GB/s (4 GiB, median of 10; floors at the best of the run, %.0f GB/s)",
		name, own/1e9, bw/1e9)}
	for _, c := range runs {
		seqs := make([]compute.Seq, c.bs)
		for i := range seqs {
			pg := pagesFor(i, per1K)
			if c.ctx > 1024 {
				pg = make([]int32, per8K)
				for j := range pg {
					pg[j] = int32(128*per1K + i*per8K + j)
				}
			}
			seqs[i] = compute.Seq{Tokens: []int32{int32(r.IntN(V))}, Pos: c.ctx, Pages: pg, Logits: true}
		}
		step := func(copyLogits bool) func() error {
			return func() error { return b.forwardOpt(ctx, seqs, out[:c.bs], copyLogits) }
		}
		b.setGraphMode(graphsOff)
		eager, err := median(step(true), 3, 20)
		if err != nil {
			t.Fatal(err)
		}
		b.setGraphMode(graphsOn)
		if _, err := median(step(true), 3, 1); err != nil { // capture
			t.Fatal(err)
		}
		b.ResetStepTimes()
		graph, err := median(step(true), 0, 20)
		if err != nil {
			t.Fatal(err)
		}
		st := b.StepTimes()
		b.ResetStepTimes()
		dev, err := median(step(false), 0, 20)
		if err != nil {
			t.Fatal(err)
		}
		st2 := b.StepTimes()
		floor := (stepWeightBytes(cfg, b.WeightBytes(), b.eb, c.bs) + float64(c.bs)*float64(c.ctx+1)*kvTok) / bw
		x := func(d time.Duration) float64 { return d.Seconds() / floor }
		us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
		samp := " - | - | - | - |"
		if withSampling {
			hostS, stH, devS, stS, devG, stG, q, stQ := benchSampling(t, b, seqs, out[:c.bs])
			samp = fmt.Sprintf(" %.2f (%.1f) | %.2f (%.2fx, %.1f) | %.2f (%.1f) | %.2f (%.2fx, %.1f / %.1f) |",
				ms(hostS), us(stH.GapMean()), ms(devS), x(devS), us(stS.GapMean()), ms(devG), us(stG.GapMean()),
				ms(q), x(q), us(stQ.GapMean()), us(stQ.GapMax))
		}
		l := fmt.Sprintf("| %s | %d | %d | %.2f | %.2f (%.2fx) | %.2f (%.2fx) | %.2f (%.2fx) | %.2f | %.1f / %.1f | %.1f / %.1f |",
			name, c.bs, c.ctx, floor*1e3, ms(eager), x(eager), ms(graph), x(graph), ms(dev), x(dev),
			ms(st.Busy)/float64(max(st.Passes, 1)), us(st.GapMean()), us(st.GapMax), us(st2.GapMean()), us(st2.GapMax)) + samp
		lines = append(lines, l)
		t.Log(l)
	}
	gs := b.GraphStats()
	lines = append(lines, fmt.Sprintf("%s graphs: %+v", name, gs))
	if gs.Replays < 40*len(runs) {
		t.Errorf("decode steps did not replay graphs: %+v", gs)
	}
	return lines
}

// benchSampling times decode steps of seqs sampled on the host and on the
// GPU (see TestBenchGraph8B), each after warm-up steps, with the gaps; the
// last, greedy steps queued one ahead with their tokens from the step
// before (compute.AsyncSampler), is the mean over 20 steps.
func benchSampling(t *testing.T, b *Backend, seqs []compute.Seq, out [][]float32) (host time.Duration, hostSt StepTimes,
	dev time.Duration, devSt StepTimes, greedy time.Duration, greedySt StepTimes, queued time.Duration, queuedSt StepTimes) {
	t.Helper()
	ctx := context.Background()
	sp := sampling.Params{Temperature: 0.7, TopK: 50, TopP: 0.9}
	n := len(seqs)
	cpus := make([]*sampling.Sampler, n)
	for i := range cpus {
		cpus[i] = sampling.New(sp, uint64(i))
	}
	step := uint64(0)
	hostStep := func() error {
		if err := b.forwardOpt(ctx, seqs, out, true); err != nil {
			return err
		}
		for i, s := range cpus {
			s.Sample(step, out[i])
		}
		step++
		return nil
	}
	timed := func(f func() error) (time.Duration, StepTimes) {
		for range 3 {
			if err := f(); err != nil {
				t.Fatal(err)
			}
		}
		b.ResetStepTimes()
		d, err := median(f, 0, 20)
		if err != nil {
			t.Fatal(err)
		}
		return d, b.StepTimes()
	}
	host, hostSt = timed(hostStep)
	devStep := func(p sampling.Params) func() error {
		samp := make([]compute.Sample, n)
		for i := range samp {
			st, err := b.NewSamplerState(p, uint64(i), nil)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { st.Close() })
			samp[i] = compute.Sample{State: st}
		}
		res := make([]compute.Sampled, n)
		return func() error {
			for i := range samp {
				samp[i].Step = step
			}
			step++
			return b.ForwardSample(ctx, seqs, samp, res)
		}
	}
	dev, devSt = timed(devStep(sp))
	greedy, greedySt = timed(devStep(sampling.Params{}))

	samp := make([]compute.Sample, n)
	for i := range samp {
		st, err := b.NewSamplerState(sampling.Params{}, uint64(i), nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { st.Close() })
		samp[i] = compute.Sample{State: st}
	}
	from := make([]int, n)
	for i := range from {
		from[i] = i
	}
	res := make([]compute.Sampled, n)
	start := func(f []int) compute.Pending {
		for i := range samp {
			samp[i].Step = step
		}
		step++
		p, err := b.StartSample(ctx, seqs, samp, f)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	chain := func(steps int) time.Duration {
		t0 := time.Now()
		p := start(nil)
		for k := range steps {
			var next compute.Pending
			if k < steps-1 {
				next = start(from)
			}
			if err := p.Wait(res); err != nil {
				t.Fatal(err)
			}
			p = next
		}
		return time.Since(t0)
	}
	chain(4)
	b.ResetStepTimes()
	queued = chain(20) / 20
	return host, hostSt, dev, devSt, greedy, greedySt, queued, b.StepTimes()
}

// stepWeightBytes is what a decode step of batch tokens reads of the
// weights: all of a dense model's; of an MoE model's experts, those its
// tokens choose (k at batch 1; E(1-(1-k/E)^batch) expected under uniform
// routing, as random weights route).
func stepWeightBytes(cfg model.Config, all int64, eb, batch int) float64 {
	if cfg.Experts == 0 {
		return float64(all)
	}
	moe := 0
	for i := range cfg.Layers {
		if cfg.MoELayer(i) {
			moe++
		}
	}
	e, k := float64(cfg.Experts), float64(cfg.TopK)
	chosen := min(e, e*(1-math.Pow(1-k/e, float64(batch))))
	per := 3 * float64(cfg.Dim) * float64(cfg.ExpertDim) * float64(eb)
	return float64(all) - float64(moe)*(e-chosen)*per
}
