package cuda

import (
	"errors"
	"fmt"

	"go.uber.org/zap"
)

// ErrOutOfMemory is wrapped when a pool or allocation asks for more than the
// GPU has free; the message names both numbers.
var ErrOutOfMemory = errors.New("cuda: not enough free GPU memory")

// PoolConfig configures a GPU memory pool. The zero value of each field
// means: HandleType auto (FABRIC only if a trial allocation succeeds, else
// POSIX FD), no peers, no logging.
type PoolConfig struct {
	// Size is the number of bytes wanted; the pool rounds it up to the
	// allocation granularity and never takes more.
	Size uint64
	// HandleType forces HandlePosixFD or HandleFabric; HandleNone picks.
	HandleType HandleType
	// Peers are devices besides the owner granted read/write access.
	Peers []Device
	// Logger receives the FABRIC fallback line; nil means none.
	Logger *zap.Logger
}

// Validate reports a config that cannot work.
func (c PoolConfig) Validate() error {
	if c.Size == 0 {
		return errors.New("cuda: pool size is 0")
	}
	switch c.HandleType {
	case HandleNone, HandlePosixFD, HandleFabric:
	default:
		return fmt.Errorf("cuda: pool handle type %v not supported", c.HandleType)
	}
	return nil
}

// Pool is one contiguous VMM range of shareable physical memory on one GPU:
// one reservation, one physical allocation, one mapping.
type Pool struct {
	ctx    *Context
	ptr    DevicePtr
	size   uint64
	gran   uint64
	ht     HandleType
	handle MemHandle
	access []Device
	xfer   poolCopies
}

// PoolExport is what another process needs to map a pool: the POSIX fd (to
// be passed over a unix socket or as an inherited file) or the fabric handle
// bytes, plus the size and granularity.
type PoolExport struct {
	HandleType  HandleType   `json:"handle_type"`
	FD          int          `json:"-"` // HandlePosixFD: owned by whoever holds it
	Fabric      FabricHandle `json:"fabric,omitempty"`
	Size        uint64       `json:"size"`
	Granularity uint64       `json:"granularity"`
	Device      int          `json:"device"` // owner's device ordinal (in the owner's process)
}

// FabricProbe returns the (cached) outcome of a trial FABRIC allocation on
// the context's device.
func (c *Context) FabricProbe() FabricProbe {
	c.fabricOnce.Do(func() { c.fabric = c.ProbeFabric() })
	return c.fabric
}

// NewPool reserves, allocates and maps a pool on c's device.
func (c *Context) NewPool(cfg PoolConfig) (*Pool, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	ht := cfg.HandleType
	if ht == HandleNone {
		if fp := c.FabricProbe(); fp.Usable {
			ht = HandleFabric
		} else {
			ht = HandlePosixFD
			lg.Info("FABRIC handles unavailable, GPU memory pool falls back to POSIX file descriptors",
				zap.Int("gpu", int(c.dev)), zap.Bool("attribute_supported", fp.AttributeSupported),
				zap.NamedError("reason", fp.Err))
		}
	}
	gran, err := c.dev.AllocationGranularity(ht, false)
	if err != nil {
		return nil, fmt.Errorf("cuda: pool on GPU %d (%v handles): %w", c.dev, ht, err)
	}
	size := (cfg.Size + gran - 1) / gran * gran
	free, total, err := c.MemGetInfo()
	if err != nil {
		return nil, err
	}
	if size > free {
		return nil, poolOOM(c.dev, cfg.Size, size, free, total, nil)
	}
	p := &Pool{ctx: c, size: size, gran: gran, ht: ht}
	if p.handle, err = c.MemCreate(size, ht); err != nil {
		if Code(err) == ErrorOutOfMemory {
			free, total, _ = c.MemGetInfo()
			return nil, poolOOM(c.dev, cfg.Size, size, free, total, err)
		}
		return nil, fmt.Errorf("cuda: pool of %d bytes on GPU %d (%v handles): %w", size, c.dev, ht, err)
	}
	if p.ptr, err = c.MemAddressReserve(size, gran); err != nil {
		MemRelease(p.handle)
		return nil, fmt.Errorf("cuda: pool of %d bytes on GPU %d: %w", size, c.dev, err)
	}
	if err = c.MemMap(p.ptr, size, 0, p.handle); err != nil {
		MemAddressFree(p.ptr, size)
		MemRelease(p.handle)
		return nil, fmt.Errorf("cuda: pool of %d bytes on GPU %d: %w", size, c.dev, err)
	}
	if err = p.GrantAccess(append([]Device{c.dev}, cfg.Peers...)...); err != nil {
		p.Close()
		return nil, err
	}
	return p, nil
}

func poolOOM(d Device, asked, rounded, free, total uint64, cause error) error {
	err := fmt.Errorf("%w: GPU %d: pool of %d bytes (%.2f GiB, %d after rounding) requested, %d bytes (%.2f GiB) free of %d (%.2f GiB)",
		ErrOutOfMemory, d, asked, gib(asked), rounded, free, gib(free), total, gib(total))
	if cause != nil {
		err = fmt.Errorf("%w: %w", err, cause)
	}
	return err
}

func gib(n uint64) float64 { return float64(n) / (1 << 30) }

// GrantAccess gives devices read/write access to the whole pool (the owner
// always has it).
func (p *Pool) GrantAccess(devs ...Device) error {
	var add []Device
	for _, d := range devs {
		seen := false
		for _, a := range p.access {
			seen = seen || a == d
		}
		if !seen {
			add = append(add, d)
		}
	}
	if len(add) == 0 {
		return nil
	}
	all := append(append([]Device{}, p.access...), add...)
	if err := p.ctx.MemSetAccess(p.ptr, p.size, all...); err != nil {
		return fmt.Errorf("cuda: pool on GPU %d: grant access to %v: %w", p.ctx.dev, add, err)
	}
	p.access = all
	return nil
}

// Ptr is the pool's base address.
func (p *Pool) Ptr() DevicePtr { return p.ptr }

// Size is the pool's size (the request rounded up to the granularity).
func (p *Pool) Size() uint64 { return p.size }

// Granularity is the allocation granularity used.
func (p *Pool) Granularity() uint64 { return p.gran }

// HandleType is the shareable handle type backing the pool.
func (p *Pool) HandleType() HandleType { return p.ht }

// Context is the owning context.
func (p *Pool) Context() *Context { return p.ctx }

// Export returns what another process needs to map the pool. For POSIX FD
// pools each call creates a new file descriptor that the caller must close
// once sent.
func (p *Pool) Export() (PoolExport, error) {
	e := PoolExport{HandleType: p.ht, FD: -1, Size: p.size, Granularity: p.gran, Device: int(p.ctx.dev)}
	var err error
	switch p.ht {
	case HandlePosixFD:
		e.FD, err = MemExportFD(p.handle)
	case HandleFabric:
		e.Fabric, err = MemExportFabric(p.handle)
	}
	if err != nil {
		return PoolExport{}, fmt.Errorf("cuda: export pool on GPU %d: %w", p.ctx.dev, err)
	}
	return e, nil
}

// Close unmaps and frees the pool. Importers' mappings keep the physical
// memory alive until they close too.
func (p *Pool) Close() error {
	if p == nil || p.ptr == 0 {
		return nil
	}
	p.closeCopies()
	err := errors.Join(MemUnmap(p.ptr, p.size), MemAddressFree(p.ptr, p.size), MemRelease(p.handle))
	p.ptr = 0
	return err
}

// ImportedPool is a peer's pool mapped into this process.
type ImportedPool struct {
	ctx    *Context
	ptr    DevicePtr
	size   uint64
	handle MemHandle
}

// Ptr is where the peer's pool starts in this process.
func (m *ImportedPool) Ptr() DevicePtr { return m.ptr }

// Size is the mapped size.
func (m *ImportedPool) Size() uint64 { return m.size }

// ImportPool maps a pool exported by another process (or this one) into c,
// with read/write access for c's device and any extra devices. For POSIX FD
// exports, e.FD must be valid in this process; the caller keeps ownership.
func (c *Context) ImportPool(e PoolExport, extra ...Device) (*ImportedPool, error) {
	if e.Size == 0 || e.Granularity == 0 || e.Size%e.Granularity != 0 {
		return nil, fmt.Errorf("cuda: import pool: bad size %d / granularity %d", e.Size, e.Granularity)
	}
	m := &ImportedPool{ctx: c, size: e.Size}
	var err error
	switch e.HandleType {
	case HandlePosixFD:
		m.handle, err = c.MemImportFD(e.FD)
	case HandleFabric:
		m.handle, err = c.MemImportFabric(e.Fabric)
	default:
		err = fmt.Errorf("handle type %v not importable", e.HandleType)
	}
	if err != nil {
		return nil, fmt.Errorf("cuda: import %v pool on GPU %d: %w", e.HandleType, c.dev, err)
	}
	if m.ptr, err = c.MemAddressReserve(e.Size, e.Granularity); err != nil {
		MemRelease(m.handle)
		return nil, fmt.Errorf("cuda: import pool on GPU %d: %w", c.dev, err)
	}
	if err = c.MemMap(m.ptr, e.Size, 0, m.handle); err != nil {
		MemAddressFree(m.ptr, e.Size)
		MemRelease(m.handle)
		return nil, fmt.Errorf("cuda: import pool on GPU %d: %w", c.dev, err)
	}
	if err = c.MemSetAccess(m.ptr, e.Size, append([]Device{c.dev}, extra...)...); err != nil {
		m.Close()
		return nil, fmt.Errorf("cuda: import pool on GPU %d: %w", c.dev, err)
	}
	return m, nil
}

// Close unmaps the imported pool.
func (m *ImportedPool) Close() error {
	if m == nil || m.ptr == 0 {
		return nil
	}
	err := errors.Join(MemUnmap(m.ptr, m.size), MemAddressFree(m.ptr, m.size), MemRelease(m.handle))
	m.ptr = 0
	return err
}

// IpcExport describes legacy-IPC-shared cuMemAlloc memory: the handle covers
// the whole allocation [Base, Base+Size); Offset locates the exported address.
type IpcExport struct {
	Handle IpcMemHandle `json:"handle"`
	Size   uint64       `json:"size"`
	Offset uint64       `json:"offset"`
}

// ExportIPC exports the cuMemAlloc allocation containing p.
func (c *Context) ExportIPC(p DevicePtr) (IpcExport, error) {
	pi, err := c.PointerInfo(p)
	if err != nil {
		return IpcExport{}, err
	}
	h, err := c.IpcGetMemHandle(pi.RangeStart)
	if err != nil {
		return IpcExport{}, err
	}
	return IpcExport{Handle: h, Size: pi.RangeSize, Offset: uint64(p - pi.RangeStart)}, nil
}

// ImportIPC opens a legacy IPC export and returns the exported address in
// this process (base + offset); close it with IpcCloseMemHandle(ptr-Offset).
func (c *Context) ImportIPC(e IpcExport) (DevicePtr, error) {
	base, err := c.IpcOpenMemHandle(e.Handle)
	if err != nil {
		return 0, err
	}
	return base + DevicePtr(e.Offset), nil
}
