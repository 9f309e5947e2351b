package cuda

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/cublas"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestKernelBench8B times the decode kernels one by one at the llama3-8b
// shape (random bf16 weights of 4 layers, rotated so no launch finds its
// weights in L2), old and new side by side, with CUDA events around batches
// of launches (median of 7), as GB/s of the bytes each must read against
// the HBM read bandwidth measured here; and checks the new kernels' outputs
// against the old ones in the same run: the fused GEMVs bit for bit,
// attn_decode2 and attn_decode against attn_split within 1e-2, every output
// written (poisoned first). Attention runs as a one-layer benchmark over its
// own 8 GiB pool (random page tables), so batch 256 at 32K fits.
// MOONCAKE_BENCH=1; BENCH_OUT=file receives the tables.
func TestKernelBench8B(t *testing.T) {
	if os.Getenv("MOONCAKE_BENCH") == "" {
		t.Skip("set MOONCAKE_BENCH=1 to run the 8B-shape kernel benchmark")
	}
	cfg, err := model.RandomConfig("llama3-8b")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Layers = 4
	b := newOrSkip(t, &model.Model{Config: cfg, Random: true}, Options{PageSize: 64, Pages: 16, RandomWeights: true,
		Seed: 3, DisableCUDAGraph: true, tune: tuning{skinnyMax: skMaxN, fuseCombine: true, wg: true}})
	if b.fn.g2QKV == nil || b.fn.attnDecode2 == nil {
		t.Fatalf("new kernels not loaded (v2: %v)", b.fn.v2Err)
	}
	bw, err := b.readBandwidth(4<<30, 10)
	if err != nil {
		t.Fatal(err)
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		t.Fatal(err)
	}
	kb := &kbench{t: t, b: b, bw: bw}
	defer kb.free()
	kb.add("HBM read bandwidth %.0f GB/s (4 GiB, median of 10); llama3-8b shape, bf16, random data", bw/1e9)
	kb.add("skinny GEMM: %d blocks resident; splits (qkv, wo, gate/up, down, logits) %v", b.fn.skCap, kb.splits())
	for _, name := range []string{"gemv_f32out", "gemv2_plain", "gemv2_norm", "gemv2_qkv", "gemv2_silu", "gemm_sk_plain",
		"gemm_sk_qkv", "gemm_sk_silu", "rmsnorm", "rope_kv",
		"silu_mul", "attn_split", "attn_decode", "attn_decode2", "attn_decode2_w8", "attn_combine"} {
		f := kb.fn(name)
		regs, _ := f.Attribute(cu.FuncAttrNumRegs)
		local, _ := f.Attribute(cu.FuncAttrLocalSizeBytes)
		shared, _ := f.Attribute(cu.FuncAttrSharedSizeBytes)
		kb.add("kernel %s: %d registers, %d bytes local, %d bytes static shared; gemv2 grid cap %d blocks", name, regs, local,
			shared, b.fn.g2Blocks[f])
	}
	if f := b.fn.attnTC; f != nil {
		regs, _ := f.Attribute(cu.FuncAttrNumRegs)
		local, _ := f.Attribute(cu.FuncAttrLocalSizeBytes)
		shared, _ := f.Attribute(cu.FuncAttrSharedSizeBytes)
		kb.add("kernel attn_decode_tc: %d registers, %d bytes local, %d bytes static shared, %d threads", regs, local, shared,
			b.fn.tcThreads)
	}
	// MOONCAKE_KBENCH_PARTS (e.g. "attention") runs only those parts.
	parts := os.Getenv("MOONCAKE_KBENCH_PARTS")
	for _, p := range []struct {
		name string
		run  func()
	}{{"gemvs", kb.gemvs}, {"skinny", kb.skinny}, {"wgemm", kb.wgemm}, {"small", kb.smallKernels}, {"attention", kb.attention}, {"prefill", kb.prefill}} {
		if parts == "" || slices.Contains(strings.Split(parts, ","), p.name) {
			p.run()
		}
	}
	if kb.bad > 0 {
		t.Errorf("%d correctness checks failed (see the log)", kb.bad)
	}
	if d := os.Getenv("BENCH_OUT"); d != "" {
		if err := os.WriteFile(d, []byte(strings.Join(kb.lines, "\n")+"\n"), 0o644); err != nil {
			t.Error(err)
		}
	}
}

type kbench struct {
	t      *testing.T
	b      *Backend
	bw     float64
	lines  []string
	allocs []cu.DevicePtr
	bad    int
}

func (k *kbench) add(f string, a ...any) {
	s := fmt.Sprintf(f, a...)
	k.lines = append(k.lines, s)
	k.t.Log(s)
}

func (k *kbench) fail(f string, a ...any) {
	k.bad++
	k.add("FAIL "+f, a...)
}

func (k *kbench) fn(name string) *cu.Function {
	f, err := k.b.mod.Function(name)
	if err != nil {
		k.t.Fatal(err)
	}
	return f
}

func (k *kbench) alloc(n uint64) cu.DevicePtr {
	p, err := k.b.cx.MemAlloc(max(n, 256))
	if err != nil {
		k.t.Fatal(err)
	}
	k.allocs = append(k.allocs, p)
	return p
}

func (k *kbench) free() {
	k.b.stream.Synchronize()
	for _, p := range k.allocs {
		k.b.cx.MemFree(p)
	}
}

func (k *kbench) sync() {
	if err := k.b.stream.Synchronize(); err != nil {
		k.t.Fatal(err)
	}
}

// put copies host data to p (the stream idle first).
func (k *kbench) put(p cu.DevicePtr, v any) {
	k.sync()
	var raw []byte
	switch x := v.(type) {
	case []int32:
		raw = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(x))), len(x)*4)
	case []int64:
		raw = unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(x))), len(x)*8)
	default:
		k.t.Fatalf("put %T", v)
	}
	if err := k.b.cx.MemcpyHtoD(p, raw); err != nil {
		k.t.Fatal(err)
	}
}

func (k *kbench) get(p cu.DevicePtr, n uint64) []byte {
	k.sync()
	raw := make([]byte, n)
	if err := k.b.cx.MemcpyDtoH(raw, p); err != nil {
		k.t.Fatal(err)
	}
	return raw
}

// randT / randF fill n elements of T / f32 at p with uniform values in
// [off-s, off+s).
func (k *kbench) randT(p cu.DevicePtr, n uint64, seed uint64, s float32) {
	if err := k.b.fill(k.b.fn.fillT, p, n, seed, s, 0); err != nil {
		k.t.Fatal(err)
	}
}

func (k *kbench) randF(p cu.DevicePtr, n uint64, seed uint64, s, off float32) {
	if err := k.b.fill(k.b.fn.fillF, p, n, seed, s, off); err != nil {
		k.t.Fatal(err)
	}
}

func (k *kbench) launch(f *cu.Function, grid, block cu.Dim3, smem uint32, args ...any) {
	if err := k.b.stream.Launch(f, grid, block, smem, args...); err != nil {
		k.t.Fatal(err)
	}
}

// time returns the median over 7 batches of the mean time of one call of
// run(i) (a sequence of launches), in microseconds; inner calls per batch.
func (k *kbench) time(inner int, run func(i int)) float64 {
	st := k.b.stream
	e0, err := k.b.cx.NewEvent(cu.EventDefault)
	if err != nil {
		k.t.Fatal(err)
	}
	defer e0.Destroy()
	e1, err := k.b.cx.NewEvent(cu.EventDefault)
	if err != nil {
		k.t.Fatal(err)
	}
	defer e1.Destroy()
	for i := 0; i < inner; i++ {
		run(i)
	}
	var ts []float64
	for rep := 0; rep < 7; rep++ {
		e0.Record(st)
		for i := 0; i < inner; i++ {
			run(i)
		}
		e1.Record(st)
		if err := e1.Synchronize(); err != nil {
			k.t.Fatal(err)
		}
		ms, err := cu.ElapsedMs(e0, e1)
		if err != nil {
			k.t.Fatal(err)
		}
		ts = append(ts, float64(ms)*1e3/float64(inner))
	}
	slices.Sort(ts)
	return ts[len(ts)/2]
}

// gbs is bytes over us microseconds in GB/s, and its share of the HBM read
// bandwidth.
func (k *kbench) gbs(bytes float64, us float64) (float64, float64) {
	g := bytes / (us * 1e-6) / 1e9
	return g, 100 * g * 1e9 / k.bw
}

// gemvs times the decode GEMVs at 1, 2 and 4 tokens: the separate kernels
// (rmsnorm, gemv_*, rope_kv, silu_mul) against the fused gemv2_* set, and
// checks that both give the same bytes.
func (k *kbench) gemvs() {
	b := k.b
	c := &b.cfg
	dim, qd, kvd, hid, V := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim, c.Vocab
	const N = 4
	L := len(b.w.layers)
	x := k.alloc(N * uint64(dim) * 4)
	xb := k.alloc(N * uint64(dim) * 2)
	qkvF := k.alloc(N * uint64(qd+2*kvd) * 4)
	gu := k.alloc(N * uint64(2*hid) * 2)
	att := k.alloc(N * uint64(qd) * 2)
	hin := k.alloc(N * uint64(hid) * 2)
	var q, kc, vc, h, y, lg [2]cu.DevicePtr
	for v := range 2 {
		q[v], kc[v], vc[v] = k.alloc(N*uint64(qd)*2), k.alloc(N*uint64(kvd)*2), k.alloc(N*uint64(kvd)*2)
		h[v], y[v], lg[v] = k.alloc(N*uint64(hid)*2), k.alloc(N*uint64(dim)*4), k.alloc(N*uint64(V)*4)
	}
	pos, slot, rows := k.alloc(N*4), k.alloc(N*8), k.alloc(N*4)
	k.put(pos, []int32{1000, 1, 77, 8191})
	k.put(slot, []int64{0, -1, 2 * int64(kvd), 3 * int64(kvd)}) // row 1: a padding row (no KV write)
	k.put(rows, []int32{3, 1, 0, 2})
	k.randF(x, N*uint64(dim), 11, 1, 0.1)
	k.randT(att, N*uint64(qd), 12, 1)
	k.randT(hin, N*uint64(hid), 13, 1)
	rmsT := rmsThreads(dim)
	vt := rmsVT(dim)
	null := cu.DevicePtr(0)
	eps := c.NormEps
	ropeY := ropeBlocks(c.Heads, c.KVHeads, c.HeadDim)
	f := &b.fn
	gemvOld := k.fn("gemv_f32out")
	gemvOldT := k.fn("gemv_tout")
	gemvGrid := func(out int) cu.Dim3 { return cu.D1(uint32((out + 7) / 8)) }
	wb := func(rows, cols int) float64 { return float64(rows) * float64(cols) * 2 }
	k.add("")
	k.add("| GEMV (weights rotated over %d layers) | n | old us | new us | old GB/s (%% HBM) | new GB/s (%% HBM) | new/old | outputs |", L)
	k.add("| --- | --- | --- | --- | --- | --- | --- | --- |")
	row := func(name string, n int, bytes, old, nw float64, same string) {
		og, op := k.gbs(bytes, old)
		ng, np := k.gbs(bytes, nw)
		k.add("| %s | %d | %.1f | %.1f | %.0f (%.0f%%) | %.0f (%.0f%%) | %.2f | %s |", name, n, old, nw, og, op, ng, np, nw/old, same)
	}
	// equal compares two device buffers of n bytes.
	equal := func(what string, n int, a, bb cu.DevicePtr, sz uint64) string {
		if bytes.Equal(k.get(a, sz), k.get(bb, sz)) {
			return "equal"
		}
		k.fail("%s at n=%d: fused output differs from the separate kernels'", what, n)
		return "DIFFER"
	}
	for _, n := range []int{1, 2, 4} {
		n32 := int32(n)
		xs := uint32(n * dim * 2)
		// QKV: rmsnorm + gemv + rope_kv vs gemv2_qkv.
		oldQKV := func(i int) {
			w := &b.w.layers[i%L]
			k.launch(f.rmsnorm, cu.D1(uint32(n)), cu.D1(rmsT), 0, xb, x, w.attnNorm, null, int32(dim), eps)
			k.launch(gemvOld, gemvGrid(qd+2*kvd), cu.D1(256), 0, qkvF, xb, w.wqkv, n32, int32(qd+2*kvd), int32(dim), float32(0))
			k.launch(f.ropeKV, cu.Dim3{X: uint32(n), Y: ropeY, Z: 1}, cu.D1(ropeThreads), 0, q[0], kc[0], vc[0], qkvF, w.bqkv, pos,
				slot, b.ropeTab, b.rope, int32(b.ropeN), int32(c.Heads), int32(c.KVHeads), int32(0))
		}
		newQKV := func(i int) {
			w := &b.w.layers[i%L]
			k.launch(f.g2QKV, b.g2Grid(f.g2QKV, (qd+2*kvd)/2), cu.D1(g2Threads), xs, q[1], kc[1], vc[1], x, w.attnNorm, w.wqkv,
				w.bqkv, pos, slot, b.ropeTab, b.rope, int32(b.ropeN), n32, int32(dim), vt, eps, int32(c.Heads), int32(c.KVHeads), int32(0))
		}
		for v := range 2 { // same poison in both
			k.randT(q[v], N*uint64(qd), 99, 5)
			k.randT(kc[v], N*uint64(kvd), 98, 5)
			k.randT(vc[v], N*uint64(kvd), 97, 5)
		}
		oldQKV(0)
		newQKV(0)
		same := equal("q", n, q[0], q[1], uint64(n*qd*2))
		if s := equal("k", n, kc[0], kc[1], N*uint64(kvd)*2); s != "equal" {
			same = s
		}
		if s := equal("v", n, vc[0], vc[1], N*uint64(kvd)*2); s != "equal" {
			same = s
		}
		row("qkv: rmsnorm+gemv+rope_kv vs gemv2_qkv", n, wb(qd+2*kvd, dim), k.time(8, oldQKV), k.time(8, newQKV), same)
		// The old GEMV alone (what the fused kernel also replaces).
		gOnly := k.time(8, func(i int) {
			k.launch(gemvOld, gemvGrid(qd+2*kvd), cu.D1(256), 0, qkvF, xb, b.w.layers[i%L].wqkv, n32, int32(qd+2*kvd), int32(dim), float32(0))
		})
		g, p := k.gbs(wb(qd+2*kvd, dim), gOnly)
		k.add("| qkv: gemv_f32out alone | %d | %.1f | | %.0f (%.0f%%) | | | |", n, gOnly, g, p)
		// Gate/up: rmsnorm + gemv_tout + silu_mul vs gemv2_silu.
		oldMLP := func(i int) {
			w := &b.w.layers[i%L]
			k.launch(f.rmsnorm, cu.D1(uint32(n)), cu.D1(rmsT), 0, xb, x, w.ffnNorm, null, int32(dim), eps)
			k.launch(gemvOldT, gemvGrid(2*hid), cu.D1(256), 0, gu, xb, w.w13, n32, int32(2*hid), int32(dim), float32(0))
			k.launch(f.siluMul, cu.Dim3{X: uint32(n), Y: siluBlocks(hid), Z: 1}, cu.D1(siluThreads), 0, h[0], gu, int32(hid))
		}
		newMLP := func(i int) {
			w := &b.w.layers[i%L]
			k.launch(f.g2SiLU, b.g2Grid(f.g2SiLU, hid), cu.D1(g2Threads), xs, h[1], x, w.ffnNorm, w.w13, n32, int32(hid),
				int32(dim), vt, eps)
		}
		oldMLP(0)
		newMLP(0)
		same = equal("h", n, h[0], h[1], uint64(n*hid*2))
		row("gate/up: rmsnorm+gemv+silu_mul vs gemv2_silu", n, wb(2*hid, dim), k.time(4, oldMLP), k.time(4, newMLP), same)
		// wo and w2 (residual added: beta 1, the same start in both).
		for _, m := range []struct {
			name    string
			in      int
			X       cu.DevicePtr
			pick    func(l *devLayer) cu.DevicePtr
			reps    int
			outRows int
		}{
			{"wo: gemv_f32out vs gemv2_plain", qd, att, func(l *devLayer) cu.DevicePtr { return l.wo }, 8, dim},
			{"down: gemv_f32out vs gemv2_plain", hid, hin, func(l *devLayer) cu.DevicePtr { return l.w2 }, 6, dim},
		} {
			k.randF(y[0], N*uint64(dim), 21, 1, 0)
			k.randF(y[1], N*uint64(dim), 21, 1, 0)
			o := func(i int) {
				k.launch(gemvOld, gemvGrid(m.outRows), cu.D1(256), 0, y[0], m.X, m.pick(&b.w.layers[i%L]), n32, int32(m.outRows), int32(m.in), float32(1))
			}
			nw := func(i int) {
				xb, stage := g2Stage(n, m.in)
				k.launch(f.g2Plain, b.g2Grid(f.g2Plain, (m.outRows+1)/2), cu.D1(g2Threads), xb, y[1], m.X, m.pick(&b.w.layers[i%L]),
					n32, int32(m.outRows), int32(m.in), float32(1), stage, int32(1))
			}
			o(0)
			nw(0)
			same := equal(m.name, n, y[0], y[1], uint64(n*dim*4))
			row(m.name, n, wb(m.outRows, m.in), k.time(m.reps, o), k.time(m.reps, nw), same)
		}
		// Logits: rmsnorm (gathered rows) + gemv vs gemv2_norm.
		oldLM := func(int) {
			k.launch(f.rmsnorm, cu.D1(uint32(n)), cu.D1(rmsT), 0, xb, x, b.w.norm, rows, int32(dim), eps)
			k.launch(gemvOld, gemvGrid(V), cu.D1(256), 0, lg[0], xb, b.w.lmHead, n32, int32(V), int32(dim), float32(0))
		}
		newLM := func(int) {
			k.launch(f.g2Norm, b.g2Grid(f.g2Norm, (V+1)/2), cu.D1(g2Threads), xs, lg[1], x, b.w.norm, rows, b.w.lmHead, n32,
				int32(V), int32(dim), vt, eps, cu.DevicePtr(0), int32(1))
		}
		oldLM(0)
		newLM(0)
		same = equal("logits", n, lg[0], lg[1], uint64(n*V*4))
		row("logits: rmsnorm+gemv vs gemv2_norm", n, wb(V, dim), k.time(3, oldLM), k.time(3, newLM), same)
	}
}

// wgemm times the decode GEMMs of 8..128 tokens on cuBLAS and on gemm_wg
// (the weights rotated over the layers, as run.gemm launches them), checking
// that both agree (f32 outputs within 1e-5, bf16 ones within 1e-2).
func (k *kbench) wgemm() {
	b := k.b
	c := &b.cfg
	if b.fn.gw[0] == nil {
		if hopper(k.t, b) {
			k.fail("gemm_wg not loaded on a compute capability 9.0 device")
		}
		return
	}
	dim, qd, kvd, hid, V := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim, c.Vocab
	const N = 128
	L := len(b.w.layers)
	xs := map[int]cu.DevicePtr{}
	for i, in := range []int{dim, qd, hid} {
		if xs[in] == 0 {
			xs[in] = k.alloc(N * uint64(in) * 2)
			k.randT(xs[in], N*uint64(in), uint64(61+i), 1)
		}
	}
	maxOut := max(qd+2*kvd, 2*hid, dim, V)
	var y [2]cu.DevicePtr
	for v := range y {
		y[v] = k.alloc(N * uint64(maxOut) * 4)
	}
	r := &run{b: b, s: b.stream}
	k.add("")
	k.add("| decode GEMM (weights rotated over %d layers) | n | cuBLAS us | gemm_wg us | cuBLAS GB/s (%% HBM) | gemm_wg GB/s (%% HBM) | wg/cuBLAS | outputs |", L)
	k.add("| --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, m := range []struct {
		name    string
		out, in int
		yF32    bool
		beta    float32
		pick    func(l *devLayer) cu.DevicePtr
		reps    int
	}{
		{"qkv", qd + 2*kvd, dim, true, 0, func(l *devLayer) cu.DevicePtr { return l.wqkv }, 8},
		{"wo (+y)", dim, qd, true, 1, func(l *devLayer) cu.DevicePtr { return l.wo }, 8},
		{"gate/up (bf16)", 2 * hid, dim, false, 0, func(l *devLayer) cu.DevicePtr { return l.w13 }, 4},
		{"down (+y)", dim, hid, true, 1, func(l *devLayer) cu.DevicePtr { return l.w2 }, 6},
		{"logits", V, dim, true, 0, nil, 3},
	} {
		wOf := func(i int) cu.DevicePtr {
			if m.pick == nil {
				return b.w.lmHead
			}
			return m.pick(&b.w.layers[i%L])
		}
		x := xs[m.in]
		for _, n := range []int{8, 16, 32, 64, 128} {
			cnt := n * m.out
			for v := range y { // the same values in both (beta 1 adds them)
				if m.yF32 {
					k.randF(y[v], uint64(cnt), 71, 1, 0)
				} else {
					k.randT(y[v], uint64(cnt), 71, 1)
				}
			}
			k.cublas(y[0], m.yF32, x, wOf(0), n, m.out, m.in, m.beta)
			if !r.gemmWG(y[1], m.yF32, x, wOf(0), n, m.out, m.in, m.beta) {
				k.fail("%s: gemm_wg does not take n=%d %dx%d", m.name, n, m.out, m.in)
				return
			}
			if r.err != nil {
				k.fail("%s: gemm_wg: %v", m.name, r.err)
				return
			}
			var ga, gb []float32
			tol := 1e-5
			if m.yF32 {
				ga, gb = f32s(k.get(y[0], uint64(cnt*4))), f32s(k.get(y[1], uint64(cnt*4)))
			} else {
				ga, gb, tol = bf16s(k.get(y[0], uint64(cnt*2))), bf16s(k.get(y[1], uint64(cnt*2))), 1e-2
			}
			same := fmt.Sprintf("rel %.1e", relErr(gb, ga))
			if e := relErr(gb, ga); !(e <= tol) {
				k.fail("%s at n=%d: gemm_wg vs cuBLAS: rel err %.3g > %.3g", m.name, n, e, tol)
				same = fmt.Sprintf("DIFFER %.1e", e)
			}
			bytes := float64(m.out) * float64(m.in) * 2
			old := k.time(m.reps, func(i int) { k.cublas(y[0], m.yF32, x, wOf(i), n, m.out, m.in, m.beta) })
			nw := k.time(m.reps, func(i int) { r.gemmWG(y[1], m.yF32, x, wOf(i), n, m.out, m.in, m.beta) })
			og, op := k.gbs(bytes, old)
			ng, np := k.gbs(bytes, nw)
			k.add("| %s | %d | %.1f | %.1f | %.0f (%.0f%%) | %.0f (%.0f%%) | %.2f | %s |", m.name, n, old, nw, og, op, ng, np, nw/old, same)
		}
	}
	if r.err != nil {
		k.fail("gemm_wg: %v", r.err)
	}
}

// splits lists skSplit's (splits, chunks per split) for the 8B GEMMs.
func (k *kbench) splits() [][2]int {
	c := &k.b.cfg
	qd, kvd, hid := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim
	var out [][2]int
	for _, sh := range [][2]int{{ceilDiv(qd+2*kvd, skRows), c.Dim}, {ceilDiv(c.Dim, skRows), qd}, {hid / 64, c.Dim},
		{ceilDiv(c.Dim, skRows), hid}, {ceilDiv(c.Vocab, skRows), c.Dim}} {
		s, cps := skSplit(k.b.fn.skCap, sh[0], sh[1])
		out = append(out, [2]int{s, cps})
	}
	return out
}

// cublas runs y[n][out] = x . w^T + beta*y through cuBLAS as the backend
// does for batches above the GEMV's (y f32 when yF32, else T).
func (k *kbench) cublas(y cu.DevicePtr, yF32 bool, x, w cu.DevicePtr, n, out, in int, beta float32) {
	yt := cublas.R16BF
	if yF32 {
		yt = cublas.R32F
	}
	if err := k.b.blas.GemmEx(&cublas.Gemm{TransA: cublas.OpT, TransB: cublas.OpN, M: out, N: n, K: in, Alpha: 1, Beta: beta,
		A: uint64(w), AType: cublas.R16BF, LDA: in, B: uint64(x), BType: cublas.R16BF, LDB: in, C: uint64(y), CType: yt,
		LDC: out, Compute: cublas.Compute32F}); err != nil {
		k.t.Fatal(err)
	}
}

// skinny times the decode GEMMs of 5..32 tokens (and 1, 4 for scale):
// cuBLAS (+ rope_kv / silu_mul) against gemm_sk_*, checking that both
// agree (f32 outputs within 1e-5, bf16 ones within 1e-2: rounding flips).
func (k *kbench) skinny() {
	b := k.b
	c := &b.cfg
	f := &b.fn
	if f.skPlain == nil || f.skQKV == nil || f.skSiLU == nil {
		k.fail("skinny GEMM kernels not loaded")
		return
	}
	dim, qd, kvd, hid, V := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim, c.Vocab
	const N = 32
	L := len(b.w.layers)
	xb := k.alloc(N * uint64(dim) * 2)
	qkvF := k.alloc(N * uint64(qd+2*kvd) * 4)
	gu := k.alloc(N * uint64(2*hid) * 2)
	att := k.alloc(N * uint64(qd) * 2)
	hin := k.alloc(N * uint64(hid) * 2)
	var q, kc, vc, h, y, lg [2]cu.DevicePtr
	for v := range 2 {
		q[v], kc[v], vc[v] = k.alloc(N*uint64(qd)*2), k.alloc(N*uint64(kvd)*2), k.alloc(N*uint64(kvd)*2)
		h[v], y[v], lg[v] = k.alloc(N*uint64(hid)*2), k.alloc(N*uint64(dim)*4), k.alloc(N*uint64(V)*4)
	}
	pos, slot := k.alloc(N*4), k.alloc(N*8)
	ps, ss := make([]int32, N), make([]int64, N)
	for i := range ps {
		ps[i], ss[i] = int32(100+37*i), int64(i*kvd)
	}
	ss[3] = -1 // a padding row
	k.put(pos, ps)
	k.put(slot, ss)
	k.randT(xb, N*uint64(dim), 51, 1)
	k.randT(att, N*uint64(qd), 52, 1)
	k.randT(hin, N*uint64(hid), 53, 1)
	ropeY := ropeBlocks(c.Heads, c.KVHeads, c.HeadDim)
	wb := func(rows, cols int) float64 { return float64(rows) * float64(cols) * 2 }
	k.add("")
	k.add("| skinny GEMM (weights rotated over %d layers) | n | cuBLAS us | gemm_sk us | cuBLAS GB/s (%% HBM) | gemm_sk GB/s (%% HBM) | sk/cuBLAS | outputs |", L)
	k.add("| --- | --- | --- | --- | --- | --- | --- | --- |")
	row := func(name string, n int, bytes, old, nw float64, same string) {
		og, op := k.gbs(bytes, old)
		ng, np := k.gbs(bytes, nw)
		k.add("| %s | %d | %.1f | %.1f | %.0f (%.0f%%) | %.0f (%.0f%%) | %.2f | %s |", name, n, old, nw, og, op, ng, np, nw/old, same)
	}
	near := func(what string, n int, a, bb cu.DevicePtr, count int, asT bool, tol float64) string {
		var ga, gb []float32
		if asT {
			ga, gb = bf16s(k.get(a, uint64(count*2))), bf16s(k.get(bb, uint64(count*2)))
		} else {
			ga, gb = f32s(k.get(a, uint64(count*4))), f32s(k.get(bb, uint64(count*4)))
		}
		e := relErr(gb, ga)
		if !(e <= tol) {
			k.fail("%s at n=%d: gemm_sk vs cuBLAS: rel err %.3g > %.3g", what, n, e, tol)
			return fmt.Sprintf("DIFFER %.1e", e)
		}
		return fmt.Sprintf("rel %.1e", e)
	}
	for _, n := range []int{1, 4, 8, 16, 24, 32} {
		n32 := int32(n)
		launchSK := func(fn *cu.Function, rb, in int, args ...any) {
			s, cps := skSplit(f.skCap, rb, in)
			k.launch(fn, cu.Dim3{X: uint32(rb), Y: uint32(s), Z: 1}, cu.D1(skThreads), 0,
				append(args, int32(cps), f.skPart, f.skCnt)...)
		}
		oldQKV := func(i int) {
			w := &b.w.layers[i%L]
			k.cublas(qkvF, true, xb, w.wqkv, n, qd+2*kvd, dim, 0)
			k.launch(f.ropeKV, cu.Dim3{X: uint32(n), Y: ropeY, Z: 1}, cu.D1(ropeThreads), 0, q[0], kc[0], vc[0], qkvF, w.bqkv, pos,
				slot, b.ropeTab, b.rope, int32(b.ropeN), int32(c.Heads), int32(c.KVHeads), int32(0))
		}
		newQKV := func(i int) {
			w := &b.w.layers[i%L]
			launchSK(f.skQKV, ceilDiv(qd+2*kvd, skRows), dim, q[1], kc[1], vc[1], xb, w.wqkv, w.bqkv, pos, slot, b.ropeTab,
				b.rope, int32(b.ropeN), n32, int32(dim), int32(c.Heads), int32(c.KVHeads), int32(0))
		}
		for v := range 2 {
			k.randT(q[v], N*uint64(qd), 91, 5)
			k.randT(kc[v], N*uint64(kvd), 92, 5)
			k.randT(vc[v], N*uint64(kvd), 93, 5)
		}
		oldQKV(0)
		newQKV(0)
		same := near("q", n, q[0], q[1], n*qd, true, 1e-2)
		near("k", n, kc[0], kc[1], N*kvd, true, 1e-2)
		near("v", n, vc[0], vc[1], N*kvd, true, 1e-2)
		row("qkv: cuBLAS+rope_kv vs gemm_sk_qkv", n, wb(qd+2*kvd, dim), k.time(8, oldQKV), k.time(8, newQKV), same)
		oldMLP := func(i int) {
			w := &b.w.layers[i%L]
			k.cublas(gu, false, xb, w.w13, n, 2*hid, dim, 0)
			k.launch(f.siluMul, cu.Dim3{X: uint32(n), Y: siluBlocks(hid), Z: 1}, cu.D1(siluThreads), 0, h[0], gu, int32(hid))
		}
		newMLP := func(i int) {
			launchSK(f.skSiLU, hid/64, dim, h[1], xb, b.w.layers[i%L].w13, n32, int32(hid), int32(dim))
		}
		oldMLP(0)
		newMLP(0)
		same = near("h", n, h[0], h[1], n*hid, true, 1e-2)
		row("gate/up: cuBLAS+silu_mul vs gemm_sk_silu", n, wb(2*hid, dim), k.time(4, oldMLP), k.time(4, newMLP), same)
		for _, m := range []struct {
			name string
			in   int
			X    cu.DevicePtr
			pick func(l *devLayer) cu.DevicePtr
			reps int
		}{
			{"wo", qd, att, func(l *devLayer) cu.DevicePtr { return l.wo }, 8},
			{"down", hid, hin, func(l *devLayer) cu.DevicePtr { return l.w2 }, 6},
		} {
			o := func(i int) { k.cublas(y[0], true, m.X, m.pick(&b.w.layers[i%L]), n, dim, m.in, 0) }
			nw := func(i int) {
				launchSK(f.skPlain, ceilDiv(dim, skRows), m.in, y[1], m.X, m.pick(&b.w.layers[i%L]), n32, int32(dim), int32(m.in), float32(0))
			}
			o(0)
			nw(0)
			same := near(m.name, n, y[0], y[1], n*dim, false, 1e-5)
			row(m.name+": cuBLAS vs gemm_sk_plain", n, wb(dim, m.in), k.time(m.reps, o), k.time(m.reps, nw), same)
		}
		o := func(int) { k.cublas(lg[0], true, xb, b.w.lmHead, n, V, dim, 0) }
		nw := func(int) {
			launchSK(f.skPlain, ceilDiv(V, skRows), dim, lg[1], xb, b.w.lmHead, n32, int32(V), int32(dim), float32(0))
		}
		o(0)
		nw(0)
		same = near("logits", n, lg[0], lg[1], n*V, false, 1e-5)
		row("logits: cuBLAS vs gemm_sk_plain", n, wb(V, dim), k.time(3, o), k.time(3, nw), same)
	}
}

// smallKernels times the kernels that stay separate for batches above the
// fused path's (cuBLAS GEMMs in between): rmsnorm, rope_kv, silu_mul.
func (k *kbench) smallKernels() {
	b := k.b
	c := &b.cfg
	dim, qd, kvd, hid := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim
	const N = 256
	x := k.alloc(N * uint64(dim) * 4)
	xb := k.alloc(N * uint64(dim) * 2)
	qkvF := k.alloc(N * uint64(qd+2*kvd) * 4)
	q := k.alloc(N * uint64(qd) * 2)
	kv := k.alloc(2 * N * uint64(kvd) * 2)
	gu := k.alloc(N * uint64(2*hid) * 2)
	h := k.alloc(N * uint64(hid) * 2)
	pos, slot := k.alloc(N*4), k.alloc(N*8)
	ps, ss := make([]int32, N), make([]int64, N)
	for i := range ps {
		ps[i], ss[i] = int32(1000+i), int64(i*kvd)
	}
	k.put(pos, ps)
	k.put(slot, ss)
	k.randF(x, N*uint64(dim), 31, 1, 0)
	k.randF(qkvF, N*uint64(qd+2*kvd), 32, 1, 0)
	k.randT(gu, N*uint64(2*hid), 33, 2)
	f := &b.fn
	w := &b.w.layers[0]
	k.add("")
	k.add("| small kernel (cuBLAS batches) | n | us | GB/s moved (%% HBM) |")
	k.add("| --- | --- | --- | --- |")
	for _, n := range []int{1, 32, 128, 256} {
		nb := uint32(n)
		us := k.time(20, func(int) {
			k.launch(f.rmsnorm, cu.D1(nb), cu.D1(rmsThreads(dim)), 0, xb, x, w.attnNorm, cu.DevicePtr(0), int32(dim), c.NormEps)
		})
		g, p := k.gbs(float64(n*dim)*6, us)
		k.add("| rmsnorm | %d | %.2f | %.0f (%.0f%%) |", n, us, g, p)
		us = k.time(20, func(int) {
			k.launch(f.ropeKV, cu.Dim3{X: nb, Y: ropeBlocks(c.Heads, c.KVHeads, c.HeadDim), Z: 1}, cu.D1(ropeThreads), 0, q, kv,
				kv+cu.DevicePtr(N*kvd*2), qkvF, w.bqkv, pos, slot, b.ropeTab, b.rope, int32(b.ropeN), int32(c.Heads), int32(c.KVHeads), int32(0))
		})
		g, p = k.gbs(float64(n*(qd+2*kvd))*6, us)
		k.add("| rope_kv | %d | %.2f | %.0f (%.0f%%) |", n, us, g, p)
		us = k.time(20, func(int) {
			k.launch(f.siluMul, cu.Dim3{X: nb, Y: siluBlocks(hid), Z: 1}, cu.D1(siluThreads), 0, h, gu, int32(hid))
		})
		g, p = k.gbs(float64(n*hid)*6, us)
		k.add("| silu_mul | %d | %.2f | %.0f (%.0f%%) |", n, us, g, p)
	}
}

// attention times attn_split, attn_decode_tc and attn_decode2 (+ attn_combine),
// attn_decode2 merging its own splits (4 and 8 warps) at batch 1..256 and contexts 1K..32K of one layer (the 8B shape: 8 KV
// heads of 128, GQA 4) over an 8 GiB pool of 64-token pages, page tables
// random; the floor is the K and V bytes read once.
func (k *kbench) attention() {
	b := k.b
	c := &b.cfg
	hd, qd, kvd := c.HeadDim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	const ps, poolPages, maxBS, maxCtx = 64, 32768, 256, 32768
	pageBytes := uint64(ps * kvd * 2)
	kc, vc := k.alloc(poolPages*pageBytes), k.alloc(poolPages*pageBytes)
	k.randT(kc, poolPages*pageBytes/2, 41, 1)
	k.randT(vc, poolPages*pageBytes/2, 42, 1)
	q := k.alloc(maxBS * uint64(qd) * 2)
	k.randT(q, maxBS*uint64(qd), 43, 1)
	maxSplit := ceilDiv(maxCtx+1, b.fn.split)
	part := k.alloc(maxBS * uint64(c.Heads) * uint64(maxSplit) * uint64(hd+2) * 4)
	var att [6]cu.DevicePtr
	for i := range att {
		att[i] = k.alloc(maxBS * uint64(qd) * 2)
	}
	perSeq := ceilDiv(maxCtx+1, ps)
	qrow, pos, ptoff, pages := k.alloc(maxBS*4), k.alloc(maxBS*4), k.alloc(maxBS*4), k.alloc(maxBS*uint64(perSeq)*4)
	qr, po := make([]int32, maxBS), make([]int32, maxBS)
	for i := range qr {
		qr[i], po[i] = int32(i), int32(i*perSeq)
	}
	k.put(qrow, qr)
	k.put(ptoff, po)
	r := rand.New(rand.NewPCG(4, 4))
	pg := make([]int32, maxBS*perSeq)
	for i := range pg {
		pg[i] = int32(r.IntN(poolPages))
	}
	k.put(pages, pg)
	// The diagnostic's view of the pool: one KV head, pages of ps rows of hd
	// (kvd/hd times as many), query z reading q row z's first group.
	group := c.Heads / c.KVHeads
	nq := maxBS * c.KVHeads
	var dq struct{ qrow, pos, ptoff, pages cu.DevicePtr }
	dq.qrow, dq.pos, dq.ptoff, dq.pages = k.alloc(uint64(nq)*4), k.alloc(uint64(nq)*4), k.alloc(uint64(nq)*4),
		k.alloc(uint64(nq*perSeq)*4)
	dr, dp := make([]int32, nq), make([]int32, nq)
	for i := range dr {
		dr[i], dp[i] = int32(i), int32(i*perSeq)
	}
	k.put(dq.qrow, dr)
	k.put(dq.ptoff, dp)
	dpg := make([]int32, nq*perSeq)
	for i := range dpg {
		dpg[i] = int32(r.IntN(poolPages * c.KVHeads))
	}
	k.put(dq.pages, dpg)
	f := &b.fn
	split, dec2, dec2w8, comb := k.fn("attn_split"), k.fn("attn_decode2"), k.fn("attn_decode2_w8"), k.fn("attn_combine")
	tc := b.fn.attnTC
	if tc == nil {
		k.fail("attn_decode_tc not loaded")
		return
	}
	if f.attnCnt == 0 {
		k.fail("attn_decode2 has no split counters (it would not merge)")
		return
	}
	div := float32(math.Sqrt(float64(hd)))
	scaleLog2 := float32(1 / math.Sqrt(float64(hd)) * math.Log2E)
	null := cu.DevicePtr(0)
	k.add("")
	k.add("attention variants: split = attn_split + attn_combine (the f32 reference), tc = attn_decode_tc + combine (the default), tcd = attn_decode_tc over the same bytes laid out as one KV head (rows 256 bytes apart instead of 2 KiB: 8x the queries; a diagnostic, unchecked), d2 = attn_decode2 + combine, d2m = attn_decode2 merging its own splits, d2m8 = attn_decode2_w8 merging; us per layer, %% of HBM on the K and V bytes")
	k.add("| attention, one layer | batch | ctx | floor us | split us | tc us (%%) | d2 us (%%) | d2m us (%%) | d2m8 us (%%) | tcd us (%%) | combine alone us | checks |")
	k.add("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	cases := []struct{ bs, ctx int }{{1, 1024}, {1, 8192}, {1, 32768}, {8, 1024}, {8, 8192}, {8, 32768},
		{32, 1024}, {32, 8192}, {32, 32768}, {128, 1024}, {128, 8192}, {128, 32768}, {256, 1024}, {256, 8192}, {256, 32768}}
	if only := os.Getenv("MOONCAKE_KBENCH_ATTN"); only != "" { // e.g. "128x1024,32x1024"
		cases = cases[:0]
		for _, f := range strings.Split(only, ",") {
			var bs, ctx int
			if _, err := fmt.Sscanf(f, "%dx%d", &bs, &ctx); err != nil || bs < 1 || bs > maxBS || ctx < 1 || ctx > maxCtx {
				k.t.Fatalf("MOONCAKE_KBENCH_ATTN: %q is not batch x ctx within %d x %d", f, maxBS, maxCtx)
			}
			cases = append(cases, struct{ bs, ctx int }{bs, ctx})
		}
	}
	for _, cs := range cases {
		ps32 := make([]int32, maxBS)
		for i := range ps32 {
			ps32[i] = int32(cs.ctx) // the decode token's position: ctx+1 keys
		}
		k.put(pos, ps32)
		dpos := make([]int32, nq)
		for i := range dpos {
			dpos[i] = int32(cs.ctx)
		}
		k.put(dq.pos, dpos)
		nsplit := ceilDiv(cs.ctx+1, b.fn.split)
		partML := part + cu.DevicePtr(uint64(cs.bs)*uint64(c.Heads)*uint64(nsplit)*uint64(hd)*4)
		kvBytes := float64(cs.bs) * float64(cs.ctx+1) * float64(2*kvd*2)
		floorUS := kvBytes / k.bw * 1e6
		inner := max(1, min(20, int(2000/floorUS)))
		grid := cu.Dim3{X: uint32(nsplit), Y: uint32(c.KVHeads), Z: uint32(cs.bs)}
		args := func(last ...any) []any {
			return append([]any{part, partML, q, kc, vc, qrow, pos, ptoff, pages, int32(ps), int32(nsplit), int32(c.Heads),
				int32(c.KVHeads), int32(0)}, last...)
		}
		combine := func(out cu.DevicePtr) {
			k.launch(comb, cu.Dim3{X: uint32(c.Heads), Y: uint32(cs.bs), Z: 1}, cu.D1(uint32(f.combineThreads)), 0, out, part,
				partML, qrow, pos, int32(nsplit), int32(c.Heads), int32(0), int32(0))
		}
		kern := []func(int){
			func(int) {
				k.launch(split, grid, cu.D1(uint32(f.attThreads)), 0, args(div, int32(0))...)
				combine(att[0])
			},
			func(int) { k.launch(tc, grid, cu.D1(uint32(f.tcThreads)), 0, args(scaleLog2)...); combine(att[1]) },
			func(int) { k.launch(dec2, grid, cu.D1(128), 0, args(scaleLog2, null, null)...); combine(att[2]) },
			func(int) { k.launch(dec2, grid, cu.D1(128), 0, args(scaleLog2, att[3], f.attnCnt)...) },
			func(int) { k.launch(dec2w8, grid, cu.D1(256), 0, args(scaleLog2, att[4], f.attnCnt)...) },
			func(int) {
				// the same bytes as one KV head of rows 256 bytes apart: 8x the queries
				k.launch(tc, cu.Dim3{X: uint32(nsplit), Y: 1, Z: uint32(cs.bs * c.KVHeads)}, cu.D1(uint32(f.tcThreads)), 0,
					part, partML, q, kc, vc, dq.qrow, dq.pos, dq.ptoff, dq.pages, int32(ps), int32(nsplit), int32(group), int32(1),
					int32(0), scaleLog2)
			},
		}
		var got [6][]float32
		var raw [6][]byte
		check := cs.bs*cs.ctx <= 32*8192
		for i, fn := range kern[:5] {
			if !check {
				break
			}
			// Poison (bf16 NaN) so unwritten outputs show.
			if err := b.stream.MemsetD8(att[i], 0xff, uint64(cs.bs*qd*2)); err != nil {
				k.t.Fatal(err)
			}
			fn(0)
			raw[i] = k.get(att[i], uint64(cs.bs*qd*2))
			got[i] = bf16s(raw[i])
		}
		verdict := "not checked"
		if check {
			verdict = ""
			for i, name := range []string{"tc", "d2", "d2m", "d2m8"} {
				e := relErr(got[i+1], got[0])
				nan := 0
				for _, v := range got[i+1] {
					if v != v {
						nan++
					}
				}
				if !(e < 1e-2) || nan > 0 {
					k.fail("%s batch %d ctx %d: rel err %.3g vs attn_split, %d unwritten", name, cs.bs, cs.ctx, e, nan)
				}
				verdict += fmt.Sprintf("%s %.1e ", name, e)
			}
			if !bytes.Equal(raw[3], raw[2]) {
				k.fail("batch %d ctx %d: attn_decode2 merging its splits differs from attn_combine's merge", cs.bs, cs.ctx)
				verdict += "d2m != d2 "
			} else {
				verdict += "d2m == d2 "
			}
		}
		var us [6]float64
		for i, fn := range kern {
			if i == 0 && cs.bs*cs.ctx > 128*8192 {
				continue // the reference kernel is slow here; the others are what matter
			}
			us[i] = k.time(inner, fn)
		}
		cus := k.time(inner, func(int) { combine(att[2]) })
		pc := func(i int) float64 { _, p := k.gbs(kvBytes, us[i]); return p }
		k.add("| attention | %d | %d | %.1f | %.1f | %.1f (%.0f%%) | %.1f (%.0f%%) | %.1f (%.0f%%) | %.1f (%.0f%%) | %.1f (%.0f%%) | %.1f | %s|",
			cs.bs, cs.ctx, floorUS, us[0], us[1], pc(1), us[2], pc(2), us[3], pc(3), us[4], pc(4), us[5], pc(5), cus, verdict)
	}
}

// prefill times the flash prefill attention of one layer (one sequence, no
// cached prefix) at 1K..8K tokens (MOONCAKE_KBENCH_PREFILL, e.g.
// "2048,16384", picks others): attn_prefill3 of 128-row and of 64-row tiles
// and attn_prefill4 (wgmma) against llama.cu's attn_prefill2, in TFLOP/s
// counted over the causal half (4 x head dim x heads x L(L+1)/2), and checks
// that they agree.
func (k *kbench) prefill() {
	b := k.b
	c := &b.cfg
	f := &b.fn
	hd, qd, kvd := c.HeadDim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	if f.attnFlash2 == nil || f.flash2Rows != 128 || !f.flash2HeadsX || f.flash64 == nil || f.flash3 == nil {
		k.fail("attn_prefill3/4 not loaded (flash rows %d, heads on x %v, 64-row kernel %v, attn_prefill4 %v: %v)",
			f.flash2Rows, f.flash2HeadsX, f.flash64 != nil, f.flash3 != nil, f.hopperErr)
		return
	}
	p2 := k.fn("attn_prefill2") // 8 warps: its shared-memory attribute was raised at load
	const ps = 64
	lens := []int{1024, 2048, 4096, 8192}
	if v := os.Getenv("MOONCAKE_KBENCH_PREFILL"); v != "" {
		lens = lens[:0]
		for _, x := range strings.Split(v, ",") {
			n, err := strconv.Atoi(x)
			if err != nil || n < 1 || n > 65536 {
				k.t.Fatalf("MOONCAKE_KBENCH_PREFILL: %q is not a length in 1..65536", x)
			}
			lens = append(lens, n)
		}
	}
	maxL := slices.Max(lens)
	npg := ceilDiv(maxL, ps)
	kc, vc := k.alloc(uint64(npg*ps*kvd*2)), k.alloc(uint64(npg*ps*kvd*2))
	k.randT(kc, uint64(npg*ps*kvd), 51, 1)
	k.randT(vc, uint64(npg*ps*kvd), 52, 1)
	q := k.alloc(uint64(maxL * qd * 2))
	k.randT(q, uint64(maxL*qd), 53, 1)
	var out [4]cu.DevicePtr
	for i := range out {
		out[i] = k.alloc(uint64(maxL * qd * 2))
	}
	qstart, qlen, pos0, ptoff, pages := k.alloc(4), k.alloc(4), k.alloc(4), k.alloc(4), k.alloc(uint64(npg*4))
	k.put(qstart, []int32{0})
	k.put(pos0, []int32{0})
	k.put(ptoff, []int32{0})
	pg := make([]int32, npg)
	for i, v := range rand.New(rand.NewPCG(5, 5)).Perm(npg) {
		pg[i] = int32(v)
	}
	k.put(pages, pg)
	scaleLog2 := float32(1 / math.Sqrt(float64(hd)) * math.Log2E)
	k.add("")
	k.add("| flash prefill, one layer | tokens | attn_prefill2 us (TFLOP/s) | attn_prefill3 us (TFLOP/s) | attn_prefill3_64 us (TFLOP/s) | attn_prefill4 us (TFLOP/s) | vs attn_prefill2 |")
	k.add("| --- | --- | --- | --- | --- | --- | --- |")
	for _, L := range lens {
		k.put(qlen, []int32{int32(L)})
		args := func(o cu.DevicePtr) []any {
			return []any{o, q, kc, vc, qstart, qlen, pos0, ptoff, pages, int32(ps), int32(c.Heads), int32(c.KVHeads), scaleLog2}
		}
		heads := uint32(c.Heads)
		run := [4]func(int){
			func(int) {
				k.launch(p2, cu.Dim3{X: uint32(ceilDiv(L, 128)), Y: heads, Z: 1}, cu.D1(256), uint32(2*2*64*(hd+8)*2), args(out[0])...)
			},
			func(int) {
				k.launch(f.flash3, cu.Dim3{X: heads, Y: uint32(ceilDiv(L, 128)), Z: 1}, cu.D1(128), uint32(f.flash3Smem), args(out[1])...)
			},
			func(int) {
				k.launch(f.flash64, cu.Dim3{X: heads, Y: uint32(ceilDiv(L, 64)), Z: 1}, cu.D1(flash64Threads), uint32(f.flash64Smem), args(out[2])...)
			},
			func(int) {
				k.launch(f.attnFlash2, cu.Dim3{X: heads, Y: uint32(ceilDiv(L, 128)), Z: 1}, cu.D1(uint32(f.flash2Threads)),
					uint32(f.flash2Smem), args(out[3])...)
			},
		}
		var got [4][]float32
		for i := range run {
			if err := b.stream.MemsetD8(out[i], 0xff, uint64(L*qd*2)); err != nil { // bf16 NaN: unwritten rows show
				k.t.Fatal(err)
			}
			run[i](0)
			got[i] = bf16s(k.get(out[i], uint64(L*qd*2)))
		}
		verdict := ""
		for i := 1; i < len(run); i++ {
			nan := 0
			for _, v := range got[i] {
				if v != v {
					nan++
				}
			}
			e := relErr(got[i], got[0])
			if !(e < 1e-2) || nan > 0 {
				k.fail("prefill %d tokens: kernel %d rel err %.3g vs attn_prefill2, %d values unwritten", L, i, e, nan)
			}
			verdict += fmt.Sprintf("%.1e ", e)
		}
		flops := 4 * float64(hd*c.Heads) * float64(L) * float64(L+1) / 2
		var us [4]float64
		for i := range run {
			us[i] = k.time(10, run[i])
		}
		tf := func(u float64) float64 { return flops / (u * 1e-6) / 1e12 }
		k.add("| flash prefill | %d | %.1f (%.0f) | %.1f (%.0f) | %.1f (%.0f) | %.1f (%.0f) | rel err %s|", L, us[0], tf(us[0]),
			us[1], tf(us[1]), us[2], tf(us[2]), us[3], tf(us[3]), verdict)
	}
}

// f32s decodes little-endian f32 values.
func f32s(raw []byte) []float32 {
	o := make([]float32, len(raw)/4)
	for i := range o {
		o[i] = math.Float32frombits(uint32(raw[4*i]) | uint32(raw[4*i+1])<<8 | uint32(raw[4*i+2])<<16 | uint32(raw[4*i+3])<<24)
	}
	return o
}

// bf16s decodes little-endian bf16 values.
func bf16s(raw []byte) []float32 {
	o := make([]float32, len(raw)/2)
	for i := range o {
		o[i] = math.Float32frombits(uint32(raw[2*i])<<16 | uint32(raw[2*i+1])<<24)
	}
	return o
}
