package fdshare

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

// ErrShut is what a Fetch adopt callback returns when the caller's state
// for the peer was shut meanwhile; Fetch then reports the peer's error
// (Err) instead of a refusal.
var ErrShut = errors.New("fdshare: peer state closed")

// ClientConfig configures a Client.
type ClientConfig struct {
	// Kind is the connection kind of the engine's handshake, the key of
	// the peer's segment-level entry in Transports, and the prefix of
	// errors and logs.
	Kind string
	// Version is the protocol version the peer must publish.
	Version int
	Wire    *Wire
	Host    transfer.Host
	// Self is this engine's incarnation, sent in hello.
	Self string
	// Peer is the peer incarnation's descriptor.
	Peer   *transfer.Descriptor
	Logger *zap.Logger // nil: no logs
	// Go runs the connection's reader on a goroutine its owner waits for
	// at Close; false means the owner is closed.
	Go func(fn func()) bool
	// OnRevoke is called (on the reader) when the peer removed an item.
	OnRevoke func(id uint64)
	// OnGone is called (on the reader) once the connection ended, after
	// the client was marked dead with why. It is expected to release what
	// came from the peer and call Close.
	OnGone func(why error)
}

// Client is the initiator's connection to one peer incarnation: it
// connects once with a ticket and checks the peer's proof, fetches items
// (their fds) by id, and carries the peer's liveness: the connection's end
// (EOF, hang-up) marks the peer dead.
type Client struct {
	cfg ClientConfig
	lg  *zap.Logger

	connecting chan struct{} // a one-slot lock around Connect

	mu     sync.Mutex
	conn   *net.UnixConn
	raw    syscall.RawConn
	closed bool

	dead    atomic.Bool
	deadErr atomic.Pointer[error]

	wmu     sync.Mutex // serializes writes on conn
	rmu     sync.Mutex
	nextReq uint64
	waiting map[uint64]chan Reply
	done    chan struct{} // closed by Close
}

// Reply is a map reply and the fd it carried (-1 if none). The receiver
// owns the fd.
type Reply struct {
	Packet
	FD int
}

// NewClient returns an unconnected client (no I/O).
func NewClient(cfg ClientConfig) *Client {
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	return &Client{cfg: cfg, lg: lg, connecting: make(chan struct{}, 1),
		waiting: map[uint64]chan Reply{}, done: make(chan struct{})}
}

// Connected reports whether Connect succeeded (it stays true after the
// connection ends: see Alive).
func (c *Client) Connected() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.conn != nil
}

// Done is closed by Close.
func (c *Client) Done() <-chan struct{} { return c.done }

// Connect sets up the unix connection once: ticket through the engine's
// handshake, hello with the ticket, the server's proof checked; then it
// starts the reader.
func (c *Client) Connect(ctx context.Context) error {
	select {
	case c.connecting <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-c.connecting }()
	c.mu.Lock()
	conn, closed := c.conn, c.closed
	c.mu.Unlock()
	if conn != nil {
		return nil
	}
	if closed {
		return c.Err()
	}
	kind, name := c.cfg.Kind, c.cfg.Peer.Name
	var info struct {
		Socket  string `json:"socket"`
		Version int    `json:"version"`
	}
	if err := json.Unmarshal(c.cfg.Peer.Transports[kind], &info); err != nil || info.Socket == "" {
		return fmt.Errorf("%s: %s publishes no usable %s socket: %v", kind, name, kind, err)
	}
	if info.Version != c.cfg.Version {
		return fmt.Errorf("%s: %s speaks %s protocol %d, this process %d", kind, name, kind, info.Version, c.cfg.Version)
	}
	tc, err := c.cfg.Host.Dial(ctx, c.cfg.Peer, kind)
	if err != nil {
		return err
	}
	defer tc.Close()
	dl := time.Now().Add(c.cfg.Host.Timeout())
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	tc.SetDeadline(dl)
	var tk ticketMsg
	if err := transfer.ReadFrame(tc, &tk); err != nil {
		return fmt.Errorf("%w: %s ticket from %s: %v", transfer.ErrPeerDead, kind, name, err)
	}
	if tk.Socket != info.Socket || len(tk.Ticket) != 32 || len(tk.Proof) != 32 {
		return fmt.Errorf("%s: bad ticket from %s (socket %q, published %q)", kind, name, tk.Socket, info.Socket)
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unixpacket", info.Socket)
	if err != nil {
		return fmt.Errorf("%w: %s: connect to %s at %s: %v", transfer.ErrPeerDead, kind, name, info.Socket, err)
	}
	uc := nc.(*net.UnixConn)
	hello := Packet{Type: TypeHello, Text: c.cfg.Self}
	copy(hello.Key[:32], tk.Ticket)
	var buf [MaxPacket + 1]byte
	uc.SetDeadline(dl)
	if _, _, err := uc.WriteMsgUnix(c.cfg.Wire.Append(buf[:0], &hello), nil, nil); err != nil {
		uc.Close()
		return fmt.Errorf("%w: %s hello to %s: %v", transfer.ErrPeerDead, kind, name, err)
	}
	w, err := c.cfg.Wire.Read(uc, buf[:c.cfg.Wire.MaxPacket()+1])
	if err != nil {
		uc.Close()
		return fmt.Errorf("%w: %s welcome from %s: %v", transfer.ErrPeerDead, kind, name, err)
	}
	if w.Type != TypeWelcome || w.Status != 0 {
		uc.Close()
		return fmt.Errorf("%s: %s refused the connection: %s", kind, name, w.Text)
	}
	if subtle.ConstantTimeCompare(w.Key[:32], tk.Proof) != 1 {
		uc.Close()
		return fmt.Errorf("%w: %s: the process at %s did not prove it is %s", transfer.ErrAuth, kind, info.Socket, name)
	}
	uc.SetDeadline(time.Time{})
	raw, err := uc.SyscallConn()
	if err != nil {
		uc.Close()
		return fmt.Errorf("%s: %w", kind, err)
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		uc.Close()
		return c.Err()
	}
	c.conn, c.raw = uc, raw
	c.mu.Unlock()
	if !c.cfg.Go(c.readLoop) {
		c.Die(transfer.ErrClosed)
		c.cfg.OnGone(transfer.ErrClosed)
		return transfer.ErrClosed
	}
	c.lg.Debug("connected", zap.String("peer", name), zap.String("incarnation", c.cfg.Peer.Incarnation))
	return nil
}

// Err is why the peer can no longer be used.
func (c *Client) Err() error {
	if e := c.deadErr.Load(); e != nil {
		return *e
	}
	return fmt.Errorf("%w: %s connection to %s closed", transfer.ErrPeerDead, c.cfg.Kind, c.cfg.Peer.Name)
}

// Die records the first reason the peer is gone.
func (c *Client) Die(err error) {
	c.deadErr.CompareAndSwap(nil, &err)
	c.dead.Store(true)
}

// Dead reports whether Die was called.
func (c *Client) Dead() bool { return c.dead.Load() }

// Alive is the cheap liveness check around a batch: the reader's flag,
// then a zero-timeout poll of the socket for a hang-up. A client that
// never connected is alive until Die.
func (c *Client) Alive() error {
	if c.dead.Load() {
		return c.Err()
	}
	c.mu.Lock()
	raw := c.raw
	c.mu.Unlock()
	if raw == nil {
		return nil
	}
	hup := false
	cerr := raw.Control(func(fd uintptr) {
		fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
		n, err := unix.Poll(fds, 0)
		hup = err == nil && n > 0 && fds[0].Revents&(unix.POLLHUP|unix.POLLRDHUP|unix.POLLERR|unix.POLLNVAL) != 0
	})
	if cerr != nil || hup {
		c.Die(fmt.Errorf("%w: %s (pid %d) hung up its %s socket", transfer.ErrPeerDead, c.cfg.Peer.Name, c.cfg.Peer.PID, c.cfg.Kind))
		return c.Err()
	}
	return nil
}

// Close closes the connection (if any) and fails the fetches waiting for
// a reply. It does not mark the client dead: call Die first.
func (c *Client) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	conn := c.conn
	c.mu.Unlock()
	if conn != nil {
		conn.Close()
	}
	c.rmu.Lock()
	w := c.waiting
	c.waiting = nil
	close(c.done)
	c.rmu.Unlock()
	for _, ch := range w {
		close(ch)
	}
}

// readLoop receives map replies (with their fds) and revocations until the
// connection ends, then marks the peer dead and calls OnGone.
func (c *Client) readLoop() {
	kind, name := c.cfg.Kind, c.cfg.Peer.Name
	buf := make([]byte, c.cfg.Wire.MaxPacket()+1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	var why error
	for {
		n, oobn, flags, _, err := c.conn.ReadMsgUnix(buf, oob)
		if err == nil && n == 0 {
			err = errors.New("EOF")
		}
		if err != nil {
			why = fmt.Errorf("%w: %s connection to %s (pid %d) ended: %v", transfer.ErrPeerDead, kind, name, c.cfg.Peer.PID, err)
			break
		}
		fd, ferr := TakeFD(oob[:oobn], flags)
		pk, err := c.cfg.Wire.Decode(buf[:n])
		if err == nil && ferr != nil {
			err = ferr
		}
		if err != nil {
			if fd >= 0 {
				unix.Close(fd)
			}
			why = fmt.Errorf("%w: %s: protocol error from %s: %v", transfer.ErrPeerDead, kind, name, err)
			break
		}
		switch pk.Type {
		case TypeMapReply:
			// Sent under rmu (never blocks: one reply per buffered
			// channel), so a waiter that gave up and removed itself
			// either finds the reply in its channel or never gets it.
			c.rmu.Lock()
			ch := c.waiting[pk.Req]
			delete(c.waiting, pk.Req)
			if ch != nil {
				ch <- Reply{Packet: pk, FD: fd}
			}
			c.rmu.Unlock()
			if ch == nil && fd >= 0 {
				unix.Close(fd)
			}
		case TypeRevoke:
			if fd >= 0 {
				unix.Close(fd)
			}
			c.cfg.OnRevoke(pk.Region)
		default:
			if fd >= 0 {
				unix.Close(fd)
			}
			why = fmt.Errorf("%w: %s: unexpected packet type %d from %s", transfer.ErrPeerDead, kind, pk.Type, name)
		}
		if why != nil {
			break
		}
	}
	c.Die(why)
	c.lg.Info(kind+" peer gone: unmapping its regions", zap.String("peer", name),
		zap.String("incarnation", c.cfg.Peer.Incarnation), zap.Error(c.Err()))
	c.cfg.OnGone(why)
}

// Fetch asks the peer for each item of ids and calls adopt with each
// reply, in order (adopt owns the reply's fd). An item whose adopt fails
// (the peer refused it, or sent something inconsistent) is returned in
// refused with adopt's error; err is for what fails the whole batch
// (connection, ctx, ErrShut from adopt). The client must be connected.
func (c *Client) Fetch(ctx context.Context, ids []uint64, adopt func(i int, r Reply) error) (refused map[uint64]error, err error) {
	chs := make([]chan Reply, len(ids))
	reqs := make([]uint64, len(ids))
	for i, id := range ids {
		ch := make(chan Reply, 1)
		c.rmu.Lock()
		if c.waiting == nil {
			c.rmu.Unlock()
			return nil, c.Err()
		}
		c.nextReq++
		req := c.nextReq
		c.waiting[req] = ch
		c.rmu.Unlock()
		chs[i], reqs[i] = ch, req
		var buf [MaxPacket]byte
		pk := Packet{Type: TypeMapReq, Req: req, Region: id}
		c.wmu.Lock()
		c.conn.SetWriteDeadline(time.Now().Add(c.cfg.Host.Timeout()))
		_, _, err := c.conn.WriteMsgUnix(c.cfg.Wire.Append(buf[:0], &pk), nil, nil)
		c.wmu.Unlock()
		if err != nil {
			c.Die(fmt.Errorf("%w: %s: request to %s: %v", transfer.ErrPeerDead, c.cfg.Kind, c.cfg.Peer.Name, err))
			c.conn.Close()
			return nil, c.Err()
		}
	}
	var first error
	for i, id := range ids {
		var r Reply
		var ok bool
		select {
		case r, ok = <-chs[i]:
		case <-ctx.Done():
			c.giveUp(reqs[i], chs[i])
			if first == nil {
				first = ctx.Err()
			}
			continue
		}
		if !ok {
			if first == nil {
				first = c.Err()
			}
			continue
		}
		if err := adopt(i, r); err != nil {
			if errors.Is(err, ErrShut) {
				if first == nil {
					first = c.Err()
				}
				continue
			}
			if refused == nil {
				refused = map[uint64]error{}
			}
			refused[id] = err
		}
	}
	return refused, first
}

// giveUp withdraws a map request; a reply that already arrived has its fd
// closed, and readLoop closes the fd of one that arrives later.
func (c *Client) giveUp(req uint64, ch chan Reply) {
	c.rmu.Lock()
	if c.waiting != nil {
		delete(c.waiting, req)
	}
	c.rmu.Unlock()
	select {
	case r, ok := <-ch:
		if ok && r.FD >= 0 {
			unix.Close(r.FD)
		}
	default:
	}
}
