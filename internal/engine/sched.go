package engine

import (
	"context"
	"fmt"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// loop runs steps until ctx ends or Close.
//
// One step: finish aborted requests; admit queued requests in FIFO order
// while there is a running slot and the head's pages can be allocated; run
// one forward pass over every decoding request (one token each) plus prompt
// chunks of prefilling requests, oldest first, up to ChunkedPrefillSize
// tokens; sample and emit. With nothing to run, the loop sleeps until a
// request arrives or ends, pages are freed (the allocator says so: they can
// be freed outside the engine, by the disaggregation layer), a gate opens or
// a queued request's wait bound passes.
func (e *Engine) loop(ctx context.Context) error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-e.done:
			return nil
		default:
		}
		e.reap()
		freed := e.pages.Changed() // before admit: no release is missed
		next := e.admit()
		if len(e.running) == 0 && e.fl == nil {
			var wait <-chan time.Time
			if !next.IsZero() {
				timer.Reset(max(time.Until(next), 0))
				wait = timer.C
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-e.done:
				return nil
			case <-e.wake:
			case <-freed:
			case <-wait:
			}
			timer.Stop() // Go 1.23 timers: no stale tick after Stop or Reset
			continue
		}
		if err := e.step(ctx); err != nil && ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

// reap finishes running requests whose context ended.
func (e *Engine) reap() {
	for _, s := range e.running {
		if err := s.aborted(); err != nil {
			e.finishAbort(s, err)
		}
	}
	e.compact()
}

// compact drops finished requests from the running list.
func (e *Engine) compact() {
	e.running = slices.DeleteFunc(e.running, func(s *seq) bool { return s.state == stateDone })
	e.nRunning.Store(int64(len(e.running)))
}

// admit moves queued requests into the running batch, FIFO, while there is
// a slot and the head's pages can be allocated. A request waiting for its
// PrefillGate is passed over (it is not waiting for pages) unless the pool
// has room to spare; one that waited
// MaxQueueWait for pages, or whose hook aborted it, is finished. It returns
// when the oldest waiting request's bound passes (zero if none waits).
func (e *Engine) admit() (next time.Time) {
	var admitted, expired []*seq
	var aborted []abortedSeq
	now := time.Now()
	e.mu.Lock()
	blocked := false
	kept := e.queue[:0]
	for _, s := range e.queue {
		if err := s.aborted(); err != nil {
			aborted = append(aborted, abortedSeq{s, err})
			continue
		}
		if s.gated(now) {
			// Waiting for its peer, not for pages: admitted early only
			// while the pool can afford it (a quarter of it stays for
			// requests whose peers are ready, so rooms admitted early can
			// never starve them).
			if !blocked && len(e.running) < e.cfg.MaxRunningRequests &&
				e.pages.Free()-s.needPages >= e.pages.Total()/4 && e.reserve(s) {
				e.running = append(e.running, s)
				admitted = append(admitted, s)
				continue
			}
			kept = append(kept, s)
			continue
		}
		deadline := s.readyAt.Add(e.cfg.MaxQueueWait)
		if !now.Before(deadline) {
			expired = append(expired, s)
			continue
		}
		if !blocked && len(e.running) < e.cfg.MaxRunningRequests && e.reserve(s) {
			e.running = append(e.running, s)
			admitted = append(admitted, s)
			continue
		}
		blocked = true // FIFO: nothing overtakes a request waiting for pages
		if next.IsZero() || deadline.Before(next) {
			next = deadline
		}
		kept = append(kept, s)
	}
	clear(e.queue[len(kept):])
	e.queue = kept
	if len(e.queue) == 0 {
		e.queue = nil // let the backing array go
	}
	e.mu.Unlock()
	for _, a := range aborted {
		e.finishAbort(a.s, a.err)
	}
	for _, s := range expired {
		e.finishAbort(s, fmt.Errorf("%w: waited %v for %d KV pages (%d free of %d; --max-queue-wait)",
			ErrQueueTimeout, e.cfg.MaxQueueWait, s.needPages, e.pages.Free(), e.pages.Total()))
	}
	for _, s := range admitted {
		e.start(s)
	}
	if len(admitted) > 0 {
		e.compact()
	}
	return next
}

// reserve gives s its pages: first the longest cached prefix of its prompt
// (all but its last token, whose logits must be computed), then fresh ones
// (the allocator evicts from the cache when short). It reports false, with
// nothing taken, if the pages are not there.
func (e *Engine) reserve(s *seq) bool {
	if s.needPages == 0 {
		return true
	}
	var m *kvcache.Match
	if c := e.cfg.Cache; c != nil && s.req.Preloaded == nil && s.prefilled == 0 {
		m = c.Lookup(s.prompt[:len(s.prompt)-1])
		defer m.Done()
		if len(m.Pages) > 0 && s.table.Share(m.Pages) != nil {
			m.Pages = nil
		}
	}
	shared := 0
	if m != nil {
		shared = len(m.Pages)
	}
	if err := s.table.Grow(s.needPages - shared); err != nil {
		if shared > 0 {
			s.table.Release()
			s.table = e.pages.NewTable()
		}
		return false
	}
	if shared > 0 {
		s.cached, s.prefilled = m.Tokens(), m.Tokens()
	}
	if m != nil {
		e.m.cacheQuery.Add(float64(len(s.prompt)))
		e.m.cacheHit.Add(float64(s.cached))
	}
	s.needPages = 0
	return true
}

type abortedSeq struct {
	s   *seq
	err error
}

// start begins an admitted request.
func (e *Engine) start(s *seq) {
	now := time.Now()
	e.m.queueSeconds.Observe(now.Sub(s.submitted).Seconds())
	mode := "colocated"
	switch {
	case s.hook != nil:
		mode = "prefill"
	case s.req.Preloaded != nil:
		mode = "decode"
	}
	e.lg.Info("request admitted", zap.String("rid", s.req.ID), zap.Uint64("room", s.req.Room),
		zap.String("mode", mode), zap.Int("prompt_tokens", len(s.prompt)), zap.Int("max_new_tokens", s.maxNew),
		zap.Int("pages", s.table.Len()), zap.Duration("queued", now.Sub(s.submitted)))
	e.openDevice(s)
	switch {
	case s.hook != nil:
		s.state = statePrefill
		s.hook.Pages(slices.Clone(s.table.IDs()))
		if c, ok := s.hook.(PrefillCacheHook); ok && s.cached > 0 {
			c.Cached(s.cached)
		}
	case s.req.Preloaded != nil:
		// The prefill server sampled step 0; emit counts it, so decoding
		// samples step 1 on, as the colocated request does.
		pl := s.req.Preloaded
		s.state = stateDecode
		s.pos = len(s.prompt)
		s.next[0] = int32(pl.FirstToken)
		lp := float32(0)
		if s.req.Logprobs {
			lp = pl.FirstLogprob
		}
		e.emit(s, pl.FirstToken, lp, pl.FirstTop, false)
	default:
		s.state = statePrefill
	}
}

// openDevice gives s a device sampling state when the model samples on the
// device; without one (refused) s samples on the host.
func (e *Engine) openDevice(s *seq) {
	if e.ds == nil {
		return
	}
	st, err := e.ds.NewSamplerState(samplingParams(s.req.Params), s.seed, s.prompt)
	if err != nil {
		log := e.lg.Debug
		if !e.dsWarned {
			e.dsWarned = true
			log = e.lg.Warn
		}
		log("device sampling state refused; the request samples on the host", zap.String("rid", s.req.ID),
			zap.Uint64("room", s.req.Room), zap.Error(err))
		return
	}
	s.dev = st
}

// logprobs are the chosen token's log-probability and the position's most
// likely tokens under the model's raw distribution: log-softmax of the
// logits at temperature 1, before logit_bias, penalties, temperature and filters. Each
// only when the request asked for it, both from one normalisation: it costs
// an exp per vocabulary entry (1-2 ms at 128K), on the first token's
// critical path. A prefill-only request sees the same flags as its decode
// side, which uses the values only then.
func (e *Engine) logprobs(s *seq, logits []float32, tok int) (float32, []sampling.TopLogprob) {
	if !s.req.Logprobs && s.req.TopLogprobs <= 0 {
		return 0, nil
	}
	lp, top := sampling.Logprobs(logits, tok, s.req.TopLogprobs)
	if !s.req.Logprobs {
		lp = 0
	}
	return lp, top
}

// emit hands one output token to s: text, stop conditions, timing. It
// finishes s if the token ends it. onDevice: s's device state sampled (and
// counted) tok.
func (e *Engine) emit(s *seq, tok int, lp float32, top []sampling.TopLogprob, onDevice bool) {
	now := time.Now()
	if s.output == 0 {
		e.m.ttft.Observe(now.Sub(s.submitted).Seconds())
	} else {
		e.m.itl.Observe(now.Sub(s.lastToken).Seconds())
	}
	s.lastToken = now
	s.output++
	s.sampler.Accept(tok)
	if s.dev != nil && !onDevice {
		s.devPending = append(s.devPending, int32(tok))
	}
	if e.cfg.Cache != nil {
		s.outIDs = append(s.outIDs, int32(tok))
	}

	ev := Event{Token: tok, Logprob: lp, Top: top}
	var f *Finish
	if (e.eos[tok] && !s.req.Params.IgnoreEOS) || s.stopIDs[tok] {
		// The stop token's own text is not output.
		text, m, stop := s.text.flush()
		ev.Text = text
		f = &Finish{Type: "stop", Matched: tok}
		if stop {
			f.Matched = m
		}
	} else {
		text, m, stop := s.text.push(tok)
		ev.Text = text
		switch {
		case stop:
			f = &Finish{Type: "stop", Matched: m}
		case s.output >= s.maxNew:
			rest, m, stop := s.text.flush()
			ev.Text += rest
			switch {
			case stop:
				f = &Finish{Type: "stop", Matched: m}
			case s.hook != nil:
				// A prefill-only request ends after its first token by
				// design, not at a length limit.
				f = &Finish{Type: "stop"}
			default:
				f = &Finish{Type: "length"}
			}
		}
	}
	if f != nil {
		e.finish(s, f, ev)
		return
	}
	s.out.post(ev)
}

func (e *Engine) finishAbort(s *seq, err error) {
	e.finish(s, &Finish{Type: "abort", Err: err}, Event{Token: -1})
}

// finish ends s exactly once: unregisters its context, hands its pages back
// (or to the prefill hook, which releases them when its transfer is done;
// the allocator then wakes the loop), counts and logs it, and posts ev with f.
// While a pass that includes s is still in flight (queued passes, pass.go)
// it reads s's pages and device state, so all of that waits for the pass to
// land; s takes no further part meanwhile.
func (e *Engine) finish(s *seq, f *Finish, ev Event) {
	if s.state == stateDone {
		return
	}
	s.state = stateDone
	if s.lastPass != 0 && s.lastPass > e.landed { // lastPass 0: never in a pass (any goroutine)
		e.deferred = append(e.deferred, deferredFinish{s, f, ev})
		return
	}
	e.end(s, f, ev)
}

// end is finish's work.
func (e *Engine) end(s *seq, f *Finish, ev Event) {
	if s.stopCtx != nil {
		s.stopCtx()
	}
	if s.dev != nil {
		if err := s.dev.Close(); err != nil {
			e.lg.Error("closing the device sampling state", zap.String("rid", s.req.ID), zap.Uint64("room", s.req.Room), zap.Error(err))
		}
		s.dev, s.devPending = nil, nil
	}
	close(s.ended)
	if c := e.cfg.Cache; c != nil {
		c.Insert(s.kvTokens(), s.table.IDs())
	}
	if s.hook != nil && !s.hookDone {
		s.hookDone = true
		release := func() { s.table.Release() }
		if f.Type == "abort" {
			s.hook.Done(-1, 0, nil, f.Err, release)
		} else {
			s.hook.Done(ev.Token, ev.Logprob, ev.Top, nil, release)
		}
	} else if err := s.table.Release(); err != nil {
		e.lg.Error("releasing pages", zap.String("rid", s.req.ID), zap.Uint64("room", s.req.Room), zap.Error(err))
	}
	f.PromptTokens = len(s.prompt)
	f.OutputTokens = s.output
	f.CachedTokens = s.cached
	e.m.requests.WithLabelValues(f.Type).Inc()
	if f.Type == "abort" {
		e.lg.Info("request aborted", zap.String("rid", s.req.ID), zap.Uint64("room", s.req.Room),
			zap.Int("output_tokens", s.output), zap.Error(f.Err))
	} else {
		e.lg.Info("request finished", zap.String("rid", s.req.ID), zap.Uint64("room", s.req.Room),
			zap.String("finish", f.Type), zap.Any("matched", f.Matched),
			zap.Int("prompt_tokens", len(s.prompt)), zap.Int("output_tokens", s.output),
			zap.Duration("e2e", time.Since(s.submitted)))
	}
	ev.Finish = f
	s.out.post(ev)
}
