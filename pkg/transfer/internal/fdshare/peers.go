package fdshare

import (
	"context"
	"fmt"
	"sync"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Peers is an initiator's table of per-incarnation peer states (P, the
// transport's), and the goroutines its transport's Close waits for:
// batches, completions, Client readers (pass Go as ClientConfig.Go).
type Peers[P any] struct {
	open func(*transfer.Descriptor) P
	shut func(P, error)

	ctx    context.Context // canceled when Close begins; bounds Bound
	cancel context.CancelFunc

	mu     sync.Mutex
	m      map[string]P
	closed bool
	wg     sync.WaitGroup
}

// NewPeers returns an empty table: open makes the state of a new peer
// incarnation (no I/O), shut releases one (with the reason it is gone).
func NewPeers[P any](open func(*transfer.Descriptor) P, shut func(P, error)) *Peers[P] {
	ctx, cancel := context.WithCancel(context.Background())
	return &Peers[P]{open: open, shut: shut, ctx: ctx, cancel: cancel, m: map[string]P{}}
}

// Get returns the state of d's incarnation, creating it (no I/O);
// transfer.ErrClosed after Close.
func (s *Peers[P]) Get(d *transfer.Descriptor) (P, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		var zero P
		return zero, transfer.ErrClosed
	}
	p, ok := s.m[d.Incarnation]
	if !ok {
		p = s.open(d)
		s.m[d.Incarnation] = p
	}
	return p, nil
}

// Lookup returns the state of incarnation inc, if there is one.
func (s *Peers[P]) Lookup(inc string) (P, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.m[inc]
	return p, ok
}

// All returns every state in the table.
func (s *Peers[P]) All() []P {
	s.mu.Lock()
	defer s.mu.Unlock()
	ps := make([]P, 0, len(s.m))
	for _, p := range s.m {
		ps = append(ps, p)
	}
	return ps
}

// Drop forgets d's incarnation and shuts its state with an error wrapping
// transfer.ErrPeerRestarted.
func (s *Peers[P]) Drop(d *transfer.Descriptor) {
	s.mu.Lock()
	p, ok := s.m[d.Incarnation]
	delete(s.m, d.Incarnation)
	s.mu.Unlock()
	if ok {
		s.shut(p, fmt.Errorf("%w: %s incarnation %s was dropped", transfer.ErrPeerRestarted, d.Name, d.Incarnation))
	}
}

// Go runs fn on a goroutine Close waits for; false if closed.
func (s *Peers[P]) Go(fn func()) bool {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return false
	}
	s.wg.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.wg.Done()
		fn()
	}()
	return true
}

// Submit hands a batch for d to the transport: fast runs on the caller's
// goroutine and reports whether it took the batch; if not, slow runs on a
// goroutine Close waits for. After Close the tasks fail with
// transfer.ErrClosed.
func (s *Peers[P]) Submit(d *transfer.Descriptor, tasks []*transfer.Task, fast func(P) bool, slow func(P)) {
	p, err := s.Get(d)
	if err != nil {
		FailAll(tasks, err)
		return
	}
	if fast(p) {
		return
	}
	if !s.Go(func() { slow(p) }) {
		FailAll(tasks, transfer.ErrClosed)
	}
}

// Bound runs fn (a blocking connect) with a context that ends with ctx or
// when Close begins.
func (s *Peers[P]) Bound(ctx context.Context, fn func(context.Context) error) error {
	cctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.ctx, cancel)
	err := fn(cctx)
	stop()
	cancel()
	return err
}

// Close ends the table: Get and Go fail from now on, Bound calls are
// canceled, every state is shut with transfer.ErrClosed, then Close waits
// for the goroutines started with Go.
func (s *Peers[P]) Close() {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.closed = true
	m := s.m
	s.m = map[string]P{}
	s.mu.Unlock()
	s.cancel()
	for _, p := range m {
		s.shut(p, transfer.ErrClosed)
	}
	s.wg.Wait()
}
