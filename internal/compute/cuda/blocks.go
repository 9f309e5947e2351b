package cuda

import (
	"errors"
	"fmt"
	"math"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/csrc"
	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// A layer is the Spec's blocks, enqueued in order (enqueue): the attention
// block (attention: RMSNorm, q/k/v with optional biases, optional per-head
// q/k RMSNorm, RoPE and the KV write, attention, the output projection) and
// the MLP block, dense SwiGLU (denseMLP) or a mixture of experts (moeMLP).
// Llama's blocks keep the fused decode kernels; a block with q/k norms runs
// the projection, qk_norm and rope_kv as separate kernels.

// ErrUnsupported marks a model the CUDA backend does not run.
var ErrUnsupported = errors.New("cuda backend: not supported")

// Supports says whether the backend runs models of c: every registered
// block but sliding-window attention.
func Supports(c model.Config) error {
	switch {
	case c.Spec == nil:
		return fmt.Errorf("%w: no architecture", ErrUnsupported)
	case c.SlidingWindow > 0:
		return fmt.Errorf("%w: %s with sliding-window attention (sliding_window %d)", ErrUnsupported, c.ArchName(), c.SlidingWindow)
	}
	return nil
}

// blockKernels are the functions of the blocks kernel set (csrc/llama/blocks.cu),
// loaded only for a Spec with q/k norms or experts.
type blockKernels struct {
	mod                           *cu.Module
	qkNorm, moeGather, moeCombine *cu.Function
}

// needsBlocks says whether c's layers use the blocks kernel set.
func needsBlocks(c *model.Config) bool {
	return c.Spec.Attention.QKNorm || c.Spec.MLP.MoE
}

// loadBlocks compiles and loads the blocks kernel set with the llama set's
// macros opts, when the model needs it.
func (b *Backend) loadBlocks(k *cu.Kernels, opts []string) error {
	if !needsBlocks(&b.cfg) {
		return nil
	}
	src, err := csrc.LlamaKernel("blocks")
	if err != nil {
		return fmt.Errorf("cuda backend: kernel source: %w", err)
	}
	bk := &b.bk
	if bk.mod, err = k.LoadSource(b.cx, "blocks", src, opts...); err != nil {
		return fmt.Errorf("cuda backend: block kernels: %w", err)
	}
	for _, f := range []struct {
		dst  **cu.Function
		name string
	}{{&bk.qkNorm, "qk_norm"}, {&bk.moeGather, "moe_gather"}, {&bk.moeCombine, "moe_combine"}} {
		if *f.dst, err = bk.mod.Function(f.name); err != nil {
			return fmt.Errorf("cuda backend: block kernels: %w", err)
		}
	}
	return nil
}

// layerPass is what the blocks of one enqueued pass share: the plan, the
// buffers and the launch shapes that depend on the pass alone.
type layerPass struct {
	r           *run
	p           *passPlan
	d           *passBufs
	slots       cu.DevicePtr
	fused, sk   bool   // the pass runs the fused decode kernels; the skinny GEMMs
	xsmem       uint32 // gemv2's normalised x, n rows of T
	vt          int32
	interleaved int32
	scaleLog2   float32
	div         float32
	layerBytes  cu.DevicePtr
	partML      cu.DevicePtr
}

func (lp *layerPass) meta(off int) cu.DevicePtr { return lp.d.meta + cu.DevicePtr(off*4) }

// attention enqueues layer li's attention block and, when hooked, reports
// the layer's KV writes to the seqs.
func (b *Backend) attention(lp *layerPass, li int, w *devLayer, seqs []compute.Seq, hooked bool) error {
	c := &b.cfg
	r, p, d := lp.r, lp.p, lp.d
	dim, qd, kvd := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	n := p.n
	nb := uint32(n)
	hd := c.HeadDim
	null := cu.DevicePtr(0)
	rmsT := rmsThreads(dim)
	kc := b.kvBase + cu.DevicePtr(2*li)*lp.layerBytes
	vc := kc + lp.layerBytes
	qkNorm := w.qNorm != 0
	switch {
	case lp.fused && !qkNorm:
		f := b.fn.g2QKV
		r.launchDep(f, b.g2Grid(f, (qd+2*kvd)/2), cu.D1(g2Threads), lp.xsmem, d.q, kc, vc, d.x, w.attnNorm, w.wqkv, w.bqkv,
			lp.meta(p.pos), lp.slots, b.ropeTab, b.rope, int32(b.ropeN), int32(n), int32(dim), lp.vt, c.NormEps,
			int32(c.Heads), int32(c.KVHeads), lp.interleaved)
	case lp.sk && b.fn.skQKV != nil && !qkNorm:
		r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, d.xb, d.x, w.attnNorm, null, int32(dim), c.NormEps)
		f := &b.fn
		rb := ceilDiv(qd+2*kvd, skRows)
		s, cps := skSplit(f.skCap, rb, dim)
		r.launchDep(f.skQKV, cu.Dim3{X: uint32(rb), Y: uint32(s), Z: 1}, cu.D1(skThreads), 0, d.q, kc, vc, d.xb, w.wqkv,
			w.bqkv, lp.meta(p.pos), lp.slots, b.ropeTab, b.rope, int32(b.ropeN), int32(n), int32(dim), int32(c.Heads),
			int32(c.KVHeads), lp.interleaved, int32(cps), f.skPart, f.skCnt)
	default:
		r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, d.xb, d.x, w.attnNorm, null, int32(dim), c.NormEps)
		r.gemm(d.qkv, true, d.xb, w.wqkv, n, qd+2*kvd, dim, 0)
		bias := w.bqkv
		if qkNorm {
			// The biases, then each q and k head's RMSNorm, in place.
			heads := c.Heads + c.KVHeads // the v heads' blocks only add their bias
			if w.bqkv != 0 {
				heads += c.KVHeads
			}
			r.launch(b.bk.qkNorm, cu.Dim3{X: nb, Y: uint32(heads), Z: 1}, cu.D1(32), 0, d.qkv, w.bqkv,
				w.qNorm, w.kNorm, int32(c.Heads), int32(c.KVHeads), c.NormEps)
			bias = null
		}
		r.launch(b.fn.ropeKV, cu.Dim3{X: nb, Y: ropeBlocks(c.Heads, c.KVHeads, hd), Z: 1}, cu.D1(ropeThreads), 0, d.q, kc, vc,
			d.qkv, bias, lp.meta(p.pos), lp.slots, b.ropeTab, b.rope, int32(b.ropeN), int32(c.Heads), int32(c.KVHeads),
			lp.interleaved)
	}
	if hooked && r.err == nil {
		if err := b.reportLayer(r.s, seqs, li); err != nil {
			return fmt.Errorf("cuda backend: layer %d: %w", li, err)
		}
	}
	if p.np > 0 && b.fn.attnFlash2 != nil {
		bq := 16 * b.fn.flash2Warps
		r.launch(b.fn.attnFlash2, cu.Dim3{X: uint32((p.maxPrefill + bq - 1) / bq), Y: uint32(c.Heads), Z: uint32(p.np)},
			cu.D1(uint32(32*b.fn.flash2Warps)), uint32(b.fn.flash2Smem), d.att, d.q, kc, vc, lp.meta(p.pStart), lp.meta(p.pLen),
			lp.meta(p.pPos0), lp.meta(p.pPtoff), lp.meta(p.pages), int32(b.layout.PageSize), int32(c.Heads), int32(c.KVHeads),
			lp.scaleLog2)
	} else if p.np > 0 {
		r.launch(b.fn.attnFlash, cu.Dim3{X: uint32((p.maxPrefill + 63) / 64), Y: uint32(c.Heads), Z: uint32(p.np)},
			cu.D1(128), 0, d.att, d.q, kc, vc, lp.meta(p.pStart), lp.meta(p.pLen), lp.meta(p.pPos0), lp.meta(p.pPtoff),
			lp.meta(p.pages), int32(b.layout.PageSize), int32(c.Heads), int32(c.KVHeads), lp.scaleLog2)
	}
	qchunk := p.qchunk
	for q0 := 0; q0 < p.ng; q0 += qchunk {
		cnt := uint32(min(qchunk, p.ng-q0))
		grid := cu.Dim3{X: uint32(p.nsplit), Y: uint32(c.KVHeads), Z: cnt}
		args := []any{d.part, lp.partML, d.q, kc, vc, lp.meta(p.gRow), lp.meta(p.gPos), lp.meta(p.gPtoff), lp.meta(p.pages),
			int32(b.layout.PageSize), int32(p.nsplit), int32(c.Heads), int32(c.KVHeads), int32(q0)}
		f := &b.fn
		switch {
		case f.attnDecode2 != nil && f.attnCnt != 0 && int(cnt) <= f.attnCntQ:
			// The last split block of each query merges: no combine.
			r.launch(f.attnDecode2, grid, cu.D1(uint32(f.d2Threads)), 0, append(args, lp.scaleLog2, d.att, f.attnCnt)...)
			continue
		case f.attnDecode2 != nil:
			r.launch(f.attnDecode2, grid, cu.D1(uint32(f.d2Threads)), 0, append(args, lp.scaleLog2, null, null)...)
		case f.attnDecode != nil:
			r.launch(f.attnDecode, grid, cu.D1(128), 0, append(args, lp.div)...)
		default:
			r.launch(f.attnSplit, grid, cu.D1(uint32(f.attThreads)), 0, append(args, lp.div)...)
		}
		r.launch(f.attnCombine, cu.Dim3{X: uint32(c.Heads), Y: cnt, Z: 1}, cu.D1(uint32(f.combineThreads)), 0,
			d.att, d.part, lp.partML, lp.meta(p.gRow), lp.meta(p.gPos), int32(p.nsplit), int32(c.Heads), int32(q0))
	}
	r.gemm(d.x, true, d.att, w.wo, n, dim, qd, 1)
	return nil
}

// denseMLP enqueues a dense SwiGLU MLP block.
func (b *Backend) denseMLP(lp *layerPass, w *devLayer) {
	c := &b.cfg
	r, d := lp.r, lp.d
	n, dim, hid := lp.p.n, c.Dim, c.HiddenDim
	nb := uint32(n)
	null := cu.DevicePtr(0)
	rmsT := rmsThreads(dim)
	switch {
	case lp.fused:
		f := b.fn.g2SiLU
		r.launchDep(f, b.g2Grid(f, hid), cu.D1(g2Threads), lp.xsmem, d.h, d.x, w.ffnNorm, w.w13, int32(n), int32(hid),
			int32(dim), lp.vt, c.NormEps)
	case lp.sk && b.fn.skSiLU != nil:
		r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, d.xb, d.x, w.ffnNorm, null, int32(dim), c.NormEps)
		f := &b.fn
		s, cps := skSplit(f.skCap, hid/64, dim)
		r.launchDep(f.skSiLU, cu.Dim3{X: uint32(hid / 64), Y: uint32(s), Z: 1}, cu.D1(skThreads), 0, d.h, d.xb, w.w13,
			int32(n), int32(hid), int32(dim), int32(cps), f.skPart, f.skCnt)
	default:
		r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, d.xb, d.x, w.ffnNorm, null, int32(dim), c.NormEps)
		r.gemm(d.gu, false, d.xb, w.w13, n, 2*hid, dim, 0)
		r.launch(b.fn.siluMul, cu.Dim3{X: nb, Y: siluBlocks(hid), Z: 1}, cu.D1(siluThreads), 0, d.h, d.gu, int32(hid))
	}
	r.gemm(d.x, true, d.h, w.w2, n, dim, hid, 1)
}

// moeBufs are the eager buffers of the MoE blocks; routed[k] rows are the
// (token, rank) pairs, sorted by expert.
type moeBufs struct {
	logits     dbuf // router logits f32 [n][E (+1: the shared expert's gate)]
	xe, gu, h  dbuf // T [routed][Dim], [routed][2*ExpertDim], [routed][ExpertDim]
	ye         dbuf // f32 [routed][Dim]
	meta       dbuf // int32 [routed] source token, [routed] row of each pair, f32 [routed] weight
	sgu, sh    dbuf // shared expert: T [n][2*SharedExpertDim], [n][SharedExpertDim]
	sy         dbuf // f32 [n][Dim]
	hostLogits *cu.HostMem
	stage      *cu.HostMem // the meta image
	rt         router
}

func (m *moeBufs) free(b *Backend) {
	for _, d := range []*dbuf{&m.logits, &m.xe, &m.gu, &m.h, &m.ye, &m.meta, &m.sgu, &m.sh, &m.sy} {
		if d.p != 0 {
			b.cx.MemFree(d.p)
		}
		*d = dbuf{}
	}
	m.hostLogits.Free()
	m.stage.Free()
	m.hostLogits, m.stage = nil, nil
}

// moeStride is the router GEMM's output row: the experts' logits, then the
// shared expert's gate logit.
func (b *Backend) moeStride() int {
	if b.cfg.Spec.MLP.SharedExpert {
		return b.cfg.Experts + 1
	}
	return b.cfg.Experts
}

// ensureMoE grows the MoE buffers for a pass of n tokens (the stream is
// idle).
func (b *Backend) ensureMoE(n int) error {
	c := &b.cfg
	if !c.Spec.MLP.MoE {
		return nil
	}
	m := &b.moe
	nk := uint64(n) * uint64(c.TopK)
	eb, dim, I, S := uint64(b.eb), uint64(c.Dim), uint64(c.ExpertDim), uint64(c.SharedExpertDim)
	stride := uint64(b.moeStride())
	for _, e := range []struct {
		d  *dbuf
		sz uint64
	}{
		{&m.logits, uint64(n) * stride * 4}, {&m.xe, nk * dim * eb}, {&m.gu, nk * 2 * I * eb}, {&m.h, nk * I * eb},
		{&m.ye, nk * dim * 4}, {&m.meta, nk * 12}, {&m.sgu, uint64(n) * 2 * S * eb}, {&m.sh, uint64(n) * S * eb},
		{&m.sy, uint64(n) * dim * 4},
	} {
		if err := b.ensure(e.d, e.sz); err != nil {
			return fmt.Errorf("cuda backend: MoE scratch: %w", err)
		}
	}
	if err := b.ensureHost(&m.hostLogits, uint64(n)*stride*4); err != nil {
		return err
	}
	return b.ensureHost(&m.stage, nk*12)
}

// combineThreads is moe_combine's block for rows of dim.
func combineThreads(dim int) uint32 { return uint32(min(1024, max(32, (dim+31)/32*32))) }

// moeMLP enqueues a mixture-of-experts block: RMSNorm, the router GEMM
// (and the shared expert), then, on the host, each token's top k of the
// softmax and the pairs sorted by expert (a copy of the router logits and
// a synchronisation: this block cannot be captured), then the gather, each
// chosen expert's GEMMs over its rows (the other experts' weights are not
// read), SiLU, and the weighted sum added to the residual stream.
func (b *Backend) moeMLP(lp *layerPass, w *devLayer) {
	c := &b.cfg
	r, d := lp.r, lp.d
	m := &b.moe
	mw := w.moe
	n, dim, E, K, I, S := lp.p.n, c.Dim, c.Experts, c.TopK, c.ExpertDim, c.SharedExpertDim
	nk := n * K
	eb := cu.DevicePtr(b.eb)
	stride := b.moeStride()
	null := cu.DevicePtr(0)
	r.launch(b.fn.rmsnorm, cu.D1(uint32(n)), cu.D1(rmsThreads(dim)), 0, d.xb, d.x, w.ffnNorm, null, int32(dim), c.NormEps)
	r.gemm(m.logits.p, true, d.xb, mw.router, n, stride, dim, 0)
	sh, gate := null, null
	if mw.sw13 != 0 {
		r.gemm(m.sgu.p, false, d.xb, mw.sw13, n, 2*S, dim, 0)
		r.launch(b.fn.siluMul, cu.Dim3{X: uint32(n), Y: siluBlocks(S), Z: 1}, cu.D1(siluThreads), 0, m.sh.p, m.sgu.p, int32(S))
		r.gemm(m.sy.p, true, m.sh.p, mw.sw2, n, dim, S, 0)
		sh, gate = m.sy.p, m.logits.p+cu.DevicePtr(E*4)
	}
	if r.err != nil {
		return
	}
	if r.err = r.s.MemcpyDtoH(m.hostLogits.Ptr(), m.logits.p, uint64(n*stride*4)); r.err != nil {
		return
	}
	if r.err = r.s.Synchronize(); r.err != nil {
		return
	}
	logits := unsafe.Slice((*float32)(m.hostLogits.Ptr()), n*stride)
	img := unsafe.Slice((*int32)(m.stage.Ptr()), 3*nk)
	counts := m.rt.route(logits, n, stride, E, K, c.NormTopKProb || c.Spec.MLP.NormTopK == model.NormTopKAlways, img)
	if r.err = r.s.MemcpyHtoD(m.meta.p, m.stage.Ptr(), uint64(3*nk*4)); r.err != nil {
		return
	}
	src := m.meta.p
	rows := src + cu.DevicePtr(nk*4)
	wts := rows + cu.DevicePtr(nk*4)
	r.launch(b.bk.moeGather, cu.D1(uint32(nk)), cu.D1(combineThreads(dim)), 0, m.xe.p, d.xb, src, int32(dim))
	off := 0
	for e, cnt := range counts {
		if cnt > 0 {
			r.gemm(m.gu.p+cu.DevicePtr(off*2*I)*eb, false, m.xe.p+cu.DevicePtr(off*dim)*eb,
				mw.w13+cu.DevicePtr(e*2*I*dim)*eb, cnt, 2*I, dim, 0)
			off += cnt
		}
	}
	r.launch(b.fn.siluMul, cu.Dim3{X: uint32(nk), Y: siluBlocks(I), Z: 1}, cu.D1(siluThreads), 0, m.h.p, m.gu.p, int32(I))
	off = 0
	for e, cnt := range counts {
		if cnt > 0 {
			r.gemm(m.ye.p+cu.DevicePtr(off*dim*4), true, m.h.p+cu.DevicePtr(off*I)*eb,
				mw.w2+cu.DevicePtr(e*dim*I)*eb, cnt, dim, I, 0)
			off += cnt
		}
	}
	r.launch(b.bk.moeCombine, cu.D1(uint32(n)), cu.D1(combineThreads(dim)), 0, d.x, m.ye.p, rows, wts, sh, gate,
		int32(stride), int32(K), int32(dim))
}

// router is the host side of MoE routing, its buffers reused across layers.
type router struct {
	counts, next []int
	ids          []int32
	w            []float32
}

// route picks, for each of n tokens, the top k of the softmax over the
// first e of its stride logits (the lowest expert id on ties; renormalised
// to sum to 1 when norm is set, as the CPU backend does) and sorts the
// (token, rank) pairs by expert, in token order within an expert. It writes
// img: [n*k] the source token of each sorted row, [n*k] the sorted row of
// pair t*k+j, [n*k] the pair's weight (f32 bits); and returns the rows of
// each expert.
func (rt *router) route(logits []float32, n, stride, e, k int, norm bool, img []int32) []int {
	nk := n * k
	if cap(rt.counts) < e {
		rt.counts, rt.next = make([]int, e), make([]int, e)
	}
	counts, next := rt.counts[:e], rt.next[:e]
	if cap(rt.ids) < nk {
		rt.ids = make([]int32, nk)
	}
	ids := rt.ids[:nk]
	src, rows, wts := img[:nk], img[nk:2*nk], img[2*nk:3*nk]
	clear(counts)
	for t := 0; t < n; t++ {
		topK(logits[t*stride:t*stride+e], ids[t*k:(t+1)*k])
		for j := 0; j < k; j++ {
			counts[ids[t*k+j]]++
		}
	}
	off := 0
	for x := range counts {
		next[x] = off
		off += counts[x]
	}
	for p, id := range ids {
		row := next[id]
		next[id]++
		rows[p] = int32(row)
		src[row] = int32(p / k)
	}
	for t := 0; t < n; t++ {
		rt.w = topWeights(logits[t*stride:t*stride+e], ids[t*k:(t+1)*k], norm, rt.w[:0])
		for j, v := range rt.w {
			wts[t*k+j] = int32(math.Float32bits(v))
		}
	}
	return counts
}

// topK writes into ids the len(ids) largest of l in order (the lowest
// index on ties).
func topK(l []float32, ids []int32) {
	for j := range ids {
		best := -1
		for i, v := range l {
			if (best < 0 || v > l[best]) && !takenID(ids[:j], int32(i)) {
				best = i
			}
		}
		ids[j] = int32(best)
	}
}

// topWeights appends to w the softmax probabilities of ids over l,
// renormalised over ids when norm is set (as the CPU backend computes them:
// the exponentials in float64, each probability rounded to float32).
func topWeights(l []float32, ids []int32, norm bool, w []float32) []float32 {
	mx := l[0]
	for _, v := range l {
		mx = max(mx, v)
	}
	var sum float64
	for _, v := range l {
		sum += math.Exp(float64(v - mx))
	}
	for _, id := range ids {
		w = append(w, float32(math.Exp(float64(l[id]-mx))/sum))
	}
	if norm {
		var s float32
		for _, v := range w {
			s += v
		}
		for j := range w {
			w[j] /= s
		}
	}
	return w
}

func takenID(ids []int32, i int32) bool {
	for _, id := range ids {
		if id == i {
			return true
		}
	}
	return false
}
