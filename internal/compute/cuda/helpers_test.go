package cuda

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/cublas"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// newOrSkip makes a backend, skipping the test when no GPU, driver, NVRTC
// or cuBLAS is found.
func newOrSkip(tb testing.TB, m *model.Model, o Options) *Backend {
	tb.Helper()
	if o.KernelCache.CacheDir == "" {
		o.KernelCache.CacheDir = filepath.Join(os.TempDir(), "mooncake-kernels-test")
	}
	b, err := New(m, o)
	if err != nil {
		if errors.Is(err, cu.ErrNoDriver) || errors.Is(err, cu.ErrNoDevice) || errors.Is(err, cu.ErrNoNVRTC) ||
			errors.Is(err, cublas.ErrNoLibrary) {
			tb.Skipf("no usable GPU: %v", err)
		}
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := b.Close(); err != nil {
			tb.Error(err)
		}
	})
	return b
}

func sharedDir(tb testing.TB) string {
	if d := os.Getenv("MOONCAKE_SHARED"); d != "" {
		return d
	}
	dir, err := os.Getwd()
	if err != nil {
		tb.Fatal(err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(dir, "..", "shared")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			tb.Fatal("no go.mod above the test directory")
		}
		dir = parent
	}
}

type refCase struct {
	Prompt           string    `json:"prompt"`
	PromptIDs        []int32   `json:"prompt_ids"`
	GreedyNextIDs    []int32   `json:"greedy_next_ids"`
	LastPromptLogits []float32 `json:"last_prompt_logits"`
}

func stories260K(tb testing.TB) (*model.Model, []refCase) {
	p := filepath.Join(sharedDir(tb), "models", "stories260K", "stories260K.bin")
	if _, err := os.Stat(p); err != nil {
		tb.Skipf("stories260K not found (set MOONCAKE_SHARED): %v", err)
	}
	m, err := model.LoadLlama2C(p)
	if err != nil {
		tb.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(sharedDir(tb), "reference", "stories260K-greedy.json"))
	if err != nil {
		tb.Skipf("reference outputs not found (set MOONCAKE_SHARED): %v", err)
	}
	var r struct {
		Cases []refCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		tb.Fatal(err)
	}
	return m, r.Cases
}

func pagesFor(i, per int) []int32 {
	p := make([]int32, per)
	for j := range p {
		p[j] = int32(i*per + j)
	}
	return p
}

func argmax(x []float32) int32 {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return int32(best)
}

// runBatch runs all prompts together: each forward pass carries, for every
// unfinished sequence, its next prompt chunk (chunks[i] tokens; 0 = whole)
// or one greedy decode token. It returns per sequence the logits after its
// prompt and after each of steps decode tokens.
func runBatch(tb testing.TB, b compute.Model, prompts [][]int32, chunks []int, steps, pagesPer int) [][][]float32 {
	tb.Helper()
	V := b.Config().Vocab
	type state struct {
		pos    int
		logits [][]float32
	}
	st := make([]state, len(prompts))
	for {
		var seqs []compute.Seq
		var idx []int
		for i, p := range prompts {
			s := &st[i]
			if len(s.logits) == steps+1 {
				continue
			}
			var toks []int32
			if s.pos < len(p) {
				ck := chunks[i]
				if ck <= 0 {
					ck = len(p)
				}
				toks = p[s.pos:min(s.pos+ck, len(p))]
			} else {
				toks = []int32{argmax(s.logits[len(s.logits)-1])}
			}
			seqs = append(seqs, compute.Seq{Tokens: toks, Pos: s.pos, Pages: pagesFor(i, pagesPer), Logits: s.pos+len(toks) >= len(p)})
			idx = append(idx, i)
		}
		if len(seqs) == 0 {
			break
		}
		out := make([][]float32, len(seqs))
		for j := range out {
			out[j] = make([]float32, V)
		}
		if err := b.Forward(context.Background(), seqs, out); err != nil {
			tb.Fatal(err)
		}
		for j, i := range idx {
			st[i].pos += len(seqs[j].Tokens)
			if seqs[j].Logits {
				st[i].logits = append(st[i].logits, out[j])
			}
		}
	}
	res := make([][][]float32, len(prompts))
	for i := range st {
		res[i] = st[i].logits
	}
	return res
}

func randPrompt(r *rand.Rand, n, vocab int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(r.IntN(vocab))
	}
	return p
}

func maxAbsDiff(a, b []float32) float64 {
	d := 0.0
	for i := range a {
		d = math.Max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// relErr is ||a-b|| / ||b||; NaN anywhere gives +Inf.
func relErr(a, b []float32) float64 {
	var num, den float64
	for i := range a {
		if a[i] != a[i] {
			return math.Inf(1)
		}
		d := float64(a[i] - b[i])
		num += d * d
		den += float64(b[i]) * float64(b[i])
	}
	if den == 0 {
		return math.Sqrt(num)
	}
	return math.Sqrt(num / den)
}
