package cpu

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// BenchmarkMatRows measures the matmul tiles on a stories260K-sized FFN
// matrix (rows 172, in 64) for n tokens; the metric is multiply-adds per ns.
func BenchmarkMatRows(b *testing.B) {
	r := rand.New(rand.NewPCG(1, 1))
	for _, in := range []int{64, 172} {
		rows := 512
		w := wmat{dt: model.F32, f32: randVec(r, rows*in), rows: rows, in: in, ld: in}
		for _, n := range []int{1, 3, 32} {
			x := randVec(r, n*in)
			out := make([]float32, n*rows)
			b.Run(fmt.Sprintf("in=%d/n=%d", in, n), func(b *testing.B) {
				for b.Loop() {
					for r0 := 0; r0 < rows; r0 += 8 {
						matRows(&w, x, n, out, r0, 8)
					}
				}
				b.ReportMetric(float64(rows*in*n)*float64(b.N)/float64(b.Elapsed().Nanoseconds()), "MAC/ns")
			})
		}
	}
}
