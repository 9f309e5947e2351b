package cpu

import (
	"math"
	"slices"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
)

// TestGolden checks every tiny architecture, written as convert --random
// writes it (seed 0) and loaded from disk, against transformers' float32
// run of the same directory: the last-position logits within 1e-4 (the top
// ones one by one, all of them through their sum and sum of squares) and
// the greedy continuation token for token.
func TestGolden(t *testing.T) {
	for _, name := range computetest.GoldenShapes() {
		t.Run(name, func(t *testing.T) {
			f, m := computetest.LoadGolden(t, name)
			per := 8
			be := newBackend(t, m, 16, per, 1)
			worst := 0.0
			for i, p := range f.Prompts {
				want := p.Float32
				logits := greedy(t, be, p.IDs, pagesFor(0, per), 0, len(want.Greedy))
				last := logits[0]
				for _, top := range want.Top {
					d := math.Abs(float64(last[int(top[0])]) - top[1])
					worst = max(worst, d)
					if d > 1e-4 {
						t.Errorf("prompt %d (%d tokens): logit of %d is %v, transformers %v", i, len(p.IDs), int(top[0]), last[int(top[0])], top[1])
					}
				}
				var sum, sq float64
				for _, v := range last {
					sum += float64(v)
					sq += float64(v) * float64(v)
				}
				if math.Abs(sum-want.Sum) > 1e-4*math.Sqrt(float64(len(last))) || math.Abs(sq-want.SumSq) > 1e-4*math.Sqrt(want.SumSq*float64(len(last)))*2 {
					t.Errorf("prompt %d: logits sum %v sum of squares %v, transformers %v %v", i, sum, sq, want.Sum, want.SumSq)
				}
				got := make([]int32, len(want.Greedy))
				for s := range got {
					got[s] = argmax(logits[s])
				}
				if !slices.Equal(got, want.Greedy) {
					t.Errorf("prompt %d: greedy %v, transformers %v", i, got, want.Greedy)
				}
			}
			t.Logf("%s (%s): max |logit - transformers %s float32| over the top %d: %.2g", name, f.Architecture,
				f.Transformers, len(f.Prompts[0].Float32.Top), worst)
		})
	}
}
