package cuda

import (
	"cmp"
	"fmt"

	"github.com/mooncake-go/mooncake-go/csrc"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

// Split-K attention defaults: keys per split (ATT_SPLIT; fixed for a
// backend, so a sequence's splits never depend on the batch) and threads per
// block (ATT_THREADS).
const (
	defaultAttSplit   = 256
	defaultAttThreads = 128
)

// tuning holds kernel variants for tests and benchmarks; zero values are the
// defaults.
type tuning struct {
	split, threads int // split-K attention shape
}

// kernels are the functions of the compiled llama kernel set.
type kernels struct {
	embed, rmsnorm, ropeKV            *cu.Function
	attnSplit, attnCombine, attnFlash *cu.Function
	siluMul, gemmF32, gemmT           *cu.Function
	fillT, fillF, readBW              *cu.Function
	attThreads, combineThreads        int
	split                             int
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
// kernel set for this model and device.
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
	if b.mod, err = k.LoadSource(b.cx, csrc.LlamaKernels, src, opts...); err != nil {
		return fmt.Errorf("cuda backend: kernels: %w", err)
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
	return err
}
