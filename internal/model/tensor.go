package model

import (
	"encoding/binary"
	"fmt"
	"math"
	"unsafe"
)

// DType is the element type of a stored tensor.
type DType uint8

// The dtypes weights may be stored in.
const (
	F32 DType = iota + 1
	F16
	BF16
)

// Size is the bytes per element.
func (d DType) Size() int {
	switch d {
	case F32:
		return 4
	case F16, BF16:
		return 2
	}
	return 0
}

// String is the safetensors name ("F32", "F16", "BF16").
func (d DType) String() string {
	switch d {
	case F32:
		return "F32"
	case F16:
		return "F16"
	case BF16:
		return "BF16"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// TorchName is config.json's torch_dtype for d.
func (d DType) TorchName() string {
	return map[DType]string{F32: "float32", F16: "float16", BF16: "bfloat16"}[d]
}

// ParseDType reads a safetensors or torch dtype name ("BF16", "bfloat16",
// "bf16", ...).
func ParseDType(s string) (DType, error) {
	switch s {
	case "F32", "float32", "f32", "fp32":
		return F32, nil
	case "F16", "float16", "f16", "fp16", "half":
		return F16, nil
	case "BF16", "bfloat16", "bf16":
		return BF16, nil
	}
	return 0, fmt.Errorf("model: dtype %q not supported (float32, float16, bfloat16)", s)
}

// Tensor is one named weight in its stored dtype. Data holds the elements
// row-major in native byte order; for a loaded model it is usually a view of
// a read-only memory mapping of the file, so it must not be written.
type Tensor struct {
	Name  string
	DType DType
	Shape []int
	Data  []byte
}

// Numel is the number of elements.
func (t *Tensor) Numel() int { return numel(t.Shape) }

// F32 returns the elements as a []float32 sharing Data when the tensor is
// F32 and 4-byte aligned, else nil.
func (t *Tensor) F32() []float32 {
	if t.DType != F32 || len(t.Data) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(t.Data)))%4 != 0 {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(t.Data))), len(t.Data)/4)
}

// U16 returns the elements of an F16 or BF16 tensor as raw 16-bit values
// sharing Data (2-byte aligned), else nil.
func (t *Tensor) U16() []uint16 {
	if t.DType.Size() != 2 || len(t.Data) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(t.Data)))%2 != 0 {
		return nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(unsafe.SliceData(t.Data))), len(t.Data)/2)
}

// ReadF32 converts the elements starting at element off into dst (exact for
// every dtype).
func (t *Tensor) ReadF32(dst []float32, off int) {
	es := t.DType.Size()
	b := t.Data[off*es : (off+len(dst))*es]
	switch t.DType {
	case F32:
		if f := t.F32(); f != nil {
			copy(dst, f[off:])
			return
		}
		for i := range dst {
			dst[i] = math.Float32frombits(binary.NativeEndian.Uint32(b[4*i:]))
		}
	case BF16:
		if u := t.U16(); u != nil {
			for i, h := range u[off : off+len(dst)] {
				dst[i] = math.Float32frombits(uint32(h) << 16)
			}
			return
		}
		for i := range dst {
			dst[i] = math.Float32frombits(uint32(binary.NativeEndian.Uint16(b[2*i:])) << 16)
		}
	case F16:
		if u := t.U16(); u != nil {
			for i, h := range u[off : off+len(dst)] {
				dst[i] = f16ToF32(h)
			}
			return
		}
		for i := range dst {
			dst[i] = f16ToF32(binary.NativeEndian.Uint16(b[2*i:]))
		}
	}
}

// ToF32 returns the elements as float32: Data itself when it is an aligned
// F32 tensor, else a converted copy.
func (t *Tensor) ToF32() []float32 {
	if f := t.F32(); f != nil {
		return f
	}
	out := make([]float32, t.Numel())
	parallelChunks(int64(len(out)), func(off, n int64) { t.ReadF32(out[off:off+n], int(off)) })
	return out
}

// f32Tensor wraps float32 values as an F32 tensor without copying.
func f32Tensor(name string, shape []int, v []float32) *Tensor {
	return &Tensor{Name: name, DType: F32, Shape: shape, Data: f32Bytes(v)}
}

// RoundTo returns v rounded to dtype d's precision (nearest even), as
// float32.
func RoundTo(d DType, v float32) float32 {
	switch d {
	case BF16:
		return math.Float32frombits(uint32(f32ToBF16(v)) << 16)
	case F16:
		return f16ToF32(f32ToF16(v))
	}
	return v
}

// BF16ToF32 widens a bfloat16 exactly.
func BF16ToF32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// F16ToF32 widens an IEEE half exactly.
func F16ToF32(h uint16) float32 { return f16ToF32(h) }

// F32ToF16 rounds to an IEEE half (nearest even), returning its bits.
func F32ToF16(f float32) uint16 { return f32ToF16(f) }

// F32ToBF16 rounds to a bfloat16 (nearest even), returning its bits.
func F32ToBF16(f float32) uint16 { return f32ToBF16(f) }
