package nvlink

import (
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/unixfd"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// peer is the initiator's state for one peer incarnation: the unix
// connection (its liveness) and the mapped regions.
type peer struct {
	t    *Transport
	desc *transfer.Descriptor

	connecting chan struct{} // a one-slot lock around connect

	// mu is held shared by batches from launch until their kernel
	// finished, and exclusively to change or release imports, so no kernel
	// runs on memory being unmapped.
	mu     sync.RWMutex
	conn   *net.UnixConn
	raw    syscall.RawConn
	maps   map[uint64]*mapping // by region id
	byAddr map[uint64]*mapping // by the region's address in the peer
	closed bool                // shut: imports are released

	dead    atomic.Bool
	deadErr atomic.Pointer[error]

	wmu     sync.Mutex // serializes writes on conn
	rmu     sync.Mutex
	nextReq uint64
	waiting map[uint64]chan reply
	done    chan struct{} // closed when the connection ends
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

type reply struct {
	p  packet
	fd int
}

func newPeer(t *Transport, d *transfer.Descriptor) *peer {
	return &peer{t: t, desc: d, connecting: make(chan struct{}, 1), maps: map[uint64]*mapping{}, byAddr: map[uint64]*mapping{},
		waiting: map[uint64]chan reply{}, done: make(chan struct{})}
}

func (p *peer) connected() bool {
	if p.t.fabric {
		return true // mnnvl: no socket, imports come from the descriptor
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.conn != nil
}

// connect sets up the unix connection once: ticket through the engine's
// handshake, hello with the ticket, the server's proof checked.
func (p *peer) connect(ctx context.Context) error {
	select {
	case p.connecting <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-p.connecting }()
	p.mu.RLock()
	conn, closed := p.conn, p.closed
	p.mu.RUnlock()
	if conn != nil {
		return nil
	}
	if closed {
		return p.err()
	}
	var info Info
	if err := json.Unmarshal(p.desc.Transports[Name], &info); err != nil || info.Socket == "" {
		return fmt.Errorf("nvlink: %s publishes no usable nvlink socket: %v", p.desc.Name, err)
	}
	if info.Version != protocolVersion {
		return fmt.Errorf("nvlink: %s speaks nvlink protocol %d, this process %d", p.desc.Name, info.Version, protocolVersion)
	}
	tc, err := p.t.h.Dial(ctx, p.desc, Name)
	if err != nil {
		return err
	}
	defer tc.Close()
	dl := time.Now().Add(p.t.h.Timeout())
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	tc.SetDeadline(dl)
	var tk ticketMsg
	if err := transfer.ReadFrame(tc, &tk); err != nil {
		return fmt.Errorf("%w: nvlink ticket from %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
	}
	if tk.Socket != info.Socket || len(tk.Ticket) != 32 || len(tk.Proof) != 32 {
		return fmt.Errorf("nvlink: bad ticket from %s (socket %q, published %q)", p.desc.Name, tk.Socket, info.Socket)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", info.Socket)
	if err != nil {
		return fmt.Errorf("%w: nvlink: connect to %s at %s: %v", transfer.ErrPeerDead, p.desc.Name, info.Socket, err)
	}
	uc := c.(*net.UnixConn)
	hello := packet{Type: typeHello, Text: p.t.inc}
	copy(hello.Key[:32], tk.Ticket)
	var buf [maxPacket + 1]byte
	uc.SetDeadline(dl)
	if _, _, err := uc.WriteMsgUnix(hello.appendTo(buf[:0]), nil, nil); err != nil {
		uc.Close()
		return fmt.Errorf("%w: nvlink hello to %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
	}
	w, err := readPacket(uc, buf[:])
	if err != nil {
		uc.Close()
		return fmt.Errorf("%w: nvlink welcome from %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
	}
	if w.Type != typeWelcome || w.Status != 0 {
		uc.Close()
		return fmt.Errorf("nvlink: %s refused the connection: %s", p.desc.Name, w.Text)
	}
	if subtle.ConstantTimeCompare(w.Key[:32], tk.Proof) != 1 {
		uc.Close()
		return fmt.Errorf("%w: nvlink: the process at %s did not prove it is %s", transfer.ErrAuth, info.Socket, p.desc.Name)
	}
	uc.SetDeadline(time.Time{})
	raw, err := uc.SyscallConn()
	if err != nil {
		uc.Close()
		return fmt.Errorf("nvlink: %w", err)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		uc.Close()
		return p.err()
	}
	p.conn, p.raw = uc, raw
	p.mu.Unlock()
	if !p.t.goTracked(p.readLoop) {
		p.shut(transfer.ErrClosed)
		return transfer.ErrClosed
	}
	p.t.lg.Debug("connected", zap.String("peer", p.desc.Name), zap.String("incarnation", p.desc.Incarnation))
	return nil
}

// err is why the peer can no longer be used.
func (p *peer) err() error {
	if e := p.deadErr.Load(); e != nil {
		return *e
	}
	return fmt.Errorf("%w: nvlink connection to %s closed", transfer.ErrPeerDead, p.desc.Name)
}

// die records the first reason the peer is gone.
func (p *peer) die(err error) {
	p.deadErr.CompareAndSwap(nil, &err)
	p.dead.Store(true)
}

// alive is the cheap liveness check around a batch: the reader's flag, then
// a zero-timeout poll of the socket for a hang-up.
func (p *peer) alive() error {
	if p.dead.Load() {
		return p.err()
	}
	if p.raw == nil {
		return nil // mnnvl: liveness comes from the engine
	}
	hup := false
	cerr := p.raw.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		n, err := unix.Poll(fds, 0)
		hup = err == nil && n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR|unix.POLLNVAL) != 0
	})
	if cerr != nil || hup {
		p.die(fmt.Errorf("%w: %s (pid %d) hung up its nvlink socket", transfer.ErrPeerDead, p.desc.Name, p.desc.PID))
		return p.err()
	}
	return nil
}

// readLoop receives map replies (with their fds) and revocations until the
// connection ends, then marks the peer dead and releases its mappings.
func (p *peer) readLoop() {
	buf := make([]byte, maxPacket+1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	var why error
	for {
		n, oobn, flags, _, err := p.conn.ReadMsgUnix(buf, oob)
		if err == nil && n == 0 {
			err = errors.New("EOF")
		}
		if err != nil {
			why = fmt.Errorf("%w: nvlink connection to %s (pid %d) ended: %v", transfer.ErrPeerDead, p.desc.Name, p.desc.PID, err)
			break
		}
		fd, ferr := unixfd.TakeFD(oob[:oobn], flags)
		pk, err := decodePacket(buf[:n])
		if err == nil && ferr != nil {
			err = ferr
		}
		if err != nil {
			if fd >= 0 {
				unix.Close(fd)
			}
			why = fmt.Errorf("%w: nvlink: protocol error from %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
			break
		}
		switch pk.Type {
		case typeMapReply:
			// Sent under rmu (never blocks: one reply per buffered
			// channel), so a waiter that gave up and removed itself
			// either finds the reply in its channel or never gets it.
			p.rmu.Lock()
			ch := p.waiting[pk.Req]
			delete(p.waiting, pk.Req)
			if ch != nil {
				ch <- reply{p: pk, fd: fd}
			}
			p.rmu.Unlock()
			if ch == nil && fd >= 0 {
				unix.Close(fd)
			}
		case typeRevoke:
			if fd >= 0 {
				unix.Close(fd)
			}
			p.revoke(pk.Region)
		default:
			if fd >= 0 {
				unix.Close(fd)
			}
			why = fmt.Errorf("%w: nvlink: unexpected packet type %d from %s", transfer.ErrPeerDead, pk.Type, p.desc.Name)
		}
		if why != nil {
			break
		}
	}
	p.die(why)
	p.t.lg.Info("nvlink peer gone: unmapping its regions", zap.String("peer", p.desc.Name),
		zap.String("incarnation", p.desc.Incarnation), zap.Error(p.err()))
	p.shut(why)
}

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
		p.die(why)
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
	conn := p.conn
	p.mu.Unlock()
	if conn != nil {
		conn.Close()
	}
	p.rmu.Lock()
	w := p.waiting
	p.waiting = nil
	close(p.done)
	p.rmu.Unlock()
	for _, ch := range w {
		close(ch)
	}
	for _, m := range maps {
		m.release()
	}
}

// mapRegions makes sure every region in hs is mapped: it asks the serving
// side for the memfds it lacks and maps each once. A region the peer
// refuses (or sends inconsistently) stays unmapped, with the reason in
// refused; err is for what fails the whole batch (connection, ctx).
func (p *peer) mapRegions(ctx context.Context, hs []want) (refused map[uint64]string, err error) {
	p.mu.RLock()
	var need []want
	for _, h := range hs {
		if p.maps[h.ID] == nil {
			need = append(need, h)
		}
	}
	p.mu.RUnlock()
	if len(need) == 0 {
		return nil, nil
	}
	chs := make([]chan reply, len(need))
	reqs := make([]uint64, len(need))
	for i, h := range need {
		ch := make(chan reply, 1)
		p.rmu.Lock()
		if p.waiting == nil {
			p.rmu.Unlock()
			return nil, p.err()
		}
		p.nextReq++
		req := p.nextReq
		p.waiting[req] = ch
		p.rmu.Unlock()
		chs[i], reqs[i] = ch, req
		var buf [maxPacket]byte
		pk := packet{Type: typeMapReq, Req: req, Region: h.ID}
		p.wmu.Lock()
		p.conn.SetWriteDeadline(time.Now().Add(p.t.h.Timeout()))
		_, _, err := p.conn.WriteMsgUnix(pk.appendTo(buf[:0]), nil, nil)
		p.wmu.Unlock()
		if err != nil {
			p.die(fmt.Errorf("%w: nvlink: request to %s: %v", transfer.ErrPeerDead, p.desc.Name, err))
			p.conn.Close()
			return nil, p.err()
		}
	}
	var first error
	for i, h := range need {
		var r reply
		var ok bool
		select {
		case r, ok = <-chs[i]:
		case <-ctx.Done():
			p.giveUp(reqs[i], chs[i])
			if first == nil {
				first = ctx.Err()
			}
			continue
		}
		if !ok {
			if first == nil {
				first = p.err()
			}
			continue
		}
		if err := p.adopt(h, r); err != nil {
			if errors.Is(err, errClosedPeer) {
				if first == nil {
					first = p.err()
				}
				continue
			}
			if refused == nil {
				refused = map[uint64]string{}
			}
			refused[h.ID] = err.Error()
		}
	}
	return refused, first
}

var errClosedPeer = errors.New("nvlink: peer state closed")

// giveUp withdraws a map request; a reply that already arrived has its fd
// closed, and readLoop closes the fd of one that arrives later.
func (p *peer) giveUp(req uint64, ch chan reply) {
	p.rmu.Lock()
	if p.waiting != nil {
		delete(p.waiting, req)
	}
	p.rmu.Unlock()
	select {
	case r, ok := <-ch:
		if ok && r.fd >= 0 {
			unix.Close(r.fd)
		}
	default:
	}
}

// want is a region to import: its handle, the raw handle and its address.
type want struct {
	Handle
	raw  []byte
	addr uint64
	dev  int // local GPU the first batch launches on (legacy IPC is opened there)
}

// adopt imports the object of one reply, after checking it against the
// handle the descriptor published.
func (p *peer) adopt(h want, r reply) error {
	closeFD := func() {
		if r.fd >= 0 {
			unix.Close(r.fd)
			r.fd = -1
		}
	}
	defer closeFD()
	if r.p.Status != 0 {
		return fmt.Errorf("%s refused nvlink region %d: %s", p.desc.Name, h.ID, r.p.Text)
	}
	if kindOf(r.p.Kind) != h.Kind || r.p.Offset != h.Offset || r.p.Size != h.Size {
		return fmt.Errorf("nvlink: %s sent region %d as %s [%d, +%d), descriptor says %s [%d, +%d)",
			p.desc.Name, h.ID, kindOf(r.p.Kind), r.p.Offset, r.p.Size, h.Kind, h.Offset, h.Size)
	}
	if (h.Kind == KindVMMFD || h.Kind == KindHost) && r.fd < 0 {
		return fmt.Errorf("nvlink: %s sent region %d without its fd", p.desc.Name, h.ID)
	}
	m, err := p.t.importRegion(h, r.p.Key, r.fd, r.p.Flags&flagWritable != 0, r.p.Gran)
	if err != nil {
		return err
	}
	if h.Kind == KindHost {
		r.fd = -1 // owned by the mapping now
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
