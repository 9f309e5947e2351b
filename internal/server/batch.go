package server

import (
	"context"
	"net/http"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

// A request of several generations (a batch of prompts, or n > 1) runs each as its
// own engine request: the parent run (the HTTP request) forks one kid per generation,
// prompt i's sample j at index i*n + j (SGLang's order). With a prefix cache, a prompt
// asked n > 1 times is computed once first (one token, discarded) so that its n
// samples take its pages from the cache instead of computing it n times. The engine
// could do better: one prefill, then n sequences sharing the prompt's pages by
// reference count, including the prompt's last partial page.

// submitAll tokenizes every prompt of sp and submits its generations as kids of rn.
// On an error every kid already submitted is aborted (rn.end drains them).
func (s *Server) submitAll(r *http.Request, rn *run, sp *spec) *Error {
	if e := s.checkCount(sp); e != nil {
		return e
	}
	reqs := make([]*engine.Request, len(sp.prompts))
	zero := make([]bool, len(sp.prompts))
	for i := range sp.prompts {
		var e *Error
		if reqs[i], zero[i], e = s.build(sp, i); e != nil {
			return e
		}
	}
	ctx, cancel := context.WithCancel(r.Context())
	rn.cancel = cancel
	n := max(sp.n, 1)
	for i, req := range reqs {
		if n > 1 && s.cfg.PrefixCache && !zero[i] {
			if e := s.warm(ctx, r.Header, req); e != nil {
				cancel()
				return e
			}
		}
		for j := range n {
			k := rn.fork()
			kctx, kcancel := context.WithCancelCause(ctx)
			k.abort = kcancel
			if e := k.submit(kctx, r.Header, sample(sp, req, i, j), sp.boot, zero[i]); e != nil {
				cancel()
				return e
			}
			s.live.add(k.req.ID, k, kcancel)
		}
	}
	return nil
}

// sample is prompt i's request for its sample j: its own id and, with a seed, seed+j
// (so that the n samples differ and sample 0 is what n=1 gives).
func sample(sp *spec, req *engine.Request, i, j int) *engine.Request {
	c := *req
	c.ID = sp.rid(i, j)
	if j > 0 && c.Params.Seed != nil {
		seed := *c.Params.Seed + int64(j)
		c.Params.Seed = &seed
	}
	return &c
}

// warm computes req's prompt into the prefix cache: one token, discarded.
func (s *Server) warm(ctx context.Context, h http.Header, req *engine.Request) *Error {
	w := *req
	w.ID = newID("prefix-")
	w.Params.MaxNewTokens, w.Logprobs, w.TopLogprobs = 1, false, 0
	if e := s.admit(h, nil, w.ID); e != nil {
		return e
	}
	ch, err := s.cfg.Generator.Submit(ctx, &w)
	if err != nil {
		return asError(err)
	}
	var fin *engine.Finish
	for ev := range ch {
		if ev.Finish != nil {
			fin = ev.Finish
		}
	}
	switch {
	case fin == nil:
		return asError(errNoFinish)
	case fin.Type == "abort":
		return asError(fin.Err)
	}
	s.lg.Debug("prompt cached for n > 1", zap.String("rid", w.ID), zap.Int("prompt_tokens", len(w.InputIDs)))
	return nil
}

// collectAll reads every kid to its end; it returns the first failure (the others are
// aborted).
func (rn *run) collectAll() error {
	for _, k := range rn.kids {
		k.collect()
		if err := k.failure(); err != nil {
			rn.cancel()
			return err
		}
	}
	return nil
}

// kidEvent is an event of kid k (ok false: its channel closed).
type kidEvent struct {
	k  int
	ev engine.Event
	ok bool
}

// streamAll is stream for the kids of rn: their events in the order they come.
// emit gets each kid's events (k is its index); a failure of any kid aborts the
// others and, if no output was sent, is answered as a plain HTTP error, otherwise
// as an error event without [DONE].
func (rn *run) streamAll(w http.ResponseWriter, emit func(out *sse, k int, ev engine.Event), final func(out *sse)) {
	merged := make(chan kidEvent)
	live := len(rn.kids)
	for k, kid := range rn.kids {
		go func() {
			for ev := range kid.events {
				merged <- kidEvent{k, ev, true}
			}
			merged <- kidEvent{k: k}
		}()
	}
	// The kids' channels are read here only, until each has closed.
	var out *sse
	var failed error
	started := false
	for live > 0 {
		ke := <-merged
		kid := rn.kids[ke.k]
		if !ke.ok {
			live--
		}
		ev, ok := kid.apply(ke.ev, ke.ok)
		if !ok || failed != nil {
			continue
		}
		if err := kid.failure(); ev.Finish != nil && err != nil {
			failed = err
			rn.cancel()
			continue
		}
		if !started {
			started, out = true, startSSE(w)
		}
		emit(out, ke.k, ev)
	}
	if failed != nil {
		e := asError(failed)
		rn.status = e.Status
		if !started {
			rn.fail(w, e)
		} else if e.Status != statusClientClosed {
			out.fail(e)
		}
		return
	}
	if !started {
		out = startSSE(w)
	}
	if final != nil {
		final(out)
	}
	out.done()
}
