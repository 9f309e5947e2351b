package transfer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Request is one transfer: Len bytes between local memory at Local and the
// address Remote inside a region that segment Segment published.
//
// With Pages set it is a page list: for each entry p, Len bytes between
// Local+p.Local and Remote+p.Remote. Every page must lie in the one local
// region that holds Local and the one remote region that holds Remote; the
// list is checked in one pass and completes or fails as one task. A batch of
// many small pages costs a few nanoseconds per page this way instead of a
// request's worth of work each.
type Request struct {
	Op      Op
	Local   uintptr
	Len     uint64
	Segment SegmentID
	Remote  uint64
	Pages   []PageOffset
}

// PageOffset places one page of a page-list request: byte offsets from the
// request's Local and Remote.
type PageOffset struct {
	Local, Remote uint64
}

// span returns the bytes from r's bases that its pages reach (Len for a
// plain request), or false if that wraps.
func (r *Request) span() (local, remote uint64, ok bool) {
	if r.Pages == nil {
		return r.Len, r.Len, true
	}
	if len(r.Pages) == 0 || r.Len == 0 {
		return 0, 0, false
	}
	var ml, mr uint64
	for _, p := range r.Pages {
		ml = max(ml, p.Local)
		mr = max(mr, p.Remote)
	}
	local, remote = ml+r.Len, mr+r.Len
	return local, remote, local >= ml && remote >= mr
}

// TaskState is a task's progress.
type TaskState int

const (
	Pending TaskState = iota
	Completed
	Failed
	TimedOut
)

func (s TaskState) String() string {
	return [...]string{"pending", "completed", "failed", "timed out"}[s]
}

// TaskStatus is one task's state; Err says why it failed or timed out.
type TaskStatus struct {
	State     TaskState
	Err       error
	Transport string
}

// Batch is a set of submitted requests. Every task leaves Pending within the
// engine's Timeout.
type Batch struct {
	e        *Engine
	start    time.Time
	cancel   context.CancelFunc
	stop     func() bool
	mu       sync.Mutex
	tasks    []Task // state and error per task, under mu
	groups   []group
	pending  int
	done     chan struct{}
	reqs     []Request
	held     []*Region // local regions, released once the transports are done with them
	released atomic.Bool
	reported int  // tasks whose transport called Done (under mu)
	expired  bool // the bound or the caller's context ended tasks, not their transports (under mu)
}

// lateReport counts a transport's Done for a task the engine had ended.
func (b *Batch) lateReport() {
	b.mu.Lock()
	b.reported++
	all := b.reported == len(b.tasks)
	b.mu.Unlock()
	if all {
		b.releaseHeld()
	}
}

// releaseHeld lets the batch's local regions go (once).
func (b *Batch) releaseHeld() {
	if b.released.CompareAndSwap(false, true) {
		release(b.held)
	}
}

func release(rs []*Region) {
	for _, r := range rs {
		r.Release()
	}
}

// group is the tasks of one batch that go to one peer through one transport.
type group struct {
	t     Transport
	peer  *Descriptor
	tasks []*Task
}

// Submit checks every request (local memory registered, target address
// inside a region the target published, with the needed access right) and,
// if all pass, starts them. If any fails the check nothing moves and the
// error names the request and the address range. Cancelling ctx cancels
// the batch.
func (e *Engine) Submit(ctx context.Context, reqs []Request) (*Batch, error) {
	e.mu.RLock()
	closed := e.closed
	e.mu.RUnlock()
	if closed {
		return nil, ErrClosed
	}
	// Per-request work is kept small (large batches of small pages are the
	// common case): tasks live in one slice, and the segment, local region
	// and transport of the previous request are reused while they fit.
	store := make([]Task, len(reqs))
	var groups []group
	// The local regions the batch touches are held until it ends, so
	// UnregisterMemory waits for it.
	var held []*Region
	started := false
	defer func() {
		if !started {
			release(held)
		}
	}()
	gi := -1 // group of the previous request
	refreshed := map[SegmentID]bool{}
	var (
		curID   SegmentID = -1
		cur     *segment
		d       *Descriptor
		tab     *regionTable
		lr      *Region
		lastRem *RegionInfo
		lastLoc Location
		lastT   Transport
	)
	for i := range reqs {
		r := &reqs[i]
		if r.Segment != curID || cur == nil {
			cur = e.segAt(r.Segment)
			if cur == nil {
				return nil, fmt.Errorf("transfer: request %d: %w: id %d not opened", i, ErrSegmentNotFound, r.Segment)
			}
			var stale bool
			d, tab, stale = cur.snapshot()
			if stale && !refreshed[r.Segment] {
				refreshed[r.Segment] = true
				if err := e.refresh(ctx, cur); err != nil {
					return nil, fmt.Errorf("transfer: request %d: %w", i, err)
				}
				d, tab, _ = cur.snapshot()
			}
			curID, lastRem, lastT = r.Segment, nil, nil
		}
		ln, rn := r.Len, r.Len
		if r.Pages != nil {
			var ok bool
			if ln, rn, ok = r.span(); !ok {
				return nil, &OpError{Op: r.Op.String(), Segment: cur.name, Err: fmt.Errorf("request %d: %w: page list of %d pages of %d bytes is empty or wraps",
					i, ErrOutOfBounds, len(r.Pages), r.Len)}
			}
		}
		if lr == nil || uint64(r.Local) < lr.Addr || uint64(r.Local)+ln > lr.End() || uint64(r.Local)+ln < uint64(r.Local) || ln == 0 {
			var err error
			if lr, err = e.HoldLocal(uint64(r.Local), ln, 0); err != nil {
				return nil, &OpError{Op: r.Op.String(), Segment: cur.name, Err: fmt.Errorf("request %d: local memory: %w", i, err)}
			}
			if slices.Contains(held, lr) {
				lr.Release()
			} else {
				held = append(held, lr)
			}
		}
		rr, err := tab.Check(r.Remote, rn, r.Op.need())
		if errors.Is(err, ErrOutOfBounds) && !refreshed[r.Segment] && r.Segment != LocalSegment {
			// The peer may have registered memory since we last looked.
			refreshed[r.Segment] = true
			if rerr := e.refresh(ctx, cur); rerr == nil {
				d, tab, _ = cur.snapshot()
				lastRem, lastT = nil, nil
				rr, err = tab.Check(r.Remote, rn, r.Op.need())
			}
		}
		if err != nil {
			return nil, &OpError{Op: r.Op.String(), Segment: cur.name, Err: fmt.Errorf("request %d: %w", i, err)}
		}
		t := lastT
		if rr != lastRem || lr.Location != lastLoc || t == nil {
			if t = e.pick(lr.Location, d, rr); t == nil {
				return nil, &OpError{Op: r.Op.String(), Segment: cur.name, Err: fmt.Errorf("request %d: %w from %v to %v (installed: %v)",
					i, ErrNoTransport, lr.Location, rr.Location, e.transportNames())}
			}
			e.noteChoice(cur.name, d.Incarnation, t.Name(), lr.Location, rr.Location)
			lastRem, lastLoc, lastT = rr, lr.Location, t
		}
		if r.Pages != nil && !takesPageLists(t) {
			return nil, &OpError{Op: r.Op.String(), Segment: cur.name, Err: fmt.Errorf("request %d: %w: transport %s does not take page lists",
				i, ErrNoTransport, t.Name())}
		}
		// rr points into the segment's region table, which is replaced,
		// never changed, when the descriptor is refreshed.
		if gi < 0 || groups[gi].t != t || groups[gi].peer != d {
			gi = -1
			for k := range groups {
				if groups[k].t == t && groups[k].peer == d {
					gi = k
				}
			}
			if gi < 0 {
				groups = append(groups, group{t: t, peer: d})
				gi = len(groups) - 1
			}
		}
		store[i] = Task{Op: r.Op, Local: uint64(r.Local), Len: r.Len, Remote: r.Remote, Region: rr, LocalRegion: lr, i: i, g: int32(gi)}
		if r.Pages != nil {
			store[i].Len, store[i].List = rn, &PageList{PageLen: r.Len, Pages: r.Pages}
		}
		groups[gi].tasks = append(groups[gi].tasks, &store[i])
	}

	bctx, cancel := context.WithTimeout(ctx, e.cfg.Timeout)
	b := &Batch{e: e, start: time.Now(), cancel: cancel, tasks: store, groups: groups,
		pending: len(reqs), done: make(chan struct{}), reqs: reqs, held: held}
	started = true
	if len(reqs) == 0 {
		cancel()
		close(b.done)
		return b, nil
	}
	for i := range store {
		store[i].b = b
	}
	// Bound the batch: when bctx ends, every task still pending times out
	// (or is canceled with the caller's context).
	// stop is set under mu: the function below may run (in its own
	// goroutine) before AfterFunc returns, and it takes mu first.
	b.mu.Lock()
	b.stop = context.AfterFunc(bctx, func() {
		err := ctxErr(bctx, "batch")
		b.mu.Lock()
		b.expired = b.pending > 0
		b.mu.Unlock()
		for i := range store {
			store[i].end(err)
		}
	})
	b.mu.Unlock()
	for _, g := range groups {
		g.t.Submit(bctx, g.peer, g.tasks)
	}
	return b, nil
}

// pick is the transport selector: the first installed transport that can
// serve local memory at loc to the remote region rem of peer.
func (e *Engine) pick(loc Location, peer *Descriptor, rem *RegionInfo) Transport {
	for _, t := range e.cfg.Transports {
		if t.Reach() == ReachSameMachine && !peer.Host.SameMachine(e.self.Host) {
			continue
		}
		if t.CanServe(loc, peer, rem) {
			return t
		}
	}
	return nil
}

// noteChoice logs, once per peer incarnation and pair of locations, which
// transport the selector chose.
func (e *Engine) noteChoice(seg, inc, transport string, from, to Location) {
	key := seg + "|" + inc + "|" + transport + "|" + from.String() + "|" + to.String()
	if _, seen := e.chosen.LoadOrStore(key, true); !seen {
		e.lg.Info("transport selected", zap.String("segment", seg), zap.String("transport", transport),
			zap.Stringer("local", from), zap.Stringer("remote", to))
	}
}

// Select names the transport the engine would use between local memory at
// loc and a region at rem of peer ("" if none): the selector that Submit
// uses, for tools such as `mooncake-go topo`.
func (e *Engine) Select(loc Location, peer *Descriptor, rem *RegionInfo) string {
	if t := e.pick(loc, peer, rem); t != nil {
		return t.Name()
	}
	return ""
}

// finish sets task i's result; reported says its transport is done with
// its memory.
func (b *Batch) finish(i int, err error, reported bool) {
	b.mu.Lock()
	if reported {
		b.reported++
	}
	allReported := b.reported == len(b.tasks)
	t := &b.tasks[i]
	if t.state != Pending {
		b.mu.Unlock()
		if allReported {
			b.releaseHeld()
		}
		return
	}
	switch {
	case err == nil:
		t.state = Completed
	case errors.Is(err, ErrTimeout):
		t.state = TimedOut
	default:
		t.state = Failed
	}
	t.err = err
	b.pending--
	last := b.pending == 0
	b.mu.Unlock()
	if allReported {
		b.releaseHeld() // every transport is done with the batch's memory
	}

	r := &b.reqs[i]
	if err != nil && r.Segment != LocalSegment && (errors.Is(err, ErrPeerDead) || errors.Is(err, ErrTimeout) || errors.Is(err, ErrPeerRestarted)) {
		if s := b.e.segAt(r.Segment); s != nil {
			s.markStale() // refetch (and check the incarnation) before the next use
		}
	}
	if err != nil && b.e.lg.Core().Enabled(zap.DebugLevel) {
		b.e.lg.Debug("task failed", zap.String("transport", b.groups[t.g].t.Name()), zap.Error(err))
	}
	if last {
		b.complete()
	}
}

// complete records the batch's metrics (aggregated here, not per task) and
// releases waiters.
func (b *Batch) complete() {
	b.mu.Lock()
	stop := b.stop
	b.mu.Unlock()
	stop()
	b.cancel()
	// The local regions went when every transport reported its tasks
	// (finish). Tasks the engine ended (timed out, canceled) may still have
	// bytes on their way; if some transport never reports, the regions go
	// one Timeout later, when every transport's own bounded waits have ended.
	b.mu.Lock()
	expired := b.expired
	b.mu.Unlock()
	if expired && len(b.held) > 0 && !b.released.Load() {
		time.AfterFunc(b.e.cfg.Timeout, b.releaseHeld)
	}
	el := time.Since(b.start).Seconds()
	// Count per transport (a batch has few groups, and groups of one
	// transport share its label values).
	type agg struct {
		states [TimedOut + 1]int
		bytes  [Write + 1]uint64
	}
	per := map[string]*agg{}
	for k := range b.groups {
		name := b.groups[k].t.Name()
		a := per[name]
		if a == nil {
			a = &agg{}
			per[name] = a
		}
		for _, t := range b.groups[k].tasks {
			a.states[t.state]++
			if t.state == Completed {
				a.bytes[t.Op] += t.Bytes()
			}
		}
	}
	m := b.e.m
	for name, a := range per {
		result := "completed"
		for st, n := range a.states {
			if n == 0 {
				continue
			}
			m.tasks.WithLabelValues(name, TaskState(st).String()).Add(float64(n))
			if TaskState(st) != Completed {
				result = "failed"
			}
		}
		for op, n := range a.bytes {
			if n > 0 {
				m.bytes.WithLabelValues(name, Op(op).String()).Add(float64(n))
			}
		}
		m.batches.WithLabelValues(name, result).Inc()
		m.seconds.WithLabelValues(name).Observe(el)
	}
	close(b.done)
}

// Done is closed when every task has left Pending.
func (b *Batch) Done() <-chan struct{} { return b.done }

// Status returns task i's state.
func (b *Batch) Status(i int) TaskStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.statusLocked(i)
}

func (b *Batch) statusLocked(i int) TaskStatus {
	t := &b.tasks[i]
	return TaskStatus{State: t.state, Err: t.err, Transport: b.groups[t.g].t.Name()}
}

// Statuses returns every task's state.
func (b *Batch) Statuses() []TaskStatus {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]TaskStatus, len(b.tasks))
	for i := range b.tasks {
		out[i] = b.statusLocked(i)
	}
	return out
}

// Wait blocks until the batch is done (or ctx ends) and returns nil if every
// task completed, else the first failure with the count of failed tasks.
func (b *Batch) Wait(ctx context.Context) error {
	select {
	case <-b.done:
	case <-ctx.Done():
		return ctxErr(ctx, "wait for batch")
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var first error
	n := 0
	for i := range b.tasks {
		if s := b.statusLocked(i); s.State != Completed {
			n++
			if first == nil {
				first = fmt.Errorf("task %d via %s %v: %w", i, s.Transport, s.State, s.Err)
			}
		}
	}
	if first != nil {
		return fmt.Errorf("transfer: %d of %d tasks failed; first: %w", n, len(b.tasks), first)
	}
	return nil
}

// Transfer submits reqs and waits for them: the synchronous helper.
func (e *Engine) Transfer(ctx context.Context, reqs []Request) error {
	b, err := e.Submit(ctx, reqs)
	if err != nil {
		return err
	}
	return b.Wait(context.WithoutCancel(ctx)) // the batch itself is bounded
}
