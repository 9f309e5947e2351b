package cuda

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
)

// stagedComm is a communicator for tensor-parallel ranks that share one
// GPU (NCCL refuses two ranks on one device): each operation copies the
// device buffer to pinned host memory on the rank's stream, waits, runs
// the in-process CPU communicator (sums in rank order) and copies the
// result back, enqueued on the stream. It waits on the host, so it cannot
// be captured: graphs go off.
type stagedComm struct {
	collective.Comm
	s       *cu.Stream
	in, out *cu.HostMem
}

func stagedComms(devs []int, streams []*cu.Stream) ([]collective.Comm, error) {
	local := collective.NewLocal(len(devs))
	out := make([]collective.Comm, len(devs))
	for r := range out {
		out[r] = &stagedComm{Comm: local[r], s: streams[r]}
	}
	return out, nil
}

// failing wraps the communicators mk makes: rank r's fail(r)-th all-reduce
// fails (0: none) before it reaches the inner one. Abort and Capturable
// pass through.
func failing(mk CommsFunc, fail func(rank int) int) CommsFunc {
	return func(devs []int, streams []*cu.Stream) ([]collective.Comm, error) {
		cs, err := mk(devs, streams)
		for r := range cs {
			cs[r] = &failingComm{Comm: cs[r], at: fail(r)}
		}
		return cs, err
	}
}

type failingComm struct {
	collective.Comm
	at, n int
}

var errInjected = errors.New("injected all-reduce failure")

func (c *failingComm) AllReduce(ctx context.Context, b collective.Buf) error {
	if c.n++; c.at > 0 && c.n == c.at {
		return errInjected
	}
	return c.Comm.AllReduce(ctx, b)
}

func (c *failingComm) Abort() {
	if a, ok := c.Comm.(interface{ Abort() }); ok {
		a.Abort()
	} else {
		c.Comm.Close()
	}
}

func (c *failingComm) Capturable() bool {
	k, ok := c.Comm.(interface{ Capturable() bool })
	return ok && k.Capturable()
}

// host stages n floats of device memory p into pinned memory.
func (c *stagedComm) host(h **cu.HostMem, p uintptr, n int) ([]float32, error) {
	if *h == nil || (*h).Size() < uint64(n)*4 {
		if err := c.s.Synchronize(); err != nil {
			return nil, err
		}
		(*h).Free()
		m, err := c.s.Context().MemHostAlloc(uint64(n)*4, 0)
		if err != nil {
			return nil, err
		}
		*h = m
	}
	if p != 0 {
		if err := c.s.MemcpyDtoH((*h).Ptr(), cu.DevicePtr(p), uint64(n)*4); err != nil {
			return nil, err
		}
	}
	if err := c.s.Synchronize(); err != nil {
		return nil, err
	}
	return unsafe.Slice((*float32)((*h).Ptr()), n), nil
}

func (c *stagedComm) AllReduce(ctx context.Context, b collective.Buf) error {
	v, err := c.host(&c.in, b.Dev, b.N)
	if err != nil {
		return err
	}
	if err := c.Comm.AllReduce(ctx, collective.Host(v)); err != nil {
		return err
	}
	return c.s.MemcpyHtoD(cu.DevicePtr(b.Dev), c.in.Ptr(), uint64(b.N)*4)
}

func (c *stagedComm) AllGather(ctx context.Context, send, recv collective.Buf) error {
	v, err := c.host(&c.in, send.Dev, send.N)
	if err != nil {
		return err
	}
	w, err := c.host(&c.out, 0, recv.N)
	if err != nil {
		return err
	}
	if err := c.Comm.AllGather(ctx, collective.Host(v), collective.Host(w)); err != nil {
		return err
	}
	return c.s.MemcpyHtoD(cu.DevicePtr(recv.Dev), c.out.Ptr(), uint64(recv.N)*4)
}

func (c *stagedComm) Close() error {
	err := c.Comm.Close()
	if c.s.Synchronize() == nil {
		c.in.Free()
		c.out.Free()
		c.in, c.out = nil, nil
	}
	return err
}

// newTPOrSkip loads m over tp ranks sharing GPU 0.
func newTPOrSkip(tb testing.TB, m *model.Model, o Options, tp int, to TPOptions) *TP {
	tb.Helper()
	to.Size = tp
	if to.Devices == nil {
		to.Devices = make([]int, tp)
	}
	if to.Comms == nil {
		to.Comms = stagedComms
	}
	return loadOrSkip(tb, &o, func(o Options) (*TP, error) { return NewTP(m, o, to) })
}

// TestStories260KTP: stories260K (8 heads, 4 KV heads) over 1, 2, 4 and 8
// ranks on one GPU (at 8 every KV head is held by two ranks) reproduces
// llama2.c in float32: greedy ids exactly, last prompt logits within
// 1e-4, every step's logits within 2e-5 of tp 1's; and at tp 2 in bf16
// within 3e-2 relative of llama2.c. tp 1 runs through NewTP with graphs.
func TestStories260KTP(t *testing.T) {
	gpuOrSkip(t)
	m, cases := stories260K(t)
	var ref [][][]float32
	for _, tc := range []struct {
		tp    int
		dtype string
	}{{1, "float32"}, {2, "float32"}, {4, "float32"}, {8, "float32"}, {2, "bfloat16"}} {
		t.Run(fmt.Sprintf("tp=%d/%s", tc.tp, tc.dtype), func(t *testing.T) {
			b := newTPOrSkip(t, m, Options{DType: tc.dtype, PageSize: 16, Pages: 64}, tc.tp, TPOptions{})
			var got [][][]float32
			worst, worstRel, vsTP1 := 0.0, 0.0, 0.0
			for ci, c := range cases {
				steps := len(c.GreedyNextIDs) - 1
				logits := runBatch(t, b, [][]int32{c.PromptIDs}, []int{3}, steps, 32)[0]
				got = append(got, logits)
				worst = max(worst, maxAbsDiff(logits[0], c.LastPromptLogits))
				worstRel = max(worstRel, relErr(logits[0], c.LastPromptLogits))
				if tc.dtype != "float32" {
					continue
				}
				for i, want := range c.GreedyNextIDs {
					if g := argmax(logits[i]); g != want {
						t.Errorf("%q: token %d is %d, want %d", c.Prompt, i, g, want)
						break
					}
				}
				if ref != nil {
					for i := range logits {
						vsTP1 = max(vsTP1, maxAbsDiff(logits[i], ref[ci][i]))
					}
				}
			}
			t.Logf("tp %d %s: last prompt logits max abs diff %.3g (rel %.3g) off llama2.c", tc.tp, tc.dtype, worst, worstRel)
			if tc.dtype == "float32" {
				t.Logf("tp %d: every step's logits %.3g off tp 1's", tc.tp, vsTP1)
			}
			switch {
			case tc.dtype == "float32" && worst > 1e-4:
				t.Errorf("last prompt logits %g off llama2.c's", worst)
			case tc.dtype == "float32" && vsTP1 > 2e-5:
				t.Errorf("logits %g off tp 1's", vsTP1)
			case tc.dtype == "bfloat16" && worstRel > 3e-2:
				t.Errorf("bf16 last prompt logits relative error %g > 3e-2", worstRel)
			}
			if tc.tp == 1 {
				ref = got
				if g := b.Ranks()[0].graphs; g == nil || g.replays == 0 {
					t.Errorf("tp 1 through NewTP replayed no decode graph")
				}
			}
		})
	}
}

// TestConformanceTP runs the conformance suite over 2 and 4 ranks sharing
// GPU 0 (the tiny shapes' 4 heads and 1 or 2 KV heads: at 4 every KV head
// is replicated; the MoE shapes' experts split too) against the CPU
// backend, as TestConformance does at tp 1: float32 within 1e-4, bf16
// within 3e-2, every KV head in place on every rank that holds it.
func TestConformanceTP(t *testing.T) {
	gpuOrSkip(t)
	skip := computetest.WithSkip(unsupported)
	ref := computetest.WithReference(newCPURef)
	o := Options{BatchInvariant: true, NoFlashPrefill: true, DisableCUDAGraph: true}
	for _, tp := range []int{2, 4} {
		t.Run(fmt.Sprintf("tp=%d/float32", tp), func(t *testing.T) {
			o := o
			o.DType = "float32"
			computetest.Run(t, newCUDATP(o, tp), ref, skip, computetest.WithTolerance(model.F32, 1e-4),
				computetest.WithTolerance(model.BF16, 1e-4), computetest.WithTolerance(model.F16, 1e-4))
		})
	}
	t.Run("tp=2/bfloat16", func(t *testing.T) {
		o := o
		o.DType = "bfloat16"
		computetest.Run(t, newCUDATP(o, 2), ref, skip, computetest.WithDTypes(model.BF16), computetest.WithTolerance(model.BF16, 3e-2))
	})
}

func newCUDATP(o Options, tp int) computetest.NewFunc {
	return func(tb testing.TB, m *model.Model, pageSize, pages int) computetest.Backend {
		o := o
		o.PageSize, o.Pages = pageSize, pages
		b := newTPOrSkip(tb, m, o, tp, TPOptions{})
		return computetest.Backend{Model: b, KV: func(l int, kind kvcache.Kind, p int) []float32 {
			pages := make([][]float32, tp)
			for r, rk := range b.Ranks() {
				kv, err := rk.pageKV(l, kind, p)
				if err != nil {
					tb.Fatal(err)
				}
				pages[r] = kv
			}
			kv, err := computetest.MergeKV(b.Shards(), pages, m.Config.KVHeads, l, p)
			if err != nil {
				tb.Fatal(err)
			}
			return kv
		}}
	}
}

// TestTPRankFails: rank 1's third all-reduce fails (ranks sharing GPU 0).
func TestTPRankFails(t *testing.T) {
	gpuOrSkip(t)
	rankFails(t, TPOptions{Comms: stagedComms})
}

// rankFails: rank 1's third all-reduce fails; the pass fails naming rank 1
// (rank 0, waiting for it, is released), the failure is counted under
// tp_rank 1, and the next passes, on new communicators, give the logits of
// llama2.c again. to.Comms makes the communicators that fail.
func rankFails(t *testing.T, to TPOptions) {
	m, cases := stories260K(t)
	var made atomic.Int32
	fail := func(rank int) int {
		if made.Add(1) <= 2 && rank == 1 { // the first communicators only
			return 3
		}
		return 0
	}
	to.Comms, to.Registerer = failing(to.Comms, fail), prometheus.NewRegistry()
	b := newTPOrSkip(t, m, Options{DType: "float32", PageSize: 16, Pages: 64}, 2, to)
	prompt := cases[0].PromptIDs
	out := [][]float32{make([]float32, m.Config.Vocab)}
	seqs := []compute.Seq{{Tokens: prompt, Pages: pagesFor(0, 8), Logits: true}}
	start := time.Now()
	err := b.Forward(context.Background(), seqs, out)
	var re *compute.RankError
	if !errors.As(err, &re) || re.Rank != 1 || !errors.Is(err, errInjected) {
		t.Fatalf("pass with a failing rank 1: %v, want a RankError of rank 1 wrapping the injected failure", err)
	}
	t.Logf("the failed pass ended in %v", time.Since(start))
	if v := sharedtest.Counter(b.met.Failures.WithLabelValues("1")); v != 1 {
		t.Errorf("failures of tp_rank 1 = %v, want 1", v)
	}
	for range 2 {
		if err := b.Forward(context.Background(), seqs, out); err != nil {
			t.Fatalf("pass after the failure: %v", err)
		}
		if d := maxAbsDiff(out[0], cases[0].LastPromptLogits); d > 1e-4 {
			t.Fatalf("logits after the failure %g off llama2.c's", d)
		}
	}
	if v := sharedtest.Counter(b.met.Forward.WithLabelValues("1")); v <= 0 {
		t.Errorf("forward seconds of tp_rank 1 = %v", v)
	}
}

// twoGPUsOrSkip skips a test that needs GPUs 0 and 1.
func twoGPUsOrSkip(t *testing.T) {
	t.Helper()
	gpuOrSkip(t)
	if n, _ := cu.DeviceCount(); n < 2 {
		t.Skipf("needs two GPUs (this machine has %d)", n)
	}
}

// TestTPNCCL (two GPUs): stories260K float32 at tp 2 on GPUs 0 and 1
// through NCCL, CUDA graphs on (the all-reduces captured): greedy ids equal
// llama2.c's, every step's logits within 2e-5 of tp 1's, decode graphs
// replayed on both ranks; and a rank that fails mid-pass releases the
// other from NCCL (ncclCommAbort), the next passes right.
func TestTPNCCL(t *testing.T) {
	twoGPUsOrSkip(t)
	m, cases := stories260K(t)
	o := Options{DType: "float32", PageSize: 16, Pages: 64}
	run := func(b *TP) [][][]float32 {
		var all [][][]float32
		for _, c := range cases {
			all = append(all, runBatch(t, b, [][]int32{c.PromptIDs}, []int{3}, len(c.GreedyNextIDs)-1, 32)[0])
		}
		return all
	}
	ref := run(newTPOrSkip(t, m, o, 1, TPOptions{}))
	b := newTPOrSkip(t, m, o, 2, TPOptions{Devices: []int{0, 1}, Comms: NCCLComms})
	got := run(b)
	worst := 0.0
	for ci, c := range cases {
		for i, want := range c.GreedyNextIDs {
			if g := argmax(got[ci][i]); g != want {
				t.Errorf("%q: token %d is %d, want %d", c.Prompt, i, g, want)
				break
			}
		}
		for i := range got[ci] {
			worst = max(worst, maxAbsDiff(got[ci][i], ref[ci][i]))
		}
	}
	t.Logf("tp 2 over NCCL: logits %.3g off tp 1's", worst)
	if worst > 2e-5 {
		t.Errorf("logits %g off tp 1's", worst)
	}
	for r, rk := range b.Ranks() {
		if g := rk.graphs; g == nil || g.replays == 0 || rk.gmode != graphsOn {
			t.Errorf("rank %d replayed no decode graph", r)
		}
	}
	t.Run("rank fails", func(t *testing.T) { rankFails(t, TPOptions{Devices: []int{0, 1}, Comms: NCCLComms}) })
}

// TestTPRefused: shapes that do not split are refused before any GPU work.
func TestTPRefused(t *testing.T) {
	m, _ := stories260K(t)
	for _, tc := range []struct {
		o    TPOptions
		want string
	}{
		{TPOptions{Size: 3}, "heads do not split"},
		{TPOptions{Size: 2, Devices: []int{0}}, "1 GPUs for 2"},
	} {
		_, err := NewTP(m, Options{DType: "float32"}, tc.o)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("NewTP(%+v) = %v, want an error containing %q", tc.o, err, tc.want)
		}
	}
}

// TestShardSlices checks the weight slices ranks take: rows share the
// data, columns are copied, for every split of a matrix.
func TestShardSlices(t *testing.T) {
	const rows, cols = 6, 10
	data := make([]byte, rows*cols*2)
	for i := range rows * cols {
		data[2*i], data[2*i+1] = byte(i), byte(i>>8)
	}
	tt := &model.Tensor{Name: "w", DType: model.BF16, Shape: []int{rows, cols}, Data: data}
	at := func(t *model.Tensor, i, j int) int {
		k := (i*t.Shape[1] + j) * 2
		return int(t.Data[k]) | int(t.Data[k+1])<<8
	}
	for tp := 1; tp <= 4; tp++ {
		for r := range tp {
			lo, hi := model.Split(rows, tp, r)
			rs := rowsOf(tt, lo, hi)
			if rs.Shape[0] != hi-lo || rs.Shape[1] != cols || rs.Numel()*2 != len(rs.Data) {
				t.Fatalf("rows [%d,%d): shape %v, %d bytes", lo, hi, rs.Shape, len(rs.Data))
			}
			for i := range hi - lo {
				for j := range cols {
					if at(rs, i, j) != (lo+i)*cols+j {
						t.Fatalf("rows [%d,%d): element (%d,%d) = %d", lo, hi, i, j, at(rs, i, j))
					}
				}
			}
			clo, chi := model.Split(cols, tp, r)
			cs := colsOf(tt, clo, chi)
			if cs.Shape[0] != rows || cs.Shape[1] != chi-clo || cs.Numel()*2 != len(cs.Data) {
				t.Fatalf("cols [%d,%d): shape %v, %d bytes", clo, chi, cs.Shape, len(cs.Data))
			}
			for i := range rows {
				for j := range chi - clo {
					if at(cs, i, j) != i*cols+clo+j {
						t.Fatalf("cols [%d,%d): element (%d,%d) = %d", clo, chi, i, j, at(cs, i, j))
					}
				}
			}
		}
	}
	if rowsOf(nil, 0, 1) != nil || colsOf(nil, 0, 1) != nil {
		t.Error("a missing tensor must stay missing")
	}
}

// TestShardOf checks the ranks' shapes cover the model once (replicated KV
// heads past the KV head count).
func TestShardOf(t *testing.T) {
	c := model.Config{Heads: 8, KVHeads: 2, HeadDim: 16, HiddenDim: 100, ExpertDim: 30, SharedExpertDim: 0, Vocab: 1001}
	for _, tp := range []int{1, 2, 4, 8} {
		heads, hidden, expert, vocab := 0, 0, 0, 0
		for r := range tp {
			sh, rc := shardOf(c, tp, r)
			heads += rc.Heads
			hidden += rc.HiddenDim
			expert += rc.ExpertDim
			vocab += sh.vrows
			if sh.vlo != r*sh.vshard && sh.vrows > 0 {
				t.Errorf("tp %d rank %d: vocab rows from %d, want %d", tp, r, sh.vlo, r*sh.vshard)
			}
			if want := max(1, 2/tp); rc.KVHeads != want || sh.klo != r*2/tp && tp <= 2 || tp > 2 && sh.klo != r/(tp/2) {
				t.Errorf("tp %d rank %d: KV heads %d from %d", tp, r, rc.KVHeads, sh.klo)
			}
			if (sh.resid() == 1) != (r == 0) {
				t.Errorf("tp %d rank %d: residual beta %v", tp, r, sh.resid())
			}
		}
		if heads != c.Heads || hidden != c.HiddenDim || expert != c.ExpertDim || vocab != c.Vocab {
			t.Errorf("tp %d: ranks hold %d heads, %d hidden, %d expert, %d vocab rows", tp, heads, hidden, expert, vocab)
		}
	}
}

// TestBenchTP8B (two GPUs; MOONCAKE_BENCH=1): the 8B shape (or
// MOONCAKE_BENCH_SHAPE) in bf16 with random weights and KV at tp 1 and tp 2
// through NCCL: decode steps at batch 1 and 32 (ctx 1K; CUDA graphs, logits
// copied to the host) and a 4K-token prefill, median host wall times, and
// tp 2's time as a share of tp 1's (the goal of the two-GPU issue: <= 0.6).
// BENCH_OUT=file receives the table.
func TestBenchTP8B(t *testing.T) {
	if os.Getenv("MOONCAKE_BENCH") == "" {
		t.Skip("set MOONCAKE_BENCH=1 to run the tensor-parallel benchmark")
	}
	twoGPUsOrSkip(t)
	shape := cmp.Or(os.Getenv("MOONCAKE_BENCH_SHAPE"), "llama3-8b")
	cfg, err := model.RandomConfig(shape)
	if err != nil {
		t.Fatal(err)
	}
	const ps, ctxLen, prefill = 64, 1024, 4096
	per := ceilDiv(ctxLen+1, ps)
	pages := 32*per + ceilDiv(prefill, ps)
	type row struct{ b1, b32, pre time.Duration }
	var rows []row
	for _, tp := range []int{1, 2} {
		devs := []int{0, 1}[:tp]
		b := newTPOrSkip(t, &model.Model{Config: cfg, Random: true}, Options{PageSize: ps, Pages: pages, RandomWeights: true,
			Seed: 1, CUDAGraphMaxBS: 32}, tp, TPOptions{Devices: devs, Comms: NCCLComms})
		for _, rk := range b.Ranks() {
			if err := rk.fill(rk.fn.fillT, rk.kvBase, uint64(rk.layout.TotalBytes())/uint64(rk.eb), 7, 1, 0); err != nil {
				t.Fatal(err)
			}
		}
		ctx := context.Background()
		r := rand.New(rand.NewPCG(3, 3))
		out := make([][]float32, 32)
		for i := range out {
			out[i] = make([]float32, cfg.Vocab)
		}
		decode := func(bs int) time.Duration {
			seqs := make([]compute.Seq, bs)
			for i := range seqs {
				seqs[i] = compute.Seq{Tokens: []int32{int32(r.IntN(cfg.Vocab))}, Pos: ctxLen, Pages: pagesFor(i, per), Logits: true}
			}
			d, err := median(func() error { return b.Forward(ctx, seqs, out[:bs]) }, 3, 20)
			if err != nil {
				t.Fatal(err)
			}
			return d
		}
		toks := make([]int32, prefill)
		for i := range toks {
			toks[i] = int32(r.IntN(cfg.Vocab))
		}
		pg := make([]int32, ceilDiv(prefill, ps))
		for i := range pg {
			pg[i] = int32(32*per + i)
		}
		pre, err := median(func() error {
			return b.Forward(ctx, []compute.Seq{{Tokens: toks, Pages: pg, Logits: true}}, out[:1])
		}, 1, 3)
		if err != nil {
			t.Fatal(err)
		}
		rows = append(rows, row{decode(1), decode(32), pre})
	}
	lines := []string{shape + " bf16, random weights and KV, GPUs 0 (tp 1) and 0-1 (tp 2, NCCL); median host wall ms",
		"| tp | decode b1 ctx 1K | decode b32 ctx 1K | prefill 4K |", "| --- | --- | --- | --- |"}
	for i, rw := range rows {
		lines = append(lines, fmt.Sprintf("| %d | %.2f (%.2f of tp 1) | %.2f (%.2f) | %.1f (%.2f) |", i+1, ms(rw.b1),
			rw.b1.Seconds()/rows[0].b1.Seconds(), ms(rw.b32), rw.b32.Seconds()/rows[0].b32.Seconds(), ms(rw.pre),
			rw.pre.Seconds()/rows[0].pre.Seconds()))
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
