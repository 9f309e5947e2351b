package computetest

import (
	"fmt"
	"math"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// NaiveResult is what Naive computes for a prompt.
type NaiveResult struct {
	Logits []float32     // of the last position
	K, V   [][][]float32 // [layer][position][KVHeads*HeadDim]: K after q/k norm and RoPE, as a KV cache holds them
}

// Naive runs ids through m with a plain float64 implementation of m's Spec
// written from the HF modeling code (no paging, batching, kernels or KV
// cache): an independent check of a backend's numerics, of the blocks'
// semantics and of what its KV cache holds.
func Naive(m *model.Model, ids []int32) (*NaiveResult, error) {
	c := &m.Config
	if c.Spec == nil || !m.HasWeights() || len(ids) == 0 {
		return nil, fmt.Errorf("computetest: no model or no tokens")
	}
	res := &NaiveResult{}
	spec := c.Spec
	d, hd := c.Dim, c.HeadDim
	n := len(ids)
	f := func(t *model.Tensor) []float64 {
		if t == nil {
			return nil
		}
		v := t.ToF32()
		out := make([]float64, len(v))
		for i, x := range v {
			out[i] = float64(x)
		}
		return out
	}
	embed := f(m.Embed)
	x := make([][]float64, n)
	for t, id := range ids {
		x[t] = append([]float64(nil), embed[int(id)*d:(int(id)+1)*d]...)
	}
	inv := c.InvFreq()
	rope := func(v []float64, heads, pos int) {
		half := hd / 2
		for h := 0; h < heads; h++ {
			e := v[h*hd : (h+1)*hd]
			for i := 0; i < half; i++ {
				a := float64(pos) * inv[i]
				cs, sn := math.Cos(a), math.Sin(a)
				i0, i1 := i, i+half
				if spec.Attention.Rope == model.RopeInterleaved {
					i0, i1 = 2*i, 2*i+1
				}
				p, q := e[i0], e[i1]
				e[i0], e[i1] = p*cs-q*sn, p*sn+q*cs
			}
		}
	}
	for li := range m.Layers {
		l := &m.Layers[li]
		q := make([][]float64, n)
		k := make([][]float64, n)
		v := make([][]float64, n)
		wq, wk, wv, wo := f(l.Q), f(l.K), f(l.V), f(l.O)
		bq, bk, bv := f(l.QBias), f(l.KBias), f(l.VBias)
		qn, kn := f(l.QNorm), f(l.KNorm)
		an := f(l.AttnNorm)
		for t := range x {
			h := rms(x[t], an, c.NormEps)
			q[t], k[t], v[t] = matvec(wq, h, bq), matvec(wk, h, bk), matvec(wv, h, bv)
			if qn != nil {
				for i := 0; i < c.Heads; i++ {
					copy(q[t][i*hd:], rms(q[t][i*hd:(i+1)*hd], qn, c.NormEps))
				}
				for i := 0; i < c.KVHeads; i++ {
					copy(k[t][i*hd:], rms(k[t][i*hd:(i+1)*hd], kn, c.NormEps))
				}
			}
			rope(q[t], c.Heads, t)
			rope(k[t], c.KVHeads, t)
		}
		res.K = append(res.K, narrow(k))
		res.V = append(res.V, narrow(v))
		w := c.Window(li)
		group := c.Heads / c.KVHeads
		for t := range x {
			att := make([]float64, c.Heads*hd)
			lo := 0
			if w > 0 {
				lo = max(0, t-w+1)
			}
			for h := 0; h < c.Heads; h++ {
				g := h / group
				sc := make([]float64, t+1-lo)
				mx := math.Inf(-1)
				for j := lo; j <= t; j++ {
					s := 0.0
					for i := 0; i < hd; i++ {
						s += q[t][h*hd+i] * k[j][g*hd+i]
					}
					sc[j-lo] = s / math.Sqrt(float64(hd))
					mx = math.Max(mx, sc[j-lo])
				}
				sum := 0.0
				for j := range sc {
					sc[j] = math.Exp(sc[j] - mx)
					sum += sc[j]
				}
				for j := lo; j <= t; j++ {
					p := sc[j-lo] / sum
					for i := 0; i < hd; i++ {
						att[h*hd+i] += p * v[j][g*hd+i]
					}
				}
			}
			addInto(x[t], matvec(wo, att, nil))
		}
		mn := f(l.MLPNorm)
		if !c.MoELayer(li) {
			gate, up, down := f(l.Gate), f(l.Up), f(l.Down)
			for t := range x {
				addInto(x[t], swiglu(gate, up, down, rms(x[t], mn, c.NormEps)))
			}
			continue
		}
		router := f(l.Router)
		type exp struct{ gate, up, down []float64 }
		ex := make([]exp, len(l.Experts))
		for e, xp := range l.Experts {
			ex[e] = exp{f(xp.Gate), f(xp.Up), f(xp.Down)}
		}
		sg, su, sd, sgate := f(l.Shared.Gate), f(l.Shared.Up), f(l.Shared.Down), f(l.SharedGate)
		for t := range x {
			h := rms(x[t], mn, c.NormEps)
			logit := matvec(router, h, nil)
			mx := math.Inf(-1)
			for _, z := range logit {
				mx = math.Max(mx, z)
			}
			sum := 0.0
			prob := make([]float64, len(logit))
			for e, z := range logit {
				prob[e] = math.Exp(z - mx)
				sum += prob[e]
			}
			chosen := map[int]bool{}
			var ids []int
			var wts []float64
			for j := 0; j < c.TopK; j++ {
				best := -1
				for e := range prob {
					if !chosen[e] && (best < 0 || prob[e] > prob[best]) {
						best = e
					}
				}
				chosen[best] = true
				ids = append(ids, best)
				wts = append(wts, prob[best]/sum)
			}
			if c.NormTopKProb {
				s := 0.0
				for _, w := range wts {
					s += w
				}
				for j := range wts {
					wts[j] /= s
				}
			}
			out := make([]float64, d)
			for j, e := range ids {
				y := swiglu(ex[e].gate, ex[e].up, ex[e].down, h)
				for i := range out {
					out[i] += wts[j] * y[i]
				}
			}
			if sg != nil {
				gs := 1 / (1 + math.Exp(-matvec(sgate, h, nil)[0]))
				y := swiglu(sg, su, sd, h)
				for i := range out {
					out[i] += gs * y[i]
				}
			}
			addInto(x[t], out)
		}
	}
	last := rms(x[n-1], f(m.Norm), c.NormEps)
	res.Logits = narrow([][]float64{matvec(f(m.LMHead), last, nil)})[0]
	return res, nil
}

func narrow(x [][]float64) [][]float32 {
	out := make([][]float32, len(x))
	for i, row := range x {
		out[i] = make([]float32, len(row))
		for j, v := range row {
			out[i][j] = float32(v)
		}
	}
	return out
}

func rms(x, w []float64, eps float32) []float64 {
	ss := 0.0
	for _, v := range x {
		ss += v * v
	}
	sc := 1 / math.Sqrt(ss/float64(len(x))+float64(eps))
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = w[i] * v * sc
	}
	return out
}

// matvec is w [rows][len(x)] times x, plus b when not nil.
func matvec(w, x, b []float64) []float64 {
	in := len(x)
	out := make([]float64, len(w)/in)
	for r := range out {
		s := 0.0
		for i, v := range x {
			s += w[r*in+i] * v
		}
		if b != nil {
			s += b[r]
		}
		out[r] = s
	}
	return out
}

func swiglu(gate, up, down, x []float64) []float64 {
	g, u := matvec(gate, x, nil), matvec(up, x, nil)
	for i := range g {
		g[i] = g[i] / (1 + math.Exp(-g[i])) * u[i]
	}
	return matvec(down, g, nil)
}

func addInto(dst, src []float64) {
	for i := range dst {
		dst[i] += src[i]
	}
}
