package transfer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Config configures an Engine. The zero value of every field means the
// default noted on it.
type Config struct {
	// Listen is the address the engine accepts peers on ("127.0.0.1:0").
	Listen string
	// Name is the segment name (default: the listen address, host:port).
	Name string
	// Registry stores descriptors; nil means P2P: the segment name is the
	// address and descriptors come from the peers themselves.
	Registry Registry
	// Transports in order of preference (for example nvlink, shm, tcp).
	Transports []Transport
	// Secret is the cluster secret every peer must prove before it learns
	// or gets anything, and that this engine proves to its peers. The zero
	// value means the per-user secret of this host (auth.UserDefault).
	Secret auth.Secret
	// Insecure turns peer authentication off (Secret must be zero): every
	// peer that connects is served.
	Insecure bool
	// Timeout bounds one batch (default 5s).
	Timeout    time.Duration
	Logger     *zap.Logger           // nil: no logs
	Registerer prometheus.Registerer // nil: no metrics
	// OnNotify receives notifications from peers. It runs on a connection's
	// reader goroutine: it must not block for long.
	OnNotify func(Notification)
}

// Validate reports a configuration New cannot use.
func (c *Config) Validate() error {
	if len(c.Transports) == 0 {
		return errors.New("transfer: config: at least one transport is required")
	}
	seen := map[string]bool{}
	for _, t := range c.Transports {
		if seen[t.Name()] {
			return fmt.Errorf("transfer: config: transport %s given twice", t.Name())
		}
		seen[t.Name()] = true
	}
	if c.Timeout < 0 {
		return fmt.Errorf("transfer: config: negative timeout %v", c.Timeout)
	}
	if c.Insecure && !c.Secret.IsZero() {
		return errors.New("transfer: config: Insecure with a Secret")
	}
	return nil
}

// Notification is a small message from another segment.
type Notification struct {
	From  string // the sender's segment name
	Topic string
	Data  []byte
}

// Engine is one process's transfer engine: its segment, its registered
// memory, its transports and its connections to peers.
type Engine struct {
	cfg Config
	lg  *zap.Logger
	ln  net.Listener
	m   *metrics

	mu       sync.RWMutex
	self     *Descriptor
	local    []*Region // sorted by Addr
	segs     []*segment
	byName   map[string]SegmentID
	handlers map[string]func(net.Conn, Hello)
	ctl      map[string]*ctlConn // by peer name
	closed   bool
	chosen   sync.Map // transport choices already logged

	// pending holds a token per accepted connection awaiting its proof.
	pending chan struct{}
	// refusals and busy limit the log lines of refused handshakes.
	refusals, busy limiter

	wg   sync.WaitGroup
	done chan struct{}
	// stopped is closed once Close has closed every transport: nothing
	// touches registered memory after that.
	stopped chan struct{}
	ctx     context.Context // canceled by Close
	cancel  context.CancelFunc
}

// SegmentID names an opened segment in requests.
type SegmentID int

// LocalSegment is the SegmentID of the engine's own segment (loopback
// transfers go through the same checks and transports).
const LocalSegment SegmentID = 0

// New starts an engine: it listens, starts the transports and publishes the
// segment's descriptor.
func New(ctx context.Context, cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Second
	}
	if cfg.Secret.IsZero() && !cfg.Insecure {
		s, err := auth.UserDefault()
		if err != nil {
			return nil, fmt.Errorf("transfer: no cluster secret given and the per-user one is unavailable: %w", err)
		}
		cfg.Secret = s
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("transfer: listen on %s: %w", cfg.Listen, err)
	}
	addr := ln.Addr().String()
	if cfg.Name == "" {
		cfg.Name = addr
	}
	var inc [8]byte
	_, _ = rand.Read(inc[:])
	e := &Engine{
		cfg: cfg, lg: lg.Named("transfer"), ln: ln, m: newMetrics(cfg.Registerer),
		self: &Descriptor{
			Name: cfg.Name, Incarnation: hex.EncodeToString(inc[:]), Host: LocalHostID(),
			Addr: addr, PID: os.Getpid(), Transports: map[string]json.RawMessage{},
		},
		byName:   map[string]SegmentID{},
		handlers: map[string]func(net.Conn, Hello){},
		ctl:      map[string]*ctlConn{},
		pending:  make(chan struct{}, maxPending),
		done:     make(chan struct{}),
		stopped:  make(chan struct{}),
	}
	e.ctx, e.cancel = context.WithCancel(context.Background())
	e.handlers["ctl"] = e.serveCtl
	for i, t := range cfg.Transports {
		if err := t.Start(e); err != nil {
			for _, s := range cfg.Transports[:i] {
				s.Close()
			}
			ln.Close()
			return nil, fmt.Errorf("transfer: start transport %s: %w", t.Name(), err)
		}
		e.self.Transports[t.Name()] = t.Info()
	}
	if err := e.self.Seal(cfg.Secret); err != nil {
		e.closeTransports()
		ln.Close()
		return nil, err
	}
	// Segment 0 is the engine itself.
	e.segs = append(e.segs, &segment{name: cfg.Name, desc: e.self})
	e.byName[cfg.Name] = LocalSegment
	if err := e.publish(ctx); err != nil {
		e.closeTransports()
		ln.Close()
		e.cancel()
		return nil, err
	}
	e.wg.Add(1)
	go e.acceptLoop()
	e.lg.Info("engine started", zap.String("segment", cfg.Name), zap.String("addr", addr),
		zap.Strings("transports", e.transportNames()), zap.String("incarnation", e.self.Incarnation),
		zap.Bool("p2p", cfg.Registry == nil), zap.String("auth", authMode(cfg.Secret)),
		zap.String("secret", cfg.Secret.Source()), zap.String("fingerprint", cfg.Secret.Fingerprint()))
	return e, nil
}

func (e *Engine) transportNames() []string {
	var s []string
	for _, t := range e.cfg.Transports {
		s = append(s, t.Name())
	}
	return s
}

// Name is the segment name.
func (e *Engine) Name() string { return e.cfg.Name }

// Addr is the address peers connect to.
func (e *Engine) Addr() string { return e.self.Addr }

// Incarnation is this process's incarnation id.
func (e *Engine) Incarnation() string { return e.self.Incarnation }

// Host interface.

func (e *Engine) Logger() *zap.Logger    { return e.lg }
func (e *Engine) Timeout() time.Duration { return e.cfg.Timeout }

func (e *Engine) Self() *Descriptor {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.self.Clone()
}

func (e *Engine) selfRef() *Descriptor {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.self
}

func (e *Engine) Handle(kind string, fn func(net.Conn, Hello)) {
	e.mu.Lock()
	e.handlers[kind] = fn
	e.mu.Unlock()
}

func (e *Engine) Dial(ctx context.Context, peer *Descriptor, kind string) (net.Conn, error) {
	conn, _, err := e.dialHandshake(ctx, peer.Addr, kind, peer.Incarnation, false)
	return conn, err
}

func (e *Engine) CheckLocal(addr, n uint64, need Access) (*Region, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.checkLocalLocked(addr, n, need)
}

// HoldLocal is CheckLocal that also holds the region until its Release:
// UnregisterMemory waits for every hold.
func (e *Engine) HoldLocal(addr, n uint64, need Access) (*Region, error) {
	e.mu.RLock()
	defer e.mu.RUnlock()
	r, err := e.checkLocalLocked(addr, n, need)
	if err == nil {
		r.holds.Add(1)
	}
	return r, err
}

func (e *Engine) checkLocalLocked(addr, n uint64, need Access) (*Region, error) {
	if n == 0 || addr+n < addr {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds, Detail: "empty or wrapping range"}
	}
	i := sort.Search(len(e.local), func(i int) bool { return e.local[i].End() > addr })
	if i == len(e.local) || e.local[i].Addr > addr {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds, Detail: "not in any local registered region"}
	}
	r := e.local[i]
	if addr+n > r.End() {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrOutOfBounds,
			Detail: fmt.Sprintf("crosses the end of local region [%#x, %#x)", r.Addr, r.End())}
	}
	if r.Access&need != need {
		return nil, &RangeError{Addr: addr, Len: n, Err: ErrAccessDenied,
			Detail: fmt.Sprintf("local region grants %v, request needs %v", r.Access, need)}
	}
	return r, nil
}

func (e *Engine) acceptLoop() {
	defer e.wg.Done()
	for {
		conn, err := e.ln.Accept()
		if err != nil {
			select {
			case <-e.done:
				return
			default:
			}
			e.lg.Warn("accept failed", zap.Error(err))
			time.Sleep(10 * time.Millisecond)
			continue
		}
		select {
		case e.pending <- struct{}{}:
		default:
			// Too many connections await their proof: refuse this one at
			// once, before it costs anything.
			refuseBusy(conn)
			e.m.handshakes.WithLabelValues("busy").Inc()
			if ok, dropped := e.busy.allow(time.Now(), time.Second); ok {
				e.lg.Warn("connection refused: too many connections await authentication",
					zap.String("remote", conn.RemoteAddr().String()), zap.Int("pending", maxPending),
					zap.Int("refused_since_last_log", dropped))
			}
			continue
		}
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			e.serveConn(conn)
		}()
	}
}

// serveConn runs the handshake of an accepted connection (holding one of
// the pending tokens until the verdict), then hands it to its kind's
// handler.
func (e *Engine) serveConn(conn net.Conn) {
	// Close the connection when the engine closes, so neither a handshake
	// nor a handler outlives it.
	stop := context.AfterFunc(e.ctx, func() { conn.Close() })
	defer stop()
	conn.SetDeadline(time.Now().Add(proofTime))
	h, err := e.serverHandshake(conn)
	<-e.pending
	if err != nil {
		result := "error"
		var he *handshakeError
		if errors.As(err, &he) {
			result = he.result
		}
		e.m.handshakes.WithLabelValues(result).Inc()
		conn.Close()
		if ok, dropped := e.refusals.allow(time.Now(), 100*time.Millisecond); ok {
			msg := "handshake failed"
			if result == "auth_failed" {
				msg = "authentication failed"
			}
			e.lg.Warn(msg, zap.String("remote", conn.RemoteAddr().String()), zap.String("peer", h.Name),
				zap.Error(err), zap.Int("refused_since_last_log", dropped))
		}
		return
	}
	e.m.handshakes.WithLabelValues("accepted").Inc()
	conn.SetDeadline(time.Time{})
	e.mu.RLock()
	fn := e.handlers[h.Kind]
	e.mu.RUnlock()
	fn(conn, h)
}

// publish writes the descriptor to the registry (nothing in P2P mode).
func (e *Engine) publish(ctx context.Context) error {
	if e.cfg.Registry == nil {
		return nil
	}
	d := e.Self()
	if err := e.cfg.Registry.Put(ctx, d); err != nil {
		return &OpError{Op: "publish", Segment: d.Name, Err: err}
	}
	return nil
}

func (e *Engine) closeTransports() {
	for _, t := range e.cfg.Transports {
		if err := t.Close(); err != nil {
			e.lg.Warn("transport close", zap.String("transport", t.Name()), zap.Error(err))
		}
	}
}

// Close stops accepting peers, removes the descriptor from the registry,
// closes connections and transports, and waits for every goroutine. Order:
// registry entry, listener, control connections, transports, handlers.
func (e *Engine) Close() error {
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return nil
	}
	e.closed = true
	ctls := e.ctl
	e.ctl = map[string]*ctlConn{}
	e.mu.Unlock()
	var err error
	if e.cfg.Registry != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if derr := e.cfg.Registry.Delete(ctx, e.cfg.Name); derr != nil {
			e.lg.Warn("registry delete", zap.Error(derr))
		}
		cancel()
	}
	close(e.done)
	e.cancel()
	err = e.ln.Close()
	for _, c := range ctls {
		c.close(ErrClosed)
	}
	e.closeTransports()
	e.wg.Wait()
	close(e.stopped)
	e.lg.Info("engine closed", zap.String("segment", e.cfg.Name))
	return err
}
