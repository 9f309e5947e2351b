package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
)

// blocksEmu compiles testdata/blocks_emu.cpp with csrc/llama/blocks.cu for
// a head dim and storage type, and any further macros.
func blocksEmu(t *testing.T, headDim int, bf16 bool, defs ...string) string {
	t.Helper()
	src, _ := filepath.Abs("../../../csrc/llama/blocks.cu")
	bf := 0
	if bf16 {
		bf = 1
	}
	return emuCompile(t, "blocks_emu", append([]string{fmt.Sprintf("-DHEAD_DIM=%d", headDim), fmt.Sprintf("-DUSE_BF16=%d", bf),
		`-DBLOCKS_CU="` + src + `"`}, defs...)...)
}

// emuCompile builds testdata/<name>.cpp, a kernel emulation through
// cudaemu.h, with the given defines; it skips without a C++ compiler (or
// off x86-64). -O0: an optimiser may split one __syncthreads into a call
// per branch, which the emulation's check for divergent barriers (by call
// site) would take for divergence.
func emuCompile(t *testing.T, name string, defines ...string) string {
	t.Helper()
	if runtime.GOARCH != "amd64" {
		t.Skip("the kernel emulation switches coroutines in x86-64 assembly")
	}
	cxx, err := exec.LookPath("g++")
	if err != nil {
		if cxx, err = exec.LookPath("clang++"); err != nil {
			t.Skip("no C++ compiler for the kernel emulation")
		}
	}
	bin := filepath.Join(t.TempDir(), name)
	args := append([]string{"-std=c++20", "-O0", "-ffp-contract=off"}, defines...)
	cmd := exec.Command(cxx, append(args, "-Itestdata", "testdata/"+name+".cpp", "-o", bin)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building the kernel emulation: %v\n%s", err, out)
	}
	return bin
}

// emuCall runs the emulation over the input in and reads n values of
// type V from its output.
func emuCall[V any](t *testing.T, bin string, in *bytes.Buffer, n int) []V {
	t.Helper()
	dir := t.TempDir()
	ip, op := filepath.Join(dir, "in"), filepath.Join(dir, "out")
	if err := os.WriteFile(ip, in.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(bin, ip, op).CombinedOutput(); err != nil {
		t.Fatalf("emulation: %v\n%s", err, out)
	}
	b, err := os.ReadFile(op)
	if err != nil {
		t.Fatal(err)
	}
	v := make([]V, n)
	if err := binary.Read(bytes.NewReader(b), binary.LittleEndian, v); err != nil {
		t.Fatalf("emulation output of %d bytes: %v", len(b), err)
	}
	return v
}

func put(t *testing.T, w *bytes.Buffer, v ...any) {
	for _, x := range v {
		if err := binary.Write(w, binary.LittleEndian, x); err != nil {
			t.Fatal(err)
		}
	}
}

func randF32(r *rand.Rand, n int, s float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64() * s)
	}
	return v
}

// TestBlockKernelsEmulated runs blocks.cu's kernels on the host (every
// block, its threads as coroutines) against Go references: qk_norm (bias,
// then RMSNorm of each q and k head with its weights; v heads the bias
// only) for a head dim that is not a multiple of 32 and for 128, with and
// without biases; moe_gather exactly; moe_combine with and without the
// gated shared expert.
func TestBlockKernelsEmulated(t *testing.T) {
	for _, tc := range []struct {
		hd   int
		bf16 bool
	}{{48, true}, {128, false}} {
		t.Run(fmt.Sprintf("hd%d", tc.hd), func(t *testing.T) {
			bin := blocksEmu(t, tc.hd, tc.bf16)
			r := rand.New(rand.NewPCG(1, uint64(tc.hd)))
			hd := tc.hd
			for _, hb := range []int32{0, 1} {
				const n, nh, nkv = 3, 4, 2
				const eps = float32(1e-6)
				W := (nh + 2*nkv) * hd
				qkv, bias := randF32(r, n*W, 2), randF32(r, W, 0.5)
				qw, kw := randF32(r, hd, 1), randF32(r, hd, 1)
				var in bytes.Buffer
				put(t, &in, int32(1), int32(n), int32(nh), int32(nkv), hb, eps, qkv, bias, qw, kw)
				got := emuCall[float32](t, bin, &in, n*W)
				for tk := 0; tk < n; tk++ {
					for h := 0; h < nh+2*nkv; h++ {
						x := make([]float64, hd)
						ss := 0.0
						for i := range x {
							x[i] = float64(qkv[tk*W+h*hd+i])
							if hb == 1 {
								x[i] = float64(qkv[tk*W+h*hd+i] + bias[h*hd+i])
							}
							ss += x[i] * x[i]
						}
						sc := 1 / math.Sqrt(ss/float64(hd)+float64(eps))
						for i := range x {
							g := float64(got[tk*W+h*hd+i])
							want := x[i]
							switch {
							case h < nh:
								want = float64(qw[i]) * sc * x[i]
							case h < nh+nkv:
								want = float64(kw[i]) * sc * x[i]
							}
							if math.Abs(g-want) > 1e-5*(1+math.Abs(want)) {
								t.Fatalf("qk_norm bias %d token %d head %d elem %d: %v, want %v", hb, tk, h, i, g, want)
							}
						}
					}
				}
			}

			// moe_gather: rows of T (bf16 bits or f32 bits), copied exactly.
			const toks, dim, rows = 5, 72, 9
			src := make([]int32, rows)
			for i := range src {
				src[i] = int32(r.IntN(toks))
			}
			var in bytes.Buffer
			put(t, &in, int32(2), int32(rows), int32(toks), int32(dim), src)
			if tc.bf16 {
				xb := make([]uint16, toks*dim)
				for i := range xb {
					xb[i] = uint16(r.Uint32())
				}
				put(t, &in, xb)
				got := emuCall[uint16](t, bin, &in, rows*dim)
				for i := range rows {
					for j := range dim {
						if got[i*dim+j] != xb[int(src[i])*dim+j] {
							t.Fatalf("moe_gather row %d elem %d: %#x, want %#x", i, j, got[i*dim+j], xb[int(src[i])*dim+j])
						}
					}
				}
			} else {
				xb := randF32(r, toks*dim, 1)
				put(t, &in, xb)
				got := emuCall[float32](t, bin, &in, rows*dim)
				for i := range rows {
					for j := range dim {
						if got[i*dim+j] != xb[int(src[i])*dim+j] {
							t.Fatalf("moe_gather row %d elem %d: %v, want %v", i, j, got[i*dim+j], xb[int(src[i])*dim+j])
						}
					}
				}
			}

			// moe_combine.
			for _, hs := range []int32{0, 1} {
				const n, k, gs = 4, 3, 5
				x, ye := randF32(r, n*dim, 1), randF32(r, n*k*dim, 1)
				row := r.Perm(n * k)
				rows := make([]int32, n*k)
				for i, v := range row {
					rows[i] = int32(v)
				}
				w, sh, gate := randF32(r, n*k, 0.5), randF32(r, n*dim, 1), randF32(r, n*gs, 2)
				var in bytes.Buffer
				put(t, &in, int32(3), int32(n), int32(k), int32(dim), hs, int32(gs), x, ye, rows, w, sh, gate)
				got := emuCall[float32](t, bin, &in, n*dim)
				for tk := 0; tk < n; tk++ {
					g := 1 / (1 + math.Exp(-float64(gate[tk*gs])))
					for i := 0; i < dim; i++ {
						o := 0.0
						for j := 0; j < k; j++ {
							o += float64(w[tk*k+j]) * float64(ye[int(rows[tk*k+j])*dim+i])
						}
						if hs == 1 {
							o += g * float64(sh[tk*dim+i])
						}
						want := float64(x[tk*dim+i]) + o
						if d := math.Abs(float64(got[tk*dim+i]) - want); d > 1e-5*(1+math.Abs(want)) {
							t.Fatalf("moe_combine shared %d token %d elem %d: %v, want %v", hs, tk, i, got[tk*dim+i], want)
						}
					}
				}
			}
		})
	}
}

// TestRouteEmulated runs moe_topk and moe_sort, and moe_route (its
// one-token form at n 1), on the host against their definition: each token's k highest logits of the first e (ties to the
// lower id), the softmax probabilities over all e (renormalised or not),
// the pairs sorted by expert in pair order within an expert, each expert's
// offsets and the list of experts with rows.
func TestRouteEmulated(t *testing.T) {
	bin := blocksEmu(t, 64, true)
	r := rand.New(rand.NewPCG(3, 4))
	for _, tc := range []struct {
		n, e, k, stride int
		norm            bool
	}{{1, 8, 2, 8, true}, {7, 16, 4, 17, true}, {33, 8, 2, 9, false}, {5, 128, 8, 128, true}, {4, 4, 4, 4, false},
		{300, 128, 8, 129, true}, {3, 512, 8, 512, false}, {64, 60, 4, 61, true},
		{1, 128, 8, 129, true}, {1, 512, 8, 512, false}, {1, 60, 4, 60, true}, {1, 4, 4, 4, true}} {
		logits := randF32(r, tc.n*tc.stride, 1)
		if tc.n > 4 || tc.n == 1 && tc.e > 4 {
			// ties at the top: across lanes (1, 2) and within one (1, 33)
			t0 := min(tc.n-1, 1) * tc.stride
			logits[t0+1], logits[t0+2] = 5, 5
			if tc.e > 33 {
				logits[t0+33] = 5
			}
		}
		nk := tc.n * tc.k
		norm := int32(0)
		if tc.norm {
			norm = 1
		}
		var sep []int32
		for fused := range int32(2) {
			name := fmt.Sprintf("%+v moe_topk+moe_sort", tc)
			if fused == 1 {
				name = fmt.Sprintf("%+v moe_route", tc)
			}
			var in bytes.Buffer
			put(t, &in, int32(4), int32(tc.n), int32(tc.stride), int32(tc.e), int32(tc.k), norm, fused, logits)
			out := emuCall[int32](t, bin, &in, 4*nk+2*tc.e+2)
			checkRoute(t, name, out, logits, tc.n, tc.e, tc.k, tc.stride, tc.norm)
			if fused == 0 {
				sep = out
				continue
			}
			// the same bits (act past nact is not written)
			nact := int(out[4*nk+2*tc.e+1])
			for i := range 4*nk + tc.e + 1 + nact {
				if out[i] != sep[i] {
					t.Fatalf("%s: output word %d %#x, moe_topk+moe_sort's %#x", name, i, out[i], sep[i])
				}
			}
		}
	}
}

// checkRoute checks one routing result (out: ids, weights, rows, src,
// offs, act, nact) against the definition.
func checkRoute(t *testing.T, tc string, out []int32, logits []float32, n, e, k, stride int, norm bool) {
	t.Helper()
	nk := n * k
	ids, wts, rows, src := out[:nk], out[nk:2*nk], out[2*nk:3*nk], out[3*nk:4*nk]
	offs, act, nact := out[4*nk:4*nk+e+1], out[4*nk+e+1:4*nk+2*e+1], int(out[4*nk+2*e+1])
	var wantAct []int32
	for x := 0; x < e; x++ {
		if offs[x+1] < offs[x] {
			t.Fatalf("%s: offsets fall at expert %d", tc, x)
		}
		if offs[x+1] > offs[x] {
			wantAct = append(wantAct, int32(x))
		}
	}
	if offs[0] != 0 || int(offs[e]) != nk {
		t.Fatalf("%s: offsets span [%d, %d), want [0, %d)", tc, offs[0], offs[e], nk)
	}
	if nact != len(wantAct) || fmt.Sprint(act[:nact]) != fmt.Sprint(wantAct) {
		t.Fatalf("%s: active experts %v, want %v", tc, act[:min(nact, e)], wantAct)
	}
	seen := make([]bool, nk)
	for tk := 0; tk < n; tk++ {
		l := logits[tk*stride : tk*stride+e]
		order := make([]int, e)
		for i := range order {
			order[i] = i
		}
		// stable selection: larger first, lower id on ties
		for i := 0; i < k; i++ {
			for j := i + 1; j < e; j++ {
				if l[order[j]] > l[order[i]] || (l[order[j]] == l[order[i]] && order[j] < order[i]) {
					order[i], order[j] = order[j], order[i]
				}
			}
		}
		mx := math.Inf(-1)
		for _, v := range l {
			mx = math.Max(mx, float64(v))
		}
		sum, sel := 0.0, 0.0
		for _, v := range l {
			sum += math.Exp(float64(v) - mx)
		}
		for j := 0; j < k; j++ {
			sel += math.Exp(float64(l[order[j]])-mx) / sum
		}
		for j := 0; j < k; j++ {
			p := tk*k + j
			id := order[j]
			if int(ids[p]) != id {
				t.Fatalf("%s: token %d rank %d: expert %d, want %d", tc, tk, j, ids[p], id)
			}
			row := int(rows[p])
			if row < 0 || row >= nk || seen[row] {
				t.Fatalf("%s: row %d out of range or used twice", tc, row)
			}
			seen[row] = true
			if row < int(offs[id]) || row >= int(offs[id+1]) {
				t.Fatalf("%s: token %d rank %d (expert %d) in row %d, outside the expert's rows", tc, tk, j, id, row)
			}
			if int(src[row]) != tk {
				t.Fatalf("%s: row %d's source token %d, want %d", tc, row, src[row], tk)
			}
			want := math.Exp(float64(l[id])-mx) / sum
			if norm {
				want /= sel
			}
			if g := float64(math.Float32frombits(uint32(wts[p]))); math.Abs(g-want) > 1e-6 {
				t.Fatalf("%s: token %d rank %d weight %v, want %v", tc, tk, j, g, want)
			}
		}
	}
	// Pair order within each expert.
	for p := 1; p < nk; p++ {
		for q := 0; q < p; q++ {
			if ids[q] == ids[p] && rows[q] > rows[p] {
				t.Fatalf("%s: pairs %d and %d of expert %d out of order", tc, q, p, ids[p])
			}
		}
	}
}

// TestGroupedGEMVEmulated runs moe_gemv_silu and moe_gemv_down on the host
// over a routing with experts of 0 to 9 rows (more than one 4-row group)
// and k lengths below, at and past one 1024-element pass, in bf16 and
// float32, against float64 references: every output row written, each
// within the storage type's rounding; moe_gemv_silu1 equal to
// moe_gemv_silu bit for bit.
func TestGroupedGEMVEmulated(t *testing.T) {
	for _, bf := range []bool{true, false} {
		bin := blocksEmu(t, 64, bf)
		r := rand.New(rand.NewPCG(7, 8))
		const E, ntok, k = 6, 9, 3
		// routing: token t picks experts (t+j*2) % E for j < k, expert 5 none
		var ids []int
		for tk := 0; tk < ntok; tk++ {
			for j := 0; j < k; j++ {
				ids = append(ids, (tk+j*2)%(E-1))
			}
		}
		_, src, offs, act := sortedRouting(ids, E, k)
		rows := len(ids)
		actE := append(append([]int32(nil), act...), make([]int32, E-len(act))...)
		for _, silu := range []bool{true, false} {
			for _, tc := range []struct{ units, in int }{{13, 40}, {24, 1032}} {
				nrow, xrows := 1, rows
				if silu {
					nrow, xrows = 2, ntok
				}
				X := randF32(r, xrows*tc.in, 1)
				W := randF32(r, E*nrow*tc.units*tc.in, 0.2)
				if bf {
					X, W = bf16Round(X), bf16Round(W)
				}
				run := func(kind int) []float32 {
					var in bytes.Buffer
					put(t, &in, int32(5), int32(kind), int32(E), int32(tc.units), int32(tc.in), int32(rows), int32(ntok), int32(len(act)),
						actE, offs, src)
					putT(t, &in, bf, X)
					putT(t, &in, bf, W)
					if silu && bf {
						return bf16Floats(emuCall[uint16](t, bin, &in, rows*tc.units))
					}
					return emuCall[float32](t, bin, &in, rows*tc.units)
				}
				got := run(b2i(silu))
				if silu {
					// moe_gemv_silu1 (one row a pass, X prefetched): the same bits
					for i, v := range run(2) {
						if math.Float32bits(v) != math.Float32bits(got[i]) {
							t.Fatalf("bf16 %v %+v: moe_gemv_silu1 h[%d][%d] %v, moe_gemv_silu %v", bf, tc, i/tc.units, i%tc.units, v, got[i])
						}
					}
				}
				for e := 0; e < E; e++ {
					for row := int(offs[e]); row < int(offs[e+1]); row++ {
						xr := row
						if silu {
							xr = int(src[row])
						}
						for o := 0; o < tc.units; o++ {
							dot := func(wr int) (float64, float64) {
								var s, a float64
								for i := 0; i < tc.in; i++ {
									v := float64(W[(e*nrow*tc.units+wr)*tc.in+i]) * float64(X[xr*tc.in+i])
									s, a = s+v, a+math.Abs(v)
								}
								return s, a
							}
							want, mag := dot(o)
							tol := 1e-5 * mag
							if silu {
								u, umag := dot(tc.units + o)
								if bf {
									want, u = float64(bf16Round([]float32{float32(want)})[0]), float64(bf16Round([]float32{float32(u)})[0])
								}
								mag = math.Abs(want/(1+math.Exp(-want)))*umag + mag*math.Abs(u)
								want = want / (1 + math.Exp(-want)) * u
								tol = 1e-5*mag + math.Abs(want)*1e-6
								if bf {
									tol += math.Abs(want) / 128
								}
							}
							if g := float64(got[row*tc.units+o]); !(math.Abs(g-want) <= tol+1e-7) {
								t.Fatalf("bf16 %v silu %v %+v: row %d (expert %d) unit %d: %v, want %v (tol %g)", bf, silu, tc, row, e, o,
									g, want, tol)
							}
						}
					}
				}
			}
		}
	}
}

// sortedRouting is moe_sort's result for pairs p (token p/k) choosing
// experts ids[p] of E: each pair's sorted row, each row's token, the
// experts' offsets (E+1) and the experts with rows.
func sortedRouting(ids []int, E, k int) (rows, src, offs, act []int32) {
	offs = make([]int32, E+1)
	for _, id := range ids {
		offs[id+1]++
	}
	for e := 0; e < E; e++ {
		offs[e+1] += offs[e]
	}
	next := append([]int32(nil), offs[:E]...)
	rows, src = make([]int32, len(ids)), make([]int32, len(ids))
	for p, id := range ids {
		rows[p] = next[id]
		src[next[id]] = int32(p / k)
		next[id]++
	}
	for e := 0; e < E; e++ {
		if offs[e+1] > offs[e] {
			act = append(act, int32(e))
		}
	}
	return rows, src, offs, act
}

// TestGEMVDownAddEmulated runs moe_gemv_down_add on the host against
// moe_gemv_down followed by moe_combine (both emulated) over the same
// routing: x bit for bit, in bf16 and float32, with and without the gated
// shared expert, for pair counts below, at and past one DA_P group with
// tokens whose pairs straddle two groups, experts shared between tokens,
// and input lengths below and past one DA_CH pass, in the kernel's default
// build and the variants tuning blocksDefs selects; and, so that equal
// wrong answers cannot pass, x against a float64 reference.
func TestGEMVDownAddEmulated(t *testing.T) {
	for _, v := range []struct {
		bf   bool
		defs []string
	}{{true, nil}, {false, nil}, {true, []string{"-DDA_P=4", "-DDA_PRE=1"}}, {true, []string{"-DDA_CH=1", "-DDA_PRE=1"}}} {
		bf := v.bf
		bin := blocksEmu(t, 64, bf, v.defs...)
		r := rand.New(rand.NewPCG(9, 10))
		for _, tc := range []struct{ E, n, k, out, in int }{{16, 1, 8, 24, 1032}, {6, 5, 3, 13, 40}, {8, 4, 2, 9, 520}, {5, 2, 1, 5, 8}} {
			var ids []int
			for tk := 0; tk < tc.n; tk++ {
				for _, e := range r.Perm(tc.E)[:tc.k] {
					ids = append(ids, e)
				}
			}
			nk := len(ids)
			rows, _, offs, act := sortedRouting(ids, tc.E, tc.k)
			actE := append(append([]int32(nil), act...), make([]int32, tc.E-len(act))...)
			ids32 := make([]int32, nk)
			for i, v := range ids {
				ids32[i] = int32(v)
			}
			const gs = 3
			for hs := range int32(2) {
				X, W := randF32(r, nk*tc.in, 1), randF32(r, tc.E*tc.out*tc.in, 0.2)
				if bf {
					X, W = bf16Round(X), bf16Round(W)
				}
				w, x := randF32(r, nk, 0.5), randF32(r, tc.n*tc.out, 1)
				sh, gate := randF32(r, tc.n*tc.out, 1), randF32(r, tc.n*gs, 2)
				var in bytes.Buffer
				put(t, &in, int32(7), int32(tc.E), int32(tc.out), int32(tc.in), int32(tc.n), int32(tc.k), hs, int32(gs), int32(len(act)),
					ids32, rows, actE, offs)
				putT(t, &in, bf, X)
				putT(t, &in, bf, W)
				put(t, &in, w, x, sh, gate)
				got := emuCall[float32](t, bin, &in, 2*tc.n*tc.out)
				fused, sep := got[:tc.n*tc.out], got[tc.n*tc.out:]
				for i := range fused {
					tk, o := i/tc.out, i%tc.out
					if math.Float32bits(fused[i]) != math.Float32bits(sep[i]) {
						t.Fatalf("bf16 %v %v %+v shared %d: x[%d][%d] %v, moe_gemv_down + moe_combine %v", bf, v.defs, tc, hs, tk, o, fused[i], sep[i])
					}
					want, mag := float64(x[i]), math.Abs(float64(x[i]))
					for j := 0; j < tc.k; j++ {
						p := tk*tc.k + j
						for c := 0; c < tc.in; c++ {
							v := float64(w[p]) * float64(W[(ids[p]*tc.out+o)*tc.in+c]) * float64(X[int(rows[p])*tc.in+c])
							want, mag = want+v, mag+math.Abs(v)
						}
					}
					if hs == 1 {
						v := float64(sh[i]) / (1 + math.Exp(-float64(gate[tk*gs])))
						want, mag = want+v, mag+math.Abs(v)
					}
					if d := math.Abs(float64(fused[i]) - want); d > 1e-5*mag+1e-6 {
						t.Fatalf("bf16 %v %v %+v shared %d: x[%d][%d] %v, want %v", bf, v.defs, tc, hs, tk, o, fused[i], want)
					}
				}
			}
		}
	}
}

// bf16Round rounds each value to bfloat16 (nearest even).
func bf16Round(v []float32) []float32 {
	o := make([]float32, len(v))
	for i, x := range v {
		o[i] = math.Float32frombits(uint32(bf16Bits(x)) << 16)
	}
	return o
}

func bf16Bits(x float32) uint16 {
	u := math.Float32bits(x)
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}

func bf16Floats(h []uint16) []float32 {
	o := make([]float32, len(h))
	for i, x := range h {
		o[i] = math.Float32frombits(uint32(x) << 16)
	}
	return o
}

// putT writes v as the emulation's T: bf16 bits or float32.
func putT(t *testing.T, w *bytes.Buffer, bf bool, v []float32) {
	if !bf {
		put(t, w, v)
		return
	}
	h := make([]uint16, len(v))
	for i, x := range v {
		h[i] = bf16Bits(x)
	}
	put(t, w, h)
}

// TestQKNormRopeEmulated runs qk_norm_rope on the host against qk_norm (also
// emulated) followed by a Go copy of rope_kv's arithmetic (llama.cu: f32
// operations in its order, cos/sin from the table or in double): q and the
// K/V cache bit for bit, in float32 and bfloat16, head dims 64, 128 and 48
// (lanes past the head), both RoPE styles, with and without biases, a token
// without a slot (-1: no KV write) and positions past the table. Cache
// elements no slot points at must keep their bytes.
func TestQKNormRopeEmulated(t *testing.T) {
	for _, tc := range []struct {
		hd   int
		bf16 bool
	}{{64, false}, {64, true}, {128, false}, {128, true}, {48, true}} {
		t.Run(fmt.Sprintf("hd%d_bf16_%v", tc.hd, tc.bf16), func(t *testing.T) {
			bin := blocksEmu(t, tc.hd, tc.bf16)
			hd, half := tc.hd, tc.hd/2
			r := rand.New(rand.NewPCG(5, uint64(tc.hd)))
			const n, nh, nkv, ntab = 6, 4, 2, 16
			const eps = float32(1e-6)
			W, QD, KVD := (nh+2*nkv)*hd, nh*hd, nkv*hd
			pos := []int32{0, 3, ntab - 1, ntab, 70000, 1<<20 + 7}
			slot := []int64{int64(2 * KVD), -1, 0, int64(5 * KVD), int64(KVD), int64(3 * KVD)}
			ce := 7 * KVD // rows 4 and 6 are never written
			inv := make([]float64, half)
			for i := range inv {
				inv[i] = math.Pow(1e6, -float64(2*i)/float64(hd))
			}
			tab := make([]float32, ntab*half*2)
			for p := 0; p < ntab; p++ {
				for i := 0; i < half; i++ {
					a := float64(p) * inv[i]
					tab[2*(p*half+i)], tab[2*(p*half+i)+1] = float32(math.Cos(a)), float32(math.Sin(a))
				}
			}
			for _, hb := range []int32{0, 1} {
				for _, il := range []int32{0, 1} {
					qkv, bias := randF32(r, n*W, 2), randF32(r, W, 0.5)
					qw, kw := randF32(r, hd, 0.3), randF32(r, hd, 0.3)
					for i := range qw {
						qw[i], kw[i] = 1+qw[i], 1+kw[i]
					}
					// The reference: qk_norm in place, then rope_kv without a bias.
					var in bytes.Buffer
					put(t, &in, int32(1), int32(n), int32(nh), int32(nkv), hb, eps, qkv, bias, qw, kw)
					norm := emuCall[float32](t, bin, &in, n*W)
					ones := uint32(0xffffffff)
					if tc.bf16 {
						ones = 0xffff
					}
					fill := func(k int) []uint32 {
						v := make([]uint32, k)
						for i := range v {
							v[i] = ones
						}
						return v
					}
					wq, wk, wv := fill(n*QD), fill(ce), fill(ce)
					st := func(dst []uint32, i int64, v float32) {
						if tc.bf16 {
							dst[i] = uint32(bf16Bits(v))
						} else {
							dst[i] = math.Float32bits(v)
						}
					}
					for tk := 0; tk < n; tk++ {
						row := norm[tk*W : (tk+1)*W]
						for j := 0; j < (nh+nkv)*half; j++ {
							h, i := j/half, j%half
							ia, ib := h*hd+i, h*hd+i+half
							if il == 1 {
								ia, ib = h*hd+2*i, h*hd+2*i+1
							}
							p := int(pos[tk])
							var c, sv float32
							if p < ntab {
								c, sv = tab[2*(p*half+i)], tab[2*(p*half+i)+1]
							} else {
								a := float64(p) * inv[i]
								c, sv = float32(math.Cos(a)), float32(math.Sin(a))
							}
							a, b := row[ia], row[ib]
							ra := float32(float32(a*c) - float32(b*sv))
							rb := float32(float32(a*sv) + float32(b*c))
							switch s := slot[tk]; {
							case h < nh:
								st(wq, int64(tk*QD+ia), ra)
								st(wq, int64(tk*QD+ib), rb)
							case s >= 0:
								st(wk, s+int64(ia-QD), ra)
								st(wk, s+int64(ib-QD), rb)
							}
						}
						if s := slot[tk]; s >= 0 {
							for e := 0; e < KVD; e++ {
								st(wv, s+int64(e), row[QD+KVD+e])
							}
						}
					}
					in.Reset()
					put(t, &in, int32(6), int32(n), int32(nh), int32(nkv), hb, il, int32(ntab), int32(ce), eps, qkv, bias, qw, kw,
						pos, slot, tab, inv)
					var got []uint32
					if tc.bf16 {
						for _, v := range emuCall[uint16](t, bin, &in, n*QD+2*ce) {
							got = append(got, uint32(v))
						}
					} else {
						got = emuCall[uint32](t, bin, &in, n*QD+2*ce)
					}
					want := append(append(wq, wk...), wv...)
					for i := range want {
						if got[i] != want[i] {
							what, at := "q", i
							if i >= n*QD+ce {
								what, at = "v cache", i-n*QD-ce
							} else if i >= n*QD {
								what, at = "k cache", i-n*QD
							}
							t.Fatalf("bias %d interleaved %d: %s element %d: %#x, want %#x", hb, il, what, at, got[i], want[i])
						}
					}
				}
			}
		})
	}
}

// TestRouteSiLUEmulated runs moe_route_silu1 on the host against moe_route
// followed by moe_gemv_silu1 (both emulated) for one token: h and every
// routing word the kernels after it read equal bit for bit, in bf16 and
// float32, with ties at the top of the logits, k of E from 2 of 8 to 8 of
// 128 and grids of one and several blocks along the units; and, so that
// equal wrong answers cannot pass, the routing against its definition
// (checkRoute) and h against a float64 reference.
func TestRouteSiLUEmulated(t *testing.T) {
	for _, bf := range []bool{true, false} {
		bin := blocksEmu(t, 64, bf)
		r := rand.New(rand.NewPCG(9, 10))
		for _, tc := range []struct {
			e, k, units, in int
			norm            bool
		}{{8, 2, 13, 40, true}, {128, 8, 24, 1032, true}, {60, 4, 8, 264, false}, {256, 8, 16, 80, true}} {
			logits := randF32(r, tc.e, 1)
			logits[1], logits[2] = 5, 5 // a tie at the top, across lanes
			if tc.e > 33 {
				logits[33] = 5 // and within one
			}
			X := randF32(r, tc.in, 1)
			W := randF32(r, tc.e*2*tc.units*tc.in, 0.2)
			if bf {
				X, W = bf16Round(X), bf16Round(W)
			}
			var in bytes.Buffer
			put(t, &in, int32(8), int32(tc.e), int32(tc.k), int32(b2i(tc.norm)), int32(tc.units), int32(tc.in), logits)
			putT(t, &in, bf, X)
			putT(t, &in, bf, W)
			esz := 4
			if bf {
				esz = 2
			}
			hb, words := tc.k*tc.units*esz, 4*tc.k+2*tc.e+2
			out := emuCall[byte](t, bin, &in, 2*(hb+4*words))
			run := func(i int) (h []float32, route []int32) {
				b := out[i*(hb+4*words):]
				for j := range tc.k * tc.units {
					if bf {
						h = append(h, math.Float32frombits(uint32(binary.LittleEndian.Uint16(b[2*j:]))<<16))
					} else {
						h = append(h, math.Float32frombits(binary.LittleEndian.Uint32(b[4*j:])))
					}
				}
				for j := range words {
					route = append(route, int32(binary.LittleEndian.Uint32(b[hb+4*j:])))
				}
				return h, route
			}
			name := fmt.Sprintf("bf16 %v %+v", bf, tc)
			h0, r0 := run(0)
			h1, r1 := run(1)
			checkRoute(t, name+" moe_route_silu1", r1, logits, 1, tc.e, tc.k, tc.e, tc.norm)
			// act past nact is not written by either
			for i := range 4*tc.k + tc.e + 1 + tc.k {
				if r1[i] != r0[i] {
					t.Fatalf("%s: routing word %d %#x, moe_route's %#x", name, i, r1[i], r0[i])
				}
			}
			if r1[len(r1)-1] != r0[len(r0)-1] {
				t.Fatalf("%s: nact %d, moe_route's %d", name, r1[len(r1)-1], r0[len(r0)-1])
			}
			act := r1[4*tc.k+tc.e+1:]
			for row := range tc.k {
				e := int(act[row]) // one row an expert, in id order
				for o := range tc.units {
					i := row*tc.units + o
					if math.Float32bits(h1[i]) != math.Float32bits(h0[i]) {
						t.Fatalf("%s: h[%d][%d] %v, moe_route + moe_gemv_silu1's %v", name, row, o, h1[i], h0[i])
					}
					dot := func(wr int) float64 {
						var s float64
						for j := range tc.in {
							s += float64(W[(e*2*tc.units+wr)*tc.in+j]) * float64(X[j])
						}
						return s
					}
					g, u := dot(o), dot(tc.units+o)
					want := g / (1 + math.Exp(-g)) * u
					if d := math.Abs(float64(h1[i]) - want); d > 0.02*math.Abs(want)+1e-3 {
						t.Fatalf("%s: h[%d][%d] (expert %d) %v, want %v", name, row, o, e, h1[i], want)
					}
				}
			}
		}
	}
}
