package cpu

import (
	"math"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// rope holds cos/sin tables per position, grown on demand, for one head
// dimension: entry [pos*half + i] rotates pair i at position pos.
type rope struct {
	half        int
	interleaved bool
	invFreq     []float64
	cos, sin    []float32
}

func newRope(c *model.Config) *rope {
	return &rope{half: c.HeadDim / 2, interleaved: c.Spec.Attention.Rope == model.RopeInterleaved, invFreq: c.InvFreq()}
}

// ensure grows the tables to cover positions below n.
func (r *rope) ensure(n int) {
	have := len(r.cos) / r.half
	if have >= n {
		return
	}
	n = max(n, 2*have, 256)
	cos := make([]float32, n*r.half)
	sin := make([]float32, n*r.half)
	copy(cos, r.cos)
	copy(sin, r.sin)
	for p := have; p < n; p++ {
		for i, f := range r.invFreq {
			a := float64(p) * f
			cos[p*r.half+i] = float32(math.Cos(a))
			sin[p*r.half+i] = float32(math.Sin(a))
		}
	}
	r.cos, r.sin = cos, sin
}

// apply rotates each head of x (heads*2*half values) for position pos.
func (r *rope) apply(x []float32, heads, pos int) {
	h := r.half
	cs := r.cos[pos*h : pos*h+h]
	sn := r.sin[pos*h : pos*h+h]
	for hh := 0; hh < heads; hh++ {
		v := x[hh*2*h : (hh+1)*2*h]
		if r.interleaved {
			for i := 0; i < h; i++ {
				a, b := v[2*i], v[2*i+1]
				v[2*i] = a*cs[i] - b*sn[i]
				v[2*i+1] = a*sn[i] + b*cs[i]
			}
		} else {
			lo, hi := v[:h], v[h:2*h]
			for i := 0; i < h; i++ {
				a, b := lo[i], hi[i]
				lo[i] = a*cs[i] - b*sn[i]
				hi[i] = a*sn[i] + b*cs[i]
			}
		}
	}
}
