package cuda

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
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
// the projection (gemv2_norm at fused sizes, else rmsnorm and a GEMM), then
// qk_norm_rope (q/k norms, RoPE and the KV write).

// ErrUnsupported marks a model the CUDA backend does not run.
var ErrUnsupported = errors.New("cuda backend: not supported")

// Supports says whether the backend runs models of c: every registered
// block (sliding-window attention through the split-K kernels only).
func Supports(c model.Config) error {
	switch {
	case c.Spec == nil:
		return fmt.Errorf("%w: no architecture", ErrUnsupported)
	case c.Spec.MLP.MoE && (c.Experts > moeMaxExperts || c.TopK > 32):
		return fmt.Errorf("%w: %s with %d experts, top %d (the routing kernels take at most %d experts, top 32)",
			ErrUnsupported, c.ArchName(), c.Experts, c.TopK, moeMaxExperts)
	}
	return nil
}

// blockKernels are the functions of the blocks kernel set (csrc/llama/blocks.cu),
// loaded only for a Spec with q/k norms or experts, and the grouped expert
// GEMMs of the llama set (moeSiLU, moeDown: nil when that set has none or
// the shapes do not suit them).
type blockKernels struct {
	mod                                             *cu.Module
	qkNorm, moeGather, moeCombine, moeTopK, moeSort *cu.Function
	moeRoute, gemvSiLU, gemvSiLU1, gemvDown         *cu.Function
	routeSiLU1                                      *cu.Function // nil without tuning routeSiLU: moe_route, moe_gemv_silu1
	qkNormRope                                      *cu.Function // nil with tuning noQKRope: qk_norm, rope_kv
	gemvDownAdd                                     *cu.Function // nil with tuning noMoEAdd: moe_gemv_down, moe_combine
	moeSiLU, moeDown                                *cu.Function // moe_sk_*: bf16 only
	grouped                                         bool         // the shapes suit the grouped kernels
	// the grouped GEMMs' split-K: resident blocks of the GPU, and the
	// partials and counters of passes of at most skMaxN tokens
	moeCap          int
	moePart, moeCnt cu.DevicePtr
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
	opts = append(slices.Clip(opts), strings.Fields(b.opts.tune.blocksDefs)...)
	if bk.mod, err = k.LoadSource(b.cx, "blocks", src, opts...); err != nil {
		return fmt.Errorf("cuda backend: block kernels: %w", err)
	}
	for _, f := range []struct {
		dst  **cu.Function
		name string
	}{{&bk.qkNorm, "qk_norm"}, {&bk.moeGather, "moe_gather"}, {&bk.moeCombine, "moe_combine"}, {&bk.moeTopK, "moe_topk"},
		{&bk.moeSort, "moe_sort"}, {&bk.moeRoute, "moe_route"}, {&bk.gemvSiLU, "moe_gemv_silu"}, {&bk.gemvSiLU1, "moe_gemv_silu1"},
		{&bk.gemvDown, "moe_gemv_down"}, {&bk.qkNormRope, "qk_norm_rope"}, {&bk.gemvDownAdd, "moe_gemv_down_add"},
		{&bk.routeSiLU1, "moe_route_silu1"}} {
		if *f.dst, err = bk.mod.Function(f.name); err != nil {
			return fmt.Errorf("cuda backend: block kernels: %w", err)
		}
	}
	if b.opts.tune.noQKRope {
		bk.qkNormRope = nil
	}
	if b.opts.tune.noMoEAdd {
		bk.gemvDownAdd = nil
	}
	if !b.opts.tune.routeSiLU || b.cfg.Experts > routeSiLUMaxE {
		bk.routeSiLU1 = nil
	}
	return nil
}

// Routing limits of moe_topk, moe_sort and moe_route (csrc/llama/blocks.cu:
// TOPK_PER * 32 = MOE_MAXE experts).
const (
	moeMaxExperts  = 512     // MOE_MAXE
	moeSortThreads = 16 * 32 // MOE_SORT_WARPS
	// moeRouteMax is the most tokens routed by one moe_route launch (its
	// 16 warps route them one after another) instead of moe_topk's grid.
	moeRouteMax = 64
	// moeGemvMax is the most tokens of a pass whose experts run moe_gemv_*
	// (weights read once per 4 rows of an expert) rather than moe_sk_*.
	moeGemvMax = 8
	// moeAddPairs is the most (token, expert) pairs of a pass of the
	// grouped GEMVs that run moe_gemv_down_add (a weight row read once a
	// pair) instead of moe_gemv_down and moe_combine.
	moeAddPairs = 16
	// routeSiLUMaxE is the most experts moe_route_silu1 ranks (a thread
	// each of its 256).
	routeSiLUMaxE = 256
)

// loadGrouped enables the grouped expert kernels when the expert shapes
// suit them: moe_gemv_* always, and the tensor-core moe_sk_* of the llama
// set (bf16 with the second-generation kernels), whose split-K workspace it
// allocates.
func (b *Backend) loadGrouped() error {
	c := &b.cfg
	bk := &b.bk
	if !c.Spec.MLP.MoE || c.Dim%8 != 0 || c.ExpertDim%8 != 0 {
		return nil
	}
	bk.grouped = true
	if !b.bf16 {
		return nil
	}
	silu, err1 := b.mod.Function("moe_sk_silu")
	down, err2 := b.mod.Function("moe_sk_down")
	if err1 != nil || err2 != nil {
		return nil
	}
	bk.moeSiLU, bk.moeDown = silu, down
	sms, err := b.cx.MultiprocessorCount()
	if err != nil || sms <= 0 || b.opts.BatchInvariant {
		return nil // no split: every token's sums in one order
	}
	smemPerSM, _ := b.dev.Attribute(cu.AttrMaxSharedMemoryPerSM)
	regs, _ := silu.Attribute(cu.FuncAttrNumRegs)
	static, _ := silu.Attribute(cu.FuncAttrSharedSizeBytes)
	bk.moeCap = sms * residentBlocks(skThreads, regs, static, smemPerSM)
	var part uint64
	maxCnt := 0
	for n := 1; n <= skMaxN; n++ {
		for _, k := range b.moeShapes(n) {
			if k.splits > 1 {
				part = max(part, uint64(k.slots*k.rb*k.splits)*skRows*32*4)
			}
			maxCnt = max(maxCnt, k.slots*k.rb)
		}
	}
	if bk.moePart, err = b.alloc(part); err != nil {
		return fmt.Errorf("cuda backend: grouped expert GEMM workspace: %w", err)
	}
	if bk.moeCnt, err = b.alloc(uint64(maxCnt) * 4); err != nil {
		return fmt.Errorf("cuda backend: grouped expert GEMM counters: %w", err)
	}
	return b.cx.MemsetD8(bk.moeCnt, 0, uint64(maxCnt)*4)
}

// moeShape is one grouped expert GEMM's launch: expert slots, row blocks,
// k splits and chunks per split.
type moeShape struct{ slots, rb, splits, cps int }

// moeShapes are the launches of moe_sk_silu and moe_sk_down for a pass of
// n tokens: k split to fill the GPU only for passes of at most skMaxN
// tokens (one row tile per expert) when the workspace exists.
func (b *Backend) moeShapes(n int) [2]moeShape {
	c := &b.cfg
	slots := min(c.Experts, n*c.TopK)
	sh := [2]moeShape{{slots: slots, rb: ceilDiv(c.ExpertDim, 64)}, {slots: slots, rb: ceilDiv(c.Dim, skRows)}}
	for i, in := range [2]int{c.Dim, c.ExpertDim} {
		sh[i].splits, sh[i].cps = 1, ceilDiv(in, skChunk)
		if b.bk.moeCap > 0 && n <= skMaxN {
			sh[i].splits, sh[i].cps = skSplit(b.bk.moeCap, slots*sh[i].rb, in)
		}
	}
	return sh
}

// moeCapturable says whether the MoE blocks run without the host (the
// routing and the grouped GEMMs on the device), so decode can be captured.
func (b *Backend) moeCapturable() bool { return b.bk.grouped }

// layerPass is what the blocks of one enqueued pass share: the plan, the
// buffers and the launch shapes that depend on the pass alone.
type layerPass struct {
	r           *run
	cctx        context.Context // the collectives' (never nil)
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
	moe         *moeBufs // the pass's MoE buffers (eager or the graph arena's)
	grouped     bool     // the MoE blocks run the grouped GEMMs (no host step)
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
	case lp.fused && qkNorm && b.fn.g2QKN != nil && b.bk.qkNormRope != nil:
		// rmsnorm, the GEMV and each head's qk_norm_rope work in one launch.
		f := b.fn.g2QKN
		r.launchDep(f, b.g2Grid(f, (qd+2*kvd)/2), cu.D1(g2Threads), lp.xsmem, d.qkv, d.x, w.attnNorm, w.wqkv, int32(n),
			int32(dim), lp.vt, c.NormEps, d.q, kc, vc, w.bqkv, w.qNorm, w.kNorm, lp.meta(p.pos), lp.slots, b.ropeTab, b.rope,
			int32(b.ropeN), int32(c.Heads), int32(c.KVHeads), lp.interleaved, b.fn.g2QKNCnt)
	default:
		if lp.fused && qkNorm {
			// rmsnorm and the GEMV in one launch (rows null: every token).
			f, grid, ks := b.g2Split(b.fn.g2Norm, (qd+2*kvd+1)/2, dim)
			r.launchDep(f, grid, cu.D1(g2Threads), lp.xsmem, d.qkv, d.x, w.attnNorm, null, w.wqkv,
				int32(n), int32(qd+2*kvd), int32(dim), lp.vt, c.NormEps, null, ks)
		} else {
			r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, d.xb, d.x, w.attnNorm, null, int32(dim), c.NormEps)
			r.gemm(d.qkv, true, d.xb, w.wqkv, n, qd+2*kvd, dim, 0)
		}
		bias := w.bqkv
		if qkNorm && b.bk.qkNormRope != nil {
			// The biases, each q and k head's RMSNorm, RoPE and the KV write.
			r.launchDep(b.bk.qkNormRope, cu.Dim3{X: nb, Y: uint32(c.Heads + 2*c.KVHeads), Z: 1}, cu.D1(32), 0, d.q, kc, vc,
				d.qkv, w.bqkv, w.qNorm, w.kNorm, lp.meta(p.pos), lp.slots, b.ropeTab, b.rope, int32(b.ropeN),
				int32(c.Heads), int32(c.KVHeads), lp.interleaved, c.NormEps)
			break
		}
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
	if hooked && r.err == nil && b.sh.tp == 1 {
		if err := b.reportLayer(r.s, seqs, li); err != nil {
			return fmt.Errorf("cuda backend: layer %d: %w", li, err)
		}
	}
	if f := &b.fn; p.np > 0 && f.attnFlash2 != nil {
		fn, rows, smem, threads := f.attnFlash2, f.flash2Rows, f.flash2Smem, f.flash2Threads
		if tiles := ceilDiv(p.maxPrefill, rows); f.flash64 != nil && tiles*c.Heads*p.np < f.flash64Below {
			fn, rows, smem, threads = f.flash64, 64, f.flash64Smem, flash64Threads
		}
		grid := cu.Dim3{X: uint32(ceilDiv(p.maxPrefill, rows)), Y: uint32(c.Heads), Z: uint32(p.np)}
		if f.flash2HeadsX {
			grid.X, grid.Y = grid.Y, grid.X
		}
		r.launch(fn, grid, cu.D1(uint32(threads)), uint32(smem), d.att, d.q, kc, vc, lp.meta(p.pStart), lp.meta(p.pLen),
			lp.meta(p.pPos0), lp.meta(p.pPtoff), lp.meta(p.pages), int32(b.layout.PageSize), int32(c.Heads), int32(c.KVHeads),
			lp.scaleLog2)
	} else if p.np > 0 {
		r.launch(b.fn.attnFlash, cu.Dim3{X: uint32((p.maxPrefill + 63) / 64), Y: uint32(c.Heads), Z: uint32(p.np)},
			cu.D1(128), 0, d.att, d.q, kc, vc, lp.meta(p.pStart), lp.meta(p.pLen), lp.meta(p.pPos0), lp.meta(p.pPtoff),
			lp.meta(p.pages), int32(b.layout.PageSize), int32(c.Heads), int32(c.KVHeads), lp.scaleLog2)
	}
	// A sliding window runs on attn_split and attn_combine only (windowed
	// backends load no other attention kernel).
	win := int32(c.Window(li))
	qchunk := p.qchunk
	// One decode query: wo merges the splits itself (gemv2_comb, opt-in).
	comb := b.fn.g2Comb != nil && lp.fused && n == 1 && p.ng == 1 && p.np == 0 && p.nsplit <= g2CombSplits &&
		c.Heads <= g2CombHeads && qd <= g2CombIn && qd%8 == 0 && !(b.fn.attnDecode2 != nil && b.fn.attnCnt != 0)
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
		case f.attnTC != nil && b.layout.PageSize%16 == 0:
			fn, th := f.attnTC, f.tcThreads
			if f.attnTCWide != nil && int(grid.X*grid.Y*grid.Z) < f.tcWideBelow {
				fn, th = f.attnTCWide, 2*th // more warps for a grid smaller than the GPU
			}
			r.launch(fn, grid, cu.D1(uint32(th)), 0, append(args, lp.scaleLog2)...)
		case f.attnDecode2 != nil:
			r.launch(f.attnDecode2, grid, cu.D1(uint32(f.d2Threads)), 0, append(args, lp.scaleLog2, null, null)...)
		case f.attnDecode != nil:
			r.launch(f.attnDecode, grid, cu.D1(128), 0, append(args, lp.div)...)
		default:
			r.launch(f.attnSplit, grid, cu.D1(uint32(f.attThreads)), 0, append(args, lp.div, win)...)
		}
		if !comb {
			r.launch(f.attnCombine, cu.Dim3{X: uint32(c.Heads), Y: cnt, Z: 1}, cu.D1(uint32(f.combineThreads)), 0,
				d.att, d.part, lp.partML, lp.meta(p.gRow), lp.meta(p.gPos), int32(p.nsplit), int32(c.Heads), int32(q0), win)
		}
	}
	if comb {
		f, grid, ks := b.g2Split(b.fn.g2Comb, (dim+1)/2, qd)
		r.launchDep(f, grid, cu.D1(g2Threads), uint32(qd*2), d.x, w.wo, int32(dim), int32(qd), b.sh.resid(), d.part,
			lp.partML, lp.meta(p.gPos), int32(p.nsplit), win, ks)
	} else {
		r.gemm(d.x, true, d.att, w.wo, n, dim, qd, b.sh.resid())
	}
	b.allReduce(lp)
	// With tp > 1 the all-reduce ends after every rank's KV writes of the
	// layer: rank 0 reports there (the other ranks get no layer calls).
	if hooked && r.err == nil && b.sh.tp > 1 {
		if err := b.reportLayer(r.s, seqs, li); err != nil {
			return fmt.Errorf("cuda backend: layer %d: %w", li, err)
		}
	}
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
	r.gemm(d.x, true, d.h, w.w2, n, dim, hid, b.sh.resid())
	b.allReduce(lp)
}

// moeBufs are the buffers of the MoE blocks for passes of up to n tokens;
// the routed rows are the (token, rank) pairs sorted by expert.
type moeBufs struct {
	n         int
	logits    dbuf // router logits f32 [n][E (+1: the shared expert's gate)]
	xe, gu, h dbuf // T [routed][Dim], [routed][2*ExpertDim], [routed][ExpertDim]
	ye        dbuf // f32 [routed][Dim]
	meta      dbuf // moe_topk's and moe_sort's output (moeMeta)
	sgu, sh   dbuf // shared expert: T [n][2*SharedExpertDim], [n][SharedExpertDim]
	sy        dbuf // f32 [n][Dim]
	hostOffs  *cu.HostMem
}

// moeMeta is the layout of moeBufs.meta for nk pairs and e experts (int32
// or f32 each): ids [nk], weights [nk], rows [nk], src [nk], offs [e+1],
// act [e], nact [1].
type moeMeta struct{ ids, wts, rows, src, offs, act, nact cu.DevicePtr }

func moeLayout(base cu.DevicePtr, nk, e int) (moeMeta, uint64) {
	at := func(i int) cu.DevicePtr { return base + cu.DevicePtr(i*4) }
	m := moeMeta{ids: at(0), wts: at(nk), rows: at(2 * nk), src: at(3 * nk), offs: at(4 * nk), act: at(4*nk + e + 1),
		nact: at(4*nk + 2*e + 1)}
	return m, uint64(4*nk+2*e+2) * 4
}

func (m *moeBufs) free(b *Backend) {
	for _, d := range []*dbuf{&m.logits, &m.xe, &m.gu, &m.h, &m.ye, &m.meta, &m.sgu, &m.sh, &m.sy} {
		if d.p != 0 {
			b.cx.MemFree(d.p)
		}
		*d = dbuf{}
	}
	m.hostOffs.Free()
	m.hostOffs = nil
	m.n = 0
}

// moeStride is the router GEMM's output row: the experts' logits, then the
// shared expert's gate logit.
func (b *Backend) moeStride() int {
	if b.cfg.Spec.MLP.SharedExpert {
		return b.cfg.Experts + 1
	}
	return b.cfg.Experts
}

// ensureMoE grows m for passes of n tokens (the stream is idle).
func (b *Backend) ensureMoE(m *moeBufs, n int) error {
	c := &b.cfg
	if !c.Spec.MLP.MoE || n <= m.n {
		return nil
	}
	if n*c.TopK >= 1<<21 {
		return fmt.Errorf("cuda backend: a MoE pass of %d tokens routes %d pairs (moe_sort takes fewer than 2^21)", n, n*c.TopK)
	}
	nk := uint64(n) * uint64(c.TopK)
	eb, dim, I, S := uint64(b.eb), uint64(c.Dim), uint64(c.ExpertDim), uint64(c.SharedExpertDim)
	stride := uint64(b.moeStride())
	_, metaBytes := moeLayout(0, int(nk), c.Experts)
	for _, e := range []struct {
		d  *dbuf
		sz uint64
	}{
		{&m.logits, uint64(n) * stride * 4}, {&m.xe, nk * dim * eb}, {&m.gu, nk * 2 * I * eb}, {&m.h, nk * I * eb},
		{&m.ye, nk * dim * 4}, {&m.meta, metaBytes}, {&m.sgu, uint64(n) * 2 * S * eb}, {&m.sh, uint64(n) * S * eb},
		{&m.sy, uint64(n) * dim * 4},
	} {
		if err := b.ensure(e.d, e.sz); err != nil {
			return fmt.Errorf("cuda backend: MoE scratch: %w", err)
		}
	}
	if err := b.ensureHost(&m.hostOffs, uint64(c.Experts+1)*4); err != nil {
		return err
	}
	m.n = n
	return nil
}

// bytes is the device memory m holds.
func (m *moeBufs) bytes() uint64 {
	var t uint64
	for _, d := range []*dbuf{&m.logits, &m.xe, &m.gu, &m.h, &m.ye, &m.meta, &m.sgu, &m.sh, &m.sy} {
		t += d.n
	}
	return t
}

// combineThreads is moe_combine's block for rows of dim.
func combineThreads(dim int) uint32 { return uint32(min(1024, max(32, (dim+31)/32*32))) }

// moeGroupedRows is the most routed rows per expert, on average, for which
// an eager pass runs the grouped GEMMs (one tile of rows each); above it,
// each expert's rows run as one GEMM (cuBLAS), after a copy of the
// expert offsets to the host.
const moeGroupedRows = 32

// moeGroupedFor says whether an eager pass of n tokens runs the grouped
// GEMMs (a captured pass always does).
func (b *Backend) moeGroupedFor(n int) bool {
	c := &b.cfg
	return b.moeCapturable() && (b.opts.BatchInvariant || n*c.TopK <= moeGroupedRows*c.Experts)
}

// moeMLP enqueues a mixture-of-experts block: RMSNorm, the router GEMM
// (and the shared expert), the routing on the device (moe_topk: each
// token's top k of the softmax; moe_sort: the pairs sorted by expert; one
// moe_route launch for both at decode sizes; with tuning routeSiLU none
// for one token, whose gate/up GEMV routes it: moe_route_silu1),
// then the chosen experts' GEMMs over their rows (the other experts'
// weights are not read) and the weighted sum added to the residual
// stream (by moe_gemv_down_add itself for a few pairs, else
// moe_combine). The grouped forms (lp.grouped: moe_gemv_* for a few tokens,
// moe_sk_* for more; in batch-invariant mode one of them for every pass)
// read the routing on the device and can be captured; the other copies
// the expert offsets to the host (a synchronisation) and runs one GEMM per
// expert.
func (b *Backend) moeMLP(lp *layerPass, w *devLayer) {
	c := &b.cfg
	r, d, m := lp.r, lp.d, lp.moe
	mw := w.moe
	n, dim, E, K, I, S := lp.p.n, c.Dim, c.Experts, c.TopK, c.ExpertDim, c.SharedExpertDim
	nk := n * K
	stride := b.moeStride()
	null := cu.DevicePtr(0)
	if lp.fused {
		// rmsnorm and the router GEMV in one launch; its block 0 writes d.xb.
		f, grid, ks := b.g2Split(b.fn.g2Norm, (stride+1)/2, dim)
		r.launchDep(f, grid, cu.D1(g2Threads), lp.xsmem, m.logits.p, d.x, w.ffnNorm, null, mw.router,
			int32(n), int32(stride), int32(dim), lp.vt, c.NormEps, d.xb, ks)
	} else {
		r.launch(b.fn.rmsnorm, cu.D1(uint32(n)), cu.D1(rmsThreads(dim)), 0, d.xb, d.x, w.ffnNorm, null, int32(dim), c.NormEps)
		r.gemm(m.logits.p, true, d.xb, mw.router, n, stride, dim, 0)
	}
	sh, gate := null, null
	if mw.sw13 != 0 {
		r.gemm(m.sgu.p, false, d.xb, mw.sw13, n, 2*S, dim, 0)
		r.launch(b.fn.siluMul, cu.Dim3{X: uint32(n), Y: siluBlocks(S), Z: 1}, cu.D1(siluThreads), 0, m.sh.p, m.sgu.p, int32(S))
		r.gemm(m.sy.p, true, m.sh.p, mw.sw2, n, dim, S, 0)
		sh, gate = m.sy.p, m.logits.p+cu.DevicePtr(E*4)
	}
	norm := int32(0)
	if c.NormTopKProb || c.Spec.MLP.NormTopK == model.NormTopKAlways {
		norm = 1
	}
	mm, _ := moeLayout(m.meta.p, nk, E)
	bk := &b.bk
	gemv := lp.grouped && (bk.moeDown == nil || n <= moeGemvMax && !b.opts.BatchInvariant)
	// One token's routing inside its gate/up GEMV (moe_route_silu1, opt-in).
	routed := gemv && n == 1 && bk.routeSiLU1 != nil
	switch {
	case routed:
	case n <= moeRouteMax:
		r.launchDep(b.bk.moeRoute, cu.D1(1), cu.D1(moeSortThreads), 0, mm.rows, mm.src, mm.offs, mm.act, mm.nact, mm.ids, mm.wts,
			m.logits.p, int32(n), int32(stride), int32(E), int32(K), norm)
	default:
		r.launch(b.bk.moeTopK, cu.D1(uint32(ceilDiv(n, 8))), cu.D1(256), 0, mm.ids, mm.wts, m.logits.p, int32(n), int32(stride),
			int32(E), int32(K), norm)
		r.launch(b.bk.moeSort, cu.D1(1), cu.D1(moeSortThreads), 0, mm.rows, mm.src, mm.offs, mm.act, mm.nact, mm.ids,
			int32(nk), int32(K), int32(E))
	}
	if b.sh.resid() == 0 && r.err == nil {
		r.err = r.s.MemsetD8(d.x, 0, uint64(n*dim)*4) // the experts' sum adds: it starts at 0
	}
	added := false // the experts' weighted sum is in x
	switch {
	case gemv:
		silu := bk.gemvSiLU
		if n == 1 {
			silu = bk.gemvSiLU1 // each expert has one row
		}
		if routed {
			r.launchDep(bk.routeSiLU1, cu.Dim3{X: uint32(ceilDiv(I, 8)), Y: uint32(K), Z: 1}, cu.D1(256), 0, m.h.p, d.xb, mw.w13,
				mm.rows, mm.src, mm.offs, mm.act, mm.nact, mm.ids, mm.wts, m.logits.p, int32(E), int32(K), norm, int32(I), int32(dim))
		} else {
			r.launchDep(silu, cu.Dim3{X: uint32(ceilDiv(I, 8)), Y: uint32(min(E, nk)), Z: 1}, cu.D1(256), 0, m.h.p, d.xb, mw.w13,
				mm.src, mm.act, mm.nact, mm.offs, int32(I), int32(dim))
		}
		if added = bk.gemvDownAdd != nil && nk <= moeAddPairs; added {
			r.launchDep(bk.gemvDownAdd, cu.D1(uint32(ceilDiv(dim, 4))), cu.D1(128), 0, d.x, m.h.p, mw.w2, mm.ids, mm.rows, mm.wts,
				sh, gate, int32(stride), int32(nk), int32(K), int32(dim), int32(I))
			break
		}
		r.launchDep(bk.gemvDown, cu.Dim3{X: uint32(ceilDiv(dim, 8)), Y: uint32(min(E, nk)), Z: 1}, cu.D1(256), 0, m.ye.p, m.h.p,
			mw.w2, mm.act, mm.nact, mm.offs, int32(dim), int32(I))
	case lp.grouped:
		sh := b.moeShapes(n)
		grid := func(k moeShape) cu.Dim3 { return cu.Dim3{X: uint32(k.rb), Y: uint32(k.splits), Z: uint32(k.slots)} }
		r.launch(bk.moeSiLU, grid(sh[0]), cu.D1(skThreads), 0, m.h.p, d.xb, mw.w13, mm.src, mm.act, mm.nact, mm.offs,
			int32(I), int32(dim), int32(sh[0].cps), bk.moePart, bk.moeCnt)
		r.launch(bk.moeDown, grid(sh[1]), cu.D1(skThreads), 0, m.ye.p, m.h.p, mw.w2, mm.act, mm.nact, mm.offs, int32(dim),
			int32(I), int32(sh[1].cps), bk.moePart, bk.moeCnt)
	default:
		b.moeExperts(lp, w, mm)
	}
	if !added {
		r.launch(b.bk.moeCombine, cu.Dim3{X: uint32(n), Y: uint32(ceilDiv(dim, 256)), Z: 1}, cu.D1(256), 0, d.x, m.ye.p, mm.rows, mm.wts,
			sh, gate, int32(stride), int32(K), int32(dim))
	}
	b.allReduce(lp)
}

// moeExperts runs each chosen expert's GEMMs over its sorted rows, the
// offsets copied to the host first.
func (b *Backend) moeExperts(lp *layerPass, w *devLayer, mm moeMeta) {
	c := &b.cfg
	r, d, m := lp.r, lp.d, lp.moe
	mw := w.moe
	n, dim, E, K, I := lp.p.n, c.Dim, c.Experts, c.TopK, c.ExpertDim
	nk := n * K
	eb := cu.DevicePtr(b.eb)
	if r.err != nil {
		return
	}
	if r.err = r.s.MemcpyDtoH(m.hostOffs.Ptr(), mm.offs, uint64(E+1)*4); r.err != nil {
		return
	}
	if r.err = r.s.Synchronize(); r.err != nil {
		return
	}
	offs := unsafe.Slice((*int32)(m.hostOffs.Ptr()), E+1)
	r.launch(b.bk.moeGather, cu.D1(uint32(nk)), cu.D1(combineThreads(dim)), 0, m.xe.p, d.xb, mm.src, int32(dim))
	for e := range E {
		if off, cnt := int(offs[e]), int(offs[e+1]-offs[e]); cnt > 0 {
			r.gemm(m.gu.p+cu.DevicePtr(off*2*I)*eb, false, m.xe.p+cu.DevicePtr(off*dim)*eb,
				mw.w13+cu.DevicePtr(e*2*I*dim)*eb, cnt, 2*I, dim, 0)
		}
	}
	r.launch(b.fn.siluMul, cu.Dim3{X: uint32(nk), Y: siluBlocks(I), Z: 1}, cu.D1(siluThreads), 0, m.h.p, m.gu.p, int32(I))
	for e := range E {
		if off, cnt := int(offs[e]), int(offs[e+1]-offs[e]); cnt > 0 {
			r.gemm(m.ye.p+cu.DevicePtr(off*dim*4), true, m.h.p+cu.DevicePtr(off*I)*eb,
				mw.w2+cu.DevicePtr(e*dim*I)*eb, cnt, dim, I, 0)
		}
	}
}
