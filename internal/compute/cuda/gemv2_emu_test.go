package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"
)

// TestGEMV2Emulated runs llama.cu's fused decode GEMVs on the host through
// cudaemu.h (bf16, head dim 64), each against a float64 sum of the same
// operands (within 1e-5 of the sum of |w||x|): gemv2_plain at 1 to 4 tokens,
// X staged and read from global memory, equal to gemv_f32out bit for bit,
// and gemv2_plain_ks split over 1 (the same bits), 2, 4 and 8 warps (tuning
// g2Split), on grids smaller and larger than the units; gemv2_comb equal bit
// for bit to attn_combine followed by gemv2_plain(_ks) over its row, with and
// without a sliding window and split; gemv2_norm_ks split as not; and
// gemv2_qkn's rows equal gemv2_norm's, its q and KV writes equal
// qk_norm_rope's over those rows (blocks.cu, emulated too) bit for bit, its
// head counters back at zero.
func TestGEMV2Emulated(t *testing.T) {
	const hd = 64
	src, _ := filepath.Abs("../../../csrc/llama/llama.cu")
	bin := emuCompile(t, "llama_emu", fmt.Sprintf("-DHEAD_DIM=%d", hd), "-DUSE_BF16=1", "-DGQA_GROUP=4", "-DATT_SPLIT=128",
		"-DATT_THREADS=128", "-DMC_V2=1", "-DFA2_WARPS=4", `-DLLAMA_CU="`+src+`"`)
	r := rand.New(rand.NewPCG(11, 12))
	bits := func(what string, got, want []float32) {
		t.Helper()
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("%s: output %d %v, want %v bit for bit", what, i, got[i], want[i])
			}
		}
	}
	near := func(what string, got []float32, want, mag []float64, rel float64) {
		t.Helper()
		for i := range want {
			if d := math.Abs(float64(got[i]) - want[i]); !(d <= rel*mag[i]+1e-6) {
				t.Fatalf("%s: output %d %v, want %v (|w||x| %g)", what, i, got[i], want[i], mag[i])
			}
		}
	}
	// dot is y0 + W . x for each token and row, and the sums of magnitudes.
	dot := func(W, x []float32, y0 []float32, n, out, in int) (want, mag []float64) {
		want, mag = make([]float64, n*out), make([]float64, n*out)
		for tk := range n {
			for o := range out {
				s, a := 0.0, 0.0
				if y0 != nil {
					s, a = float64(y0[tk*out+o]), math.Abs(float64(y0[tk*out+o]))
				}
				for i := range in {
					v := float64(W[o*in+i]) * float64(x[tk*in+i])
					s, a = s+v, a+math.Abs(v)
				}
				want[tk*out+o], mag[tk*out+o] = s, a
			}
		}
		return want, mag
	}

	for _, tc := range []struct{ n, out, in, ks, grid int }{
		{1, 37, 1024, 1, 3}, {3, 64, 2048, 2, 5}, {4, 50, 512, 4, 100}, {1, 129, 2048, 8, 16}, {2, 21, 1024, 8, 1},
		{4, 9, 8192, 2, 2}, // X past 32 KiB: read from global memory
	} {
		name := fmt.Sprintf("gemv2_plain %+v", tc)
		X, W := bf16Round(randF32(r, tc.n*tc.in, 1)), bf16Round(randF32(r, tc.out*tc.in, 0.1))
		y0 := randF32(r, tc.n*tc.out, 1)
		var in bytes.Buffer
		put(t, &in, int32(1), int32(tc.n), int32(tc.out), int32(tc.in), int32(tc.ks), int32(tc.grid))
		putT(t, &in, true, X)
		putT(t, &in, true, W)
		put(t, &in, y0)
		m := tc.n * tc.out
		got := emuCall[float32](t, bin, &in, 3*m)
		ref, plain, y := got[:m], got[m:2*m], got[2*m:]
		want, mag := dot(W, X, y0, tc.n, tc.out, tc.in)
		near(name+" gemv_f32out", ref, want, mag, 1e-5)
		bits(name+" gemv2_plain vs gemv_f32out", plain, ref)
		near(name+" gemv2_plain_ks", y, want, mag, 1e-5)
		if tc.ks == 1 {
			bits(name+" gemv2_plain_ks vs gemv_f32out", y, ref)
		}
	}

	for _, tc := range []struct{ heads, nsplit, pos, window, out, ks, grid int }{
		{8, 10, 1000, 0, 96, 1, 4}, {8, 10, 1000, 300, 96, 2, 40}, {4, 1, 5, 0, 33, 1, 2}, {16, 16, 2047, 0, 64, 4, 7},
	} {
		name := fmt.Sprintf("gemv2_comb %+v", tc)
		qd := tc.heads * hd
		po := randF32(r, tc.heads*tc.nsplit*hd, 1)
		ml := make([]float32, tc.heads*tc.nsplit*2)
		for i := 0; i < len(ml); i += 2 {
			ml[i], ml[i+1] = float32(r.Float64()*4-2), float32(0.5+r.Float64()*1.5)
		}
		W, y0 := bf16Round(randF32(r, tc.out*qd, 0.1)), randF32(r, tc.out, 1)
		var in bytes.Buffer
		put(t, &in, int32(2), int32(tc.heads), int32(tc.nsplit), int32(tc.pos), int32(tc.window), int32(tc.out), int32(tc.ks),
			int32(tc.grid), po, ml)
		putT(t, &in, true, W)
		put(t, &in, y0)
		got := emuCall[float32](t, bin, &in, 2*tc.out)
		ref, y := got[:tc.out], got[tc.out:]
		bits(name+" vs attn_combine + gemv2_plain_ks", y, ref)
		// the merge in float64, rounded to bf16 as the kernels store it
		ns, s0 := (tc.pos+128)/128, 0
		if tc.window > 0 {
			s0 = max(0, tc.pos+1-tc.window) / 128
		}
		att := make([]float32, qd)
		for h := range tc.heads {
			M := math.Inf(-1)
			for s := s0; s < ns; s++ {
				M = math.Max(M, float64(ml[(h*tc.nsplit+s)*2]))
			}
			L := 0.0
			for s := s0; s < ns; s++ {
				L += float64(ml[(h*tc.nsplit+s)*2+1]) * math.Exp(float64(ml[(h*tc.nsplit+s)*2])-M)
			}
			for d := range hd {
				a := 0.0
				for s := s0; s < ns; s++ {
					a += float64(po[(h*tc.nsplit+s)*hd+d]) * math.Exp(float64(ml[(h*tc.nsplit+s)*2])-M)
				}
				att[h*hd+d] = float32(a / L)
			}
		}
		want, mag := dot(W, bf16Round(att), y0, 1, tc.out, qd)
		near(name, y, want, mag, 1e-2) // a merged element may round to the other bf16 neighbour
	}

	qknEmulated(t, bin)

	for _, ks := range []int{1, 2, 4} {
		const n, out, in = 2, 70, 1024
		name := fmt.Sprintf("gemv2_norm ks %d", ks)
		rr := rand.New(rand.NewPCG(5, 6)) // the same operands for every ks
		x, nw, W := randF32(rr, n*in, 1), randF32(rr, in, 0.5), bf16Round(randF32(rr, out*in, 0.1))
		for i := range nw {
			nw[i]++
		}
		var buf bytes.Buffer
		put(t, &buf, int32(3), int32(n), int32(out), int32(in), int32(ks), int32(3), rmsVT(in), float32(1e-5), x, nw)
		putT(t, &buf, true, W)
		raw := emuCall[byte](t, bin, &buf, n*out*4+n*in*2)
		var y []float32
		var xo []uint16
		for i := range n * out {
			y = append(y, math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:])))
		}
		for i := range n * in {
			xo = append(xo, binary.LittleEndian.Uint16(raw[n*out*4+2*i:]))
		}
		xs := bf16Floats(xo)
		// the normalised rows against rmsnorm's definition, within a bf16 rounding
		for tk := range n {
			ss := 0.0
			for i := range in {
				ss += float64(x[tk*in+i]) * float64(x[tk*in+i])
			}
			sc := 1 / math.Sqrt(ss/in+1e-5)
			for i := range in {
				want := float64(nw[i]) * sc * float64(x[tk*in+i])
				if d := math.Abs(float64(xs[tk*in+i]) - want); d > math.Abs(want)/128+1e-6 {
					t.Fatalf("%s: normalised x[%d][%d] %v, want %v", name, tk, i, xs[tk*in+i], want)
				}
			}
		}
		want, mag := dot(W, xs, nil, n, out, in)
		near(name, y, want, mag, 1e-5)
	}
}

// qknEmulated checks gemv2_qkn (llama_emu, bin) against gemv2_norm and
// qk_norm_rope (blocks_emu) over tokens with and without a KV slot, the
// table's positions and past it, with and without a bias and interleaving.
func qknEmulated(t *testing.T, bin string) {
	const hd, half, n, nh, nkv, ntab, in = 64, 32, 3, 4, 2, 16, 512
	blocks := blocksEmu(t, hd, true)
	r := rand.New(rand.NewPCG(13, 14))
	W, QD, KVD := (nh+2*nkv)*hd, nh*hd, nkv*hd
	pos := []int32{3, ntab, 70000}
	slot := []int64{int64(2 * KVD), -1, 0}
	ce := 3 * KVD
	inv := make([]float64, half)
	for i := range inv {
		inv[i] = math.Pow(1e6, -float64(2*i)/float64(hd))
	}
	tab := make([]float32, ntab*half*2)
	for p := range ntab {
		for i := range half {
			a := float64(p) * inv[i]
			tab[2*(p*half+i)], tab[2*(p*half+i)+1] = float32(math.Cos(a)), float32(math.Sin(a))
		}
	}
	const eps = float32(1e-6)
	for _, hb := range []int32{0, 1} {
		for _, il := range []int32{0, 1} {
			name := fmt.Sprintf("gemv2_qkn bias %d interleaved %d", hb, il)
			x, nw := randF32(r, n*in, 1), randF32(r, in, 0.3)
			for i := range nw {
				nw[i]++
			}
			Wt, bias := bf16Round(randF32(r, W*in, 0.1)), randF32(r, W, 0.5)
			qw, kw := randF32(r, hd, 0.3), randF32(r, hd, 0.3)
			for i := range qw {
				qw[i], kw[i] = 1+qw[i], 1+kw[i]
			}
			var buf bytes.Buffer
			put(t, &buf, int32(4), int32(n), int32(nh), int32(nkv), hb, il, int32(ntab), int32(ce), int32(in), int32(5), rmsVT(in),
				eps, x, nw)
			putT(t, &buf, true, Wt)
			put(t, &buf, bias, qw, kw, pos, slot, tab, inv)
			sz := 2*n*W*4 + (n*QD+2*ce)*2 + (nh+2*nkv)*4
			raw := emuCall[byte](t, bin, &buf, sz)
			f32s := func(b []byte) []float32 {
				v := make([]float32, len(b)/4)
				for i := range v {
					v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
				}
				return v
			}
			plain, fused := f32s(raw[:n*W*4]), f32s(raw[n*W*4:2*n*W*4])
			for i := range plain {
				if math.Float32bits(plain[i]) != math.Float32bits(fused[i]) {
					t.Fatalf("%s: qkv %d %v, gemv2_norm's %v", name, i, fused[i], plain[i])
				}
			}
			writes := raw[2*n*W*4 : 2*n*W*4+(n*QD+2*ce)*2]
			for i, c := range raw[2*n*W*4+(n*QD+2*ce)*2:] {
				if c != 0 {
					t.Fatalf("%s: head counter byte %d is %d after the launch", name, i, c)
				}
			}
			var ref bytes.Buffer
			put(t, &ref, int32(6), int32(n), int32(nh), int32(nkv), hb, il, int32(ntab), int32(ce), eps, plain, bias, qw, kw,
				pos, slot, tab, inv)
			want := emuCall[byte](t, blocks, &ref, (n*QD+2*ce)*2)
			if !bytes.Equal(writes, want) {
				for i := range want {
					if writes[i] != want[i] {
						t.Fatalf("%s: q/kc/vc byte %d %#x, qk_norm_rope's %#x", name, i, writes[i], want[i])
					}
				}
			}
			if bytes.Count(want, []byte{0xff, 0xff}) == len(want)/2 {
				t.Fatalf("%s: qk_norm_rope wrote nothing", name)
			}
		}
	}
}
