package cuda

import (
	"math"
	"testing"
	"unsafe"

	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

// hopper reports whether b's device is compute capability 9.0, where attn.cu
// is built for sm_90a (attn_prefill4).
func hopper(t *testing.T, b *Backend) bool {
	major, minor, err := b.dev.ComputeCapability()
	if err != nil {
		t.Fatal(err)
	}
	return major == 9 && minor == 0
}

// TestWgmmaProbe checks the shared-memory layout and descriptors that
// attn_prefill4 hands to wgmma, and its reading of the accumulator and A
// register fragments, on one warpgroup against float64 products: mode 0 is
// its S = Q.K^T (both operands K-major), mode 1 its O = P.V (P from
// registers, V read N-major).
func TestWgmmaProbe(t *testing.T) {
	b := newOrSkip(t, headDim128(t), Options{PageSize: 16, Pages: 64})
	if !hopper(t, b) {
		t.Skip("needs a compute capability 9.0 device (sm_90a)")
	}
	if b.fn.hopperErr != nil || b.fn.tcMod == nil {
		t.Fatalf("attn.cu for sm_90a: %v", b.fn.hopperErr)
	}
	fn, err := b.fn.tcMod.Function("wgmma_probe")
	if err != nil {
		t.Fatal(err)
	}
	const hd = 128
	r := newRand(21)
	bits := func() ([]uint16, []float64) {
		h, v := make([]uint16, 64*hd), make([]float64, 64*hd)
		for i := range h {
			h[i] = uint16(math.Float32bits(float32(r.Float64()*2-1)) >> 16)
			v[i] = float64(math.Float32frombits(uint32(h[i]) << 16))
		}
		return h, v
	}
	ah, av := bits()
	bh, bv := bits()
	k := &kbench{t: t, b: b}
	defer k.free()
	dev := func(h []uint16) cu.DevicePtr {
		p := k.alloc(uint64(len(h) * 2))
		if err := b.cx.MemcpyHtoD(p, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(h))), len(h)*2)); err != nil {
			t.Fatal(err)
		}
		return p
	}
	a, bm, d := dev(ah), dev(bh), k.alloc(64*hd*4)
	for mode := range 2 {
		cols := hd
		want := make([]float32, 64*hd)
		if mode == 0 {
			cols = 64
		}
		for i := range 64 {
			for j := range cols {
				var sum float64
				if mode == 0 {
					for x := range hd {
						sum += av[i*hd+x] * bv[j*hd+x]
					}
				} else {
					for x := range 64 {
						sum += av[i*hd+x] * bv[x*hd+j]
					}
				}
				want[i*cols+j] = float32(sum)
			}
		}
		want = want[:64*cols]
		if err := b.stream.MemsetD8(d, 0xff, 64*hd*4); err != nil {
			t.Fatal(err)
		}
		k.launch(fn, cu.D1(1), cu.D1(128), 2*64*hd*2+1024, d, a, bm, int32(mode))
		got := f32s(k.get(d, uint64(64*cols*4)))
		e := relErr(got, want)
		t.Logf("mode %d: rel err %.3g", mode, e)
		if !(e < 1e-5) {
			t.Errorf("mode %d: rel err %.3g vs float64 (first values %v, want %v)", mode, e, got[:4], want[:4])
		}
	}
}
