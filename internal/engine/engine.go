package engine

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// eventBuffer is the capacity of each request's event channel.
const eventBuffer = 16

// Engine schedules requests onto a model: continuous batching of decode
// steps with chunked prefill, a FIFO admission queue with back-pressure, and
// KV pages reserved per request.
//
// Pages: a request reserves, at admission, every page it can need: its
// prompt plus max_new_tokens-1 positions (the last sampled token is never fed
// back). So a running request never waits for pages and nothing is ever
// preempted; a request that does not fit yet waits at the head of the queue
// (FIFO, no overtaking, so large requests do not starve), and one that can
// never fit is refused by Submit. A prefill-only request (Request.Prefill)
// reserves its prompt only; a preloaded one brings its prompt pages and
// reserves the rest.
//
// Fairness: admission is FIFO; every step runs all decoding requests, and
// the prefill token budget goes to the oldest prefilling requests first, so
// one long prompt is chunked across steps while decodes keep flowing.
//
// Output: one Event per output token; the last carries Finish. A stop token
// (EOS unless ignore_eos, or one of stop_token_ids) is an output token
// (counted, in Event.Token) but adds no text; Finish.Matched is its id. A
// stop string ends the text before it (Matched is the string); text that may
// still become a stop string is held back; at the end, held text is flushed.
// Event.Logprob (when Request.Logprobs) is the chosen token's log-probability
// under the model's raw distribution: log-softmax of the logits at
// temperature 1, before logit_bias, penalties, temperature and top-k/top-p/min-p (vLLM's
// "raw" logprobs), so it does not depend on the sampling parameters.
//
// Seeds: output step k of a request with Params.Seed s draws
// sampling.Uniform(s, k); one without a seed uses DefaultSeed mixed with the
// engine's request counter instead of s.
//
// Where tokens are sampled: with a model that samples on the device
// (compute.DeviceSampler, unless Config.HostSampling), each request gets a
// device state at admission, and a step whose every logits row belongs to
// a request with one samples there (only ids and the logprobs asked for
// come back); a step with any other request (its state refused) takes the
// logits to the host and samples there. Both follow sampling's rule, so the
// tokens are the same either way. Every accepted token also goes to the
// request's host sampler, and the tokens a device state did not sample
// itself (a preloaded first token, tokens of host steps) are handed to it
// with its next device step, so the two stay in step.
//
// Disaggregation (Request.Prefill, Request.Preloaded):
//   - Prefill: the prompt is reserved and run in chunks; Pages is called at
//     admission, Chunk after every chunk, then the first token is sampled and
//     Done(first, logprob, nil, release) is called (the logprob is always
//     computed). The request emits one Event with that token and
//     Finish{Type: "stop"} (Matched nil, or the id if the token is a stop
//     token): the prefill-only request ends by design, not at a length
//     limit. Its pages stay allocated until release is called. On failure or
//     abort, Done(-1, 0, err, release) is called instead (also for a request
//     aborted while queued: then Pages was never called and release is a
//     no-op) and the Finish is "abort".
//   - Preloaded: Submit takes over the pages (on success); at admission the
//     engine reserves the decode pages beyond them, emits FirstToken as the
//     first output token (its stop conditions apply) and decodes on, feeding
//     FirstToken at position len(InputIDs). No prompt token is computed or
//     counted in mooncake_engine_prefill_tokens_total. FirstToken counts for
//     the penalties and decoding samples from step 1 (the prefill server
//     sampled step 0), so a seeded request gives the colocated tokens.
//
// Lifecycle: New, then Run in a goroutine; Submit from any goroutine; Close
// stops Run, aborts every request still queued or running (Finish "abort"
// with ErrClosed) and releases their pages. An Engine runs once: when Run
// returns, for any reason, the engine is closed.
type Engine struct {
	cfg       Config
	model     compute.Model
	ds        compute.DeviceSampler // nil: sample on the host
	as        compute.AsyncSampler  // nil: each pass ends before the next is built
	dsWarned  bool                  // a refused device state was logged at warn level
	pages     *kvcache.Allocator
	tok       tokenizer.Tokenizer
	lg        *zap.Logger
	m         *metrics
	vocab     int
	pageSize  int
	maxSeqLen int // 0: no limit but the pool
	eos       map[int]bool

	mu      sync.Mutex
	queue   []*seq
	closed  bool
	counter uint64 // requests submitted, for default seeds

	wake      chan struct{} // capacity 1: something changed for the loop
	done      chan struct{} // closed by Close
	closeOnce sync.Once
	loopMu    sync.Mutex // held while Run runs and by Close's shutdown

	// Owned by the loop (or by shutdown under loopMu).
	running  []*seq
	passBuf  [2]pass // reused; at most two are live (pass.go)
	fl       *pass   // started, results not yet handled
	passes   uint64  // passes started (their ids)
	landed   uint64  // the last pass whose device work is over
	deferred []deferredFinish
	outs     [][]float32
	slab     []float32
	nRunning atomic.Int64
}

// New returns an engine for cfg. It registers the engine's metrics on
// cfg.Registerer.
func New(cfg Config) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	mc := cfg.Model.Config()
	e := &Engine{
		cfg:       cfg,
		model:     cfg.Model,
		pages:     cfg.Pages,
		tok:       cfg.Tokenizer,
		lg:        cfg.Logger.Named("engine"),
		vocab:     mc.Vocab,
		pageSize:  cfg.Model.Layout().PageSize,
		maxSeqLen: cfg.MaxSeqLen,
		eos:       map[int]bool{},
		wake:      make(chan struct{}, 1),
		done:      make(chan struct{}),
	}
	if d, ok := cfg.Model.(compute.DeviceSampler); ok && !cfg.HostSampling {
		e.ds = d
		if a, ok := d.(compute.AsyncSampler); ok && !cfg.DisableOverlap {
			e.as = a
		}
	}
	for _, id := range cfg.Tokenizer.EOS() {
		e.eos[id] = true
	}
	for _, id := range mc.EOS {
		e.eos[id] = true
	}
	e.m = newMetrics(e)
	if err := e.m.register(cfg.Registerer); err != nil {
		return nil, err
	}
	return e, nil
}

// Tokenizer is the tokenizer the engine decodes with.
func (e *Engine) Tokenizer() tokenizer.Tokenizer { return e.tok }

// Stats is a snapshot of the engine's load.
type Stats struct {
	Queued      int // waiting for admission
	Running     int // in the running batch
	FreePages   int
	TotalPages  int
	CachedPages int // held by the prefix cache alone (free to evict)
}

// Stats returns the current load.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	q := len(e.queue)
	e.mu.Unlock()
	st := Stats{
		Queued:     q,
		Running:    int(e.nRunning.Load()),
		FreePages:  e.pages.Free(),
		TotalPages: e.pages.Total(),
	}
	if c := e.cfg.Cache; c != nil {
		st.CachedPages = c.Idle()
	}
	return st
}

// Submit validates and queues r. It returns the channel of r's events: one
// per output token, the last with Finish set, then the channel is closed.
// Invalid requests get an error wrapping ErrBadRequest or ErrPromptTooLong
// (with the numbers), a full queue ErrOverloaded, a closed engine ErrClosed.
//
// Cancelling ctx aborts the request: its pages are released and the last
// event is Finish{Type: "abort", Err: the context's cause}. The caller must
// read the channel until it is closed or cancel ctx.
//
// Submit copies r (the caller may reuse it) but fills in r.ID when empty.
// A preloaded request's Table and a prefill request's hook pass to the
// engine in every outcome: if Submit fails, the table is released and the
// hook's Done is called with the error (and a no-op release) before Submit
// returns.
func (e *Engine) Submit(ctx context.Context, r *Request) (_ <-chan Event, err error) {
	if r == nil {
		return nil, fmt.Errorf("%w: nil request", ErrBadRequest)
	}
	// The table and the hook are ours whatever happens next: on failure the
	// table is released and the hook told, so no page or room is left.
	defer func() {
		if err == nil {
			return
		}
		if pl := r.Preloaded; pl != nil {
			pl.Table.Release()
		}
		if r.Prefill != nil {
			r.Prefill.Done(-1, 0, nil, err, func() {})
		}
	}()
	if r.ID == "" {
		r.ID = newID()
	}
	s, err := e.newSeq(r)
	if err != nil {
		return nil, err
	}
	if err := context.Cause(ctx); err != nil {
		return nil, fmt.Errorf("engine: submit %s: %w", r.ID, err)
	}
	ch := make(chan Event, eventBuffer)
	s.ctxCause = func() error { return context.Cause(ctx) }
	s.stopCtx = context.AfterFunc(ctx, func() { e.cancel(s, context.Cause(ctx)) })

	e.mu.Lock()
	switch {
	case e.closed:
		err = ErrClosed
	case s.aborted() != nil:
		err = fmt.Errorf("engine: submit %s: %w", r.ID, s.aborted())
	case len(e.queue) >= e.cfg.MaxQueue:
		err = fmt.Errorf("%w: %d requests queued (max %d)", ErrOverloaded, len(e.queue), e.cfg.MaxQueue)
	default:
		e.counter++
		seed := uint64(e.cfg.DefaultSeed) ^ splitmix64(e.counter)
		if p := r.Params.Seed; p != nil {
			seed = uint64(*p)
		}
		s.seed = seed
		s.sampler = sampling.New(samplingParams(r.Params), seed)
		s.sampler.SetPrompt(s.prompt)
		e.queue = append(e.queue, s)
	}
	e.mu.Unlock()
	if err != nil {
		s.stopCtx()
		return nil, err
	}
	go forward(ctx, s.out, ch)
	if gate := s.gate; gate != nil {
		// Wake the loop when the gate opens (or the request ends first).
		// The loop clears s.gate once it sees it open; this goroutine
		// keeps its own copy.
		go func() {
			select {
			case <-gate:
				e.signal()
			case <-s.ended:
			}
		}()
	}
	e.signal()
	return ch, nil
}

// cancel aborts s because its context ended. A queued s is finished here;
// a running one by the loop, which it wakes.
func (e *Engine) cancel(s *seq, cause error) {
	if cause == nil {
		cause = context.Canceled
	}
	s.abortErr.Store(&cause)
	e.mu.Lock()
	i := slices.Index(e.queue, s)
	if i >= 0 {
		e.queue = slices.Delete(e.queue, i, i+1)
	}
	e.mu.Unlock()
	if i >= 0 {
		e.finishAbort(s, cause)
		return
	}
	e.signal()
}

func (e *Engine) signal() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Run is the scheduling loop. It returns nil after Close, the context's
// error when ctx ends, or the error that stopped it; in every case the
// engine is then closed and every request finished.
func (e *Engine) Run(ctx context.Context) error {
	if !e.loopMu.TryLock() {
		return errors.New("engine: Run called twice")
	}
	defer e.loopMu.Unlock()
	e.mu.Lock()
	closed := e.closed
	e.mu.Unlock()
	if closed {
		return ErrClosed
	}
	// Close cancels an in-flight forward pass too.
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-e.done:
			cancel()
		case <-runCtx.Done():
		}
	}()
	err := e.loop(runCtx)
	e.drain()
	select {
	case <-e.done:
		err = nil // stopped by Close
	default:
	}
	cause := error(ErrClosed)
	if err != nil {
		cause = fmt.Errorf("%w: %w", ErrClosed, err)
	}
	e.shutdown(cause)
	return err
}

// Close stops Run (waiting for it to return), aborts all requests with
// ErrClosed and releases their pages. It does not close the model. Further
// Submits return ErrClosed. Close is idempotent.
func (e *Engine) Close() error {
	e.closeOnce.Do(func() { close(e.done) })
	e.loopMu.Lock()
	defer e.loopMu.Unlock()
	e.shutdown(ErrClosed)
	return nil
}

// shutdown closes the engine and aborts everything; loopMu is held.
func (e *Engine) shutdown(cause error) {
	e.mu.Lock()
	e.closed = true
	q := e.queue
	e.queue = nil
	e.mu.Unlock()
	for _, s := range e.running {
		e.finishAbort(s, cause)
	}
	e.running = nil
	e.nRunning.Store(0)
	for _, s := range q {
		e.finishAbort(s, cause)
	}
}

// newSeq validates r and builds its state (without sampler and queue).
func (e *Engine) newSeq(r *Request) (*seq, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: request %s: %s", ErrBadRequest, r.ID, fmt.Sprintf(format, a...))
	}
	p := r.Params
	n := len(r.InputIDs)
	switch {
	case n == 0:
		return nil, bad("empty prompt")
	case p.MaxNewTokens < 0:
		return nil, bad("max_new_tokens %d is negative", p.MaxNewTokens)
	case r.Prefill != nil && r.Preloaded != nil:
		return nil, bad("both Prefill and Preloaded set")
	case r.TopLogprobs < 0 || r.TopLogprobs > sampling.MaxTopLogprobs:
		return nil, bad("top logprobs %d outside [0, %d]", r.TopLogprobs, sampling.MaxTopLogprobs)
	}
	if err := samplingParams(p).Validate(); err != nil {
		return nil, fmt.Errorf("%w: request %s: %w", ErrBadRequest, r.ID, err)
	}
	for id := range p.LogitBias {
		if id >= e.vocab {
			return nil, bad("logit_bias token id %d is outside the vocabulary [0, %d)", id, e.vocab)
		}
	}
	prompt := make([]int32, n)
	for i, id := range r.InputIDs {
		if id < 0 || id >= e.vocab {
			return nil, bad("token id %d at position %d is outside the vocabulary [0, %d)", id, i, e.vocab)
		}
		prompt[i] = int32(id)
	}
	maxNew, need, err := e.kvPages(r)
	if err != nil {
		return nil, err
	}
	s := &seq{
		req:       *r,
		prompt:    prompt,
		maxNew:    maxNew,
		hook:      r.Prefill,
		needPages: need,
		submitted: time.Now(),
		out:       newOutbox(),
		ended:     make(chan struct{}),
	}
	s.readyAt = s.submitted
	if g, ok := r.Prefill.(PrefillGate); ok {
		s.gate = g.Ready()
	}
	s.req.InputIDs = slices.Clone(r.InputIDs)
	s.req.Params.LogitBias = maps.Clone(p.LogitBias)
	s.table = e.pages.NewTable()
	if pl := r.Preloaded; pl != nil {
		if pl.Table == nil || pl.Table.Len() < e.pagesFor(n) {
			have := 0
			if pl.Table != nil {
				have = pl.Table.Len()
			}
			return nil, bad("preloaded KV has %d pages, the prompt of %d tokens needs %d", have, n, e.pagesFor(n))
		}
		if pl.FirstToken < 0 || pl.FirstToken >= e.vocab {
			return nil, bad("preloaded first token %d is outside the vocabulary [0, %d)", pl.FirstToken, e.vocab)
		}
		s.table = pl.Table
		s.cached = pl.CachedTokens
		s.needPages = max(0, need-pl.Table.Len())
		s.req.Preloaded = &Preloaded{Table: pl.Table, FirstToken: pl.FirstToken, FirstLogprob: pl.FirstLogprob, FirstTop: pl.FirstTop,
			CachedTokens: pl.CachedTokens}
	}
	if len(p.StopTokenIDs) > 0 {
		s.stopIDs = make(map[int]bool, len(p.StopTokenIDs))
		for _, id := range p.StopTokenIDs {
			s.stopIDs[id] = true
		}
	}
	var stops []string
	for _, st := range p.Stop {
		if st != "" {
			stops = append(stops, st)
		}
	}
	s.text = newTextOut(e.tok, prompt, stops)
	return s, nil
}

// KVPages is the number of KV pages r needs in all: its prompt and, but for
// a prefill-only request, max_new_tokens - 1 more positions. A decode-side
// disaggregation layer reserves them before the KV arrives, so the request
// never waits for pages once preloaded. The error is Submit's for a request
// too long for the context or the pool.
func (e *Engine) KVPages(r *Request) (int, error) {
	_, need, err := e.kvPages(r)
	return need, err
}

func (e *Engine) kvPages(r *Request) (maxNew, need int, err error) {
	tooLong := func(format string, a ...any) error {
		return fmt.Errorf("%w: request %s: %s", ErrPromptTooLong, r.ID, fmt.Sprintf(format, a...))
	}
	p := r.Params
	n := len(r.InputIDs)
	maxNew = p.MaxNewTokens
	if e.maxSeqLen > 0 {
		if n >= e.maxSeqLen {
			return 0, 0, tooLong("the prompt has %d tokens, the context length is %d", n, e.maxSeqLen)
		}
		if maxNew == 0 {
			maxNew = min(DefaultMaxNewTokens, e.maxSeqLen-n)
		} else if n+maxNew > e.maxSeqLen {
			return 0, 0, tooLong("prompt (%d tokens) + max_new_tokens (%d) = %d exceeds the context length %d",
				n, maxNew, n+maxNew, e.maxSeqLen)
		}
	} else if maxNew == 0 {
		maxNew = DefaultMaxNewTokens
	}
	if r.Prefill != nil {
		maxNew = 1
	}
	kvTokens := n + maxNew - 1 // the last sampled token is never fed back
	if r.Prefill != nil {
		kvTokens = n
	}
	need = e.pagesFor(kvTokens)
	if total := e.pages.Total(); need > total {
		return 0, 0, tooLong("prompt (%d tokens) + max_new_tokens (%d) needs %d KV pages of %d tokens, the pool has %d",
			n, maxNew, need, e.pageSize, total)
	}
	return maxNew, need, nil
}

func (e *Engine) pagesFor(tokens int) int { return (tokens + e.pageSize - 1) / e.pageSize }

func samplingParams(p SamplingParams) sampling.Params {
	return sampling.Params{
		Temperature:       p.Temperature,
		TopP:              p.TopP,
		TopK:              p.TopK,
		MinP:              p.MinP,
		FrequencyPenalty:  p.FrequencyPenalty,
		PresencePenalty:   p.PresencePenalty,
		RepetitionPenalty: p.RepetitionPenalty,
		LogitBias:         p.LogitBias,
	}
}

func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func newID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// FlushCache gives back every page the prefix cache holds that no request
// uses (server.CacheFlusher).
func (e *Engine) FlushCache() (int, error) {
	if e.cfg.Cache == nil {
		return 0, errors.New("engine: no prefix cache (--disable-radix-cache)")
	}
	return e.cfg.Cache.Flush(), nil
}
