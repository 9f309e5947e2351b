package engine

import (
	"context"
	"fmt"
	"math"
	"slices"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// A pass is one forward pass: its batch and, once it lands, its results.
//
// Overlapped scheduling: with a model that queues sampling passes
// (compute.AsyncSampler), a pass is started and its results are handled at
// the next step. When every running request is decoding in the pass in
// flight (nothing admitted or prefilling since), that step first starts
// the next decode pass with each request's token taken from the pass in
// flight on the device, then reads and emits the pass in flight's tokens
// while the device computes the next: the device does not wait for the
// host between decode steps. A request that ends on a token of the pass in
// flight (EOS, a stop) has been computed once more for nothing; its pages
// and device state are released when that pass lands (finish defers it).
// One that would end by length is left out of the next pass.
type pass struct {
	id    uint64
	batch []compute.Seq
	seqs  []*seq
	chunk []int // prompt tokens of each seq (0: one decode token)
	dev   bool  // sampled on the device
	samp  []compute.Sample
	res   []compute.Sampled
	from  []int // each seq's row in the pass before whose token it takes (-1: its own); nil: none
	pend  compute.Pending
}

type deferredFinish struct {
	s  *seq
	f  *Finish
	ev Event
}

// free is a pass buffer not in flight, emptied.
func (e *Engine) free() *pass {
	p := &e.passBuf[0]
	if p == e.fl {
		p = &e.passBuf[1]
	}
	p.batch, p.seqs, p.chunk, p.from, p.pend = p.batch[:0], p.seqs[:0], p.chunk[:0], nil, nil
	return p
}

// step runs one forward pass, or lands the one in flight (starting the
// next first when it can), and handles the results.
func (e *Engine) step(ctx context.Context) error {
	if e.fl != nil {
		return e.land(ctx)
	}
	p := e.free()
	nLogits := e.build(p)
	if len(p.batch) == 0 {
		return nil
	}
	// On the device when every logits row's request has a device state.
	p.dev = e.ds != nil && nLogits > 0
	for i, s := range p.seqs {
		if p.batch[i].Logits && s.dev == nil {
			p.dev = false
		}
	}
	if p.dev {
		p.samp = slices.Grow(p.samp[:0], len(p.batch))[:len(p.batch)]
		p.res = slices.Grow(p.res[:0], len(p.batch))[:len(p.batch)]
		for i, s := range p.seqs {
			p.samp[i], p.res[i] = compute.Sample{}, compute.Sampled{}
			if p.batch[i].Logits {
				p.samp[i] = compute.Sample{State: s.dev, Step: uint64(s.output), Accept: s.devPending,
					Logprob: s.req.Logprobs, TopLogprobs: s.req.TopLogprobs}
			}
		}
	} else {
		if need := nLogits * e.vocab; cap(e.slab) < need {
			e.slab = make([]float32, need)
		}
		e.outs = slices.Grow(e.outs[:0], len(p.batch))[:len(p.batch)]
		k := 0
		for i, b := range p.batch {
			e.outs[i] = nil
			if b.Logits {
				e.outs[i] = e.slab[k*e.vocab : (k+1)*e.vocab : (k+1)*e.vocab]
				k++
			}
		}
	}
	if p.dev && e.as != nil {
		if err := e.startPass(ctx, p); err != nil {
			return e.failed(ctx, err, p)
		}
		e.fl = p
		return nil
	}
	e.mark(p)
	err := e.forward(ctx, p)
	e.landed = p.id
	if err != nil {
		return e.failed(ctx, err, p)
	}
	e.handle(p)
	e.compact()
	return nil
}

// build fills p with every decoding request (one token each) and prompt
// chunks of prefilling ones, oldest first, up to ChunkedPrefillSize
// tokens. It returns the logits rows.
func (e *Engine) build(p *pass) (nLogits int) {
	for _, s := range e.running {
		if s.state == stateDecode {
			p.batch = append(p.batch, compute.Seq{
				Tokens: s.next[:], Pos: s.pos, Pages: s.table.IDs()[:e.pagesFor(s.pos+1)], Logits: true,
			})
			p.seqs = append(p.seqs, s)
			p.chunk = append(p.chunk, 0)
			nLogits++
		}
	}
	budget := e.cfg.ChunkedPrefillSize
	if budget < 0 {
		budget = math.MaxInt
	}
	for _, s := range e.running {
		if budget == 0 {
			break
		}
		if s.state != statePrefill {
			continue
		}
		n := min(len(s.prompt)-s.prefilled, budget)
		end := s.prefilled + n
		last := end == len(s.prompt)
		p.batch = append(p.batch, compute.Seq{
			Tokens: s.prompt[s.prefilled:end], Pos: s.prefilled, Pages: s.table.IDs()[:e.pagesFor(end)], Logits: last,
		})
		if lh, ok := s.hook.(PrefillLayerHook); ok {
			p.batch[len(p.batch)-1].Layer = func(l int, ready compute.Fence) { lh.Layer(l, end, ready) }
		}
		p.seqs = append(p.seqs, s)
		p.chunk = append(p.chunk, n)
		budget -= n
		if last {
			nLogits++
		}
	}
	return nLogits
}

// mark gives p its id and its requests their last pass.
func (e *Engine) mark(p *pass) {
	e.passes++
	p.id = e.passes
	for _, s := range p.seqs {
		s.lastPass = p.id
	}
}

// startPass queues device-sampling pass p. The accepted tokens it was
// handed are counted by it from here on.
func (e *Engine) startPass(ctx context.Context, p *pass) (err error) {
	e.mark(p)
	defer func() {
		if r := recover(); r != nil {
			e.lg.Error("starting a forward pass panicked", zap.Any("panic", r), zap.Stack("stack"))
			err = fmt.Errorf("panic: %v", r)
		}
		if err != nil {
			e.landed = p.id // nothing of it runs
		}
	}()
	p.pend, err = e.as.StartSample(ctx, p.batch, p.samp, p.from)
	if err != nil {
		return err
	}
	for i, s := range p.seqs {
		if p.batch[i].Logits {
			s.devPending = s.devPending[:0]
		}
	}
	return nil
}

// wait lands p, started by startPass.
func (e *Engine) wait(p *pass) (err error) {
	defer func() {
		if r := recover(); r != nil {
			e.lg.Error("forward pass panicked", zap.Any("panic", r), zap.Stack("stack"))
			err = fmt.Errorf("panic: %v", r)
		}
		e.landed = max(e.landed, p.id)
	}()
	return p.pend.Wait(p.res)
}

// land handles the pass in flight, starting the next decode pass first
// when every running request is decoding in it.
func (e *Engine) land(ctx context.Context) error {
	fl := e.fl
	var next *pass
	var startErr error
	if e.chainable(fl) {
		next = e.free() // not fl's buffer: fl is still e.fl
		if e.chain(fl, next) {
			if startErr = e.startPass(ctx, next); startErr == nil {
				e.m.queuedPasses.Inc()
			}
		} else {
			next = nil
		}
	}
	e.fl = nil
	if err := e.wait(fl); err != nil {
		if next != nil && startErr == nil {
			_ = e.wait(next) // its tokens came from fl: drop it
		}
		return e.failed(ctx, err, fl, next)
	}
	e.handle(fl)
	switch {
	case startErr != nil:
		e.failed(ctx, startErr, next)
	case next != nil:
		e.fl = next
	}
	e.flushDeferred()
	e.compact()
	return nil
}

// chainable reports whether the next pass can be started before fl's
// results are read: fl decoded every running request on the device.
func (e *Engine) chainable(fl *pass) bool {
	if !fl.dev {
		return false
	}
	for _, n := range fl.chunk {
		if n != 0 {
			return false
		}
	}
	for _, s := range e.running {
		if s.state != stateDone && (s.state != stateDecode || s.lastPass != fl.id) {
			return false
		}
	}
	return true
}

// chain fills next with the decode step after fl's for each of fl's
// requests still running that fl's token does not end by length, its
// token taken from fl on the device. It reports whether any is left.
func (e *Engine) chain(fl, next *pass) bool {
	next.dev = true
	next.samp, next.res, next.from = next.samp[:0], next.res[:0], next.from[:0]
	for i, s := range fl.seqs {
		if s.state == stateDone || s.output+1 >= s.maxNew || s.aborted() != nil {
			continue
		}
		next.batch = append(next.batch, compute.Seq{
			Tokens: s.next[:], Pos: s.pos + 1, Pages: s.table.IDs()[:e.pagesFor(s.pos+2)], Logits: true,
		})
		next.seqs = append(next.seqs, s)
		next.chunk = append(next.chunk, 0)
		next.from = append(next.from, i)
		next.samp = append(next.samp, compute.Sample{State: s.dev, Step: uint64(s.output + 1), Accept: s.devPending,
			Logprob: s.req.Logprobs, TopLogprobs: s.req.TopLogprobs})
		next.res = append(next.res, compute.Sampled{})
	}
	return len(next.batch) > 0
}

// failed ends the requests of the failed passes ps (nil entries skipped)
// with err and returns err (ctx's error when shutting down: Run then aborts
// everyone with ErrClosed).
func (e *Engine) failed(ctx context.Context, err error, ps ...*pass) error {
	if ctx.Err() != nil {
		e.flushDeferred()
		return ctx.Err()
	}
	n := 0
	for _, p := range ps {
		if p != nil {
			n += len(p.batch)
		}
	}
	err = fmt.Errorf("engine: forward pass of %d sequences: %w", n, err)
	e.lg.Error("forward pass failed", zap.Error(err))
	for _, p := range ps {
		if p == nil {
			continue
		}
		for _, s := range p.seqs {
			e.finishAbort(s, err)
		}
	}
	e.flushDeferred()
	e.compact()
	return err
}

// handle takes p's results: prompt progress, tokens sampled, emitted.
// Requests that ended since p started are skipped.
func (e *Engine) handle(p *pass) {
	// Count before emitting: a client that sees its last token (or its pages
	// back) must also see the tokens counted.
	var prefillTokens, decodeTokens int
	for i, n := range p.chunk {
		switch {
		case p.seqs[i].state == stateDone:
		case n > 0:
			prefillTokens += n
		default:
			decodeTokens++
		}
	}
	e.m.prefillTokens.Add(float64(prefillTokens))
	e.m.decodeTokens.Add(float64(decodeTokens))
	// The token of output step s.output: the device's, or sampled here.
	pick := func(i int, s *seq) (int, float32, []sampling.TopLogprob) {
		if p.dev {
			r := &p.res[i]
			return r.Token, r.Logprob, r.Top
		}
		tok := s.sampler.Sample(uint64(s.output), e.outs[i])
		lp, top := e.logprobs(s, e.outs[i], tok)
		return tok, lp, top
	}
	for i, s := range p.seqs {
		if s.state == stateDone {
			continue
		}
		if n := p.chunk[i]; n > 0 {
			s.prefilled += n
			if s.hook != nil {
				s.hook.Chunk(s.prefilled)
			}
			if s.prefilled < len(s.prompt) {
				continue
			}
			tok, lp, top := pick(i, s)
			s.state = stateDecode
			s.pos = len(s.prompt)
			s.next[0] = int32(tok)
			e.emit(s, tok, lp, top, p.dev)
			continue
		}
		s.pos++
		tok, lp, top := pick(i, s)
		s.next[0] = int32(tok)
		e.emit(s, tok, lp, top, p.dev)
	}
}

// flushDeferred ends the requests whose last pass has landed.
func (e *Engine) flushDeferred() {
	kept := e.deferred[:0]
	for _, d := range e.deferred {
		if d.s.lastPass > e.landed {
			kept = append(kept, d)
			continue
		}
		e.end(d.s, d.f, d.ev)
	}
	clear(e.deferred[len(kept):])
	e.deferred = kept
}

// drain lands the pass in flight, dropping its results, and ends the
// requests that waited for it (the loop has stopped).
func (e *Engine) drain() {
	if fl := e.fl; fl != nil {
		e.fl = nil
		if err := e.wait(fl); err != nil {
			e.lg.Warn("forward pass in flight at shutdown failed", zap.Error(err))
		}
	}
	e.flushDeferred()
}

// forward runs the model on p (sampling on the device when p.dev), turning
// a backend panic into an error for the batch's requests rather than a
// crash of the server.
func (e *Engine) forward(ctx context.Context, p *pass) (err error) {
	defer func() {
		if r := recover(); r != nil {
			e.lg.Error("forward pass panicked", zap.Any("panic", r), zap.Stack("stack"))
			err = fmt.Errorf("panic: %v", r)
		}
	}()
	if p.dev {
		if err = e.ds.ForwardSample(ctx, p.batch, p.samp, p.res); err == nil {
			for i, s := range p.seqs {
				if p.batch[i].Logits {
					s.devPending = s.devPending[:0] // counted by the pass
				}
			}
		}
		return err
	}
	return e.model.Forward(ctx, p.batch, e.outs)
}
