package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
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
}

const descBytes = int(unsafe.Sizeof(copyDesc{})) // sizeof(McCopyDesc) = 32

type copySlot struct {
	host    *HostMem
	hostDev DevicePtr // device address of host (mapped)
	dev     DevicePtr
	cap     int // descriptors
	done    *Event
	used    bool
}

// Copier moves a batch of scattered blocks with one kernel launch
// (mc_scatter_copy): 16-byte loads and stores, several warps per large
// block. It is safe for concurrent use; Copy only enqueues work.
type Copier struct {
	ctx   *Context
	mod   *Module
	fn    *Function
	fill  *Function
	cfg   CopierConfig
	sms   uint32
	mu    sync.Mutex
	slots []copySlot
	next  int
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
	mod, err := k.Load(c, csrc.CopyKernels)
	if err != nil {
		return nil, err
	}
	cp := &Copier{ctx: c, mod: mod, cfg: cfg, sms: uint32(sms), slots: make([]copySlot, cfg.Slots)}
	if cp.fn, err = mod.Function("mc_scatter_copy"); err == nil {
		cp.fill, err = mod.Function("mc_fill_pattern")
	}
	if err != nil {
		mod.Unload()
		return nil, err
	}
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
	errs = append(errs, cp.mod.Unload())
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
		if s.done, err = cp.ctx.NewEvent(EventDisableTiming); err != nil {
			cp.freeSlot(s)
			return nil, err
		}
		s.cap = c
	}
	return s, nil
}

// Plan is the launch shape Copy would use for a batch.
type Plan struct {
	ChunkBytes    uint64
	TotalChunks   uint64
	ChunksPerDesc uint64 // non-zero when every descriptor has that many chunks
	Grid, Block   uint32
}

// copyDesc mirrors McCopyDesc in csrc/copy_kernels.cu (little-endian).
type copyDesc struct {
	src, dst, len, firstChunk uint64
}

// Plan computes chunking and grid for descs.
func (cp *Copier) Plan(descs []CopyDesc) Plan {
	var total uint64
	for _, d := range descs {
		total += d.Len
	}
	block := cp.cfg.BlockThreads
	maxGrid := cp.sms * cp.cfg.CTAsPerSM
	chunk := cp.cfg.ChunkBytes
	if chunk == 0 {
		warps := uint64(maxGrid) * uint64(block/32)
		chunk = total / (warps * 4) &^ 15
		chunk = min(max(chunk, 2048), 64<<10)
	}
	var chunks uint64
	per := uint64(0)
	for i, d := range descs {
		k := max((d.Len+chunk-1)/chunk, 1)
		if i == 0 {
			per = k
		} else if k != per {
			per = 0
		}
		chunks += k
	}
	wpb := uint64(block / 32)
	grid := uint32(min((chunks+wpb-1)/wpb, uint64(maxGrid)))
	return Plan{ChunkBytes: chunk, TotalChunks: chunks, ChunksPerDesc: per, Grid: max(grid, 1), Block: block}
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
	// The pinned staging buffer is viewed as []copyDesc (amd64/arm64 are
	// little-endian, as the GPU is).
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
	dp := sl.hostDev
	if !cp.cfg.HostDescriptors {
		dp = sl.dev
		if err := s.MemcpyHtoD(sl.dev, sl.host.Ptr(), uint64(len(descs)*descBytes)); err != nil {
			return err
		}
	}
	var a Args
	a.Ptr(dp).U32(uint32(len(descs))).U64(p.ChunkBytes).U64(p.TotalChunks).U64(p.ChunksPerDesc)
	if err := s.LaunchArgs(cp.fn, D1(p.Grid), D1(p.Block), 0, &a); err != nil {
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
