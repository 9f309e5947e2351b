package cpu

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// sharedDir finds the shared test data: $MOONCAKE_SHARED, or ../shared next
// to the repository root.
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

func stories260K(tb testing.TB) string {
	p := filepath.Join(sharedDir(tb), "models", "stories260K", "stories260K.bin")
	if _, err := os.Stat(p); err != nil {
		tb.Skipf("stories260K not found (set MOONCAKE_SHARED): %v", err)
	}
	return p
}

type refCase struct {
	Prompt           string    `json:"prompt"`
	PromptIDs        []int32   `json:"prompt_ids"`
	GreedyNextIDs    []int32   `json:"greedy_next_ids"`
	LastPromptLogits []float32 `json:"last_prompt_logits"`
}

func refCases(tb testing.TB) []refCase {
	p := filepath.Join(sharedDir(tb), "reference", "stories260K-greedy.json")
	b, err := os.ReadFile(p)
	if err != nil {
		tb.Skipf("reference outputs not found (set MOONCAKE_SHARED): %v", err)
	}
	var r struct {
		Cases []refCase `json:"cases"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		tb.Fatal(err)
	}
	return r.Cases
}

// newBackend makes a backend with a pool of pages pages of pageSize tokens
// on plain Go memory.
func newBackend(tb testing.TB, m *model.Model, pageSize, pages, threads int) *Backend {
	l := LayoutFor(m.Config, pageSize, pages)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		tb.Fatal(err)
	}
	b, err := New(m, pool, threads)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { b.Close() })
	return b
}

// pagesFor returns the page table of sequence i when each sequence owns
// per consecutive pages.
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

// greedy runs prompt (in chunks of chunk tokens; 0 = whole) then steps
// greedy decode steps for sequence i alone, and returns the logits after the
// prompt and after every step.
func greedy(tb testing.TB, b *Backend, prompt []int32, pages []int32, chunk, steps int) [][]float32 {
	ctx := context.Background()
	V := b.Config().Vocab
	var all [][]float32
	if chunk <= 0 {
		chunk = len(prompt)
	}
	pos := 0
	for pos < len(prompt) {
		end := min(pos+chunk, len(prompt))
		out := [][]float32{make([]float32, V)}
		seq := compute.Seq{Tokens: prompt[pos:end], Pos: pos, Pages: pages, Logits: end == len(prompt)}
		if err := b.Forward(ctx, []compute.Seq{seq}, out); err != nil {
			tb.Fatal(err)
		}
		if seq.Logits {
			all = append(all, out[0])
		}
		pos = end
	}
	for s := 0; s < steps; s++ {
		next := argmax(all[len(all)-1])
		out := [][]float32{make([]float32, V)}
		if err := b.Forward(ctx, []compute.Seq{{Tokens: []int32{next}, Pos: pos, Pages: pages, Logits: true}}, out); err != nil {
			tb.Fatal(err)
		}
		all = append(all, out[0])
		pos++
	}
	return all
}
