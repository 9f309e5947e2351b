package shm

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

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// peer is the initiator's state for one peer incarnation: the unix
// connection (its liveness) and the mapped regions.
type peer struct {
	t    *Transport
	desc *transfer.Descriptor

	connecting chan struct{} // a one-slot lock around connect

	// mu is held shared by copies and exclusively to change or unmap
	// mappings, so no copy runs on memory being unmapped.
	mu     sync.RWMutex
	conn   *net.UnixConn
	raw    syscall.RawConn
	maps   map[uint64]*mapping
	closed bool // shut: mappings are gone

	dead    atomic.Bool
	deadErr atomic.Pointer[error]

	wmu     sync.Mutex // serializes writes on conn
	rmu     sync.Mutex
	nextReq uint64
	waiting map[uint64]chan reply
	done    chan struct{} // closed when the connection ends
}

type mapping struct {
	mem      *transfer.HostMemory
	off      uint64 // the region's offset in the memfd (= in mem)
	size     uint64
	writable bool
}

type reply struct {
	p  packet
	fd int
}

func newPeer(t *Transport, d *transfer.Descriptor) *peer {
	return &peer{t: t, desc: d, connecting: make(chan struct{}, 1), maps: map[uint64]*mapping{},
		waiting: map[uint64]chan reply{}, done: make(chan struct{})}
}

func (p *peer) connected() bool {
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
		return fmt.Errorf("shm: %s publishes no usable shm socket: %v", p.desc.Name, err)
	}
	if info.Version != protocolVersion {
		return fmt.Errorf("shm: %s speaks shm protocol %d, this process %d", p.desc.Name, info.Version, protocolVersion)
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
		return fmt.Errorf("%w: shm ticket from %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
	}
	if tk.Socket != info.Socket || len(tk.Ticket) != 32 || len(tk.Proof) != 32 {
		return fmt.Errorf("shm: bad ticket from %s (socket %q, published %q)", p.desc.Name, tk.Socket, info.Socket)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", info.Socket)
	if err != nil {
		return fmt.Errorf("%w: shm: connect to %s at %s: %v", transfer.ErrPeerDead, p.desc.Name, info.Socket, err)
	}
	uc := c.(*net.UnixConn)
	hello := packet{Type: typeHello, Text: p.t.inc}
	copy(hello.Key[:], tk.Ticket)
	var buf [maxPacket + 1]byte
	uc.SetDeadline(dl)
	if _, _, err := uc.WriteMsgUnix(hello.appendTo(buf[:0]), nil, nil); err != nil {
		uc.Close()
		return fmt.Errorf("%w: shm hello to %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
	}
	w, err := readPacket(uc, buf[:])
	if err != nil {
		uc.Close()
		return fmt.Errorf("%w: shm welcome from %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
	}
	if w.Type != typeWelcome || w.Status != 0 {
		uc.Close()
		return fmt.Errorf("shm: %s refused the connection: %s", p.desc.Name, w.Text)
	}
	if subtle.ConstantTimeCompare(w.Key[:], tk.Proof) != 1 {
		uc.Close()
		return fmt.Errorf("%w: shm: the process at %s did not prove it is %s", transfer.ErrAuth, info.Socket, p.desc.Name)
	}
	uc.SetDeadline(time.Time{})
	raw, err := uc.SyscallConn()
	if err != nil {
		uc.Close()
		return fmt.Errorf("shm: %w", err)
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
	return fmt.Errorf("%w: shm connection to %s closed", transfer.ErrPeerDead, p.desc.Name)
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
	hup := false
	cerr := p.raw.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		n, err := unix.Poll(fds, 0)
		hup = err == nil && n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR|unix.POLLNVAL) != 0
	})
	if cerr != nil || hup {
		p.die(fmt.Errorf("%w: %s (pid %d) hung up its shm socket", transfer.ErrPeerDead, p.desc.Name, p.desc.PID))
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
			why = fmt.Errorf("%w: shm connection to %s (pid %d) ended: %v", transfer.ErrPeerDead, p.desc.Name, p.desc.PID, err)
			break
		}
		fd, ferr := takeFD(oob[:oobn], flags)
		pk, err := decodePacket(buf[:n])
		if err == nil && ferr != nil {
			err = ferr
		}
		if err != nil {
			if fd >= 0 {
				unix.Close(fd)
			}
			why = fmt.Errorf("%w: shm: protocol error from %s: %v", transfer.ErrPeerDead, p.desc.Name, err)
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
			why = fmt.Errorf("%w: shm: unexpected packet type %d from %s", transfer.ErrPeerDead, pk.Type, p.desc.Name)
		}
		if why != nil {
			break
		}
	}
	p.die(why)
	p.t.lg.Info("shm peer gone: unmapping its regions", zap.String("peer", p.desc.Name),
		zap.String("incarnation", p.desc.Incarnation), zap.Error(p.err()))
	p.shut(why)
}

// takeFD returns the single fd a packet may carry (-1 if none).
func takeFD(oob []byte, flags int) (int, error) {
	if flags&unix.MSG_CTRUNC != 0 {
		closeRights(oob)
		return -1, errors.New("control data truncated")
	}
	if len(oob) == 0 {
		return -1, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return -1, err
	}
	fd := -1
	var bad error
	for _, m := range msgs {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			bad = err
			continue
		}
		for _, f := range fds {
			if fd < 0 {
				fd = f
			} else {
				unix.Close(f)
				bad = errors.New("more than one fd in a packet")
			}
		}
	}
	if bad != nil && fd >= 0 {
		unix.Close(fd)
		fd = -1
	}
	return fd, bad
}

// revoke unmaps a region the peer unregistered.
func (p *peer) revoke(id uint64) {
	p.mu.Lock()
	m := p.maps[id]
	delete(p.maps, id)
	p.mu.Unlock()
	if m != nil {
		m.mem.Close()
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
		m.mem.Close()
	}
}

// mapRegions makes sure every region in hs is mapped: it asks the serving
// side for the memfds it lacks and maps each once. A region the peer
// refuses (or sends inconsistently) stays unmapped, with the reason in
// refused; err is for what fails the whole batch (connection, ctx).
func (p *peer) mapRegions(ctx context.Context, hs []Handle) (refused map[uint64]string, err error) {
	p.mu.RLock()
	var need []Handle
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
			p.die(fmt.Errorf("%w: shm: request to %s: %v", transfer.ErrPeerDead, p.desc.Name, err))
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

var errClosedPeer = errors.New("shm: peer state closed")

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

// adopt maps the memfd of one reply, after checking it against the handle
// the descriptor published.
func (p *peer) adopt(h Handle, r reply) error {
	if r.p.Status != 0 {
		if r.fd >= 0 {
			unix.Close(r.fd)
		}
		return fmt.Errorf("%s refused shm region %d: %s", p.desc.Name, h.ID, r.p.Text)
	}
	if r.fd < 0 {
		return fmt.Errorf("shm: %s sent region %d without its memfd", p.desc.Name, h.ID)
	}
	if r.p.Offset != h.Offset || r.p.Size != h.Size {
		unix.Close(r.fd)
		return fmt.Errorf("shm: %s sent region %d as [%d, +%d) of its memfd, descriptor says [%d, +%d)",
			p.desc.Name, h.ID, r.p.Offset, r.p.Size, h.Offset, h.Size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(r.fd, &st); err != nil || uint64(st.Size) < h.Offset+h.Size {
		unix.Close(r.fd)
		return fmt.Errorf("shm: memfd of region %d from %s is %d bytes, region needs %d (%v)", h.ID, p.desc.Name, st.Size, h.Offset+h.Size, err)
	}
	writable := r.p.Flags&flagWritable != 0
	mem, err := transfer.MapHost(r.fd, int64(h.Offset+h.Size), writable)
	if err != nil {
		unix.Close(r.fd)
		return err
	}
	m := &mapping{mem: mem, off: h.Offset, size: h.Size, writable: writable}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		mem.Close()
		return errClosedPeer
	}
	if p.maps[h.ID] != nil { // another batch mapped it meanwhile
		p.mu.Unlock()
		mem.Close()
		return nil
	}
	p.maps[h.ID] = m
	p.mu.Unlock()
	return nil
}
