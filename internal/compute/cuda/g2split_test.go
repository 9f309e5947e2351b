package cuda

import (
	"encoding/binary"
	"fmt"
	"math"
	"runtime"
	"testing"

	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

// TestG2Split runs gemv2_plain_ks and gemv2_norm_ks with their units split
// over 1, 2, 4 and 8 warps (tuning g2Split) on random bf16 data, on full grids
// and on grids of a few blocks (the block loop), against float64 sums of
// the same operands: every output within 1e-5 of the sum of |w||x|; ks 1
// equal to gemv_f32out bit for bit (plain); each split twice the same bits;
// gemv2_norm's normalised rows (xo) equal for every ks; and g2Split's
// choice at the MoE shapes it is meant for (wo, router) and not for the
// dense ones.
func TestG2Split(t *testing.T) {
	m := headDim128(t)
	b := newOrSkip(t, m, Options{DType: "bfloat16", PageSize: 16, Pages: 16, tune: tuning{g2Split: 8}})
	if b.fn.g2Plain == nil || b.fn.g2Norm == nil || b.fn.gemvF32 == nil {
		t.Fatalf("gemv2 set not loaded (v2: %v)", b.fn.v2Err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		t.Fatal(err)
	}
	k := &kbench{t: t, b: b}
	defer k.free()
	f := &b.fn
	split, splitN := f.g2Splits[f.g2Plain], f.g2Splits[f.g2Norm]
	if split == nil || splitN == nil {
		t.Fatal("gemv2_plain_ks or gemv2_norm_ks not loaded with tuning g2Split")
	}
	res := f.g2Blocks[split] * (g2Threads / 32)
	t.Logf("gemv2_plain: %d warps resident", res)
	// The most warps a unit (a power of two up to 8) that stay resident and
	// leave every warp a chunk a lane: the MoE router (64 units) gets 8.
	for _, c := range [][2]int{{1024, 4096}, {64, 2048}, {2048, 4096}, {2560, 2048}, {64, 128}, {8, 2048}} {
		units, in := c[0], c[1]
		fn, _, ks32 := b.g2Split(f.g2Plain, units, in)
		ks, nc := int(ks32), in/8
		fits := func(k int) bool { return k <= 8 && units*k <= res && nc%k == 0 && nc/k >= 32 }
		if ks&(ks-1) != 0 || ks > 1 && !fits(ks) || fits(2*ks) {
			t.Errorf("g2Split(%d units, in %d) = %d of %d resident warps", units, in, ks, res)
		}
		if (fn == f.g2Plain) != (ks == 1) {
			t.Errorf("g2Split(%d units, in %d): %s for %d warps a unit", units, in, fn.Name, ks)
		}
	}
	if _, _, ks := b.g2Split(f.g2Plain, 64, 2048); ks != 8 {
		t.Errorf("g2Split(64 units, in 2048) = %d, want 8", ks)
	}
	off := newOrSkip(t, m, Options{DType: "bfloat16", PageSize: 16, Pages: 16})
	if _, _, ks := off.g2Split(off.fn.g2Plain, 64, 2048); ks != 1 {
		t.Errorf("without tuning g2Split: %d warps a unit, want 1", ks)
	}

	bf := func(p cu.DevicePtr, n int) []float64 {
		raw := k.get(p, uint64(n*2))
		v := make([]float64, n)
		for i := range v {
			v[i] = float64(math.Float32frombits(uint32(binary.LittleEndian.Uint16(raw[2*i:])) << 16))
		}
		return v
	}
	f32 := func(p cu.DevicePtr, n int) []float32 {
		raw := k.get(p, uint64(n*4))
		v := make([]float32, n)
		for i := range v {
			v[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		return v
	}
	check := func(what string, got []float32, want, mag []float64) {
		t.Helper()
		for i := range want {
			if d := math.Abs(float64(got[i]) - want[i]); !(d <= 1e-5*mag[i]+1e-6) {
				t.Fatalf("%s: output %d %v, want %v (|w||x| %g)", what, i, got[i], want[i], mag[i])
			}
		}
	}
	same := func(what string, a, b []float32) {
		t.Helper()
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("%s: output %d %v vs %v", what, i, a[i], b[i])
			}
		}
	}

	// gemv2_plain: Y = X . W^T + Y.
	const out, in = 1000, 4096
	W, y0, Y := k.alloc(out*in*2), k.alloc(4*out*4), k.alloc(4*out*4)
	X := k.alloc(4 * in * 2)
	k.randT(W, out*in, 1, 0.05)
	k.randT(X, 4*in, 2, 1)
	k.randF(y0, 4*out, 3, 1, 0)
	wh, xh, yh := bf(W, out*in), bf(X, 4*in), f32(y0, 4*out)
	for _, n := range []int{1, 3} {
		want, mag := make([]float64, n*out), make([]float64, n*out)
		for tk := range n {
			for o := range out {
				s, a := float64(yh[tk*out+o]), math.Abs(float64(yh[tk*out+o]))
				for i := range in {
					v := wh[o*in+i] * xh[tk*in+i]
					s, a = s+v, a+math.Abs(v)
				}
				want[tk*out+o], mag[tk*out+o] = s, a
			}
		}
		reset := func() {
			k.sync()
			if err := b.cx.MemcpyDtoD(Y, y0, uint64(n*out*4)); err != nil {
				t.Fatal(err)
			}
		}
		reset()
		k.launch(f.gemvF32, cu.D1(uint32((out+7)/8)), cu.D1(256), 0, Y, X, W, int32(n), int32(out), int32(in), float32(1))
		ref := f32(Y, n*out)
		check("gemv_f32out", ref, want, mag)
		xb, stage := g2Stage(n, in)
		for _, ks := range []int{1, 2, 4, 8} {
			for _, grid := range []uint32{uint32(ceilDiv((out+1)/2*ks, 8)), 7} {
				var runs [2][]float32
				for r := range runs {
					reset()
					k.launch(split, cu.D1(grid), cu.D1(g2Threads), xb, Y, X, W, int32(n), int32(out), int32(in), float32(1),
						stage, int32(ks))
					runs[r] = f32(Y, n*out)
				}
				what := fmt.Sprintf("gemv2_plain_ks n %d ks %d grid %d", n, ks, grid)
				check(what, runs[0], want, mag)
				same(what+": second run", runs[0], runs[1])
				if ks == 1 {
					same(what+" vs gemv_f32out", runs[0], ref)
				}
			}
		}
	}

	// gemv2_norm: Y = rmsnorm(x[rows]) * nw . W^T, xo the normalised rows.
	const nout, nin, n = 130, 2048, 2
	Wn, xf, nw, Yn, xo := k.alloc(nout*nin*2), k.alloc(3*nin*4), k.alloc(nin*4), k.alloc(n*nout*4), k.alloc(n*nin*2)
	rows := k.alloc(n * 4)
	k.randT(Wn, nout*nin, 4, 0.05)
	k.randF(xf, 3*nin, 5, 1, 0)
	k.randF(nw, nin, 6, 0.5, 1)
	k.put(rows, []int32{2, 0})
	var xoRef []float64
	var refs []float32
	for _, ks := range []int{1, 2, 4, 8} {
		k.launch(splitN, cu.D1(uint32(min(ceilDiv((nout+1)/2*ks, 8), 5))), cu.D1(g2Threads), uint32(n*nin*2), Yn, xf, nw, rows,
			Wn, int32(n), int32(nout), int32(nin), rmsVT(nin), float32(1e-5), xo, int32(ks))
		got, xs := f32(Yn, n*nout), bf(xo, n*nin)
		if ks == 1 {
			refs, xoRef = got, xs
			wh := bf(Wn, nout*nin)
			want, mag := make([]float64, n*nout), make([]float64, n*nout)
			for tk := range n {
				for o := range nout {
					var s, a float64
					for i := range nin {
						v := wh[o*nin+i] * xs[tk*nin+i]
						s, a = s+v, a+math.Abs(v)
					}
					want[tk*nout+o], mag[tk*nout+o] = s, a
				}
			}
			check("gemv2_norm ks 1", got, want, mag)
			continue
		}
		for i := range xs {
			if xs[i] != xoRef[i] {
				t.Fatalf("gemv2_norm ks %d: normalised row element %d %v, ks 1 %v", ks, i, xs[i], xoRef[i])
			}
		}
		for i := range got {
			if d := math.Abs(float64(got[i] - refs[i])); !(d <= 1e-5*(math.Abs(float64(refs[i]))+1)) {
				t.Fatalf("gemv2_norm ks %d: output %d %v, ks 1 %v", ks, i, got[i], refs[i])
			}
		}
	}
}
