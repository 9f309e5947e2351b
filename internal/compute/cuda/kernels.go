package cuda

import (
	"cmp"
	"fmt"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/csrc"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

// Split-K attention defaults: keys per split (ATT_SPLIT; fixed for a
// backend, so a sequence's splits never depend on the batch) and threads per
// block (ATT_THREADS).
const (
	defaultAttSplit   = 128
	defaultAttThreads = 128
	defaultGemvMax    = 4 // decode GEMMs of at most this many tokens use gemv_*
	defaultFlashWarps = 8 // attn_prefill2: 16 query rows per warp
	defaultTCWarps    = 4 // attn_decode_tc: 2 chunks of 16 keys per warp at 128-key splits
)

// tuning holds kernel variants for tests and benchmarks; zero values are the
// defaults.
type tuning struct {
	split, threads int // split-K attention shape
	// gemvMax: 0 default, -1 never use gemv_* (cuBLAS for every GEMM).
	gemvMax int
	// flashWarps: 0 default, -1 the first flash kernel (attn_prefill);
	// flashV2: attn_prefill2 of flashWarps warps instead of attn_prefill3.
	flashWarps int
	flashV2    bool
	flashV3    bool // attn_prefill3 where attn_prefill4 (Hopper) would load
	noDecode   bool // attn_split instead of attn_decode2 / attn_decode
	decodeV1   bool // attn_decode instead of attn_decode2
	decode2W8  bool // attn_decode2_w8 (8 warps a block) instead of attn_decode2
	noTC       bool // attn_decode2 instead of attn_decode_tc (attn.cu)
	// wg: gemm_wg (attn.cu, sm_90a) instead of cuBLAS for 5..128 token
	// rows; off by default: slower than cuBLAS at every 8B shape measured on
	// an H200 (2026-12-02: 1.03-3.5x cuBLAS's time; docs/BENCHMARKS.md).
	wg       bool
	tcNarrow bool // no attn_decode_tc_wide for small grids
	// fuseCombine: attn_decode2 merges its own splits instead of leaving
	// them to attn_combine (measured slower on an H200, 2026-12-01: 17.5 vs
	// 12.5 us a layer at batch 1 ctx 1K, 58 vs 25 at 8K; docs/BENCHMARKS.md).
	fuseCombine bool
	// noFused: small batches run rmsnorm, gemv_*, rope_kv and silu_mul as
	// separate kernels instead of the fused gemv2_* layer.
	noFused bool
	// skinnyMax: decode GEMMs of gemvMax+1 .. skinnyMax tokens run
	// gemm_sk_* (at most skMaxN); 0: cuBLAS, which measured as fast or
	// faster at every size on an H200 (2026-12-01: 1.04-1.70x the time of
	// cuBLAS's at 5..32 tokens).
	skinnyMax int
	// pdl launches the fused GEMVs and skinny GEMMs with programmatic
	// dependent launch (each prefetches its weights while the kernel ahead
	// of it finishes).
	pdl  bool
	noV2 bool // compile without the second-generation kernels
	// noQKRope: q/k-norm models run qk_norm and rope_kv instead of
	// qk_norm_rope (the reference TestFusedDecode compares against).
	noQKRope bool
	// noMoEAdd: the grouped expert GEMVs end in moe_gemv_down and
	// moe_combine instead of moe_gemv_down_add.
	noMoEAdd bool
	// routeSiLU: a one-token MoE pass routes inside its gate/up GEMV
	// (moe_route_silu1) instead of in moe_route first. Opt-in until
	// measured on a GPU (bit for bit in emulation; docs/BENCHMARKS.md).
	routeSiLU bool
	// g2Split: the most warps gemv2_plain, gemv2_norm and gemv2_comb may
	// give one unit (their _ks forms: a row pair's chunks split between the
	// warps, summed in a fixed order): more bytes in flight for the GEMVs of
	// fewer units than resident warps. 0 or 1: one warp a unit, the sums of
	// gemv_* (bit for bit).
	g2Split int
	// combWo: a one-query decode pass merges its attention splits in wo's
	// gemv2_comb rather than in attn_combine. Opt-in until measured on a
	// GPU (its first form read a null X there; docs/BENCHMARKS.md).
	combWo bool
	// qknFold: a q/k-norm model's fused QKV GEMV runs each head's
	// qk_norm_rope work as soon as the head's rows are written (gemv2_qkn)
	// instead of in a qk_norm_rope launch. Opt-in until measured on a GPU.
	qknFold bool
	// blocksDefs: extra NVRTC macros for the blocks kernel set (space
	// separated, "-DDA_P=4 -DDA_PRE=1"), for kernel experiments.
	blocksDefs string
}

// v2Failed remembers NVRTC option sets whose MC_V2 build failed, so that
// each backend does not recompile them.
var v2Failed sync.Map

// kernels are the functions of the compiled llama kernel set.
type kernels struct {
	embed, rmsnorm, ropeKV, ropeTable *cu.Function
	attnSplit, attnCombine, attnFlash *cu.Function
	siluMul, gemmF32, gemmT           *cu.Function
	fillT, fillF, readBW              *cu.Function
	attThreads, combineThreads        int
	split                             int
	// second generation (nil when unavailable or disabled)
	attnDecode, gemvF32, gemvT *cu.Function
	gemvMax                    int
	v2Err                      error // why the MC_V2 build was not used
	// attnFlash2: the flash prefill for head dims % 32 (attn.cu's
	// attn_prefill4 on wgmma where attn.cu builds for sm_90a and the head
	// dim is 128, else its attn_prefill3, else llama.cu's attn_prefill2), flash2Rows query rows a
	// block of flash2Threads threads and flash2Smem bytes of dynamic
	// shared memory; flash2HeadsX: heads along the grid's x (attn.cu's),
	// else query tiles. flash64 (attn_prefill3_64, or nil): 64-row tiles
	// for prefills of fewer than flash64Below 128-row blocks.
	attnFlash2                            *cu.Function
	flash2Rows, flash2Threads, flash2Smem int
	flash2HeadsX                          bool
	flash64                               *cu.Function
	flash64Smem, flash64Below             int
	// flash3: attn_prefill3 (128 rows, flash3Smem bytes) when attn_prefill4
	// took attnFlash2's place; hopperErr: why attn.cu was not built for
	// sm_90a on a 9.0 device (nil: it was, or the device is not 9.0).
	flash3     *cu.Function
	flash3Smem int
	hopperErr  error
	// attnDecode2 replaces attnDecode; the gemv2 set is the fused decode
	// layer of at most gemvMax tokens (nil: separate kernels).
	attnDecode2                    *cu.Function
	g2Plain, g2Norm, g2QKV, g2SiLU *cu.Function
	// g2Comb: gemv2_comb, wo over attn_combine's output merged in its own
	// blocks, for passes of one decode query (nil: attn_combine, gemv2_plain)
	g2Comb *cu.Function
	// g2QKN: gemv2_qkn, a q/k-norm model's QKV GEMV that runs qk_norm_rope's
	// work itself (tuning qknFold), with its head counters g2QKNCnt
	g2QKN    *cu.Function
	g2QKNCnt cu.DevicePtr
	// g2Splits: the forms of g2Plain, g2Norm and g2Comb that split a unit
	// over warps (tuning g2Split; none without it)
	g2Splits map[*cu.Function]*cu.Function
	g2Blocks map[*cu.Function]int // most blocks resident at once (the grid cap)
	// skinny GEMMs (gemm_sk_*) for gemvMax < n <= skMax tokens, skCap
	// blocks resident at once; skPart and skCnt: their split-K partial
	// tiles and per-row-block counters (zero between launches).
	skPlain, skQKV, skSiLU *cu.Function
	skMax, skCap           int
	skPart, skCnt          cu.DevicePtr
	pdl                    bool // tuning pdl, and the driver takes such launches
	// attnDecode2 runs d2Threads threads a block; with attnCnt (counters
	// for attnCntQ queries of a launch) it merges the splits itself.
	d2Threads int
	attnCnt   cu.DevicePtr
	attnCntQ  int
	// attnTC (attn.cu) replaces attnDecode2 over pages of a multiple of
	// 16 keys, tcThreads a block; nil where the model does not suit it.
	// attnTCWide (twice the threads, or nil) runs grids of fewer than
	// tcWideBelow blocks outside batch-invariant mode.
	attnTC, attnTCWide     *cu.Function
	tcMod                  *cu.Module
	tcThreads, tcWideBelow int
	// gw: gemm_wg16/32/64/128 (attn.cu for sm_90a, tuning wg; nil else), the
	// GEMMs of up to 128 token rows the gemv and skinny kernels do not
	// take; gwSmem their dynamic shared memory, gwGrid blocks a launch at
	// most (the SMs), gwPart their parts ([gwGrid][2][2][64][128] f32) and
	// gwCnt the counters of gwRowBlocks 128-row blocks (zero between launches).
	gw            [4]*cu.Function
	gwSmem        [4]int
	gwGrid        int
	gwPart, gwCnt cu.DevicePtr
}

// gwNT are gemm_wg's token tiles, gw's order; gwRowBlocks bounds a GEMM's
// 128-row blocks (its counters).
var gwNT = [4]int{16, 32, 64, 128}

const gwRowBlocks = 2048

// gwSmem is GW_SMEM(nt) (attn.cu): the stages of a 128 x 64 W tile and an
// nt x 64 X tile, their mbarriers and two flags, from a 1024-byte boundary.
func gwSmem(nt int) int {
	stages := 8
	if nt > 64 {
		stages = 6
	}
	return stages*(128+nt)*64*2 + 2*stages*8 + 16 + 1024
}

// Launch shapes of the small kernels.
const (
	ropeThreads = 256 // rope_kv: one thread per rotated pair (or pair of v elements)
	siluThreads = 256 // silu_mul: 8 elements per thread when hidden % 8 == 0
	// ropeTabMax caps the positions of the f32 cos/sin table (8 bytes per
	// pair and position); rope_kv computes larger positions on the fly.
	ropeTabMax = 1 << 20
)

// rmsThreads is rmsnorm's block size for rows of dim elements: a function of
// dim alone (the reduction order must not depend on the batch). With dim % 8
// == 0 each thread holds up to 2 chunks of 8 elements (RMS_CHUNKS in
// llama.cu); dim 4096 gets 256 threads.
func rmsThreads(dim int) uint32 {
	if dim%8 != 0 {
		return 256
	}
	t := (dim/8 + 1) / 2
	t = (t + 31) / 32 * 32
	return uint32(min(max(t, 32), 1024))
}

// ropeBlocks is rope_kv's grid height: items per token over ropeThreads.
func ropeBlocks(heads, kvHeads, headDim int) uint32 {
	items := (heads+kvHeads)*headDim/2 + kvHeads*headDim/2
	return uint32((items + ropeThreads - 1) / ropeThreads)
}

// siluBlocks is silu_mul's grid height for a hidden size.
func siluBlocks(hidden int) uint32 {
	per := 1
	if hidden%8 == 0 {
		per = 8
	}
	return uint32((hidden + per*siluThreads - 1) / (per * siluThreads))
}

// kernelOptions are the NVRTC macros that specialise the kernel set to the
// model: head dim, storage type, GQA group, split size.
func (b *Backend) kernelOptions() ([]string, error) {
	c := &b.cfg
	hd := c.HeadDim
	tu := b.opts.tune
	b.fn.split = cmp.Or(tu.split, defaultAttSplit)
	b.fn.attThreads = hd * max(1, cmp.Or(tu.threads, defaultAttThreads)/hd)
	if b.fn.attThreads > 1024 {
		return nil, fmt.Errorf("cuda backend: head dim %d too large for the attention kernels", hd)
	}
	group := c.Heads / c.KVHeads
	if smem := 4 * (group*hd + group*max(b.fn.split, b.fn.attThreads) + 32); smem > 48<<10 {
		return nil, fmt.Errorf("cuda backend: %d query heads per kv head need %d bytes of shared memory", group, smem)
	}
	b.fn.combineThreads = min(1024, (hd+31)/32*32)
	bf := 0
	if b.bf16 {
		bf = 1
	}
	return []string{
		fmt.Sprintf("-DHEAD_DIM=%d", hd),
		fmt.Sprintf("-DUSE_BF16=%d", bf),
		fmt.Sprintf("-DGQA_GROUP=%d", group),
		fmt.Sprintf("-DATT_SPLIT=%d", b.fn.split),
		fmt.Sprintf("-DATT_THREADS=%d", b.fn.attThreads),
	}, nil
}

// loadKernels compiles (or finds in the on-disk cache) and loads the llama
// kernel set for this model and device: first with the second-generation
// kernels (MC_V2), and without them if NVRTC rejects that build.
func (b *Backend) loadKernels() error {
	opts, err := b.kernelOptions()
	if err != nil {
		return err
	}
	src, err := csrc.LlamaKernel(csrc.LlamaKernels)
	if err != nil {
		return fmt.Errorf("cuda backend: kernel source: %w", err)
	}
	kcfg := b.opts.KernelCache
	if kcfg.Logger == nil {
		kcfg.Logger = b.lg
	}
	k, err := cu.NewKernels(kcfg)
	if err != nil {
		return fmt.Errorf("cuda backend: %w", err)
	}
	if err := b.loadBlocks(k, opts); err != nil {
		return err
	}
	tu := b.opts.tune
	fw := cmp.Or(tu.flashWarps, defaultFlashWarps)
	v2 := append(append([]string{}, opts...), "-DMC_V2=1", fmt.Sprintf("-DFA2_WARPS=%d", max(fw, 4)))
	key := strings.Join(v2, " ")
	useV2 := !tu.noV2
	if e, failed := v2Failed.Load(key); failed && useV2 {
		useV2, b.fn.v2Err = false, e.(error)
	}
	if useV2 {
		b.mod, err = k.LoadSource(b.cx, csrc.LlamaKernels, src, v2...)
		if err != nil {
			b.lg.Warn("second-generation kernels rejected; using the first set", zap.Error(err))
			b.fn.v2Err = err
			v2Failed.Store(key, err)
			useV2 = false
		}
	}
	if !useV2 {
		if b.mod, err = k.LoadSource(b.cx, csrc.LlamaKernels, src, opts...); err != nil {
			return fmt.Errorf("cuda backend: kernels: %w", err)
		}
	}
	get := func(dst **cu.Function, name string) {
		if err != nil {
			return
		}
		*dst, err = b.mod.Function(name)
	}
	f := &b.fn
	get(&f.embed, "embed")
	get(&f.rmsnorm, "rmsnorm")
	get(&f.ropeKV, "rope_kv")
	get(&f.ropeTable, "rope_table")
	get(&f.attnSplit, "attn_split")
	get(&f.attnCombine, "attn_combine")
	get(&f.siluMul, "silu_mul")
	get(&f.gemmF32, "gemm_f32out")
	get(&f.gemmT, "gemm_tout")
	get(&f.fillT, "fill_random_t")
	get(&f.fillF, "fill_random_f")
	get(&f.readBW, "read_bw")
	hd := b.cfg.HeadDim
	if b.bf16 && hd%16 == 0 && hd <= 128 {
		get(&f.attnFlash, "attn_prefill")
		b.flash = err == nil
	}
	if err != nil || !useV2 || !b.bf16 {
		return err
	}
	group := b.cfg.Heads / b.cfg.KVHeads
	opt := func(dst **cu.Function, name string) {
		if p, e := b.mod.Function(name); e == nil {
			*dst = p
		}
	}
	if tu.gemvMax >= 0 {
		opt(&f.gemvF32, "gemv_f32out")
		opt(&f.gemvT, "gemv_tout")
		f.gemvMax = min(cmp.Or(tu.gemvMax, defaultGemvMax), 4)
	}
	if !tu.noDecode && 32%(hd/8) == 0 {
		if !tu.decodeV1 && group <= 8 {
			opt(&f.attnDecode2, "attn_decode2")
			f.d2Threads = 128
			if tu.decode2W8 {
				if p, e := b.mod.Function("attn_decode2_w8"); e == nil {
					f.attnDecode2, f.d2Threads = p, 256
				}
			}
		}
		if f.attnDecode2 != nil && tu.fuseCombine {
			const q = 4096
			p, err := b.alloc(uint64(q * b.cfg.KVHeads * 4))
			if err != nil {
				return fmt.Errorf("cuda backend: attention counters: %w", err)
			}
			if err := b.cx.MemsetD8(p, 0, uint64(q*b.cfg.KVHeads*4)); err != nil {
				return err
			}
			f.attnCnt, f.attnCntQ = p, q
		}
		if f.attnDecode2 == nil && 4*(group*f.split+4*(256/hd)*group*hd+2*group) <= 48<<10 {
			opt(&f.attnDecode, "attn_decode")
		}
	}
	if !tu.noFused && f.gemvMax > 0 && b.cfg.Dim%8 == 0 {
		b.loadFused()
	}
	if tu.skinnyMax > 0 {
		if err := b.loadSkinny(min(tu.skinnyMax, skMaxN)); err != nil {
			return err
		}
	}
	if tu.pdl {
		// read_bw over nothing: touches no memory.
		err := b.stream.LaunchPDL(f.readBW, cu.D1(1), cu.D1(32), 0, cu.DevicePtr(0), int64(0), cu.DevicePtr(0))
		if err == nil {
			err = b.stream.Synchronize()
		}
		if f.pdl = err == nil; !f.pdl {
			b.lg.Warn("programmatic dependent launch not available", zap.Error(err))
		}
	}
	if fw > 0 && hd%32 == 0 && hd <= 128 {
		opt(&f.attnFlash2, "attn_prefill2")
		if f.attnFlash2 != nil {
			f.flash2Rows, f.flash2Threads, f.flash2Smem = 16*fw, 32*fw, 2*2*64*(hd+8)*2
			if e := f.attnFlash2.SetAttribute(cu.FuncAttrMaxDynamicSharedSizeBytes, f.flash2Smem); e != nil {
				b.lg.Warn("attn_prefill2: no room for its shared memory", zap.Error(e))
				f.attnFlash2 = nil
			}
		}
	}
	if b.cfg.SlidingWindow == 0 && hd%32 == 0 && hd <= 128 {
		decodeTC := f.attnDecode2 != nil && !tu.noTC && !tu.decode2W8 && hd == 128 && group <= 8 && f.split%16 == 0
		b.loadAttn(k, opts, decodeTC, fw > 0 && !tu.flashV2)
	}
	if w := b.cfg.SlidingWindow; w > 0 {
		// Only attn_split and attn_combine take a window.
		f.attnFlash, f.attnFlash2, f.attnDecode, f.attnDecode2, f.attnTC, f.attnCnt = nil, nil, nil, nil, nil, 0
		b.flash = false
		b.lg.Info("sliding-window attention on the split-K kernels (no flash prefill, no attn_decode2)",
			zap.Int("sliding_window", w), zap.Int("from_layer", b.cfg.WindowFrom))
	}
	return nil
}

// loadAttn compiles attn.cu with the llama set's macros (for sm_90a on a
// compute capability 9.0 device when attn_prefill4 can serve, else for the
// device's plain target) and takes attn_decode_tc when decodeTC, and
// attn_prefill4 or attn_prefill3 when prefill3; a build NVRTC rejects
// leaves attn_decode2 and attn_prefill2 in use.
func (b *Backend) loadAttn(k *cu.Kernels, opts []string, decodeTC, prefill3 bool) {
	if !decodeTC && !prefill3 {
		return
	}
	f := &b.fn
	warps := min(defaultTCWarps, max(f.split/16, 1)) // 2 measured the same, 8 slower at large batches
	for f.split%(16*warps) != 0 && warps > 1 {
		warps--
	}
	src, err := csrc.LlamaKernel("attn")
	aopts := append(opts[:len(opts):len(opts)], fmt.Sprintf("-DTC_WARPS=%d", warps))
	hopper := false
	if major, minor, e := b.dev.ComputeCapability(); err == nil && e == nil && major == 9 && minor == 0 {
		// sm_90a: gemm_wg's and attn_prefill4's wgmma; the rest of attn.cu as for sm_90
		if f.tcMod, f.hopperErr = k.LoadSourceSpecific(b.cx, "attn", src, aopts...); f.hopperErr == nil {
			hopper = true
		} else {
			b.lg.Warn("attn.cu for sm_90a rejected; flash prefill on attn_prefill3", zap.Error(f.hopperErr))
		}
	}
	if err == nil && !hopper {
		f.tcMod, err = k.LoadSource(b.cx, "attn", src, aopts...)
	}
	if err != nil {
		b.lg.Warn("attn.cu rejected; attention on attn_decode2 and attn_prefill2", zap.Error(err))
		return
	}
	if hopper && b.opts.tune.wg && !b.opts.BatchInvariant {
		b.loadGemmWG()
	}
	if prefill3 {
		// P3_SMEM(rows / 64): the Q tile and 3 stages of 32-key K and V tiles
		smem := func(rows int) int { return (rows + 3*2*32) * (b.cfg.HeadDim + 8) * 2 }
		fn := func(name string, rows int) *cu.Function {
			p, err := f.tcMod.Function(name)
			if err == nil {
				err = p.SetAttribute(cu.FuncAttrMaxDynamicSharedSizeBytes, smem(rows))
			}
			if err != nil {
				b.lg.Warn(name+" not available", zap.Error(err))
				return nil
			}
			return p
		}
		if p := fn("attn_prefill3", 128); p != nil {
			f.attnFlash2, f.flash2Rows, f.flash2Threads, f.flash2Smem, f.flash2HeadsX = p, 128, 128, smem(128), true
			sms, err := b.cx.MultiprocessorCount()
			if p := fn("attn_prefill3_64", 64); p != nil && err == nil {
				// under one wave of 128-row blocks (two an SM): measured on an H200,
				// 64-row tiles won at 1K tokens (256 blocks), lost from 2K (512)
				f.flash64, f.flash64Smem, f.flash64Below = p, smem(64), 2*sms
			}
		}
		if hopper && f.attnFlash2 != nil && !b.opts.tune.flashV3 && b.cfg.HeadDim == 128 {
			// P4_SMEM: the Q tile, 4 stages of 64-key K and V tiles and their
			// two mbarriers, from a 1024-byte boundary
			const p4Smem = (128*128+4*2*64*128)*2 + 2*4*8 + 1024
			p, err := f.tcMod.Function("attn_prefill4")
			if err == nil {
				err = p.SetAttribute(cu.FuncAttrMaxDynamicSharedSizeBytes, p4Smem)
			}
			if err != nil {
				f.hopperErr = err
				b.lg.Warn("attn_prefill4 not available", zap.Error(err))
			} else {
				f.flash3, f.flash3Smem = f.attnFlash2, f.flash2Smem
				f.attnFlash2, f.flash2Threads, f.flash2Smem = p, 384, p4Smem
				// faster than attn_prefill3_64 at every length measured (H200: 33
				// vs 54 us a layer at 1K tokens)
				f.flash64Below = 0
			}
		}
	}
	if !decodeTC {
		return
	}
	if f.attnTC, err = f.tcMod.Function("attn_decode_tc"); err != nil {
		b.lg.Warn("attn_decode_tc not available; decode attention on attn_decode2", zap.Error(err))
		f.attnTC = nil
		return
	}
	f.tcThreads = 32 * warps
	if sms, err := b.cx.MultiprocessorCount(); err == nil && !b.opts.tune.tcNarrow && !b.opts.BatchInvariant {
		if w, err := f.tcMod.Function("attn_decode_tc_wide"); err == nil {
			f.attnTCWide, f.tcWideBelow = w, sms
		}
	}
}

// loadGemmWG takes gemm_wg's kernels from the sm_90a build of attn.cu and
// allocates their parts and counters; any failure leaves cuBLAS in use.
func (b *Backend) loadGemmWG() {
	f := &b.fn
	sms, err := b.cx.MultiprocessorCount()
	var fns [4]*cu.Function
	for i, nt := range gwNT {
		if err != nil {
			break
		}
		if fns[i], err = f.tcMod.Function(fmt.Sprintf("gemm_wg%d", nt)); err == nil {
			err = fns[i].SetAttribute(cu.FuncAttrMaxDynamicSharedSizeBytes, gwSmem(nt))
		}
	}
	var part, cnt cu.DevicePtr
	if err == nil {
		part, err = b.alloc(uint64(sms) * 4 * 64 * 128 * 4)
	}
	if err == nil {
		cnt, err = b.alloc(2 * gwRowBlocks * 4)
	}
	if err == nil {
		err = b.cx.MemsetD8(cnt, 0, 2*gwRowBlocks*4)
	}
	if err != nil {
		b.lg.Warn("gemm_wg not available; GEMMs of 5..128 tokens on cuBLAS", zap.Error(err))
		return
	}
	f.gw, f.gwGrid, f.gwPart, f.gwCnt = fns, sms, part, cnt
	for i, nt := range gwNT {
		f.gwSmem[i] = gwSmem(nt)
	}
}

// flash64Threads: attn_prefill3_64's block (P3_WARPS warps).
const flash64Threads = 128

// Fused decode layer launch shape: gemv2_* blocks of g2Threads threads, one
// warp per unit of two weight rows.
const g2Threads = 256

// loadFused finds the gemv2 set, raises the dynamic shared memory of the
// kernels that normalise x into it (gemvMax rows of Dim T values) and
// records how many blocks of each fit on the GPU at once. Any failure leaves
// the set nil (separate kernels).
func (b *Backend) loadFused() {
	f := &b.fn
	sms, err := b.cx.MultiprocessorCount()
	if err != nil || sms <= 0 {
		b.lg.Warn("fused decode kernels off: no multiprocessor count", zap.Error(err))
		return
	}
	smemPerSM, _ := b.dev.Attribute(cu.AttrMaxSharedMemoryPerSM)
	optin, _ := b.dev.Attribute(cu.AttrMaxSharedMemoryPerBlockOptin)
	smem := b.fusedSmem()
	blocks := map[*cu.Function]int{}
	var fns [4]*cu.Function
	for i, name := range []string{"gemv2_plain", "gemv2_norm", "gemv2_qkv", "gemv2_silu"} {
		fn, err := b.mod.Function(name)
		if err != nil {
			b.lg.Warn("fused decode kernels off", zap.Error(err))
			return
		}
		dyn := g2StageMax // gemv2_plain's staged X, at most
		if i > 0 {
			dyn = smem
			if dyn > 48<<10 {
				if dyn > optin {
					b.lg.Warn("fused decode kernels off: x does not fit in shared memory", zap.Int("bytes", dyn), zap.Int("max", optin))
					return
				}
				if err := fn.SetAttribute(cu.FuncAttrMaxDynamicSharedSizeBytes, dyn); err != nil {
					b.lg.Warn("fused decode kernels off: no room for their shared memory", zap.Error(err))
					return
				}
			}
		}
		regs, _ := fn.Attribute(cu.FuncAttrNumRegs)
		static, _ := fn.Attribute(cu.FuncAttrSharedSizeBytes)
		blocks[fn] = sms * residentBlocks(g2Threads, regs, static+dyn, smemPerSM)
		fns[i] = fn
	}
	f.g2Plain, f.g2Norm, f.g2QKV, f.g2SiLU = fns[0], fns[1], fns[2], fns[3]
	f.g2Blocks = blocks
	// The opt-in forms: gemv2_comb, and the splitting twins (tuning g2Split).
	opt := func(name string, dyn int) *cu.Function {
		fn, err := b.mod.Function(name)
		if err != nil {
			b.lg.Warn("fused decode kernel not loaded", zap.String("kernel", name), zap.Error(err))
			return nil
		}
		if dyn > 48<<10 {
			if err := fn.SetAttribute(cu.FuncAttrMaxDynamicSharedSizeBytes, dyn); err != nil {
				return nil
			}
		}
		regs, _ := fn.Attribute(cu.FuncAttrNumRegs)
		static, _ := fn.Attribute(cu.FuncAttrSharedSizeBytes)
		blocks[fn] = sms * residentBlocks(g2Threads, regs, static+dyn, smemPerSM)
		return fn
	}
	if b.opts.tune.combWo {
		f.g2Comb = opt("gemv2_comb", g2StageMax)
	}
	if c := &b.cfg; b.opts.tune.qknFold && c.Spec.Attention.QKNorm {
		if fn := opt("gemv2_qkn", smem); fn != nil {
			heads := uint64(c.Heads + 2*c.KVHeads)
			cnt, err := b.alloc(heads * 4)
			if err == nil {
				err = b.cx.MemsetD8(cnt, 0, heads*4)
			}
			if err != nil {
				b.lg.Warn("gemv2_qkn off: no head counters", zap.Error(err))
			} else {
				f.g2QKN, f.g2QKNCnt = fn, cnt
			}
		}
	}
	f.g2Splits = map[*cu.Function]*cu.Function{}
	if b.opts.tune.g2Split > 1 {
		for _, p := range []struct {
			base *cu.Function
			name string
			dyn  int
		}{{f.g2Plain, "gemv2_plain_ks", g2StageMax}, {f.g2Norm, "gemv2_norm_ks", smem}, {f.g2Comb, "", 0}} {
			switch {
			case p.base == nil:
			case p.name == "":
				f.g2Splits[p.base] = p.base // gemv2_comb splits itself
			default:
				if sf := opt(p.name, p.dyn); sf != nil {
					f.g2Splits[p.base] = sf
				}
			}
		}
	}
}

// gemv2_comb's limits (G2_COMB_S, G2_COMB_H, G2_COMB_I in llama.cu):
// splits a head it merges, heads, elements of the merged row.
const (
	g2CombSplits = 16
	g2CombHeads  = 64
	g2CombIn     = 4 * 1024 // G2_COMB_I groups of 4 elements a thread
)

// g2StageMax is the most X bytes gemv2_plain copies to shared memory
// (wo at 4 tokens, down at 1; larger X is read from global memory).
const g2StageMax = 32 << 10

// g2Stage is gemv2_plain's dynamic shared memory and stage flag for n
// tokens of in elements.
func g2Stage(n, in int) (uint32, int32) {
	if xb := n * in * 2; xb <= g2StageMax {
		return uint32(xb), 1
	}
	return 0, 0
}

// fusedSmem is the dynamic shared memory of the normalising gemv2 kernels.
func (b *Backend) fusedSmem() int { return b.fn.gemvMax * b.cfg.Dim * 2 }

// residentBlocks is how many blocks of threads threads, regs registers
// each and smem bytes of shared memory fit on one multiprocessor (Hopper's
// limits: 64K registers allocated per warp in units of 256, 2048 threads,
// 1 KiB of shared memory reserved per block); at least 1. It only caps
// grids: blocks beyond it wait for a free multiprocessor.
func residentBlocks(threads, regs, smem, smemPerSM int) int {
	warps := (threads + 31) / 32
	perWarp := (regs*32 + 255) / 256 * 256
	n := 2048 / threads
	if perWarp > 0 {
		n = min(n, 65536/(perWarp*warps))
	}
	if smemPerSM > 0 {
		n = min(n, smemPerSM/(smem+1024))
	}
	return max(n, 1)
}

// g2Grid is the grid of a gemv2 kernel over units units of work: one warp
// per unit, at most the blocks resident at once (the warps loop over units).
func (b *Backend) g2Grid(f *cu.Function, units int) cu.Dim3 {
	per := g2Threads / 32
	return cu.D1(uint32(max(1, min((units+per-1)/per, b.fn.g2Blocks[f]))))
}

// g2Split is the kernel, grid and warps a unit (ks) of a gemv2_plain,
// gemv2_norm or gemv2_comb launch (f) over units row pairs of in elements:
// ks 1 unless tuning g2Split allows more, then the most (a power of two up
// to it and 8) that keeps the warps within those resident at once, every
// warp's share of a row at least one chunk a lane; with ks > 1 the kernel is
// f's splitting form. ks depends on the shape alone, never on the batch.
func (b *Backend) g2Split(f *cu.Function, units, in int) (*cu.Function, cu.Dim3, int32) {
	ks := 1
	if sf := b.fn.g2Splits[f]; sf != nil {
		nc, resident := in/8, b.fn.g2Blocks[sf]*(g2Threads/32)
		for k := 2; k <= min(b.opts.tune.g2Split, g2Threads/32); k *= 2 {
			if units*k <= resident && nc%k == 0 && nc/k >= 32 {
				ks = k
			}
		}
		if ks > 1 {
			f = sf
		}
	}
	return f, b.g2Grid(f, units*ks), int32(ks)
}

// rmsVT is the thread count whose reduction order gemv2's rmsnorm follows:
// rmsnorm's own (so fused outputs equal the separate kernels' bit for bit)
// when it fits in a gemv2 block.
func rmsVT(dim int) int32 { return int32(min(int(rmsThreads(dim)), g2Threads)) }

// Skinny GEMM launch shape (gemm_sk_* in llama.cu): 256 threads own 128
// weight rows (64 gate + 64 up rows for the SiLU form); k in chunks of 128.
const (
	skRows    = 128
	skChunk   = 128
	skMaxN    = 32 // 4 tensor-core n tiles of 8 tokens
	skThreads = 256
)

// loadSkinny finds the gemm_sk set (none: cuBLAS stays) and allocates its
// split-K workspace for the model's GEMM shapes.
func (b *Backend) loadSkinny(maxN int) error {
	f := &b.fn
	c := &b.cfg
	plain, err := b.mod.Function("gemm_sk_plain")
	if err != nil || maxN <= f.gemvMax || c.Dim%8 != 0 {
		return nil
	}
	sms, err := b.cx.MultiprocessorCount()
	if err != nil || sms <= 0 {
		return nil
	}
	smemPerSM, _ := b.dev.Attribute(cu.AttrMaxSharedMemoryPerSM)
	regs, _ := plain.Attribute(cu.FuncAttrNumRegs)
	static, _ := plain.Attribute(cu.FuncAttrSharedSizeBytes)
	f.skCap = sms * residentBlocks(skThreads, regs, static, smemPerSM)
	if p, e := b.mod.Function("gemm_sk_qkv"); e == nil {
		f.skQKV = p
	}
	if p, e := b.mod.Function("gemm_sk_silu"); e == nil && c.HiddenDim%64 == 0 {
		f.skSiLU = p
	}
	qd, kvd, hid := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim
	var part uint64
	maxRB := 64
	for _, sh := range [][2]int{{ceilDiv(qd+2*kvd, skRows), c.Dim}, {ceilDiv(c.Dim, skRows), qd}, {hid / 64, c.Dim},
		{ceilDiv(c.Dim, skRows), hid}, {ceilDiv(c.Vocab, skRows), c.Dim}} {
		rb, in := sh[0], sh[1]
		if rb == 0 || in%8 != 0 {
			continue
		}
		if s, _ := skSplit(f.skCap, rb, in); s > 1 {
			part = max(part, uint64(rb)*uint64(s)*skRows*32*4)
		}
		maxRB = max(maxRB, rb)
	}
	if f.skPart, err = b.alloc(part); err != nil {
		return fmt.Errorf("cuda backend: skinny GEMM workspace: %w", err)
	}
	if f.skCnt, err = b.alloc(uint64(maxRB) * 4); err != nil {
		return fmt.Errorf("cuda backend: skinny GEMM counters: %w", err)
	}
	if err := b.cx.MemsetD8(f.skCnt, 0, uint64(maxRB)*4); err != nil {
		return err
	}
	f.skPlain, f.skMax = plain, maxN
	return nil
}

// skSplit is the k split of a skinny GEMM of rowBlocks row blocks over in:
// as many splits as fill the GPU's resident blocks in one wave (at least 1,
// at most one per 128-k chunk), and the chunks per split (the last split
// may have fewer).
func skSplit(capBlocks, rowBlocks, in int) (splits, cps int) {
	chunks := ceilDiv(in, skChunk)
	s := min(max(1, capBlocks/max(rowBlocks, 1)), chunks)
	cps = ceilDiv(chunks, s)
	return ceilDiv(chunks, cps), cps
}
