package tcp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/staging"
)

// Staging directions: each has its own ring, so the side of a lane that
// sends never waits for staging the side that receives holds (and so never
// for the peer).
const (
	toWire   = 0 // device -> staging -> socket
	fromWire = 1 // socket -> staging -> device
)

// stager is one lane's staging memory for device regions: a ring of
// slots*chunk bytes per direction in one allocation, made once at the first
// device request (from that region's transfer.DeviceMemory) and freed when
// the lane ends. Pieces take exactly their length from the ring, in order,
// so small pieces pack; they give it back in about the same order.
type stager struct {
	chunk, slots int
	// budget, when set, is shared by the lanes a transport serves: their
	// staging together stays within it.
	budget *staging.Budget

	once  sync.Once
	err   error
	mem   transfer.Staging
	rings [2]ring

	busy   sync.WaitGroup // copies past their context, still holding a slot
	leaked atomic.Bool    // a copy never ended: the memory must not be freed
}

func newStager(chunk, slots int) *stager { return &stager{chunk: chunk, slots: slots} }

// slot is a piece's span of a ring.
type slot struct {
	b  []byte
	sp *staging.Span
}

// ring is one direction's staging bytes and the ring handing out spans of
// them.
type ring struct {
	buf []byte
	r   *staging.Ring
}

func (r *ring) tryAlloc(n int) (*slot, bool) {
	sp, ok := r.r.TryAlloc(n)
	if !ok {
		return nil, false
	}
	return &slot{b: sp.Of(r.buf), sp: sp}, true
}

func (r *ring) release(s *slot) { r.r.Release(s.sp) }

// init allocates the staging memory from dev the first time; later calls
// return the first call's error.
func (s *stager) init(dev transfer.DeviceMemory) error {
	s.once.Do(func() {
		per := s.slots * s.chunk
		if !s.budget.Take(int64(2 * per)) {
			s.err = fmt.Errorf("%w: tcp: the staging of served lanes is at its limit of %d bytes (Config.MaxServedStaging)", transfer.ErrDeviceCopy, s.budget.Max)
			return
		}
		m, err := dev.AllocStaging(2 * per)
		if err != nil {
			s.budget.Give(int64(2 * per))
			s.err = fmt.Errorf("tcp: %d bytes of staging: %w", 2*per, err)
			return
		}
		if b := m.Bytes(); len(b) < 2*per {
			m.Close()
			s.budget.Give(int64(2 * per))
			s.err = fmt.Errorf("tcp: staging of %d bytes, asked for %d", len(b), 2*per)
			return
		}
		s.mem = m
		b := m.Bytes()
		for d := range s.rings {
			s.rings[d] = ring{buf: b[d*per : (d+1)*per : (d+1)*per], r: staging.NewRing(uint64(per))}
		}
	})
	return s.err
}

// tryGet takes n bytes (at most chunk) of direction d's ring, if free.
func (s *stager) tryGet(d, n int) (*slot, bool) { return s.rings[d].tryAlloc(n) }

// get waits for n bytes of direction d's ring, at most tmo or until stop.
func (s *stager) get(d, n int, stop <-chan struct{}, tmo time.Duration) (*slot, error) {
	t := time.NewTimer(tmo)
	defer t.Stop()
	for {
		if sl, ok := s.tryGet(d, n); ok {
			return sl, nil
		}
		if err := s.wait(d, stop, t.C); err != nil {
			return nil, fmt.Errorf("%w (%d bytes wanted, after %v)", err, n, tmo)
		}
	}
}

// wait returns once some staging of direction d was released (or an
// earlier release was not yet seen), or fails on stop or expiry.
func (s *stager) wait(d int, stop <-chan struct{}, expiry <-chan time.Time) error {
	select {
	case <-s.rings[d].r.Freed():
		return nil
	case <-stop:
		return errStopped
	case <-expiry:
		return fmt.Errorf("%w: tcp: no staging came free (%d bytes per direction)", transfer.ErrDeviceCopy, s.slots*s.chunk)
	}
}

var errStopped = errors.New("tcp: lane ended")

func (s *stager) put(d int, sl *slot) {
	if sl != nil {
		s.rings[d].release(sl)
	}
}

// settle takes over a copy whose waiter's context ended: it waits for the
// copy at most bound more, then calls done(ended) and, if the copy ended,
// returns the slot. A copy that never ends keeps its slot, and the staging
// memory is then never freed. done gets the copy's result (a context error
// if it never ended).
func (s *stager) settle(d int, slot *slot, c transfer.Completion, bound time.Duration, done func(err error, ended bool)) {
	s.busy.Add(1)
	go func() {
		defer s.busy.Done()
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		err := c.Wait(ctx)
		ended := err == nil || ctx.Err() == nil || errors.Is(err, transfer.ErrDeviceCopy)
		cancel()
		if ended {
			s.put(d, slot)
		} else {
			s.leaked.Store(true)
		}
		done(err, ended)
	}()
}

// close frees the staging memory once no copy holds a slot. Call it after
// the lane's goroutines ended.
func (s *stager) close() error {
	s.busy.Wait()
	if s.mem == nil || s.leaked.Load() {
		return nil
	}
	s.budget.Give(int64(2 * s.slots * s.chunk))
	return s.mem.Close()
}

// deviceOf returns the region's device memory, if it must be staged. A GPU
// region without one cannot be reached by tcp at all.
func deviceOf(r *transfer.Region) (transfer.DeviceMemory, error) {
	if r == nil {
		return nil, nil
	}
	if dm, ok := r.Memory.(transfer.DeviceMemory); ok {
		return dm, nil
	}
	if r.Location.Kind != transfer.CPU {
		return nil, fmt.Errorf("%w: tcp: %v region [%#x, +%d) has no transfer.DeviceMemory to stage through (register it WithMemory)",
			transfer.ErrDeviceCopy, r.Location, r.Addr, r.Len)
	}
	return nil, nil
}

// ended reports whether c already ended successfully, without waiting:
// done is a context that is already done (a completion that ended reports
// its result even then).
func ended(done context.Context, c transfer.Completion) bool { return c.Wait(done) == nil }

// doneContext returns a context that is already done.
func doneContext() context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return ctx
}

// doneCopy is a Completion that ended successfully.
type doneCopy struct{}

func (doneCopy) Wait(context.Context) error { return nil }

// copyRuns starts the device copies of a staged vector whose ranges es lie
// back to back in one slot, one copy per run of ranges that are contiguous
// in device memory too: start copies n bytes between device address addr
// and the slot at offset off. A copy that fails to start ends the list
// with its error, named by entry; the ones started still run, so the
// result's Wait returns only once they ended.
func copyRuns(es []entry, start func(addr, off, n uint64) (transfer.Completion, error)) transfer.Completion {
	var cs allOf
	var off uint64
	for i := 0; i < len(es); {
		first, n := i, es[i].len
		for i++; i < len(es) && es[i].addr == es[i-1].addr+es[i-1].len; i++ {
			n += es[i].len
		}
		c, err := start(es[first].addr, off, n)
		if err != nil {
			if len(es) > 1 {
				err = fmt.Errorf("entry %d: %w", first, err)
			}
			c, i = failed{err}, len(es)
		}
		cs = append(cs, c)
		off += n
	}
	if len(cs) == 1 {
		return cs[0]
	}
	return cs
}

// allOf is several copies as one Completion: Wait returns a context error
// while one of them may still run, otherwise once all ended, with the
// first failure.
type allOf []transfer.Completion

func (cs allOf) Wait(ctx context.Context) error {
	var first error
	for _, c := range cs {
		err := c.Wait(ctx)
		if err != nil && ctx.Err() != nil && !errors.Is(err, transfer.ErrDeviceCopy) {
			return err
		}
		if first == nil {
			first = err
		}
	}
	return first
}

// failed is a Completion that failed before it started.
type failed struct{ err error }

func (f failed) Wait(context.Context) error { return f.err }
