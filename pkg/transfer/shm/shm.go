// Package shm is the same-machine transport: two processes on one machine
// share memfd-backed host regions, so a transfer is a memcpy in the
// initiator.
//
// The serving side listens on an abstract unix socket named after the
// engine's incarnation ("@mooncake-shm-<incarnation>"; abstract sockets are
// per network namespace, which matches the engine's same-machine rule). An
// initiator first proves itself through the engine's handshake (h.Dial, kind
// "shm", which checks the cluster token and the incarnation) and receives a
// one-time ticket on that connection; it presents the ticket on the unix
// socket, checks the server's proof, then asks for each region's memfd,
// which comes back with SCM_RIGHTS. It maps every memfd once and caches the
// mapping per (peer incarnation, region id). The unix connection stays open:
// its end (EOF, hang-up) marks the peer dead, its mappings are dropped, and
// batches to it fail with transfer.ErrPeerDead. Protocol in
// docs/format/shm.md.
package shm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"runtime"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Name is the transport's name in descriptors, logs and metrics.
const Name = "shm"

// Config configures the shm transport. Zero values mean the defaults noted.
type Config struct {
	// Copiers is how many goroutines copy one large batch
	// (default min(4, GOMAXPROCS)).
	Copiers int
	// ParallelMin is the batch size in bytes from which copies are spread
	// over Copiers goroutines (default 1 MiB). Smaller batches whose peer is
	// already connected are copied in the caller's goroutine, inside Submit.
	ParallelMin int64
}

// Validate reports a configuration the transport cannot use.
func (c Config) Validate() error {
	if c.Copiers < 0 {
		return fmt.Errorf("shm: config: negative Copiers %d", c.Copiers)
	}
	if c.ParallelMin < 0 {
		return fmt.Errorf("shm: config: negative ParallelMin %d", c.ParallelMin)
	}
	return nil
}

// Info is the transport's segment-level entry in the descriptor.
type Info struct {
	// Socket is the abstract unix socket name ("@mooncake-shm-<incarnation>").
	Socket  string `json:"socket"`
	Version int    `json:"version"`
}

// Handle is a region's entry in the descriptor: the id to ask the serving
// side for, and where the region lies in its memfd.
type Handle struct {
	ID     uint64 `json:"id"`
	Offset uint64 `json:"offset"`
	Size   uint64 `json:"size"`
}

const protocolVersion = 1

// Transport is the shm transport. Create it with New and hand it to
// transfer.New in Config.Transports.
type Transport struct {
	cfg  Config
	h    transfer.Host
	lg   *zap.Logger
	ln   *net.UnixListener
	sock string
	inc  string

	ctx    context.Context // canceled by Close
	cancel context.CancelFunc

	mu      sync.Mutex
	regions map[uint64]*served          // serving side, by region id
	byReg   map[*transfer.Region]uint64 // region -> id
	nextID  uint64
	tickets map[[32]byte]ticket
	conns   map[*servedConn]struct{}
	peers   map[string]*peer // initiator side, by peer incarnation
	closed  bool

	wg sync.WaitGroup
	// busy counts batches being copied; when several submitters already
	// keep the cores busy, a large batch is copied in its caller too.
	busy atomic.Int32
}

var _ transfer.Transport = (*Transport)(nil)

// New returns an shm transport; it starts working when the engine calls
// Start.
func New(cfg Config) *Transport {
	if cfg.Copiers == 0 {
		cfg.Copiers = min(4, runtime.GOMAXPROCS(0))
	}
	if cfg.ParallelMin == 0 {
		cfg.ParallelMin = 1 << 20
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Transport{
		cfg: cfg, lg: zap.NewNop(), ctx: ctx, cancel: cancel,
		regions: map[uint64]*served{}, byReg: map[*transfer.Region]uint64{},
		tickets: map[[32]byte]ticket{}, conns: map[*servedConn]struct{}{}, peers: map[string]*peer{},
	}
}

// Name implements transfer.Transport.
func (t *Transport) Name() string { return Name }

// Reach implements transfer.Transport: same machine and network namespace
// only.
func (t *Transport) Reach() transfer.Reach { return transfer.ReachSameMachine }

// Start listens on the abstract unix socket and installs the ticket handler.
func (t *Transport) Start(h transfer.Host) error {
	if err := t.cfg.Validate(); err != nil {
		return err
	}
	t.h = h
	t.lg = h.Logger().Named("shm")
	t.inc = h.Self().Incarnation
	t.sock = "@mooncake-shm-" + t.inc
	ln, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: t.sock, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("shm: listen on %s: %w", t.sock, err)
	}
	t.ln = ln
	h.Handle(Name, t.serveTicket)
	t.wg.Add(1)
	go t.acceptLoop()
	return nil
}

// Info implements transfer.Transport.
func (t *Transport) Info() json.RawMessage {
	b, _ := json.Marshal(Info{Socket: t.sock, Version: protocolVersion})
	return b
}

// served is a region this process serves: its own copy of the memfd (read-only
// when peers may only read).
type served struct {
	id       uint64
	fd       int
	off      uint64
	size     uint64
	writable bool
}

// RegisterRegion accepts memfd-backed host memory only; the handle names the
// region's id and its place in the memfd.
func (t *Transport) RegisterRegion(r *transfer.Region) (json.RawMessage, error) {
	if r.Location.Kind != transfer.CPU {
		return nil, fmt.Errorf("%w: shm serves host memory only, not %v", transfer.ErrCannotRegister, r.Location)
	}
	if r.Host == nil || r.Host.FD() < 0 {
		return nil, fmt.Errorf("%w: shm: not memfd-backed: allocate with Engine.AllocHost or register WithHostMemory", transfer.ErrCannotRegister)
	}
	if r.HostOffset < 0 || uint64(r.HostOffset)+r.Len > uint64(r.Host.Size()) {
		return nil, fmt.Errorf("shm: region of %d bytes at offset %d does not fit its host memory of %d bytes", r.Len, r.HostOffset, r.Host.Size())
	}
	writable := r.Access&transfer.AccessWrite != 0
	fd, err := shareFD(r.Host.FD(), writable)
	if err != nil {
		return nil, err
	}
	s := &served{fd: fd, off: uint64(r.HostOffset), size: r.Len, writable: writable}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		unix.Close(fd)
		return nil, transfer.ErrClosed
	}
	t.nextID++
	s.id = t.nextID
	t.regions[s.id] = s
	t.byReg[r] = s.id
	t.mu.Unlock()
	b, _ := json.Marshal(Handle{ID: s.id, Offset: s.off, Size: s.size})
	return b, nil
}

// shareFD returns this transport's own fd for a memfd: a duplicate, or, for
// regions peers may only read, the memfd reopened read-only, so that a peer
// cannot map it writable.
func shareFD(fd int, writable bool) (int, error) {
	if writable {
		nfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("shm: dup memfd: %w", err)
		}
		return nfd, nil
	}
	nfd, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("shm: reopen memfd read-only: %w", err)
	}
	return nfd, nil
}

// UnregisterRegion forgets the region and tells connected peers to drop
// their mappings of it.
func (t *Transport) UnregisterRegion(r *transfer.Region) {
	t.mu.Lock()
	id, ok := t.byReg[r]
	var s *served
	var conns []*servedConn
	if ok {
		s = t.regions[id]
		delete(t.byReg, r)
		delete(t.regions, id)
		for c := range t.conns {
			conns = append(conns, c)
		}
	}
	t.mu.Unlock()
	if !ok {
		return
	}
	unix.Close(s.fd)
	for _, c := range conns {
		c.revoke(id)
	}
}

// CanServe implements transfer.Transport: host memory on both sides, and a
// region the peer published an shm handle for.
func (t *Transport) CanServe(loc transfer.Location, peer *transfer.Descriptor, rem *transfer.RegionInfo) bool {
	if loc.Kind != transfer.CPU || rem.Location.Kind != transfer.CPU {
		return false
	}
	if _, ok := peer.Transports[Name]; !ok {
		return false
	}
	_, ok := rem.Handles[Name]
	return ok
}

// DropPeer unmaps a peer incarnation's mappings and closes its socket.
func (t *Transport) DropPeer(d *transfer.Descriptor) {
	t.mu.Lock()
	p := t.peers[d.Incarnation]
	delete(t.peers, d.Incarnation)
	t.mu.Unlock()
	if p != nil {
		p.shut(fmt.Errorf("%w: %s incarnation %s was dropped", transfer.ErrPeerRestarted, d.Name, d.Incarnation))
	}
}

// Close stops serving, closes every connection, waits for the transport's
// goroutines and releases every mapping and fd. Order: listener, served
// connections, peer connections, goroutines, mappings, served fds.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	conns := t.conns
	t.conns = map[*servedConn]struct{}{}
	peers := t.peers
	t.peers = map[string]*peer{}
	regions := t.regions
	t.regions = map[uint64]*served{}
	t.byReg = map[*transfer.Region]uint64{}
	t.mu.Unlock()
	t.cancel()
	var err error
	if t.ln != nil {
		if e := t.ln.Close(); e != nil && !errors.Is(e, net.ErrClosed) {
			err = e
		}
	}
	for c := range conns {
		c.conn.Close()
	}
	for _, p := range peers {
		p.shut(transfer.ErrClosed)
	}
	t.wg.Wait()
	for _, s := range regions {
		unix.Close(s.fd)
	}
	return err
}

// peerFor returns the state of a peer incarnation, creating it (no I/O).
func (t *Transport) peerFor(d *transfer.Descriptor) (*peer, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.closed {
		return nil, transfer.ErrClosed
	}
	p := t.peers[d.Incarnation]
	if p == nil {
		p = newPeer(t, d)
		t.peers[d.Incarnation] = p
	}
	return p, nil
}

// goTracked runs fn on a goroutine Close waits for; false if closed.
func (t *Transport) goTracked(fn func()) bool {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return false
	}
	t.wg.Add(1)
	t.mu.Unlock()
	go func() {
		defer t.wg.Done()
		fn()
	}()
	return true
}
