// Package computetest is the conformance suite of compute.Model backends
// (Run) and its helpers: batched runs, a float64 reference implementation
// (Naive), error measures.
package computetest

import (
	"context"
	"math"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
)

// RunBatch runs all prompts together: each forward pass carries, for every
// unfinished sequence, its next prompt chunk (chunks[i] tokens; 0 = whole)
// or one greedy decode token. It returns per sequence the logits after its
// prompt and after each of steps decode tokens.
func RunBatch(tb testing.TB, b compute.Model, prompts [][]int32, chunks []int, steps, pagesPer int) [][][]float32 {
	tb.Helper()
	return runBatch(tb, b, prompts, chunks, steps, func(i int) []int32 { return PagesFor(i, pagesPer) })
}

func runBatch(tb testing.TB, b compute.Model, prompts [][]int32, chunks []int, steps int, pages func(int) []int32) [][][]float32 {
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
				toks = []int32{Argmax(s.logits[len(s.logits)-1])}
			}
			seqs = append(seqs, compute.Seq{Tokens: toks, Pos: s.pos, Pages: pages(i), Logits: s.pos+len(toks) >= len(p)})
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

// PagesFor is the page table of sequence i when each sequence owns per
// consecutive pages.
func PagesFor(i, per int) []int32 {
	p := make([]int32, per)
	for j := range p {
		p[j] = int32(i*per + j)
	}
	return p
}

// Argmax is the greedy token (the lowest id on ties).
func Argmax(x []float32) int32 {
	best := 0
	for i, v := range x {
		if v > x[best] {
			best = i
		}
	}
	return int32(best)
}

// MaxAbsDiff is max |a[i]-b[i]|.
func MaxAbsDiff(a, b []float32) float64 {
	d := 0.0
	for i := range a {
		d = math.Max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// RelErr is ||a-b|| / ||b||; NaN anywhere gives +Inf.
func RelErr(a, b []float32) float64 {
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
