// Package tcp is mooncake-go's raw-TCP transport: it reaches any peer the
// engine can connect to.
//
// Each peer incarnation gets Config.Lanes data connections ("lanes"),
// opened through the engine's handshake (connection kind "tcp", so the
// cluster secret is proved before a lane carries a byte). On a lane,
// requests are pipelined: a writer goroutine sends header and payload
// straight from registered memory with one vectored write (writev) for many
// requests, and a reader goroutine reads responses, storing the data of
// reads straight into registered memory. Tasks larger than
// Config.ChunkSize are split into chunks spread over the lanes, and
// consecutive small pieces go as one vector request to a peer that takes
// them. The serving side checks every request (every entry of a vector)
// against its registered regions (Host.HoldLocal) before it touches memory
// and answers a refused one with an error naming the range.
//
// Device memory (a region registered WithMemory of a
// transfer.DeviceMemory, such as a CUDA pool) is staged on either side:
// each lane allocates a pinned ring per direction once, and copies between
// the device and the ring run on the memory's own streams while earlier
// pieces are on the socket. The byte layout is in docs/format/tcp.md.
package tcp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/staging"
)

// Name is the transport's name in descriptors, logs and metrics, and the
// connection kind of its lanes.
const Name = "tcp"

// Config configures the transport. Zero values mean the defaults noted.
type Config struct {
	// Lanes is the number of parallel connections per peer (default 4).
	Lanes int
	// MaxInflight bounds the requests sent and not yet answered on one lane
	// (default 64).
	MaxInflight int
	// ChunkSize is the largest request on the wire: larger tasks are split
	// into chunks of this size, spread over the lanes (default 1 MiB, at
	// most MaxChunk).
	ChunkSize int
	// StagingChunk is the size of one staging slot for device memory
	// (transfer.DeviceMemory): requests to or from it are split to at most
	// this size, on either side (default 1 MiB, at most MaxChunk).
	StagingChunk int
	// StagingSlots is the number of staging slots per lane and direction
	// (default 2). Each lane that meets device memory allocates
	// 2*StagingSlots*StagingChunk bytes of staging once, so a peer costs at
	// most Lanes times that on each side.
	StagingSlots int
	// MaxServedStaging bounds the staging of all the lanes this transport
	// serves together (default 64 lanes' worth, 256 MiB with the other
	// defaults); a lane past it refuses device requests.
	MaxServedStaging int64
	// NoVectors turns vector requests (several pieces in one request) off:
	// the transport neither advertises, accepts nor sends them, as a peer
	// of an older version.
	NoVectors bool
}

const (
	defaultLanes        = 4
	defaultMaxInflight  = 64
	defaultChunk        = 1 << 20
	defaultStagingChunk = 1 << 20
	defaultStagingSlots = 2
)

// Validate reports a configuration the transport cannot use.
func (c *Config) Validate() error {
	switch {
	case c.Lanes < 0 || c.Lanes > 256:
		return fmt.Errorf("tcp: config: lanes %d not in [0, 256]", c.Lanes)
	case c.MaxInflight < 0:
		return fmt.Errorf("tcp: config: negative max inflight %d", c.MaxInflight)
	case c.ChunkSize < 0 || c.ChunkSize > MaxChunk:
		return fmt.Errorf("tcp: config: chunk size %d not in [0, %d]", c.ChunkSize, MaxChunk)
	case c.StagingChunk < 0 || c.StagingChunk > MaxChunk:
		return fmt.Errorf("tcp: config: staging chunk %d not in [0, %d]", c.StagingChunk, MaxChunk)
	case c.StagingSlots < 0 || c.StagingSlots > 64:
		return fmt.Errorf("tcp: config: staging slots %d not in [0, 64]", c.StagingSlots)
	case c.MaxServedStaging < 0:
		return fmt.Errorf("tcp: config: negative max served staging %d", c.MaxServedStaging)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Lanes == 0 {
		c.Lanes = defaultLanes
	}
	if c.MaxInflight == 0 {
		c.MaxInflight = defaultMaxInflight
	}
	if c.ChunkSize == 0 {
		c.ChunkSize = defaultChunk
	}
	if c.StagingChunk == 0 {
		c.StagingChunk = defaultStagingChunk
	}
	if c.StagingSlots == 0 {
		c.StagingSlots = defaultStagingSlots
	}
	if c.MaxServedStaging == 0 {
		c.MaxServedStaging = 64 * 2 * int64(c.StagingSlots) * int64(c.StagingChunk)
	}
	return c
}

// Transport is the tcp transport. Create it with New and hand it to
// transfer.New; the engine starts and closes it.
type Transport struct {
	cfg    Config
	cfgErr error
	h      transfer.Host
	lg     *zap.Logger
	served *staging.Budget // staging of served lanes

	mu     sync.Mutex
	peers  map[string]*peer // by segment name
	closed bool

	ctx    context.Context // canceled by Close
	cancel context.CancelFunc
	wg     sync.WaitGroup // lane and dial goroutines
}

var (
	_ transfer.Transport  = (*Transport)(nil)
	_ transfer.PageLister = (*Transport)(nil)
)

// New returns a tcp transport. An invalid cfg makes Start fail.
func New(cfg Config) *Transport {
	t := &Transport{cfgErr: cfg.Validate(), cfg: cfg.withDefaults(), peers: map[string]*peer{}}
	t.served = &staging.Budget{Max: t.cfg.MaxServedStaging}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	return t
}

// Config returns the configuration in use (defaults filled in).
func (t *Transport) Config() Config { return t.cfg }

func (t *Transport) Name() string { return Name }

// PageLists says the transport moves page-list tasks page by page.
func (t *Transport) PageLists() bool       { return true }
func (t *Transport) Reach() transfer.Reach { return transfer.ReachNetwork }

// Start registers the lane handler with the engine.
func (t *Transport) Start(h transfer.Host) error {
	if t.cfgErr != nil {
		return t.cfgErr
	}
	t.h = h
	t.lg = h.Logger().Named(Name)
	h.Handle(Name, t.serve)
	return nil
}

type info struct {
	Version int `json:"version"`
	Lanes   int `json:"lanes"`
	// StagingChunk bounds requests to this segment's device regions.
	StagingChunk int `json:"staging_chunk,omitempty"`
	// Vector is the most entries a vector request to this segment may
	// carry (0: it takes single requests only).
	Vector int `json:"vector,omitempty"`
}

// Info says that the segment serves tcp lanes (wire version, lane count,
// staging chunk, vector requests).
func (t *Transport) Info() json.RawMessage {
	in := info{Version: version, Lanes: t.cfg.Lanes, StagingChunk: t.cfg.StagingChunk, Vector: maxVector}
	if t.cfg.NoVectors {
		in.Vector = 0
	}
	b, _ := json.Marshal(in)
	return b
}

// stagedHandle marks, in the descriptor, a device region this segment's
// tcp stages: peers may send requests to it.
var stagedHandle = json.RawMessage(`{"staged":true}`)

// RegisterRegion accepts host memory, and device memory it can stage (the
// region's Memory is a transfer.DeviceMemory).
func (t *Transport) RegisterRegion(r *transfer.Region) (json.RawMessage, error) {
	if r.Location.Kind == transfer.CPU {
		return nil, nil
	}
	if _, ok := r.Memory.(transfer.DeviceMemory); !ok {
		return nil, fmt.Errorf("%w: tcp stages %v memory through its transfer.DeviceMemory, and none was given (register it WithMemory)",
			transfer.ErrCannotRegister, r.Location)
	}
	return stagedHandle, nil
}

func (t *Transport) UnregisterRegion(*transfer.Region) {}

// CanServe: the peer serves tcp lanes, and a remote device region is one
// its tcp stages. Local device memory is staged too (Submit fails a task
// whose local region has no transfer.DeviceMemory).
func (t *Transport) CanServe(loc transfer.Location, peer *transfer.Descriptor, rem *transfer.RegionInfo) bool {
	if _, ok := peer.Transports[Name]; !ok {
		return false
	}
	if rem.Location.Kind != transfer.CPU {
		_, ok := rem.Handles[Name]
		return ok
	}
	return true
}

// serve runs one accepted lane until it ends; the engine closes conn when
// it closes.
func (t *Transport) serve(conn net.Conn, from transfer.Hello) {
	defer conn.Close()
	st := newStager(t.cfg.StagingChunk, t.cfg.StagingSlots)
	st.budget = t.served
	s := newServer(conn, conn, t.h.HoldLocal, t.h.Timeout(), func() { conn.Close() }, st)
	s.vectors = !t.cfg.NoVectors
	err := s.run()
	if err != nil && !isClosed(err) && t.lg.Core().Enabled(zap.DebugLevel) {
		t.lg.Debug("lane ended", zap.String("peer", from.Name), zap.Error(err))
	}
	if errors.Is(err, errFrame) {
		t.lg.Warn("lane closed on a bad frame", zap.String("peer", from.Name), zap.Error(err))
	}
}

// Submit sends the tasks over the peer's lanes, dialing them first if
// needed. It does not block on the network.
func (t *Transport) Submit(ctx context.Context, d *transfer.Descriptor, tasks []*transfer.Task) {
	p, err := t.peerFor(d)
	if err != nil {
		failAll(tasks, err)
		return
	}
	select {
	case <-p.ready:
		t.dispatch(ctx, p, tasks)
		return
	default:
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		failAll(tasks, transfer.ErrClosed)
		return
	}
	t.wg.Add(1)
	t.mu.Unlock()
	go func() {
		defer t.wg.Done()
		select {
		case <-p.ready:
			t.dispatch(ctx, p, tasks)
		case <-ctx.Done():
			failAll(tasks, fmt.Errorf("tcp: waiting for lanes to %s: %w", d.Name, ctx.Err()))
		}
	}()
}

func failAll(tasks []*transfer.Task, err error) {
	for _, tk := range tasks {
		tk.Done(err)
	}
}

// DropPeer closes the lanes of that incarnation of the peer.
func (t *Transport) DropPeer(d *transfer.Descriptor) {
	t.mu.Lock()
	p := t.peers[d.Name]
	if p == nil || p.inc != d.Incarnation {
		t.mu.Unlock()
		return
	}
	delete(t.peers, d.Name)
	t.mu.Unlock()
	p.close(fmt.Errorf("%w: %s incarnation %s dropped", transfer.ErrPeerRestarted, d.Name, d.Incarnation))
}

// Close closes every lane and waits for the transport's goroutines.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	peers := t.peers
	t.peers = map[string]*peer{}
	t.mu.Unlock()
	t.cancel()
	for _, p := range peers {
		p.close(fmt.Errorf("tcp: %w", transfer.ErrClosed))
	}
	t.wg.Wait()
	return nil
}

func isClosed(err error) bool {
	return errors.Is(err, net.ErrClosed) || errors.Is(err, context.Canceled)
}

// remoteError is a request the serving side refused; it wraps
// ErrOutOfBounds, ErrAccessDenied or ErrDeviceCopy.
type remoteError struct {
	sentinel error
	msg      string
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.sentinel }

func statusErr(peer string, status uint8, text string) error {
	var s error
	switch status {
	case statusOutOfBounds:
		s = transfer.ErrOutOfBounds
	case statusDenied:
		s = transfer.ErrAccessDenied
	case statusDevice:
		s = transfer.ErrDeviceCopy
	default:
		s = errFrame
	}
	return &remoteError{sentinel: s, msg: fmt.Sprintf("tcp: %s refused: %s", peer, text)}
}
