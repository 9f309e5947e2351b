package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/csrc"
)

// CopyDesc is one block of a batched copy: Len bytes from Src to Dst. Both
// are unified addresses the launching device can reach (its own memory, a
// peer's mapped memory, mapped or registered host memory).
type CopyDesc struct {
	Src, Dst DevicePtr
	Len      uint64
}

// CopierConfig tunes the batch copy kernel. Zero values pick defaults.
type CopierConfig struct {
	// ChunkBytes is the unit of work of one warp (a multiple of 16); 0 sizes
	// it from the batch (2 KiB..64 KiB, about 4 chunks per resident warp).
	ChunkBytes uint64
	// BlockThreads is the CTA size (default 256).
	BlockThreads uint32
	// CTAsPerSM bounds the persistent grid (default 8).
	CTAsPerSM uint32
	// Slots is how many batches may be in flight before Copy blocks (default 4).
	Slots int
	// HostDescriptors makes the kernel read the descriptors straight from
	// the mapped pinned staging buffer instead of uploading them first.
	HostDescriptors bool
	// Kernel picks the copy kernel: KernelAuto (pages when every block has
	// the same 16-byte-multiple length and 16-byte-aligned ends, else
	// chunks), KernelChunks or KernelPages (falls back to chunks when the
	// batch does not qualify).
	Kernel CopyKernel
	// Unroll is how many 16-byte words each thread of the pages kernel has
	// in flight (default 4; a compile-time constant of the module).
	Unroll int
}

// CopyKernel names a copy kernel.
type CopyKernel string

// Copy kernels.
const (
	KernelAuto   CopyKernel = ""
	KernelChunks CopyKernel = "chunks" // mc_scatter_copy: warp per chunk, any sizes
	KernelPages  CopyKernel = "pages"  // mc_scatter_pages: flat over equal aligned pages
)

const descBytes = int(unsafe.Sizeof(copyDesc{})) // sizeof(McCopyDesc) = 32

type copySlot struct {
	host    *HostMem
	hostDev DevicePtr // device address of host (mapped)
	dev     DevicePtr
	cap     int // descriptors
	done    *Event
	up      *Event // the upload into dev finished
	used    bool
}

// Copier moves a batch of scattered blocks with one kernel launch
// (mc_scatter_copy): 16-byte loads and stores, several warps per large
// block. It is safe for concurrent use; Copy only enqueues work.
type Copier struct {
	ctx       *Context
	mod       *Module
	fn        *Function
	pages     *Function
	fill      *Function
	cfg       CopierConfig
	sms       uint32
	pagesGrid uint32  // resident CTAs of the pages kernel on the whole GPU
	upload    *Stream // descriptor uploads, overlapping earlier batches' kernels
	mu        sync.Mutex
	slots     []copySlot
	next      int
}

// NewCopier loads the copy kernels (through k) into c.
func NewCopier(c *Context, k *Kernels, cfg CopierConfig) (*Copier, error) {
	if cfg.BlockThreads == 0 {
		cfg.BlockThreads = 256
	}
	if cfg.BlockThreads%32 != 0 || cfg.BlockThreads > 1024 {
		return nil, fmt.Errorf("cuda: copier: BlockThreads %d not a multiple of 32 up to 1024", cfg.BlockThreads)
	}
	if cfg.ChunkBytes%16 != 0 {
		return nil, fmt.Errorf("cuda: copier: ChunkBytes %d not a multiple of 16", cfg.ChunkBytes)
	}
	if cfg.CTAsPerSM == 0 {
		cfg.CTAsPerSM = 8
	}
	if cfg.Slots <= 0 {
		cfg.Slots = 4
	}
	sms, err := c.MultiprocessorCount()
	if err != nil {
		return nil, err
	}
	if cfg.Unroll == 0 {
		cfg.Unroll = 4
	}
	if cfg.Unroll < 1 || cfg.Unroll > 16 {
		return nil, fmt.Errorf("cuda: copier: Unroll %d not in 1..16", cfg.Unroll)
	}
	switch cfg.Kernel {
	case KernelAuto, KernelChunks, KernelPages:
	default:
		return nil, fmt.Errorf("cuda: copier: unknown kernel %q", cfg.Kernel)
	}
	mod, err := k.Load(c, csrc.CopyKernels, fmt.Sprintf("-DMC_PAGES_UNROLL=%d", cfg.Unroll))
	if err != nil {
		return nil, err
	}
	cp := &Copier{ctx: c, mod: mod, cfg: cfg, sms: uint32(sms), slots: make([]copySlot, cfg.Slots)}
	if cp.fn, err = mod.Function("mc_scatter_copy"); err == nil {
		if cp.fill, err = mod.Function("mc_fill_pattern"); err == nil {
			cp.pages, err = mod.Function("mc_scatter_pages")
		}
	}
	if err == nil {
		cp.upload, err = c.NewStream(StreamNonBlocking)
	}
	if err != nil {
		mod.Unload()
		return nil, err
	}
	// A flat grid-stride kernel wants exactly the CTAs that fit at once:
	// a second wave would start late and stretch the tail.
	per := cfg.CTAsPerSM
	if regs, rerr := cp.pages.Attribute(FuncAttrNumRegs); rerr == nil && regs > 0 {
		per = min(per, uint32(65536/(regs*int(cfg.BlockThreads))))
	}
	per = min(per, 2048/cfg.BlockThreads)
	cp.pagesGrid = max(per, 1) * cp.sms
	return cp, nil
}

// Close waits for in-flight batches and frees the copier's memory.
func (cp *Copier) Close() error {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	var errs []error
	for i := range cp.slots {
		errs = append(errs, cp.freeSlot(&cp.slots[i]))
	}
	errs = append(errs, cp.upload.Destroy(), cp.mod.Unload())
	return errors.Join(errs...)
}

func (cp *Copier) freeSlot(s *copySlot) error {
	var errs []error
	if s.done != nil {
		if s.used {
			errs = append(errs, s.done.Synchronize())
		}
		errs = append(errs, s.done.Destroy())
	}
	if s.up != nil {
		errs = append(errs, s.up.Destroy())
	}
	if s.dev != 0 {
		errs = append(errs, cp.ctx.MemFree(s.dev))
	}
	errs = append(errs, s.host.Free())
	*s = copySlot{}
	return errors.Join(errs...)
}

// slot returns a free slot with room for n descriptors; caller holds mu.
func (cp *Copier) slot(n int) (*copySlot, error) {
	s := &cp.slots[cp.next]
	cp.next = (cp.next + 1) % len(cp.slots)
	if s.used {
		if err := s.done.Synchronize(); err != nil {
			return nil, err
		}
		s.used = false
	}
	if s.cap < n {
		if err := cp.freeSlot(s); err != nil {
			return nil, err
		}
		c := 1024
		for c < n {
			c *= 2
		}
		var err error
		if s.host, err = cp.ctx.MemHostAlloc(uint64(c*descBytes), HostAllocDeviceMap|HostAllocPortable); err != nil {
			return nil, err
		}
		if s.hostDev, err = s.host.DevicePtr(); err != nil {
			s.host.Free()
			*s = copySlot{}
			return nil, err
		}
		if s.dev, err = cp.ctx.MemAlloc(uint64(c * descBytes)); err != nil {
			s.host.Free()
			*s = copySlot{}
			return nil, err
		}
		if s.done, err = cp.ctx.NewEvent(EventDisableTiming); err == nil {
			s.up, err = cp.ctx.NewEvent(EventDisableTiming)
		}
		if err != nil {
			cp.freeSlot(s)
			return nil, err
		}
		s.cap = c
	}
	return s, nil
}

// Plan is the launch shape Copy would use for a batch.
type Plan struct {
	Kernel        CopyKernel // the kernel Copy launches
	PageBytes     uint64     // KernelPages: every block's length
	ChunkBytes    uint64
	TotalChunks   uint64
	ChunksPerDesc uint64 // non-zero when every descriptor has that many chunks
	Grid, Block   uint32
}

// copyDesc mirrors McCopyDesc in csrc/copy_kernels.cu (little-endian).
type copyDesc struct {
	src, dst, len, firstChunk uint64
}

// Plan computes chunking and grid for descs. It reads descs once when the
// blocks are equal (the common case: pages), twice otherwise.
func (cp *Copier) Plan(descs []CopyDesc) Plan {
	var total, n0 uint64
	if len(descs) > 0 {
		n0 = descs[0].Len
	}
	uniform := true
	var addrs uint64 // OR of every end, for the alignment test
	for _, d := range descs {
		total += d.Len
		uniform = uniform && d.Len == n0
		addrs |= uint64(d.Src) | uint64(d.Dst)
	}
	block := cp.cfg.BlockThreads
	maxGrid := cp.sms * cp.cfg.CTAsPerSM
	chunk := cp.cfg.ChunkBytes
	if chunk == 0 {
		warps := uint64(maxGrid) * uint64(block/32)
		chunk = total / (warps * 4) &^ 15
		chunk = min(max(chunk, 2048), 64<<10)
	}
	chunksOf := func(n uint64) uint64 { return max((n+chunk-1)/chunk, 1) }
	var chunks, per uint64
	switch {
	case len(descs) == 0:
	case uniform:
		per = chunksOf(n0)
		chunks = per * uint64(len(descs))
	default:
		// Lengths differ, but the chunk counts may still all be equal.
		last, lastK := ^uint64(0), uint64(0)
		per = chunksOf(n0)
		for _, d := range descs {
			if d.Len != last {
				last, lastK = d.Len, chunksOf(d.Len)
				if lastK != per {
					per = 0
				}
			}
			chunks += lastK
		}
	}
	wpb := uint64(block / 32)
	grid := uint32(min((chunks+wpb-1)/wpb, uint64(maxGrid)))
	p := Plan{Kernel: KernelChunks, ChunkBytes: chunk, TotalChunks: chunks, ChunksPerDesc: per, Grid: max(grid, 1), Block: block}
	// The pages kernel: equal non-zero lengths that are multiples of 16,
	// 16-byte-aligned ends.
	if cp.cfg.Kernel != KernelChunks && uniform && per != 0 && n0 != 0 && n0%16 == 0 && addrs&15 == 0 {
		vecs := total / 16
		u := uint64(max(cp.cfg.Unroll, 1))
		pg := cp.pagesGrid
		if pg == 0 {
			pg = maxGrid
		}
		threads := (vecs + u - 1) / u
		g := uint32(min((threads+uint64(block)-1)/uint64(block), uint64(pg)))
		p.Kernel, p.PageBytes, p.Grid = KernelPages, n0, max(g, 1)
	}
	return p
}

// Copy enqueues the batch on s: the descriptors go up through a pinned
// staging buffer, then one kernel launch copies every block. It returns once
// the work is enqueued; synchronize s (or record an event) to wait.
func (cp *Copier) Copy(s *Stream, descs []CopyDesc) error {
	if len(descs) == 0 {
		return nil
	}
	if uint64(len(descs)) > 1<<31 {
		return fmt.Errorf("cuda: copier: %d descriptors, at most 2^31", len(descs))
	}
	if s.ctx != cp.ctx {
		return fmt.Errorf("cuda: copier of GPU %d used with a stream of GPU %d", cp.ctx.dev, s.ctx.dev)
	}
	p := cp.Plan(descs)
	cp.mu.Lock()
	defer cp.mu.Unlock()
	sl, err := cp.slot(len(descs))
	if err != nil {
		return err
	}
	// The pinned staging buffer is viewed as []copyDesc, or as (src, dst)
	// pairs for the pages kernel (amd64/arm64 are little-endian, as the
	// GPU is).
	nbytes := uint64(len(descs) * descBytes)
	if p.Kernel == KernelPages {
		out := unsafe.Slice((*[2]uint64)(sl.host.Ptr()), len(descs))
		for i, d := range descs {
			out[i] = [2]uint64{uint64(d.Src), uint64(d.Dst)}
		}
		nbytes = uint64(len(descs) * 16)
	} else {
		out := unsafe.Slice((*copyDesc)(sl.host.Ptr()), len(descs))
		var first uint64
		for i, d := range descs {
			out[i] = copyDesc{src: uint64(d.Src), dst: uint64(d.Dst), len: d.Len, firstChunk: first}
			if p.ChunksPerDesc != 0 {
				first += p.ChunksPerDesc
			} else {
				first += max((d.Len+p.ChunkBytes-1)/p.ChunkBytes, 1)
			}
		}
	}
	dp := sl.hostDev
	if !cp.cfg.HostDescriptors {
		// Upload on the copier's own stream, so it overlaps kernels already
		// queued on s; s waits for this upload only.
		dp = sl.dev
		if err := cp.upload.MemcpyHtoD(sl.dev, sl.host.Ptr(), nbytes); err != nil {
			return err
		}
		if err := sl.up.Record(cp.upload); err != nil {
			return err
		}
		if err := s.WaitEvent(sl.up); err != nil {
			return err
		}
	}
	var a Args
	fn := cp.fn
	if p.Kernel == KernelPages {
		fn = cp.pages
		vecs := p.PageBytes / 16
		shift := int32(-1)
		if vecs&(vecs-1) == 0 {
			shift = int32(bits.TrailingZeros64(vecs))
		}
		a.Ptr(dp).U64(vecs).I32(shift).U64(vecs * uint64(len(descs)))
	} else {
		a.Ptr(dp).U32(uint32(len(descs))).U64(p.ChunkBytes).U64(p.TotalChunks).U64(p.ChunksPerDesc)
	}
	if err := s.LaunchArgs(fn, D1(p.Grid), D1(p.Block), 0, &a); err != nil {
		return err
	}
	if err := sl.done.Record(s); err != nil {
		return err
	}
	sl.used = true
	return nil
}

// Fill enqueues a fill of n bytes at dst with the pseudo-random pattern of
// seed (PatternByte gives the same bytes on the host).
func (cp *Copier) Fill(s *Stream, dst DevicePtr, n, seed uint64) error {
	words := (n + 7) / 8
	grid := uint32(min((words+255)/256, uint64(cp.sms)*8))
	return s.Launch(cp.fill, D1(max(grid, 1)), D1(256), 0, dst, n, seed)
}

// PatternWord is word i of Fill's pattern for seed.
func PatternWord(i, seed uint64) uint64 {
	x := (i + seed*0x9E3779B97F4A7C15) ^ (seed >> 7)
	x ^= x >> 33
	x *= 0xff51afd7ed558ccd
	x ^= x >> 33
	x *= 0xc4ceb9fe1a85ec53
	x ^= x >> 33
	return x
}

// PatternFill writes Fill's pattern for seed into b, as if b were the
// pattern's bytes [off, off+len(b)).
func PatternFill(b []byte, off, seed uint64) {
	i := 0
	for i < len(b) {
		pos := off + uint64(i)
		w := PatternWord(pos/8, seed)
		if pos%8 == 0 && len(b)-i >= 8 {
			binary.LittleEndian.PutUint64(b[i:], w)
			i += 8
			continue
		}
		b[i] = byte(w >> (8 * (pos % 8)))
		i++
	}
}
