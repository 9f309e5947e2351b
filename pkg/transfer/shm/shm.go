// Package shm is the same-machine transport: two processes on one machine
// share memfd-backed host regions, so a transfer is a memcpy in the
// initiator.
//
// The serving side listens on an abstract unix socket named after the
// engine's incarnation ("@mooncake-shm-<incarnation>"; abstract sockets are
// per network namespace, which matches the engine's same-machine rule). An
// initiator first proves itself through the engine's handshake (h.Dial, kind
// "shm", which checks the cluster secret and the incarnation) and receives a
// one-time ticket on that connection; it presents the ticket on the unix
// socket, checks the server's proof, then asks for each region's memfd,
// which comes back with SCM_RIGHTS. It maps every memfd once and caches the
// mapping per (peer incarnation, region id). The unix connection stays open:
// its end (EOF, hang-up) marks the peer dead, its mappings are dropped, and
// batches to it fail with transfer.ErrPeerDead. Protocol in
// docs/format/shm.md.
package shm

import (
	"encoding/json"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
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
	srv  *fdshare.Server // serving side: regions' memfds by region id
	sock string
	inc  string

	// peers is the initiator side, by peer incarnation; its goroutines
	// are the transport's.
	peers *fdshare.Peers[*peer]

	mu    sync.Mutex
	byReg map[*transfer.Region]uint64 // served region -> id

	// busy counts batches being copied; when several submitters already
	// keep the cores busy, a large batch is copied in its caller too.
	busy atomic.Int32
}

var (
	_ transfer.Transport  = (*Transport)(nil)
	_ transfer.PageLister = (*Transport)(nil)
)

// New returns an shm transport; it starts working when the engine calls
// Start.
func New(cfg Config) *Transport {
	if cfg.Copiers == 0 {
		cfg.Copiers = min(4, runtime.GOMAXPROCS(0))
	}
	if cfg.ParallelMin == 0 {
		cfg.ParallelMin = 1 << 20
	}
	t := &Transport{
		cfg: cfg, lg: zap.NewNop(),
		srv:   fdshare.NewServer(fdshare.ServerConfig{Kind: Name, Wire: &wire}),
		byReg: map[*transfer.Region]uint64{},
	}
	t.peers = fdshare.NewPeers(t.newPeer, (*peer).shut)
	return t
}

// Name implements transfer.Transport.
func (t *Transport) Name() string { return Name }

// PageLists says the transport moves page-list tasks page by page.
func (t *Transport) PageLists() bool { return true }

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
	if err := t.srv.Start(h, t.lg); err != nil {
		return err
	}
	t.sock = t.srv.Socket()
	return nil
}

// Info implements transfer.Transport.
func (t *Transport) Info() json.RawMessage {
	b, _ := json.Marshal(Info{Socket: t.sock, Version: protocolVersion})
	return b
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
	// Peers that may only read get the memfd reopened read-only, so that
	// they cannot map it writable.
	writable := r.Access&transfer.AccessWrite != 0
	fd, err := fdshare.ShareMemfd(r.Host.FD(), writable)
	if err != nil {
		return nil, fmt.Errorf("shm: %w", err)
	}
	it := fdshare.Item{FD: fd, Reply: fdshare.Packet{Offset: uint64(r.HostOffset), Size: r.Len}}
	if writable {
		it.Reply.Flags = fdshare.FlagWritable
	}
	id, err := t.srv.Add(it)
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.byReg[r] = id
	t.mu.Unlock()
	b, _ := json.Marshal(Handle{ID: id, Offset: it.Reply.Offset, Size: it.Reply.Size})
	return b, nil
}

// UnregisterRegion forgets the region and tells connected peers to drop
// their mappings of it.
func (t *Transport) UnregisterRegion(r *transfer.Region) {
	t.mu.Lock()
	id, ok := t.byReg[r]
	delete(t.byReg, r)
	t.mu.Unlock()
	if ok {
		t.srv.Remove(id)
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
func (t *Transport) DropPeer(d *transfer.Descriptor) { t.peers.Drop(d) }

// Close stops serving, closes every connection, waits for the transport's
// goroutines and releases every mapping and fd. Order: the server
// (listener, served connections, its goroutines, served fds), then the
// peers (connects canceled, connections closed, mappings released after
// the copies in flight, goroutines waited for).
// Both are idempotent, so Close is.
func (t *Transport) Close() error {
	err := t.srv.Close()
	t.peers.Close()
	t.mu.Lock()
	t.byReg = map[*transfer.Region]uint64{}
	t.mu.Unlock()
	return err
}
