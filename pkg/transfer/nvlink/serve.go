package nvlink

import (
	"crypto/rand"
	"crypto/subtle"
	"errors"
	"io"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/internal/unixfd"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// ticket admits one unix connection: the initiator got it on a connection
// that passed the engine's handshake, so it knows the cluster token and
// expects this incarnation.
type ticket struct {
	proof [32]byte // what the server answers, so the initiator knows it reached us
	from  string   // the initiator's segment name, for logs
}

// ticketMsg is sent on the "nvlink" connection after the engine's handshake.
type ticketMsg struct {
	Socket string `json:"socket"`
	Ticket []byte `json:"ticket"`
	Proof  []byte `json:"proof"`
}

// serveTicket handles an authenticated "nvlink" connection: it issues a
// one-time ticket, valid until the initiator closes this connection (or the
// engine's timeout passes).
func (t *Transport) serveTicket(conn net.Conn, from transfer.Hello) {
	defer conn.Close()
	var tk [32]byte
	var tc ticket
	_, _ = rand.Read(tk[:])
	_, _ = rand.Read(tc.proof[:])
	tc.from = from.Name
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return
	}
	t.tickets[tk] = tc
	t.mu.Unlock()
	defer func() {
		t.mu.Lock()
		delete(t.tickets, tk)
		t.mu.Unlock()
	}()
	conn.SetDeadline(time.Now().Add(t.h.Timeout()))
	if err := transfer.WriteFrame(conn, ticketMsg{Socket: t.sock, Ticket: tk[:], Proof: tc.proof[:]}); err != nil {
		return
	}
	// The initiator closes the connection once the unix socket is set up.
	_, _ = io.Copy(io.Discard, conn)
}

func (t *Transport) acceptLoop() {
	defer t.wg.Done()
	for {
		c, err := t.ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			t.lg.Warn("accept failed", zap.Error(err))
			select {
			case <-t.ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
			continue
		}
		sc := &servedConn{conn: c}
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			c.Close()
			return
		}
		t.conns[sc] = struct{}{}
		t.wg.Add(1)
		t.mu.Unlock()
		go func() {
			defer t.wg.Done()
			t.serveConn(sc)
		}()
	}
}

// servedConn is a unix connection from an initiator.
type servedConn struct {
	conn *net.UnixConn
	wmu  sync.Mutex
	from string
}

func (c *servedConn) send(p *packet, fd int) error {
	var buf [maxPacket]byte
	b := p.appendTo(buf[:0])
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

// revoke tells the initiator that a region is gone (best effort: a peer
// that does not read is closed).
func (c *servedConn) revoke(id uint64) {
	if err := c.send(&packet{Type: typeRevoke, Region: id}, -1); err != nil {
		c.conn.Close()
	}
}

// serveConn admits a connection with a ticket, then answers map requests
// until the initiator goes away.
func (t *Transport) serveConn(c *servedConn) {
	defer func() {
		c.conn.Close()
		t.mu.Lock()
		delete(t.conns, c)
		t.mu.Unlock()
	}()
	buf := make([]byte, maxPacket+1)
	c.conn.SetReadDeadline(time.Now().Add(t.h.Timeout()))
	p, err := readPacket(c.conn, buf)
	if err != nil || p.Type != typeHello {
		t.lg.Warn("unix connection without hello", zap.Error(err))
		return
	}
	t.mu.Lock()
	var tc ticket
	ok := false
	for k, v := range t.tickets {
		if subtle.ConstantTimeCompare(k[:], p.Key[:32]) == 1 {
			tc, ok = v, true
			delete(t.tickets, k)
			break
		}
	}
	t.mu.Unlock()
	if !ok {
		t.lg.Warn("unix connection refused: unknown ticket", zap.String("peer", p.Text))
		_ = c.send(&packet{Type: typeWelcome, Status: 1, Text: "unknown or used ticket"}, -1)
		return
	}
	c.from = tc.from
	w := packet{Type: typeWelcome}
	copy(w.Key[:], tc.proof[:])
	if err := c.send(&w, -1); err != nil {
		return
	}
	c.conn.SetReadDeadline(time.Time{})
	t.lg.Debug("peer connected", zap.String("peer", tc.from), zap.String("incarnation", p.Text))
	for {
		p, err := readPacket(c.conn, buf)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				t.lg.Debug("unix connection ended", zap.String("peer", c.from), zap.Error(err))
			}
			return
		}
		if p.Type != typeMapReq {
			t.lg.Warn("unexpected packet", zap.String("peer", c.from), zap.Uint8("type", p.Type))
			return
		}
		if err := t.sendRegion(c, p.Req, p.Region); err != nil {
			return
		}
	}
}

// sendRegion answers one map request: the region's fd (vmm-fd, host) with
// SCM_RIGHTS, or its IPC handle in the reply.
func (t *Transport) sendRegion(c *servedConn, req, id uint64) error {
	t.mu.Lock()
	s := t.regions[id]
	fd := -1
	var err error
	if s != nil && s.fd >= 0 {
		// A duplicate: UnregisterRegion may close s.fd meanwhile.
		fd, err = unixfd.Dup(s.fd)
	}
	var r packet
	if s != nil {
		r = packet{Type: typeMapReply, Req: req, Region: id, Kind: s.wireKind(), Offset: s.off, Size: s.size, Gran: s.gran, Key: s.key}
		if s.writable {
			r.Flags = flagWritable
		}
	}
	t.mu.Unlock()
	switch {
	case s == nil:
		r = packet{Type: typeMapReply, Req: req, Region: id, Status: 1, Text: "region is not registered (unregistered since the descriptor was read?)"}
		return c.send(&r, -1)
	case err != nil:
		r = packet{Type: typeMapReply, Req: req, Region: id, Status: 2, Text: "dup fd: " + err.Error()}
		return c.send(&r, -1)
	}
	if fd >= 0 {
		defer unix.Close(fd)
	}
	return c.send(&r, fd)
}

// readPacket reads one packet that carries no fds.
func readPacket(c *net.UnixConn, buf []byte) (packet, error) {
	var oob [64]byte
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob[:])
	if err != nil {
		return packet{}, err
	}
	if n == 0 {
		return packet{}, io.EOF
	}
	if oobn > 0 {
		unixfd.CloseRights(oob[:oobn])
		return packet{}, errors.New("nvlink: unexpected fds")
	}
	return decodePacket(buf[:n])
}
