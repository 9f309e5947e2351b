package model

import (
	"math"
	"os"
	"path/filepath"
	"testing"
)

// FuzzSafetensorsHeader feeds arbitrary files to the header parser: it must
// not panic, and every tensor it accepts must lie inside the file with a
// byte length matching its shape.
func FuzzSafetensorsHeader(f *testing.F) {
	hdr, _ := stHeader([]string{"a", "b"}, []string{"F32", "BF16"}, [][]int{{2, 3}, {4}})
	f.Add(append(hdr, make([]byte, 32)...))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 1<<16 {
			return
		}
		ts, start, err := parseSafetensorsHeader(b, int64(len(b)))
		if err != nil {
			return
		}
		for name, x := range ts {
			if x.Begin < start || x.End > int64(len(b)) || x.Begin > x.End {
				t.Fatalf("%s: [%d, %d) outside data [%d, %d)", name, x.Begin, x.End, start, len(b))
			}
			if int64(numel(x.Shape)*dtypeSize(x.DType)) != x.End-x.Begin {
				t.Fatalf("%s: %d bytes for shape %v", name, x.End-x.Begin, x.Shape)
			}
		}
	})
}

func TestHalfConversions(t *testing.T) {
	for _, v := range []float32{0, 1, -2.5, 65504, 1e-7, 6.1e-5, -0.1, 3.14159} {
		h := f32ToF16(v)
		back := f16ToF32(h)
		if math.Abs(float64(back-v)) > math.Abs(float64(v))*1e-3+6e-8 {
			t.Errorf("f16(%v) -> %v", v, back)
		}
		bf := math.Float32frombits(uint32(f32ToBF16(v)) << 16)
		if math.Abs(float64(bf-v)) > math.Abs(float64(v))*8e-3 {
			t.Errorf("bf16(%v) -> %v", v, bf)
		}
	}
	if f32ToF16(1e6) != 0x7c00 || f16ToF32(0x7c00) != float32(math.Inf(1)) {
		t.Error("f16 overflow")
	}
}

func TestSafetensorsRoundTrip(t *testing.T) {
	p := filepath.Join(t.TempDir(), "x.safetensors")
	src := []float32{1, -2, 3.5, 0.25, 7, -8}
	ts := []outTensor{
		{name: "f32", dtype: "F32", shape: []int{2, 3}, src: src},
		{name: "bf16", dtype: "BF16", shape: []int{6}, src: src},
		{name: "f16", dtype: "F16", shape: []int{3, 2}, src: src},
	}
	if err := writeSafetensors(p, ts, 2, nil); err != nil {
		t.Fatal(err)
	}
	f, err := mapSafetensors(p)
	if err != nil {
		t.Fatal(err)
	}
	defer unmap(f.data)
	for _, name := range []string{"f32", "bf16", "f16"} {
		st := f.tensors[name]
		dt, _ := ParseDType(st.DType)
		x := &Tensor{Name: name, DType: dt, Shape: st.Shape, Data: f.data[st.Begin:st.End]}
		dst := x.ToF32()
		for i := range src {
			if dst[i] != src[i] {
				t.Fatalf("%s: %v, want %v", name, dst, src)
			}
		}
		part := make([]float32, 3)
		x.ReadF32(part, 2)
		if part[0] != src[2] || part[2] != src[4] {
			t.Fatalf("%s: elements 2..4 %v", name, part)
		}
	}
	b, _ := os.ReadFile(p)
	if _, _, err := parseSafetensorsHeader(b[:len(b)-1], int64(len(b)-1)); err == nil {
		t.Error("truncated file accepted")
	}
}
