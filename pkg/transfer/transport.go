package transfer

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Reach says which peers a transport can serve.
type Reach int

const (
	ReachSameMachine Reach = iota // same boot, machine-id and network namespace
	ReachNetwork                  // any peer it can connect to
)

// Transport moves bytes for one kind of path (tcp, shm, nvlink, ...).
// Implementations live in subpackages and assert
// var _ transfer.Transport = (*Transport)(nil).
type Transport interface {
	// Name is the transport's name in descriptors, logs and metrics.
	Name() string
	Reach() Reach
	// Start is called once by New, before the engine accepts connections.
	Start(h Host) error
	// Info is the transport's segment-level entry in the descriptor (may be
	// nil). It is read after Start.
	Info() json.RawMessage
	// RegisterRegion prepares a local region and returns the handle peers
	// need to reach it (nil if none is needed). An error wrapping
	// ErrCannotRegister means this transport cannot serve the region; other
	// transports may.
	RegisterRegion(r *Region) (json.RawMessage, error)
	UnregisterRegion(r *Region)
	// CanServe reports whether the transport can move bytes between local
	// memory at loc and the region rem published by peer.
	CanServe(loc Location, peer *Descriptor, rem *RegionInfo) bool
	// Submit starts the tasks, all for one peer. It calls Done exactly once
	// for every task, from any goroutine; it must give up when ctx is done.
	Submit(ctx context.Context, peer *Descriptor, tasks []*Task)
	// DropPeer forgets connections and mappings of a peer incarnation.
	DropPeer(peer *Descriptor)
	Close() error
}

// PageLister is implemented by transports that move page-list tasks. The
// engine refuses a page-list request that would go through any other
// transport, since such a transport would copy the task's whole extent.
type PageLister interface {
	PageLists() bool
}

func takesPageLists(t Transport) bool {
	pl, ok := t.(PageLister)
	return ok && pl.PageLists()
}

// Region is a registered local region.
type Region struct {
	RegionInfo
	// Host is set when the region is memfd-backed host memory (from
	// AllocHost, or registered WithHostMemory): same-machine peers can map it.
	Host *HostMemory
	// HostOffset is the offset of Addr inside Host.
	HostOffset int64
	// Memory is the backend memory the region lies in (WithMemory), or nil.
	// GPU regions that tcp or rdma stage implement DeviceMemory.
	Memory Memory

	holds   atomic.Int64 // transfers touching the memory (HoldLocal, batches)
	drainMu sync.Mutex
	drained chan struct{} // made by UnregisterMemory; closed with the last hold
}

// Release drops a hold from Host.HoldLocal. It is a no-op on nil.
func (r *Region) Release() {
	if r == nil || r.holds.Add(-1) != 0 {
		return
	}
	r.drainMu.Lock()
	if r.drained != nil {
		select {
		case <-r.drained:
		default:
			close(r.drained)
		}
	}
	r.drainMu.Unlock()
}

// drain waits until no hold is left (or stopped is closed: the transports
// are gone), at most for bound or until ctx ends. No hold can be taken once
// the region has left the table.
func (r *Region) drain(ctx context.Context, bound time.Duration, stopped <-chan struct{}) error {
	r.drainMu.Lock()
	if r.drained == nil {
		r.drained = make(chan struct{})
	}
	n := r.holds.Load()
	ch := r.drained
	r.drainMu.Unlock()
	if n == 0 {
		return nil
	}
	start := time.Now()
	t := time.NewTimer(bound)
	defer t.Stop()
	select {
	case <-ch:
		return nil
	case <-stopped:
		return nil
	case <-t.C:
	case <-ctx.Done():
	}
	return fmt.Errorf("%w: %d transfers still touch [%#x, +%d) after %v; do not free it", ErrRegionInUse,
		r.holds.Load(), r.Addr, r.Len, time.Since(start).Round(time.Millisecond))
}

// Task is one request as a transport sees it: bounds already checked.
//
// A page-list task (List set) moves List.PageLen bytes between
// Local+p.Local and Remote+p.Remote for each p in List.Pages; Len is then
// its remote extent (the engine checked [Remote, Remote+Len), and every
// local page), so a transport's own check of [Remote, Remote+Len) covers
// every page.
type Task struct {
	Op     Op
	Local  uint64 // local address
	Len    uint64
	Remote uint64 // address inside Region
	List   *PageList
	// Region is the remote region holding [Remote, Remote+Len).
	Region *RegionInfo
	// LocalRegion is the local registered region holding [Local, Local+Len).
	LocalRegion *Region

	b     *Batch
	i     int
	g     int32         // group in b
	flags atomic.Uint32 // taskFired, taskReported
	state TaskState     // under b.mu
	err   error         // under b.mu
}

// PageList is a page-list task's pages: PageLen bytes at each offset pair.
type PageList struct {
	PageLen uint64
	Pages   []PageOffset
}

// Bytes is how many bytes the task moves.
func (t *Task) Bytes() uint64 {
	if t.List != nil {
		return t.List.PageLen * uint64(len(t.List.Pages))
	}
	return t.Len
}

// Done reports the task's result; only the first call counts.
// A transport calls it once it no longer touches the task's memory.
func (t *Task) Done(err error) {
	old := t.flags.Or(taskFired | taskReported)
	switch {
	case old&taskFired == 0:
		t.b.finish(t.i, err, true)
	case old&taskReported == 0:
		t.b.lateReport() // the engine ended the task (timed out) before its transport did
	}
}

// end sets the task's result for the engine (the batch's bound or
// context); the transport still reports the task with Done.
func (t *Task) end(err error) {
	if t.flags.Or(taskFired)&taskFired == 0 {
		t.b.finish(t.i, err, false)
	}
}

const (
	taskFired    = 1 << iota // the result is set
	taskReported             // the transport called Done
)

// Host is what the engine offers its transports.
type Host interface {
	Logger() *zap.Logger
	// Self returns a copy of the local descriptor as published now.
	Self() *Descriptor
	// Dial connects to peer's engine for a connection of the given kind,
	// after the handshake (both sides proved the cluster secret). The peer
	// must still be the incarnation in the descriptor.
	Dial(ctx context.Context, peer *Descriptor, kind string) (net.Conn, error)
	// Handle routes accepted connections of kind to fn, after the handshake
	// (fn never sees a peer that did not prove the cluster secret). fn owns
	// conn.
	Handle(kind string, fn func(conn net.Conn, from Hello))
	// HoldLocal checks that [addr, addr+n) lies in one local registered
	// region granting need, and holds the region until its Release:
	// UnregisterMemory waits for every hold. Transports that serve remote
	// requests hold the region while they touch its memory.
	HoldLocal(addr, n uint64, need Access) (*Region, error)
	// Timeout is the bound on one batch.
	Timeout() time.Duration
}
