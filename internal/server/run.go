package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	samp "github.com/mooncake-go/mooncake-go/internal/sampling"
)

// errNoFinish is the abort cause when a Generator closes a request's channel
// without a Finish event.
var errNoFinish = errors.New("server: generator closed the stream without a finish event")

// run is one request on the Generator: it accumulates the output, measures
// latencies and logs the request when it ends. The run of an HTTP request whose
// body asks for several generations (a batch, or n > 1) is the parent of one run per
// generation (its kids); the kids are logged and measured, the parent answers.
type run struct {
	s        *Server
	endpoint string
	req      *engine.Request
	start    time.Time
	events   <-chan engine.Event
	closed   bool

	parent *run
	kids   []*run
	cancel context.CancelFunc      // parent of kids: aborts them all
	abort  context.CancelCauseFunc // kid: aborts it (/abort_request); called at its end

	text     strings.Builder
	ids      []int
	logprobs []float32
	tops     [][]samp.TopLogprob
	finish   *engine.Finish
	// first and last are the times of the first and the latest output token.
	first, last time.Time
	status      int // logged
	logged      bool
}

// newID returns a random request id with a prefix.
func newID(prefix string) string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// begin makes a run for an endpoint; call end (through a defer) once.
func (s *Server) begin(endpoint string) *run {
	s.metrics.inflight.Inc()
	return &run{s: s, endpoint: endpoint, start: time.Now(), status: http.StatusOK}
}

// fork adds a kid: one generation of rn's request.
func (rn *run) fork() *run {
	k := &run{s: rn.s, endpoint: rn.endpoint, start: rn.start, status: http.StatusOK, parent: rn}
	rn.kids = append(rn.kids, k)
	return k
}

// submit prepares disaggregation and submits req. maxZero requests finish at
// once with no output. h is the request's header, which carries the LB's
// voucher for boot.
func (rn *run) submit(ctx context.Context, h http.Header, req *engine.Request, boot *Bootstrap, maxZero bool) *Error {
	rn.req = req
	if req.ID == "" {
		req.ID = newID("")
	}
	if boot != nil {
		req.Room = boot.Room
	}
	if e := rn.s.admit(h, boot, req.ID); e != nil {
		return e
	}
	if boot != nil {
		// Zero new tokens need no KV on either side: both answer at once,
		// so no room is opened that the other side would never join.
		if p := rn.s.cfg.PrepareDisagg; p != nil && !maxZero {
			if err := p(ctx, req, *boot); err != nil {
				return asError(fmt.Errorf("disaggregation: %w", err))
			}
		}
	}
	if maxZero {
		ch := make(chan engine.Event, 1)
		ch <- engine.Event{Token: -1, Finish: &engine.Finish{Type: "length", PromptTokens: len(req.InputIDs)}}
		close(ch)
		rn.events = ch
		return nil
	}
	ch, err := rn.s.cfg.Generator.Submit(ctx, req)
	if err != nil {
		return asError(err)
	}
	rn.events = ch
	return nil
}

// next returns the next event, accumulated into the run; ok is false after
// the event that carried the Finish (or when the channel closed without
// one, which becomes an abort).
func (rn *run) next() (ev engine.Event, ok bool) {
	if rn.finish != nil || rn.events == nil {
		return engine.Event{}, false
	}
	ev, ok = <-rn.events
	return rn.apply(ev, ok)
}

// apply accumulates an event read from the run's channel (ok false: the channel
// closed); it returns what next returns.
func (rn *run) apply(ev engine.Event, ok bool) (engine.Event, bool) {
	if !ok {
		rn.closed = true
		if rn.finish != nil {
			return engine.Event{}, false
		}
		ev = engine.Event{Token: -1, Finish: &engine.Finish{Type: "abort", Err: errNoFinish}}
	}
	if rn.finish != nil {
		return engine.Event{}, false
	}
	now := time.Now()
	if ev.Token >= 0 {
		if len(rn.ids) == 0 {
			rn.first = now
			rn.s.metrics.firstToken(now.Sub(rn.start))
			if rn.s.lg.Core().Enabled(zap.DebugLevel) {
				rn.s.lg.Debug("first token", zap.String("rid", rn.req.ID), zap.Uint64("room", rn.req.Room), zap.Duration("ttft", now.Sub(rn.start)))
			}
		} else {
			rn.s.metrics.nextToken(now.Sub(rn.last))
		}
		rn.last = now
		rn.ids = append(rn.ids, ev.Token)
		rn.logprobs = append(rn.logprobs, ev.Logprob)
		rn.tops = append(rn.tops, ev.Top)
	}
	rn.text.WriteString(ev.Text)
	if ev.Finish != nil {
		rn.finish = ev.Finish
		if len(rn.ids) > 0 {
			rn.s.metrics.lastToken(rn, now)
		}
	}
	return ev, true
}

// collect reads every event.
func (rn *run) collect() {
	for {
		if _, ok := rn.next(); !ok {
			return
		}
	}
}

// drain reads what is left of the channel, so the Generator never blocks on
// a request nobody reads.
func (rn *run) drain() {
	if rn.events == nil || rn.closed {
		return
	}
	for range rn.events {
	}
	rn.closed = true
}

// failure is the error that aborted the run, if any.
// A request ended by /abort_request did not fail: it is answered with what it
// generated.
func (rn *run) failure() error {
	if rn.finish != nil && rn.finish.Type == "abort" && !errors.Is(rn.finish.Err, ErrAbortRequested) {
		return rn.finish.Err
	}
	return nil
}

func (rn *run) promptTokens() int {
	if rn.finish != nil && rn.finish.PromptTokens > 0 {
		return rn.finish.PromptTokens
	}
	if rn.req != nil {
		return len(rn.req.InputIDs)
	}
	return 0
}

// cachedTokens are the prompt tokens not computed for the request (the
// prefix cache, here or on the prefill server).
func (rn *run) cachedTokens() int {
	if rn.finish != nil {
		return rn.finish.CachedTokens
	}
	return 0
}

func (rn *run) completionTokens() int {
	if rn.finish != nil && rn.finish.OutputTokens > len(rn.ids) {
		return rn.finish.OutputTokens
	}
	return len(rn.ids)
}

// end drains the channel and logs the request: one line per generation. A
// parent ends its kids (with its status where theirs is still 200).
func (rn *run) end(err error) {
	if rn.parent == nil {
		rn.s.metrics.inflight.Dec()
		if !rn.logged {
			rn.s.metrics.done(rn.endpoint, rn.status)
		}
	}
	if len(rn.kids) > 0 {
		if rn.cancel != nil {
			defer rn.cancel()
		}
		rn.logged = true
		for _, k := range rn.kids {
			if k.status == http.StatusOK {
				k.status = rn.status
			}
			k.end(err)
		}
		return
	}
	rn.drain()
	if rn.abort != nil {
		rn.s.live.remove(rn.req.ID, rn)
		rn.abort(nil)
	}
	if rn.logged {
		return
	}
	rn.logged = true
	rn.s.metrics.finished(rn)
	fields := []zap.Field{
		zap.String("endpoint", rn.endpoint),
		zap.Int("status", rn.status),
		zap.Duration("latency", time.Since(rn.start)),
	}
	if rn.req != nil {
		fields = append(fields, zap.String("rid", rn.req.ID), zap.Uint64("room", rn.req.Room),
			zap.Int("prompt_tokens", rn.promptTokens()), zap.Int("completion_tokens", rn.completionTokens()))
	}
	if rn.finish != nil {
		fields = append(fields, zap.String("finish", rn.finish.Type))
	}
	if err == nil {
		err = rn.failure()
	}
	if err != nil {
		fields = append(fields, zap.Error(err))
	}
	switch {
	case rn.status >= 500:
		rn.s.lg.Warn("request", fields...)
	default:
		rn.s.lg.Info("request", fields...)
	}
}

// fail writes an error response (before anything else was written) and
// records its status.
func (rn *run) fail(w http.ResponseWriter, e *Error) {
	rn.status = e.Status
	if e.Status != statusClientClosed {
		writeError(w, e)
	}
}

// gate answers the checks every generation endpoint shares: readiness.
func (s *Server) gate() *Error {
	if !s.ready() {
		return errorf(http.StatusServiceUnavailable, "server is not ready")
	}
	return nil
}

// elapsed is seconds since the run started.
func (rn *run) elapsed() float64 { return time.Since(rn.start).Seconds() }

// accept runs the steps every generation endpoint begins with: readiness,
// the body cap and decoding. When it returns false the error response has
// been written.
func accept[T any](s *Server, w http.ResponseWriter, r *http.Request, rn *run, decode func([]byte) (T, *Error)) (T, bool) {
	var zero T
	if e := s.gate(); e != nil {
		rn.fail(w, e)
		return zero, false
	}
	body, e := readBody(w, r, s.cfg.MaxBodyBytes)
	if e != nil {
		rn.fail(w, e)
		return zero, false
	}
	v, e := decode(body)
	if e != nil {
		rn.fail(w, e)
		return zero, false
	}
	return v, true
}
