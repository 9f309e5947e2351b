package nvlink

import (
	"context"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// peer is the initiator's state for one peer incarnation: the unix
// connection (fdshare.Client: ticket, fds, liveness; never connected for
// mnnvl) and the mapped regions.
type peer struct {
	t    *Transport
	desc *transfer.Descriptor
	link *fdshare.Client

	// mu is held shared by batches from launch until their kernel
	// finished, and exclusively to change or release imports, so no kernel
	// runs on memory being unmapped.
	mu     sync.RWMutex
	maps   map[uint64]*mapping // by region id
	byAddr map[uint64]*mapping // by the region's address in the peer
	closed bool                // shut: imports are released
}

// mapping is one imported remote region.
type mapping struct {
	h        Handle
	raw      []byte         // the descriptor's handle it was imported for
	addr     uint64         // the region's address in the peer
	base     cuda.DevicePtr // the exported object's start in this process
	writable bool
	owner    int // local ordinal that imported it (IPC: the only one mapped)
	pool     *cuda.ImportedPool
	ipc      *cuda.Context
	host     *transfer.HostMemory
	hostCtx  *cuda.Context
}

// ptr is the local address of the peer's address a (inside the region).
func (m *mapping) ptr(a uint64) cuda.DevicePtr {
	return m.base + cuda.DevicePtr(m.h.Offset+(a-m.addr))
}

func (m *mapping) release() {
	switch {
	case m.pool != nil:
		m.pool.Close()
	case m.ipc != nil:
		m.ipc.IpcCloseMemHandle(m.base)
	case m.host != nil:
		if m.hostCtx != nil {
			m.hostCtx.MemHostUnregister(hostPtr(m.host.Addr()))
		}
		m.host.Close()
	}
}

// newPeer makes the state of a peer incarnation (no I/O).
func (t *Transport) newPeer(d *transfer.Descriptor) *peer {
	p := &peer{t: t, desc: d, maps: map[uint64]*mapping{}, byAddr: map[uint64]*mapping{}}
	p.link = fdshare.NewClient(fdshare.ClientConfig{
		Kind: Name, Version: protocolVersion, Wire: &wire, Host: t.h, Self: t.inc, Peer: d, Logger: t.lg,
		Go: t.peers.Go, OnRevoke: p.revoke, OnGone: p.shut,
	})
	return p
}

func (p *peer) connected() bool {
	if p.t.fabric {
		return true // mnnvl: no socket, imports come from the descriptor
	}
	return p.link.Connected()
}

// connect sets up the unix connection once: ticket through the engine's
// handshake, hello with the ticket, the server's proof checked.
func (p *peer) connect(ctx context.Context) error { return p.link.Connect(ctx) }

// err is why the peer can no longer be used.
func (p *peer) err() error { return p.link.Err() }

// alive is the cheap liveness check around a batch: the reader's flag, then
// a zero-timeout poll of the socket for a hang-up (mnnvl: no socket,
// liveness comes from the engine).
func (p *peer) alive() error { return p.link.Alive() }

// revoke unmaps a region the peer unregistered.
func (p *peer) revoke(id uint64) {
	p.mu.Lock()
	m := p.maps[id]
	delete(p.maps, id)
	if m != nil && p.byAddr[m.addr] == m {
		delete(p.byAddr, m.addr)
	}
	p.mu.Unlock()
	if m != nil {
		m.release()
	}
}

// shut closes the connection (if any), fails waiting requests and unmaps
// every region, after the copies in flight finish.
func (p *peer) shut(why error) {
	if why != nil {
		p.link.Die(why)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	maps := p.maps
	p.maps = map[uint64]*mapping{}
	p.byAddr = map[uint64]*mapping{}
	p.mu.Unlock()
	p.link.Close()
	for _, m := range maps {
		m.release()
	}
}

// mapRegions makes sure every region in hs is mapped: it asks the serving
// side for the objects it lacks and imports each once. A region the peer
// refuses (or sends inconsistently) stays unmapped, with the reason in
// refused; err is for what fails the whole batch (connection, ctx).
func (p *peer) mapRegions(ctx context.Context, hs []want) (refused map[uint64]error, err error) {
	p.mu.RLock()
	var need []want
	var ids []uint64
	for _, h := range hs {
		if p.maps[h.ID] == nil {
			need = append(need, h)
			ids = append(ids, h.ID)
		}
	}
	p.mu.RUnlock()
	if len(need) == 0 {
		return nil, nil
	}
	return p.link.Fetch(ctx, ids, func(i int, r fdshare.Reply) error { return p.adopt(need[i], r) })
}

// errClosedPeer is what install returns when the peer was shut meanwhile.
var errClosedPeer = fdshare.ErrShut

// want is a region to import: its handle, the raw handle and its address.
type want struct {
	Handle
	raw  []byte
	addr uint64
	dev  int // local GPU the first batch launches on (legacy IPC is opened there)
}

// adopt imports the object of one reply, after checking it against the
// handle the descriptor published.
func (p *peer) adopt(h want, r fdshare.Reply) error {
	closeFD := func() {
		if r.FD >= 0 {
			unix.Close(r.FD)
			r.FD = -1
		}
	}
	defer closeFD()
	switch r.Status {
	case 0:
	case fdshare.StatusNotRegistered: // gone since we read the descriptor
		return fmt.Errorf("%w: %s no longer has nvlink region %d: %s", transfer.ErrOutOfBounds, p.desc.Name, h.ID, r.Text)
	default:
		return fmt.Errorf("%s refused nvlink region %d: %s", p.desc.Name, h.ID, r.Text)
	}
	if kindOf(r.Kind) != h.Kind || r.Offset != h.Offset || r.Size != h.Size {
		return fmt.Errorf("nvlink: %s sent region %d as %s [%d, +%d), descriptor says %s [%d, +%d)",
			p.desc.Name, h.ID, kindOf(r.Kind), r.Offset, r.Size, h.Kind, h.Offset, h.Size)
	}
	if (h.Kind == KindVMMFD || h.Kind == KindHost) && r.FD < 0 {
		return fmt.Errorf("nvlink: %s sent region %d without its fd", p.desc.Name, h.ID)
	}
	m, err := p.t.importRegion(h, r.Key, r.FD, r.Flags&fdshare.FlagWritable != 0, r.Gran)
	if err != nil {
		return err
	}
	if h.Kind == KindHost {
		r.FD = -1 // owned by the mapping now
	}
	return p.install(m)
}

// install records an import, unless the peer was shut or another batch
// imported the region meanwhile.
func (p *peer) install(m *mapping) error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		m.release()
		return errClosedPeer
	}
	if old := p.maps[m.h.ID]; old != nil {
		p.mu.Unlock()
		m.release()
		return nil
	}
	p.maps[m.h.ID] = m
	p.byAddr[m.addr] = m
	p.mu.Unlock()
	return nil
}

func kindOf(w byte) string {
	switch w {
	case wireVMMFD:
		return KindVMMFD
	case wireIPC:
		return KindIPC
	case wireHost:
		return KindHost
	case wireVMMFabric:
		return KindVMMFabric
	}
	return fmt.Sprintf("kind(%d)", w)
}

// importRegion maps a peer's exported object into this process. The fd
// (vmm-fd) stays the caller's; for host memory it becomes the mapping's.
func (t *Transport) importRegion(h want, key [64]byte, fd int, writable bool, gran uint64) (*mapping, error) {
	owner := t.busIndex(h.PCIBusID)
	if owner < 0 {
		owner = 0
	}
	if h.Kind == KindIPC {
		// cuIpcOpenMemHandle maps the memory for one context only: open it
		// in the GPU that runs the kernels (peer access is enabled lazily
		// by the driver). Opening it in the owner GPU's context and
		// enabling peer access from another GPU does not map it there
		// (seen on H200: CUDA_ERROR_ILLEGAL_ADDRESS in the kernel).
		owner = h.dev
	}
	d, err := t.device(owner)
	if err != nil {
		return nil, err
	}
	m := &mapping{h: h.Handle, raw: h.raw, addr: h.addr, writable: writable, owner: owner}
	switch h.Kind {
	case KindVMMFD, KindVMMFabric:
		if gran == 0 {
			gran = h.Granularity
		}
		e := cuda.PoolExport{HandleType: cuda.HandlePosixFD, FD: fd, Size: h.Size, Granularity: gran}
		if h.Kind == KindVMMFabric {
			e.HandleType = cuda.HandleFabric
			copy(e.Fabric[:], key[:])
		}
		var others []cuda.Device
		for i := 0; i < t.ndev; i++ {
			if i != owner {
				others = append(others, cuda.Device(i))
			}
		}
		m.pool, err = d.ctx.ImportPool(e, others...)
		if err != nil && len(others) > 0 {
			m.pool, err = d.ctx.ImportPool(e)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: import region %d: %w", t.name, h.ID, err)
		}
		m.base = m.pool.Ptr()
	case KindIPC:
		var e cuda.IpcExport
		copy(e.Handle[:], key[:])
		e.Size = h.Size
		if m.base, err = d.ctx.ImportIPC(e); err != nil {
			return nil, fmt.Errorf("%s: open IPC region %d: %w", t.name, h.ID, err)
		}
		m.ipc = d.ctx
	case KindHost:
		mem, err := transfer.MapHost(fd, int64(h.Size), writable)
		if err != nil {
			return nil, err
		}
		flags := uint(cuda.HostRegisterPortable | cuda.HostRegisterDeviceMap)
		if !writable {
			flags |= cuda.HostRegisterReadOnly
		}
		ptr := hostPtr(mem.Addr())
		if err := d.ctx.MemHostRegister(ptr, h.Size, flags); err != nil {
			mem.Close()
			return nil, fmt.Errorf("%s: page-lock peer host region %d (%d bytes): %w", t.name, h.ID, h.Size, err)
		}
		m.host, m.hostCtx = mem, d.ctx
		if m.base, err = d.ctx.MemHostGetDevicePointer(ptr); err != nil {
			m.release()
			return nil, err
		}
	default:
		return nil, fmt.Errorf("%s: unknown handle kind %q", t.name, h.Kind)
	}
	return m, nil
}
