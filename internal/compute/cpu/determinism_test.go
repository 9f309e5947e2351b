package cpu

import (
	"context"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

func runBatch(tb testing.TB, b *Backend, prompts [][]int32, chunks []int, steps, pagesPer int) [][][]float32 {
	return computetest.RunBatch(tb, b, prompts, chunks, steps, pagesPer)
}

func sameBits(a, b []float32) bool {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return len(a) == len(b)
}

// checkDeterminism compares each prompt run alone (whole prompt) against
// batched runs with several chunkings and thread counts.
func checkDeterminism(t *testing.T, m *model.Model, prompts [][]int32, steps, pageSize int) {
	maxLen := 0
	for _, p := range prompts {
		maxLen = max(maxLen, len(p)+steps)
	}
	per := (maxLen + pageSize - 1) / pageSize
	pages := per * len(prompts)
	alone := make([][][]float32, len(prompts))
	b1 := newBackend(t, m, pageSize, pages, 1)
	for i, p := range prompts {
		alone[i] = runBatch(t, b1, [][]int32{p}, []int{0}, steps, per)[0]
	}
	b2 := newBackend(t, m, pageSize, pages, 2)
	whole := make([]int, len(prompts))
	varied := make([]int, len(prompts))
	ones := make([]int, len(prompts))
	for i := range varied {
		varied[i] = []int{1, 2, 3, 5, 7, 0}[i%6]
		ones[i] = 1
	}
	for _, v := range []struct {
		name   string
		b      *Backend
		chunks []int
	}{
		{"batched", b1, whole},
		{"batched/threads=2", b2, whole},
		{"chunked", b1, varied},
		{"chunked/threads=2", b2, varied},
		{"token-by-token", b1, ones},
	} {
		got := runBatch(t, v.b, prompts, v.chunks, steps, per)
		for i := range prompts {
			for s := range alone[i] {
				if !sameBits(alone[i][s], got[i][s]) {
					t.Errorf("%s: prompt %d step %d: logits differ from the prompt run alone (max diff %g)",
						v.name, i, s, maxAbsDiff(alone[i][s], got[i][s]))
					break
				}
			}
		}
	}
}

func TestDeterminismStories260K(t *testing.T) {
	m, err := model.LoadLlama2C(stories260K(t))
	if err != nil {
		t.Fatal(err)
	}
	var prompts [][]int32
	for _, c := range refCases(t) {
		prompts = append(prompts, c.PromptIDs)
	}
	checkDeterminism(t, m, prompts, 24, 16)
}

// TestDeterminismRandom covers the built-in model with 16 concurrent
// prompts and the tiny shapes with QKV bias, half-split and llama3 RoPE.
func TestDeterminismRandom(t *testing.T) {
	for _, name := range []string{"builtin", "tiny", "tiny-qwen2", "tiny-llama3"} {
		t.Run(name, func(t *testing.T) {
			m, err := model.NewRandom(name, 7)
			if err != nil {
				t.Fatal(err)
			}
			r := rand.New(rand.NewPCG(1, 2))
			n := 16
			if name != "builtin" {
				n = 6
			}
			prompts := make([][]int32, n)
			for i := range prompts {
				p := []int32{256}
				for j := 0; j < 3+r.IntN(20); j++ {
					p = append(p, int32(r.IntN(256)))
				}
				prompts[i] = p
			}
			checkDeterminism(t, m, prompts, 8, 8)
		})
	}
}

// TestBuiltinVaries checks that the built-in model's greedy output is not
// one repeated token.
func TestBuiltinVaries(t *testing.T) {
	m := model.Builtin()
	b := newBackend(t, m, 16, 4, 1)
	logits := greedy(t, b, []int32{256, 'H', 'i'}, pagesFor(0, 4), 0, 32)
	seen := map[int32]bool{}
	for _, l := range logits {
		seen[argmax(l)] = true
	}
	if len(seen) < 4 {
		t.Errorf("built-in model produced only %d distinct tokens in 33 steps", len(seen))
	}
}

func TestForwardErrors(t *testing.T) {
	m := model.Builtin()
	b := newBackend(t, m, 4, 4, 1)
	V := m.Config.Vocab
	out := [][]float32{make([]float32, V)}
	for _, tc := range []struct {
		name string
		seq  compute.Seq
	}{
		{"token out of range", compute.Seq{Tokens: []int32{int32(V)}, Pages: []int32{0}}},
		{"too few pages", compute.Seq{Tokens: make([]int32, 5), Pages: []int32{0}}},
		{"page out of pool", compute.Seq{Tokens: []int32{1}, Pages: []int32{4}}},
		{"negative pos", compute.Seq{Tokens: []int32{1}, Pos: -1, Pages: []int32{0}}},
		{"logits without tokens", compute.Seq{Pages: []int32{0}, Logits: true}},
	} {
		if err := b.Forward(context.Background(), []compute.Seq{tc.seq}, out); err == nil {
			t.Errorf("%s: no error", tc.name)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := b.Forward(ctx, []compute.Seq{{Tokens: []int32{1}, Pages: []int32{0}, Logits: true}}, out); err == nil {
		t.Error("canceled context: no error")
	}
}
