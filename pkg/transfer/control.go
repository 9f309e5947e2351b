package transfer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
)

// The control connection ("ctl" kind) carries small request/response
// messages between engines: probes and notifications. One per peer,
// multiplexed by id; frames as in the handshake.
type ctlMsg struct {
	ID    uint64 `json:"id"`
	Op    string `json:"op,omitempty"` // probe, notify
	Topic string `json:"topic,omitempty"`
	Data  []byte `json:"data,omitempty"`
	Err   string `json:"err,omitempty"`
	Inc   string `json:"inc,omitempty"`
}

type ctlConn struct {
	name, inc string
	conn      net.Conn
	wmu       sync.Mutex

	mu      sync.Mutex
	next    uint64
	waiting map[uint64]chan ctlMsg
	err     error
	done    chan struct{}
}

func (e *Engine) adoptCtl(d *Descriptor, conn net.Conn) *ctlConn {
	c := &ctlConn{name: d.Name, inc: d.Incarnation, conn: conn, waiting: map[uint64]chan ctlMsg{}, done: make(chan struct{})}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		conn.Close()
		c.err = ErrClosed
		close(c.done)
		return c
	}
	old := e.ctl[d.Name]
	if old != nil && old.inc == d.Incarnation && old.alive() {
		// Another caller dialed the same peer at the same time and won:
		// use its connection (closing it would fail that caller's calls).
		e.mu.Unlock()
		conn.Close()
		return old
	}
	e.ctl[d.Name] = c
	e.wg.Add(1)
	e.mu.Unlock()
	if old != nil {
		old.close(ErrPeerRestarted)
	}
	go func() {
		defer e.wg.Done()
		c.readLoop()
		e.mu.Lock()
		if e.ctl[c.name] == c {
			delete(e.ctl, c.name)
		}
		e.mu.Unlock()
	}()
	return c
}

func (c *ctlConn) readLoop() {
	for {
		var m ctlMsg
		if err := ReadFrame(c.conn, &m); err != nil {
			c.close(fmt.Errorf("%w: control connection to %s lost: %v", ErrPeerDead, c.name, err))
			return
		}
		c.mu.Lock()
		ch := c.waiting[m.ID]
		delete(c.waiting, m.ID)
		c.mu.Unlock()
		if ch != nil {
			ch <- m
		}
	}
}

func (c *ctlConn) alive() bool {
	select {
	case <-c.done:
		return false
	default:
		return true
	}
}

func (c *ctlConn) close(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	w := c.waiting
	c.waiting = nil
	close(c.done)
	c.mu.Unlock()
	c.conn.Close()
	for _, ch := range w {
		close(ch)
	}
}

func (c *ctlConn) call(ctx context.Context, m ctlMsg) (ctlMsg, error) {
	ch := make(chan ctlMsg, 1)
	c.mu.Lock()
	if c.err != nil {
		err := c.err
		c.mu.Unlock()
		return ctlMsg{}, err
	}
	c.next++
	m.ID = c.next
	c.waiting[m.ID] = ch
	c.mu.Unlock()
	c.wmu.Lock()
	if dl, ok := ctx.Deadline(); ok {
		c.conn.SetWriteDeadline(dl)
	}
	err := WriteFrame(c.conn, m)
	c.wmu.Unlock()
	if err != nil {
		c.close(fmt.Errorf("%w: control connection to %s: %v", ErrPeerDead, c.name, err))
		return ctlMsg{}, c.err
	}
	select {
	case r, ok := <-ch:
		if !ok {
			return ctlMsg{}, c.err
		}
		if r.Err != "" {
			return r, errors.New(r.Err)
		}
		return r, nil
	case <-ctx.Done():
		c.mu.Lock()
		if c.waiting != nil {
			delete(c.waiting, m.ID)
		}
		c.mu.Unlock()
		return ctlMsg{}, ctxErr(ctx, "control call "+m.Op+" to "+c.name)
	}
}

// ctxErr normalises a context error: errors.Is(err, context.Canceled) or
// ErrTimeout (and context.DeadlineExceeded) hold.
func ctxErr(ctx context.Context, what string) error {
	if errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return fmt.Errorf("%w: %s: %w", ErrTimeout, what, context.DeadlineExceeded)
	}
	return fmt.Errorf("%s: %w", what, ctx.Err())
}

// ctlFor returns the control connection to an opened segment, dialing it
// if needed.
func (e *Engine) ctlFor(ctx context.Context, s *segment) (*ctlConn, *Descriptor, error) {
	d, _, _ := s.snapshot()
	e.mu.RLock()
	c := e.ctl[d.Name]
	e.mu.RUnlock()
	if c != nil && c.inc == d.Incarnation && c.alive() {
		return c, d, nil
	}
	conn, nd, err := e.dialHandshake(ctx, d.Addr, "ctl", "", true)
	if err != nil {
		s.markStale()
		return nil, d, err
	}
	if nd.Incarnation != d.Incarnation {
		e.lg.Warn("peer restarted", zap.String("segment", d.Name), zap.String("old", d.Incarnation), zap.String("new", nd.Incarnation))
		e.dropPeer(d)
		s.setDesc(nd)
	}
	return e.adoptCtl(nd, conn), nd, nil
}

func (e *Engine) segByName(ctx context.Context, name string) (*segment, error) {
	id, err := e.OpenSegmentCached(ctx, name)
	if err != nil {
		return nil, err
	}
	return e.segAt(id), nil
}

// OpenSegmentCached is OpenSegment without refreshing an already opened
// segment.
func (e *Engine) OpenSegmentCached(ctx context.Context, name string) (SegmentID, error) {
	e.mu.RLock()
	id, ok := e.byName[name]
	e.mu.RUnlock()
	if ok {
		return id, nil
	}
	return e.OpenSegment(ctx, name)
}

func (e *Engine) boundCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, e.cfg.Timeout)
}

// Probe checks that a peer segment is alive and still the incarnation last
// seen; a restarted peer gives an error wrapping ErrPeerRestarted (and its
// new descriptor is adopted).
func (e *Engine) Probe(ctx context.Context, name string) error {
	ctx, cancel := e.boundCtx(ctx)
	defer cancel()
	s, err := e.segByName(ctx, name)
	if err != nil {
		return err
	}
	old, _, _ := s.snapshot()
	c, d, err := e.ctlFor(ctx, s)
	if err != nil {
		return &OpError{Op: "probe", Segment: name, Err: err}
	}
	r, err := c.call(ctx, ctlMsg{Op: "probe"})
	if err != nil {
		s.markStale()
		return &OpError{Op: "probe", Segment: name, Err: err}
	}
	if r.Inc != old.Incarnation || d.Incarnation != old.Incarnation {
		return &OpError{Op: "probe", Segment: name, Err: fmt.Errorf("%w: was %s, now %s", ErrPeerRestarted, old.Incarnation, r.Inc)}
	}
	return nil
}

// Notify delivers a small message to a peer segment's OnNotify handler and
// waits for its acknowledgement.
func (e *Engine) Notify(ctx context.Context, name, topic string, data []byte) error {
	ctx, cancel := e.boundCtx(ctx)
	defer cancel()
	s, err := e.segByName(ctx, name)
	if err != nil {
		return err
	}
	c, _, err := e.ctlFor(ctx, s)
	if err != nil {
		return &OpError{Op: "notify", Segment: name, Err: err}
	}
	if _, err := c.call(ctx, ctlMsg{Op: "notify", Topic: topic, Data: data}); err != nil {
		return &OpError{Op: "notify", Segment: name, Err: err}
	}
	e.m.notifies.WithLabelValues("sent").Inc()
	return nil
}

func (e *Engine) serveCtl(conn net.Conn, h Hello) {
	defer conn.Close()
	var wmu sync.Mutex
	for {
		var m ctlMsg
		if err := ReadFrame(conn, &m); err != nil {
			return
		}
		r := ctlMsg{ID: m.ID, Inc: e.selfRef().Incarnation}
		switch m.Op {
		case "probe":
		case "notify":
			e.m.notifies.WithLabelValues("received").Inc()
			if e.cfg.OnNotify != nil {
				e.cfg.OnNotify(Notification{From: h.Name, Topic: m.Topic, Data: m.Data})
			}
		default:
			r.Err = "unknown control op " + m.Op
		}
		wmu.Lock()
		conn.SetWriteDeadline(time.Now().Add(e.cfg.Timeout))
		err := WriteFrame(conn, r)
		wmu.Unlock()
		if err != nil {
			return
		}
	}
}
