package fdshare

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// ServerConfig configures a Server.
type ServerConfig struct {
	// Kind is the connection kind of the engine's handshake that issues
	// tickets, and names the socket "@mooncake-<Kind>-<incarnation>".
	Kind string
	Wire *Wire
}

// Item is what a Server hands out for an id: an fd (or none) and the
// fields of the map reply.
type Item struct {
	// FD is sent with SCM_RIGHTS (a duplicate per request); -1: none.
	// Add takes ownership: the server closes it on Remove, Close, or when
	// Add fails.
	FD int
	// Reply holds the mapReply fields the transport defines (Kind, Flags,
	// Offset, Size, Gran, Key); the server sets Type, Req and Region.
	Reply Packet
}

// Server is the serving side: it issues one-time tickets on authenticated
// engine connections, admits unix connections that present one (answering
// the proof), and answers map requests with the items' fds until the peer
// hangs up. Items are kept by id from Add until Remove or Close; removing
// one sends a revoke packet to every connected peer.
type Server struct {
	cfg  ServerConfig
	lg   *zap.Logger
	h    transfer.Host
	ln   *net.UnixListener
	sock string

	ctx    context.Context // canceled by Close
	cancel context.CancelFunc

	mu      sync.Mutex
	items   map[uint64]Item
	nextID  uint64
	tickets map[[32]byte]ticket
	conns   map[*servedConn]struct{}
	closed  bool

	wg sync.WaitGroup
}

// ticket admits one unix connection: the initiator got it on a connection
// that passed the engine's handshake, so it proved the cluster secret and
// expects this incarnation.
type ticket struct {
	proof [32]byte // what the server answers, so the initiator knows it reached us
	from  string   // the initiator's segment name, for logs
}

// ticketMsg is sent on the engine connection after the handshake.
type ticketMsg struct {
	Socket string `json:"socket"`
	Ticket []byte `json:"ticket"`
	Proof  []byte `json:"proof"`
}

// NewServer returns a server holding no items; it serves after Start.
func NewServer(cfg ServerConfig) *Server {
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{cfg: cfg, lg: zap.NewNop(), ctx: ctx, cancel: cancel,
		items: map[uint64]Item{}, tickets: map[[32]byte]ticket{}, conns: map[*servedConn]struct{}{}}
}

// Start listens on the abstract unix socket and installs the ticket
// handler for Kind. lg may be nil.
func (s *Server) Start(h transfer.Host, lg *zap.Logger) error {
	if lg != nil {
		s.lg = lg
	}
	s.h = h
	sock := "@mooncake-" + s.cfg.Kind + "-" + h.Self().Incarnation
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: sock, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("%s: listen on %s: %w", s.cfg.Kind, sock, err)
	}
	s.mu.Lock()
	s.ln, s.sock = ln, sock
	s.mu.Unlock()
	h.Handle(s.cfg.Kind, s.serveTicket)
	s.wg.Add(1)
	go s.acceptLoop()
	return nil
}

// Socket is the abstract socket's name ("" before Start).
func (s *Server) Socket() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sock
}

// Add registers an item and returns its id, unique and never reused
// within the server. It fails with transfer.ErrClosed after Close.
func (s *Server) Add(it Item) (uint64, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		if it.FD >= 0 {
			unix.Close(it.FD)
		}
		return 0, transfer.ErrClosed
	}
	s.nextID++
	id := s.nextID
	s.items[id] = it
	s.mu.Unlock()
	return id, nil
}

// Remove forgets an item, closes its fd and tells connected peers to drop
// it (best effort: a peer that does not read is disconnected).
func (s *Server) Remove(id uint64) {
	s.mu.Lock()
	it, ok := s.items[id]
	var conns []*servedConn
	if ok {
		delete(s.items, id)
		for c := range s.conns {
			conns = append(conns, c)
		}
	}
	s.mu.Unlock()
	if !ok {
		return
	}
	if it.FD >= 0 {
		unix.Close(it.FD)
	}
	for _, c := range conns {
		c.revoke(id)
	}
}

// Close stops serving: it closes the listener and every served
// connection, waits for the server's goroutines, then closes the items'
// fds. It returns the listener's close error.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	conns := s.conns
	s.conns = map[*servedConn]struct{}{}
	items := s.items
	s.items = map[uint64]Item{}
	ln := s.ln
	s.mu.Unlock()
	s.cancel()
	var err error
	if ln != nil {
		if e := ln.Close(); e != nil && !errors.Is(e, net.ErrClosed) {
			err = e
		}
	}
	for c := range conns {
		c.conn.Close()
	}
	s.wg.Wait()
	for _, it := range items {
		if it.FD >= 0 {
			unix.Close(it.FD)
		}
	}
	return err
}

// serveTicket handles an authenticated engine connection of Kind: it
// issues a one-time ticket, valid until the initiator closes this
// connection (or the engine's timeout passes).
func (s *Server) serveTicket(conn net.Conn, from transfer.Hello) {
	defer conn.Close()
	var tk [32]byte
	var tc ticket
	_, _ = rand.Read(tk[:])
	_, _ = rand.Read(tc.proof[:])
	tc.from = from.Name
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.tickets[tk] = tc
	sock := s.sock
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.tickets, tk)
		s.mu.Unlock()
	}()
	conn.SetDeadline(time.Now().Add(s.h.Timeout()))
	if err := transfer.WriteFrame(conn, ticketMsg{Socket: sock, Ticket: tk[:], Proof: tc.proof[:]}); err != nil {
		return
	}
	// The initiator closes the connection once the unix socket is set up.
	_, _ = io.Copy(io.Discard, conn)
}

func (s *Server) acceptLoop() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			s.lg.Warn("accept failed", zap.Error(err))
			select {
			case <-s.ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		sc := &servedConn{wire: s.cfg.Wire, conn: c, pid: -1, uid: -1}
		if cred, err := peerCred(c); err == nil {
			sc.pid, sc.uid = int(cred.Pid), int(cred.Uid)
		}
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			c.Close()
			return
		}
		s.conns[sc] = struct{}{}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serveConn(sc)
		}()
	}
}

// servedConn is a unix connection from an initiator.
type servedConn struct {
	wire *Wire
	conn *net.UnixConn
	wmu  sync.Mutex
	from string
	// pid and uid are the connecting process's (SO_PEERCRED; -1 unknown),
	// for the logs: the ticket, not the uid, decides admission.
	pid, uid int
}

// peerCred reads the credentials of the process at the other end.
func peerCred(c *net.UnixConn) (*unix.Ucred, error) {
	raw, err := c.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, cerr
}

func (c *servedConn) send(p *Packet, fd int) error {
	var buf [MaxPacket]byte
	b := c.wire.Append(buf[:0], p)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _, err := c.conn.WriteMsgUnix(b, oob, nil)
	return err
}

// revoke tells the initiator that an item is gone (best effort: a peer
// that does not read is closed).
func (c *servedConn) revoke(id uint64) {
	if err := c.send(&Packet{Type: TypeRevoke, Region: id}, -1); err != nil {
		c.conn.Close()
	}
}

// serveConn admits a connection with a ticket, then answers map requests
// until the initiator goes away.
func (s *Server) serveConn(c *servedConn) {
	defer func() {
		c.conn.Close()
		s.mu.Lock()
		delete(s.conns, c)
		s.mu.Unlock()
	}()
	buf := make([]byte, s.cfg.Wire.MaxPacket()+1)
	c.conn.SetReadDeadline(time.Now().Add(s.h.Timeout()))
	p, err := s.cfg.Wire.Read(c.conn, buf)
	if err != nil || p.Type != TypeHello {
		s.lg.Warn("unix connection without hello", zap.Int("pid", c.pid), zap.Int("uid", c.uid), zap.Error(err))
		return
	}
	s.mu.Lock()
	var tc ticket
	ok := false
	for k, v := range s.tickets {
		if subtle.ConstantTimeCompare(k[:], p.Key[:32]) == 1 {
			tc, ok = v, true
			delete(s.tickets, k)
			break
		}
	}
	s.mu.Unlock()
	if !ok {
		s.lg.Warn("unix connection refused: unknown or used ticket (tickets come only on connections that proved the cluster secret)",
			zap.String("incarnation", p.Text), zap.Int("pid", c.pid), zap.Int("uid", c.uid))
		_ = c.send(&Packet{Type: TypeWelcome, Status: 1, Text: "unknown or used ticket"}, -1)
		return
	}
	c.from = tc.from
	w := Packet{Type: TypeWelcome}
	copy(w.Key[:32], tc.proof[:])
	if err := c.send(&w, -1); err != nil {
		return
	}
	c.conn.SetReadDeadline(time.Time{})
	s.lg.Info("peer admitted", zap.String("peer", tc.from), zap.String("incarnation", p.Text),
		zap.Int("pid", c.pid), zap.Int("uid", c.uid))
	for {
		p, err := s.cfg.Wire.Read(c.conn, buf)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				s.lg.Debug("unix connection ended", zap.String("peer", c.from), zap.Error(err))
			}
			return
		}
		if p.Type != TypeMapReq {
			s.lg.Warn("unexpected packet", zap.String("peer", c.from), zap.Uint8("type", p.Type))
			return
		}
		if err := s.sendItem(c, p.Req, p.Region); err != nil {
			return
		}
	}
}

// StatusNotRegistered is a map reply's status for an item the server does
// not have (unregistered since the peer read the descriptor).
const StatusNotRegistered = 1

// sendItem answers one map request: the item's reply fields, with a
// duplicate of its fd (if it has one) over SCM_RIGHTS.
func (s *Server) sendItem(c *servedConn, req, id uint64) error {
	s.mu.Lock()
	it, ok := s.items[id]
	fd := -1
	var err error
	if ok && it.FD >= 0 {
		// A duplicate: Remove may close it.FD meanwhile.
		fd, err = Dup(it.FD)
	}
	s.mu.Unlock()
	r := Packet{Type: TypeMapReply, Req: req, Region: id}
	switch {
	case !ok:
		r.Status, r.Text = StatusNotRegistered, "region is not registered (unregistered since the descriptor was read?)"
		return c.send(&r, -1)
	case err != nil:
		r.Status, r.Text = 2, "dup fd: "+err.Error()
		return c.send(&r, -1)
	}
	if fd >= 0 {
		defer unix.Close(fd)
	}
	r = it.Reply
	r.Type, r.Req, r.Region = TypeMapReply, req, id
	return c.send(&r, fd)
}
