package cpu

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// wmat is a weight matrix [rows][in] as the kernels read it: float32, or
// bfloat16 / IEEE half widened inside the kernels. It is the model's tensor
// itself (a view of the mapped file), converted to float32 only where the
// 16-bit kernels cannot read it (in not a multiple of 8, no F16C, or no
// AVX2).
type wmat struct {
	dt       model.DType // F32, BF16 or F16
	f32      []float32
	u16      []uint16
	rows, in int
}

func newWmat(t *model.Tensor) (wmat, error) {
	if t == nil || len(t.Shape) != 2 {
		return wmat{}, fmt.Errorf("cpu: tensor %v is not a matrix", tensorName(t))
	}
	w := wmat{dt: t.DType, rows: t.Shape[0], in: t.Shape[1]}
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

// row converts row r into dst (len in).
func (w *wmat) row(r int, dst []float32) {
	switch w.dt {
	case model.F32:
		copy(dst, w.f32[r*w.in:(r+1)*w.in])
	case model.BF16:
		for i, h := range w.u16[r*w.in : (r+1)*w.in] {
			dst[i] = model.BF16ToF32(h)
		}
	default:
		for i, h := range w.u16[r*w.in : (r+1)*w.in] {
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
