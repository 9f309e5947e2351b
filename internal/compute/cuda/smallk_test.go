package cuda

import (
	"math"
	"math/rand/v2"
	"runtime"
	"strconv"
	"testing"
	"unsafe"

	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

func TestLaunchShapes(t *testing.T) {
	for _, c := range []struct {
		dim  int
		want uint32
	}{{64, 32}, {172, 256}, {256, 32}, {4096, 256}, {8192, 512}, {8200, 544}, {16384, 1024}, {40000, 1024}} {
		if got := rmsThreads(c.dim); got != c.want {
			t.Errorf("rmsThreads(%d) = %d, want %d", c.dim, got, c.want)
		}
	}
	if got := siluBlocks(14336); got != 7 {
		t.Errorf("siluBlocks(14336) = %d, want 7", got)
	}
	if got := siluBlocks(172); got != 1 {
		t.Errorf("siluBlocks(172) = %d, want 1", got)
	}
	if got := ropeBlocks(32, 8, 128); got != 12 {
		t.Errorf("ropeBlocks(32, 8, 128) = %d, want 12", got)
	}
}

// TestSmallKernels checks rmsnorm (one and two register chunks per thread,
// the re-read tail, the scalar path, gathered rows), silu_mul (vector and
// scalar paths) and the RoPE table against Go references, in f32 and bf16:
// shapes the model tests do not reach (dim 4096, hidden 14336).
func TestSmallKernels(t *testing.T) {
	m := headDim128(t)
	for _, dt := range []string{"float32", "bfloat16"} {
		t.Run(dt, func(t *testing.T) {
			b := newOrSkip(t, m, Options{DType: dt, PageSize: 16, Pages: 16})
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			if err := b.cx.SetCurrent(); err != nil {
				t.Fatal(err)
			}
			tol := 2e-6
			if b.bf16 {
				tol = 8e-3
			}
			r := rand.New(rand.NewPCG(5, 6))
			dev := func(n uint64) cu.DevicePtr {
				p, err := b.cx.MemAlloc(max(n, 256))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { b.cx.MemFree(p) })
				return p
			}
			put := func(v []float32, asT bool) cu.DevicePtr {
				eb := uint64(4)
				if asT {
					eb = uint64(b.eb)
				}
				p := dev(uint64(len(v)) * eb)
				if err := b.upload(p, v, asT && b.bf16); err != nil {
					t.Fatal(err)
				}
				return p
			}
			// asStored rounds v as a T buffer holds it.
			asStored := func(v []float32) []float32 {
				if !b.bf16 {
					return v
				}
				o := make([]float32, len(v))
				for i, x := range v {
					o[i] = math.Float32frombits(uint32(BF16(x)) << 16)
				}
				return o
			}
			getT := func(p cu.DevicePtr, n int) []float32 {
				if err := b.cx.Synchronize(); err != nil {
					t.Fatal(err)
				}
				raw := make([]byte, n*b.eb)
				if err := b.cx.MemcpyDtoH(raw, p); err != nil {
					t.Fatal(err)
				}
				o := make([]float32, n)
				for i := range o {
					if b.bf16 {
						o[i] = math.Float32frombits(uint32(*(*uint16)(unsafe.Pointer(&raw[2*i]))) << 16)
					} else {
						o[i] = *(*float32)(unsafe.Pointer(&raw[4*i]))
					}
				}
				return o
			}
			randv := func(n int, s, off float64) []float32 {
				v := make([]float32, n)
				for i := range v {
					v[i] = float32(off + s*r.NormFloat64())
				}
				return v
			}
			check := func(name string, got, want []float32) {
				t.Helper()
				worst, scale := 0.0, 0.0
				for i := range want {
					worst = max(worst, math.Abs(float64(got[i])-float64(want[i])))
					scale = max(scale, math.Abs(float64(want[i])))
				}
				if !(worst <= tol*scale) {
					t.Errorf("%s: max abs error %.3g > %.3g (max |want| %.3g)", name, worst, tol*scale, scale)
				}
			}
			st := b.cx.DefaultStream()
			const eps = 1e-5
			for _, dim := range []int{64, 172, 4096, 8200, 40000} {
				for _, gather := range []bool{false, true} {
					const n = 3
					x := randv(n*dim, 1, 0.3)
					w := randv(dim, 0.1, 1)
					src := []int32{0, 1, 2}
					rows := cu.DevicePtr(0)
					if gather {
						src = []int32{2, 0}
						rows = dev(8)
						if err := b.cx.MemcpyHtoD(rows, unsafe.Slice((*byte)(unsafe.Pointer(&src[0])), 8)); err != nil {
							t.Fatal(err)
						}
					}
					out := dev(uint64(n * dim * b.eb))
					if err := st.Launch(b.fn.rmsnorm, cu.D1(uint32(len(src))), cu.D1(rmsThreads(dim)), 0, out, put(x, false),
						put(w, false), rows, int32(dim), float32(eps)); err != nil {
						t.Fatal(err)
					}
					want := make([]float32, len(src)*dim)
					for ri, s := range src {
						ss := 0.0
						for _, v := range x[int(s)*dim : int(s+1)*dim] {
							ss += float64(v) * float64(v)
						}
						sc := 1 / math.Sqrt(ss/float64(dim)+eps)
						for i := range dim {
							want[ri*dim+i] = float32(float64(w[i]) * sc * float64(x[int(s)*dim+i]))
						}
					}
					check("rmsnorm dim "+strconv.Itoa(dim), getT(out, len(want)), want)
				}
			}
			for _, hid := range []int{14336, 172, 8} {
				const n = 3
				gu := asStored(randv(n*2*hid, 2, 0))
				h := dev(uint64(n * hid * b.eb))
				if err := st.Launch(b.fn.siluMul, cu.Dim3{X: n, Y: siluBlocks(hid), Z: 1}, cu.D1(siluThreads), 0, h,
					put(gu, true), int32(hid)); err != nil {
					t.Fatal(err)
				}
				want := make([]float32, n*hid)
				for tk := range n {
					for i := range hid {
						g, u := float64(gu[tk*2*hid+i]), float64(gu[tk*2*hid+hid+i])
						want[tk*hid+i] = float32(g / (1 + math.Exp(-g)) * u)
					}
				}
				check("silu_mul hidden "+strconv.Itoa(hid), getT(h, len(want)), want)
			}
			// The RoPE table: f32 roundings of the double cos/sin.
			half := b.cfg.HeadDim / 2
			tab := make([]float32, 2*b.ropeN*half)
			if err := b.cx.MemcpyDtoH(unsafe.Slice((*byte)(unsafe.Pointer(&tab[0])), len(tab)*4), b.ropeTab); err != nil {
				t.Fatal(err)
			}
			inv := b.cfg.InvFreq()
			bad := 0
			for _, p := range []int{0, 1, 2, 77, 255, 1000, b.ropeN - 1} {
				for i := range half {
					a := float64(p) * inv[i]
					c, s := tab[2*(p*half+i)], tab[2*(p*half+i)+1]
					if math.Abs(float64(c)-math.Cos(a)) > 1e-6 || math.Abs(float64(s)-math.Sin(a)) > 1e-6 {
						bad++
					}
				}
			}
			if bad > 0 {
				t.Errorf("RoPE table: %d entries off by more than 1e-6", bad)
			}
		})
	}
}
