package cpu

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// wmat is a weight matrix [rows][in] as the kernels read it: float32, or
// bfloat16 / IEEE half widened inside the kernels; row r starts at element
// r*ld. It is the model's tensor itself (a view of the mapped file), or a
// tensor-parallel rank's block of it, converted to float32 only where the
// 16-bit kernels cannot read it (in not a multiple of 8, no F16C, or no
// AVX2).
type wmat struct {
	dt           model.DType // F32, BF16 or F16
	f32          []float32
	u16          []uint16
	rows, in, ld int
}

func newWmat(t *model.Tensor) (wmat, error) {
	if t == nil || len(t.Shape) != 2 {
		return wmat{}, fmt.Errorf("cpu: tensor %v is not a matrix", tensorName(t))
	}
	w := wmat{dt: t.DType, rows: t.Shape[0], in: t.Shape[1], ld: t.Shape[1]}
	switch {
	case t.DType == model.F32:
		w.f32 = t.ToF32()
	case (t.DType == model.BF16 || t.DType == model.F16 && hasF16C) && hasAVX2 && w.in%8 == 0 && t.U16() != nil:
		w.u16 = t.U16()
	default:
		w.dt, w.f32 = model.F32, t.ToF32()
	}
	return w, nil
}

// block is the view of rows [r0, r1) and columns [c0, c1) of w: shared
// memory, or a float32 copy where a 16-bit block is not 8 columns wide.
func (w wmat) block(r0, r1, c0, c1 int) wmat {
	if r0 == 0 && r1 == w.rows && c0 == 0 && c1 == w.in {
		return w
	}
	v := wmat{dt: w.dt, rows: r1 - r0, in: c1 - c0, ld: w.ld}
	off := r0*w.ld + c0
	switch {
	case w.dt == model.F32:
		v.f32 = w.f32[off:]
	case v.in%8 == 0:
		v.u16 = w.u16[off:]
	default:
		v.dt, v.ld = model.F32, v.in
		v.f32 = make([]float32, v.rows*v.in)
		for r := 0; r < v.rows; r++ {
			row := make([]float32, w.in)
			w.row(r0+r, row)
			copy(v.f32[r*v.in:], row[c0:c1])
		}
	}
	return v
}

// rowsOf is rows [r0, r1) of w; colsOf columns [c0, c1).
func (w wmat) rowsOf(r0, r1 int) wmat { return w.block(r0, r1, 0, w.in) }
func (w wmat) colsOf(c0, c1 int) wmat { return w.block(0, w.rows, c0, c1) }

// row converts row r into dst (len in).
func (w *wmat) row(r int, dst []float32) {
	switch w.dt {
	case model.F32:
		copy(dst, w.f32[r*w.ld:r*w.ld+w.in])
	case model.BF16:
		for i, h := range w.u16[r*w.ld : r*w.ld+w.in] {
			dst[i] = model.BF16ToF32(h)
		}
	default:
		for i, h := range w.u16[r*w.ld : r*w.ld+w.in] {
			dst[i] = model.F16ToF32(h)
		}
	}
}

// vec is a small tensor (norm weights, biases) converted to float32.
func vec(t *model.Tensor) []float32 {
	if t == nil {
		return nil
	}
	return t.ToF32()
}

func tensorName(t *model.Tensor) string {
	if t == nil {
		return "(missing)"
	}
	return t.Name
}
