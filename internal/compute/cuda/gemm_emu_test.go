package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestGemmWGEmulated runs attn.cu's gemm_wg (the stream-K decode GEMM on
// wgmma) on the host through cudaemu.h against float64 sums of the same
// bf16 operands, each shape twice over the same initial output: every
// output within 1e-5 of the sum of |x||w| (f32) or a bf16 rounding (bf16),
// the second run equal to the first bit for bit (the counters reset, the
// parts summed in block order), the counters zero after, nothing past the
// output written. The shapes put row blocks whole in one block, across
// blocks, blocks across row blocks, rows past out and tokens past n.
func TestGemmWGEmulated(t *testing.T) {
	src, _ := filepath.Abs("../../../csrc/llama/attn.cu")
	bin := emuCompile(t, "gemm_emu", "-DHEAD_DIM=128", "-DUSE_BF16=1", "-DGQA_GROUP=1", "-DATT_SPLIT=128",
		"-DEMU_HOPPER=1", `-DATTN_CU="`+src+`"`)
	for _, tc := range []struct {
		nt, n, out, in, blocks int
		f32                    bool
		beta                   float32
	}{
		{16, 5, 300, 640, 7, true, 1},     // 30 units over 7 blocks: parts in every row block
		{32, 32, 256, 128, 3, false, 0},   // 4 units over 3: one block spans two row blocks
		{64, 40, 128, 1024, 1, true, 0.5}, // one block: the row block whole
		{128, 128, 200, 192, 5, true, 0},  // 6 units over 5
		{128, 77, 520, 256, 3, false, 0},  // row blocks whole and in part in one block
	} {
		t.Run(fmt.Sprintf("nt%d-n%d-%dx%d-g%d", tc.nt, tc.n, tc.out, tc.in, tc.blocks), func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(tc.nt), uint64(tc.out)))
			bf := func(n int) []uint16 {
				v := make([]uint16, n)
				for i := range v {
					v[i] = model.F32ToBF16(float32(r.NormFloat64()))
				}
				return v
			}
			x, w := bf(tc.n*tc.in), bf(tc.out*tc.in)
			ny := tc.n*tc.out + 16
			yf32 := int32(0)
			var y0 []byte
			y0f := make([]float32, ny)
			for i := range y0f {
				y0f[i] = float32(r.NormFloat64())
			}
			if tc.f32 {
				yf32 = 1
				for _, v := range y0f {
					y0 = binary.LittleEndian.AppendUint32(y0, math.Float32bits(v))
				}
			} else {
				for i, v := range y0f {
					y0f[i] = model.BF16ToF32(model.F32ToBF16(v))
					y0 = binary.LittleEndian.AppendUint16(y0, model.F32ToBF16(v))
				}
			}
			var in bytes.Buffer
			put(t, &in, int32(tc.nt), int32(tc.n), int32(tc.out), int32(tc.in), int32(tc.blocks), yf32, tc.beta, x, w, y0)
			esz := 2
			if tc.f32 {
				esz = 4
			}
			rb := (tc.out + 127) / 128
			raw := emuCall[byte](t, bin, &in, 2*ny*esz+2*rb*4)
			get := func(run, i int) float32 {
				o := run*ny*esz + i*esz
				if tc.f32 {
					return math.Float32frombits(binary.LittleEndian.Uint32(raw[o:]))
				}
				return model.BF16ToF32(binary.LittleEndian.Uint16(raw[o:]))
			}
			f := func(h uint16) float64 { return float64(model.BF16ToF32(h)) }
			bad := 0
			for tok := range tc.n {
				for row := range tc.out {
					var s, a float64
					for k := range tc.in {
						p := f(x[tok*tc.in+k]) * f(w[row*tc.in+k])
						s, a = s+p, a+math.Abs(p)
					}
					i := tok*tc.out + row
					if tc.f32 {
						s += float64(tc.beta) * float64(y0f[i])
					}
					g := float64(get(0, i))
					tol := 1e-5 * (a + 1)
					if !tc.f32 {
						tol = math.Abs(s)/128 + 1e-5*a
					}
					if math.Abs(g-s) > tol && bad < 5 {
						bad++
						t.Errorf("token %d row %d: %g, want %g", tok, row, g, s)
					}
				}
			}
			for i := tc.n * tc.out; i < ny; i++ {
				if get(0, i) != y0f[i] {
					t.Fatalf("element %d past the output written", i)
				}
			}
			if !bytes.Equal(raw[:ny*esz], raw[ny*esz:2*ny*esz]) {
				t.Error("the second run differs from the first")
			}
			for i := range 2 * rb {
				if c := int32(binary.LittleEndian.Uint32(raw[2*ny*esz+4*i:])); c != 0 {
					t.Errorf("counter %d left at %d", i, c)
				}
			}
		})
	}
}
