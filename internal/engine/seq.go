package engine

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

type seqState int

const (
	stateQueued seqState = iota
	statePrefill
	stateDecode
	stateDone
)

// seq is the engine's state of one request. Until admission it belongs to
// whoever removes it from the queue under Engine.mu; after admission, to the
// loop; finish ends it exactly once.
type seq struct {
	req     Request // a copy; InputIDs cloned
	prompt  []int32
	maxNew  int
	stopIDs map[int]bool
	hook    PrefillHook

	needPages int             // pages to add to table at admission
	table     *kvcache.Table  // the request's pages (preloaded ones first)
	hookDone  bool            // Done was called on the prefill hook
	gate      <-chan struct{} // PrefillGate's channel (nil: none)
	readyAt   time.Time       // since when the request waits for pages
	ended     chan struct{}   // closed by finish

	state     seqState
	cached    int      // prompt tokens taken from the prefix cache (or the prefill's)
	outIDs    []int32  // output tokens, for the prefix cache
	prefilled int      // prompt tokens whose KV is in the pool
	pos       int      // position of next (decode)
	next      [1]int32 // token to feed at pos
	output    int      // output tokens so far, and the sampling step of the next
	lastPass  uint64   // the last pass s was in (0: none)
	seed      uint64
	sampler   *sampling.Sampler
	// dev is the request's device sampling state (nil: host only);
	// devPending the accepted tokens it has not counted yet.
	dev        compute.SamplerState
	devPending []int32
	text       *textOut

	submitted time.Time
	lastToken time.Time

	abortErr atomic.Pointer[error] // set when the request's context is done
	ctxCause func() error          // the request context's cause, nil while it lives
	stopCtx  func() bool           // unregisters the context.AfterFunc
	out      *outbox
}

// kvTokens are the tokens whose KV is in s's pages: the prompt's computed
// part, then the output tokens fed back so far.
func (s *seq) kvTokens() []int32 {
	switch s.state {
	case statePrefill, stateQueued:
		return s.prompt[:s.prefilled]
	}
	fed := s.pos - len(s.prompt)
	return append(s.prompt[:len(s.prompt):len(s.prompt)], s.outIDs[:max(0, min(fed, len(s.outIDs)))]...)
}

// gated reports whether s waits for its PrefillGate, noting when it opens.
func (s *seq) gated(now time.Time) bool {
	if s.gate == nil {
		return false
	}
	select {
	case <-s.gate:
		s.gate = nil
		s.readyAt = now
		return false
	default:
		return true
	}
}

// aborted returns why s must be aborted, nil if it need not. It looks at
// the context itself, so a cancel is seen by the next step even before the
// context.AfterFunc goroutine runs.
func (s *seq) aborted() error {
	if p := s.abortErr.Load(); p != nil {
		return *p
	}
	if s.ctxCause != nil {
		if err := s.ctxCause(); err != nil {
			return err
		}
	}
	if a, ok := s.hook.(PrefillAborter); ok {
		return a.Aborted()
	}
	return nil
}

// outbox queues a request's events without ever blocking the engine; a
// forwarder goroutine moves them to the request's channel.
type outbox struct {
	mu     sync.Mutex
	q      []Event
	final  bool
	notify chan struct{} // capacity 1
}

func newOutbox() *outbox { return &outbox{notify: make(chan struct{}, 1)} }

func (o *outbox) post(ev Event) {
	o.mu.Lock()
	o.q = append(o.q, ev)
	if ev.Finish != nil {
		o.final = true
	}
	o.mu.Unlock()
	select {
	case o.notify <- struct{}{}:
	default:
	}
}

func (o *outbox) take(dst []Event) ([]Event, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	dst = append(dst[:0], o.q...)
	clear(o.q)
	o.q = o.q[:0]
	return dst, o.final
}

// forward delivers o's events to ch in order and closes ch after the
// Finish event. If ctx ends first (the client went away), it stops waiting
// for the reader: it waits for the engine to finish the request, offers the
// Finish event without blocking, and closes ch.
func forward(ctx context.Context, o *outbox, ch chan<- Event) {
	defer close(ch)
	var buf []Event
	for {
		var final bool
		buf, final = o.take(buf)
		for _, ev := range buf {
			select {
			case ch <- ev:
				if ev.Finish != nil {
					return
				}
			case <-ctx.Done():
				if last := buf[len(buf)-1]; last.Finish != nil {
					offer(ch, last)
					return
				}
				forwardCancelled(o, ch)
				return
			}
		}
		if final {
			return // unreachable: the Finish event returned above
		}
		select {
		case <-o.notify:
		case <-ctx.Done():
			forwardCancelled(o, ch)
			return
		}
	}
}

func forwardCancelled(o *outbox, ch chan<- Event) {
	var buf []Event
	for {
		var final bool
		buf, final = o.take(buf)
		if final {
			offer(ch, buf[len(buf)-1])
			return
		}
		<-o.notify // the engine finishes an aborted request promptly
	}
}

func offer(ch chan<- Event, ev Event) {
	select {
	case ch <- ev:
	default:
	}
}
