package cuda

import (
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestKernelsV2 fails when NVRTC rejects the second-generation kernels
// (the backend would silently fall back to the first set).
func TestKernelsV2(t *testing.T) {
	m := headDim128(t)
	b := newOrSkip(t, m, Options{PageSize: 16, Pages: 16})
	if b.fn.v2Err != nil {
		t.Fatalf("MC_V2 build rejected: %v", b.fn.v2Err)
	}
	f := &b.fn
	if f.attnFlash2 == nil || f.attnDecode2 == nil || f.gemvF32 == nil || f.g2Plain == nil || f.g2Norm == nil ||
		f.g2QKV == nil || f.g2SiLU == nil {
		t.Fatalf("missing kernels: flash2 %v decode2 %v gemv %v fused %v", f.attnFlash2 != nil, f.attnDecode2 != nil,
			f.gemvF32 != nil, f.g2QKV != nil)
	}
	old := newOrSkip(t, m, Options{PageSize: 16, Pages: 16, tune: tuning{decodeV1: true}})
	if old.fn.attnDecode == nil {
		t.Fatal("attn_decode (tuning decodeV1) not loaded")
	}
	for _, f := range []*cu.Function{f.attnFlash2, f.attnDecode2, old.fn.attnDecode, f.gemvF32, f.g2Plain, f.g2Norm, f.g2QKV, f.g2SiLU} {
		regs, _ := f.Attribute(cu.FuncAttrNumRegs)
		local, _ := f.Attribute(cu.FuncAttrLocalSizeBytes)
		t.Logf("kernel %s: %d registers, %d bytes local", f.Name, regs, local)
	}
}

// TestFlashPrefillV1V2 compares the first and second kernel sets (prefill
// chunks over several tiles and pages, then decode steps), the second with
// its flash prefill from attn.cu (attn_prefill3, the default) and from
// llama.cu (attn_prefill2).
func TestFlashPrefillV1V2(t *testing.T) {
	m := headDim128(t)
	r := newRand(9)
	prompts := [][]int32{randPrompt(r, 700, m.Config.Vocab), randPrompt(r, 130, m.Config.Vocab), randPrompt(r, 2, m.Config.Vocab), randPrompt(r, 333, m.Config.Vocab)}
	chunks := []int{300, 0, 0, 129}
	const per = 48
	v1 := newOrSkip(t, m, Options{PageSize: 16, Pages: per * len(prompts), tune: tuning{noV2: true}})
	g1 := runBatch(t, v1, prompts, chunks, 3, per)
	for _, tu := range []tuning{{}, {flashV3: true}, {flashV2: true}, {flashV2: true, flashWarps: 4}} {
		v2 := newOrSkip(t, m, Options{PageSize: 16, Pages: per * len(prompts), tune: tu})
		if v2.fn.v2Err != nil {
			t.Fatalf("MC_V2 build rejected: %v", v2.fn.v2Err)
		}
		if p3 := v2.fn.flash2HeadsX; p3 == tu.flashV2 {
			t.Fatalf("%+v: flash prefill of %d rows, %d threads: attn_prefill3 %v", tu, v2.fn.flash2Rows, v2.fn.flash2Threads, p3)
		}
		if p4, want := v2.fn.flash3 != nil, !tu.flashV2 && !tu.flashV3 && hopper(t, v2); p4 != want {
			t.Fatalf("%+v: attn_prefill4 loaded %v, want %v (%v)", tu, p4, want, v2.fn.hopperErr)
		}
		g2 := runBatch(t, v2, prompts, chunks, 3, per)
		for i := range prompts {
			for s := range g1[i] {
				e := relErr(g2[i][s], g1[i][s])
				if s == 0 || s == len(g1[i])-1 {
					t.Logf("%+v prompt %d step %d: rel err v2 vs v1 %.3g", tu, i, s, e)
				}
				if !(e < 2e-2) {
					t.Errorf("%+v prompt %d step %d: rel err %g", tu, i, s, e)
				}
			}
		}
	}
}

// torchRef is what scripts/py/torch_reference.py writes.
type torchRef struct {
	Prompts [][]int32 `json:"prompts"`
	Vocab   int       `json:"vocab"`
	Logits  string    `json:"logits_file"` // f32 little endian [prompts][vocab]
	// LogitsF32: the same prompts with the model upcast to float32 (optional).
	LogitsF32 string             `json:"logits_f32_file"`
	Timings   map[string]float64 `json:"timings_ms"`
	LoadS     float64            `json:"load_s"`
}

// TestHFvsTorch loads an HF directory through model.LoadHF (the same files
// transformers loaded), compares last-position logits with PyTorch's, then
// (MOONCAKE_BENCH=1) times prefill and decode on those weights.
func TestHFvsTorch(t *testing.T) {
	dir, refPath := os.Getenv("MOONCAKE_HF_DIR"), os.Getenv("MOONCAKE_TORCH_REF")
	if dir == "" || refPath == "" {
		t.Skip("set MOONCAKE_HF_DIR and MOONCAKE_TORCH_REF")
	}
	raw, err := os.ReadFile(refPath)
	if err != nil {
		t.Fatal(err)
	}
	var ref torchRef
	if err := json.Unmarshal(raw, &ref); err != nil {
		t.Fatal(err)
	}
	lb, err := os.ReadFile(filepath.Join(filepath.Dir(refPath), ref.Logits))
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	m, err := model.LoadHF(dir)
	if err != nil {
		t.Fatal(err)
	}
	tLoad := time.Since(t0)
	cfg := m.Config
	t1 := time.Now()
	pagesPer := (8192+64)/64 + 1
	b := newOrSkip(t, m, Options{PageSize: 64, Pages: 32 * pagesPer})
	tUp := time.Since(t1)
	m.Close()
	runtime.GC()
	t.Logf("model.LoadHF (the files mapped): %v; New (bf16 uploaded from the mapping): %v", tLoad, tUp)
	V := cfg.Vocab
	if ref.Vocab != V || len(lb) != 4*V*len(ref.Prompts) {
		t.Fatalf("reference vocab %d, %d bytes of logits; model vocab %d", ref.Vocab, len(lb), V)
	}
	var l32 []byte
	if ref.LogitsF32 != "" {
		if l32, err = os.ReadFile(filepath.Join(filepath.Dir(refPath), ref.LogitsF32)); err != nil {
			t.Fatal(err)
		}
	}
	row := func(b []byte, i int) []float32 {
		v := make([]float32, V)
		for j := range v {
			v[j] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*(i*V+j):]))
		}
		return v
	}
	// With PyTorch's float32 logits, ours (bf16) are held to PyTorch's own
	// bf16 error against them (the worst over the prompts) and the argmax to
	// float32's or PyTorch bf16's (they part where the top two are closer
	// than bf16's error); without, to 2e-2 of PyTorch's bf16 logits.
	f32 := len(l32) == 4*V*len(ref.Prompts)
	out := [][]float32{make([]float32, V)}
	worst, worstOurs, worstTorch := 0.0, 0.0, 0.0
	for i, p := range ref.Prompts {
		seq := []compute.Seq{{Tokens: p, Pos: 0, Pages: pagesFor(i, pagesPer), Logits: true}}
		if err := b.Forward(context.Background(), seq, out); err != nil {
			t.Fatal(err)
		}
		want := row(lb, i)
		e := relErr(out[0], want)
		worst = max(worst, e)
		t.Logf("prompt %d (%d tokens): rel err vs PyTorch %.4g, max abs diff %.4g, argmax ours %d torch %d",
			i, len(p), e, maxAbsDiff(out[0], want), argmax(out[0]), argmax(want))
		if !f32 {
			if !(e < 2e-2) {
				t.Errorf("prompt %d: relative error %g vs PyTorch (want < 2e-2)", i, e)
			}
			continue
		}
		f := row(l32, i)
		ours, torch := relErr(out[0], f), relErr(want, f)
		worstOurs, worstTorch = max(worstOurs, ours), max(worstTorch, torch)
		t.Logf("prompt %d vs PyTorch float32: ours (bf16) %.4g, PyTorch bf16 %.4g; argmax float32 %d", i, ours, torch, argmax(f))
		if a := argmax(out[0]); a != argmax(f) && a != argmax(want) {
			t.Errorf("prompt %d: argmax %d, PyTorch float32 %d, bf16 %d", i, a, argmax(f), argmax(want))
		}
	}
	t.Logf("worst relative error vs PyTorch over %d prompts: %.4g", len(ref.Prompts), worst)
	if f32 {
		t.Logf("worst relative error vs PyTorch float32: ours (bf16) %.4g, PyTorch bf16 %.4g", worstOurs, worstTorch)
		if !(worstOurs <= worstTorch) {
			t.Errorf("bf16 error vs PyTorch float32 %.4g, worse than PyTorch's own bf16 %.4g", worstOurs, worstTorch)
		}
	}
	if os.Getenv("MOONCAKE_BENCH") != "" {
		for k, v := range ref.Timings {
			t.Logf("PyTorch %s: %.2f ms", k, v)
		}
		lines := benchOn(t, b, cfg)
		if d := os.Getenv("BENCH_OUT"); d != "" {
			f, err := os.Create(d)
			if err == nil {
				for _, l := range lines {
					f.WriteString(l + "\n")
				}
				f.Close()
			}
		}
	}
}

// TestProfile8B runs, for ncu, one decode step at batch 1 and one at batch
// 32 (ctx 1K, random KV) and one 4K prefill (not with
// MOONCAKE_PROFILE_PREFILL=0), each phase ended by an empty read_bw launch
// as a marker. MOONCAKE_PROFILE=1; MOONCAKE_BENCH_SHAPE picks the shape
// (default llama3-8b).
func TestProfile8B(t *testing.T) {
	if os.Getenv("MOONCAKE_PROFILE") == "" {
		t.Skip("set MOONCAKE_PROFILE=1")
	}
	cfg, err := model.RandomConfig(cmp.Or(os.Getenv("MOONCAKE_BENCH_SHAPE"), "llama3-8b"))
	if err != nil {
		t.Fatal(err)
	}
	const ps, ctxLen = 64, 1024
	batches := []int{1, 32} // MOONCAKE_PROFILE_BATCHES="1 32 128" picks others
	if v := os.Getenv("MOONCAKE_PROFILE_BATCHES"); v != "" {
		batches = batches[:0]
		for _, f := range strings.Fields(v) {
			n, err := strconv.Atoi(f)
			if err != nil || n < 1 {
				t.Fatalf("MOONCAKE_PROFILE_BATCHES: %q is not a batch size", f)
			}
			batches = append(batches, n)
		}
	}
	batch := slices.Max(batches)
	pagesPer := 4096/ps + 1
	b := newOrSkip(t, &model.Model{Config: cfg, Random: true}, Options{PageSize: ps, Pages: (batch + 1) * pagesPer, RandomWeights: true, Seed: 1})
	if err := b.fill(b.fn.fillT, b.kvBase, uint64(b.layout.TotalBytes())/uint64(b.eb), 5, 1, 0); err != nil {
		t.Fatal(err)
	}
	marker := func() {
		if err := b.stream.Launch(b.fn.readBW, cu.D1(1), cu.D1(32), 0, b.kvBase, int64(0), b.kvBase); err != nil {
			t.Fatal(err)
		}
	}
	r := newRand(3)
	V := cfg.Vocab
	out := make([][]float32, batch)
	for i := range out {
		out[i] = make([]float32, V)
	}
	ctx := context.Background()
	marker()
	for _, bs := range batches {
		seqs := make([]compute.Seq, bs)
		for i := range seqs {
			seqs[i] = compute.Seq{Tokens: []int32{int32(r.IntN(V))}, Pos: ctxLen, Pages: pagesFor(i, pagesPer), Logits: true}
		}
		if err := b.Forward(ctx, seqs, out[:bs]); err != nil {
			t.Fatal(err)
		}
		marker()
	}
	if os.Getenv("MOONCAKE_PROFILE_PREFILL") == "0" {
		return
	}
	seq := []compute.Seq{{Tokens: randPrompt(r, 4096, V), Pos: 0, Pages: pagesFor(batch, pagesPer), Logits: true}}
	if err := b.Forward(ctx, seq, out[:1]); err != nil {
		t.Fatal(err)
	}
	marker()
	if err := b.cx.Synchronize(); err != nil {
		t.Fatal(err)
	}
}

func newRand(seed uint64) *rand.Rand { return rand.New(rand.NewPCG(seed, seed+1)) }
