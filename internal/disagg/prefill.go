package disagg

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// PrefillConfig configures the prefill side. Zero values mean the defaults
// noted.
type PrefillConfig struct {
	Transfer Transfer
	Info     Info   // this server's model, KV layout, segment and pool address
	Listen   string // bootstrap server address; port 0 picks a free port
	// Timeout bounds each wait for the other half of a room: decode's
	// registration after the request arrived (plus QueueWait: the decode
	// may be waiting for pages), or the request after decode registered
	// (default 10s).
	Timeout time.Duration
	// QueueWait is how long a decode server may queue a request for pages
	// before it registers the room (its --max-queue-wait; default 60s).
	QueueWait time.Duration
	// Secret authenticates the bootstrap server's callers and answers (zero:
	// no authentication).
	Secret     auth.Secret
	AuxSlots   int // staging slots for first tokens (default 4096)
	Logger     *zap.Logger
	Registerer prometheus.Registerer
	// PushByLayer pushes each layer's pages as soon as the backend reports
	// the layer written, overlapping the push with the rest of the pass,
	// instead of after each chunk's pass.
	PushByLayer bool
}

// Prefill is the prefill side: the bootstrap server and the KV pushes.
type Prefill struct {
	cfg PrefillConfig
	lg  *zap.Logger
	m   *metrics
	ln  net.Listener
	srv *http.Server
	aux *auxSlots

	plansMu sync.Mutex
	plans   map[string]*kvcache.Plan // by kvcache.PlanKey of (these ranks, a decode's)

	mu     sync.Mutex
	rooms  map[uint64]*proom
	failed map[uint64]tomb // rooms that failed lately, so a late half learns why at once
	closed bool
	wg     sync.WaitGroup
	ctx    context.Context
	cancel context.CancelFunc
}

// NewPrefill starts the bootstrap server.
func NewPrefill(ctx context.Context, cfg PrefillConfig) (*Prefill, error) {
	if cfg.Transfer == nil {
		return nil, errors.New("disagg: prefill needs a transfer engine")
	}
	if err := cfg.Info.checkRanks(); err != nil {
		return nil, fmt.Errorf("disagg: prefill %w", err)
	}
	cfg.Info.AuxBytes = AuxSize
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.QueueWait == 0 {
		cfg.QueueWait = 60 * time.Second
	}
	if cfg.AuxSlots == 0 {
		cfg.AuxSlots = 4096
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("--disaggregation-bootstrap-port: listen on %s: %w (use 0 to pick a free port)", cfg.Listen, err)
	}
	aux, err := newAuxSlots(ctx, cfg.Transfer, cfg.AuxSlots)
	if err != nil {
		ln.Close()
		return nil, err
	}
	p := &Prefill{cfg: cfg, lg: lg.Named("disagg.prefill"), m: newMetrics(cfg.Registerer, "prefill"), ln: ln, aux: aux,
		rooms: map[uint64]*proom{}, failed: map[uint64]tomb{}, plans: map[string]*kvcache.Plan{}}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	mux := http.NewServeMux()
	mux.HandleFunc("GET /bootstrap/info", p.authed(func(*http.Request, []byte) (int, any) { return 200, p.cfg.Info }))
	mux.HandleFunc("GET /bootstrap/health", p.authed(p.handleHealth))
	mux.HandleFunc("POST /bootstrap/rooms", p.authed(p.handleRoom))
	mux.HandleFunc("POST /bootstrap/cancel", p.authed(p.handleCancel))
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second,
		IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 16 << 10}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		p.srv.Serve(ln)
	}()
	p.lg.Info("bootstrap server listening", zap.String("addr", ln.Addr().String()), zap.String("segment", cfg.Info.Segment))
	return p, nil
}

// Port is the bootstrap server's port.
func (p *Prefill) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Rooms is the number of rooms in progress.
func (p *Prefill) Rooms() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.rooms)
}

// closeBound bounds Close's wait for the rooms in progress.
const closeBound = 5 * time.Second

// Close stops the bootstrap server, fails the rooms in progress and waits,
// bounded, for them to release their pages (a room ends once the engine has
// let go of its request: the engine must still be running).
func (p *Prefill) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err := p.srv.Shutdown(sctx)
	cancel()
	if err != nil {
		err = errors.Join(err, p.srv.Close())
	}
	p.cancel()
	done := make(chan struct{})
	go func() { p.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(closeBound):
		p.mu.Lock()
		n := len(p.rooms)
		p.mu.Unlock()
		// The aux buffer stays registered: a room may still push from it.
		return errors.Join(err, fmt.Errorf("disagg: %d prefill rooms still open after %v", n, closeBound))
	}
	return errors.Join(err, p.cfg.Transfer.FreeHost(context.Background(), p.aux.mem))
}

// maxPlans bounds the plan cache: decode rank lists of different layouts.
const maxPlans = 64

// plan is the reshard plan of this server's ranks onto dec's, made once per
// pair of layouts.
func (p *Prefill) plan(dec Info) (*kvcache.Plan, error) {
	src, dst := p.cfg.Info.Shards(), dec.Shards()
	k := kvcache.PlanKey(src, dst)
	p.plansMu.Lock()
	defer p.plansMu.Unlock()
	if pl := p.plans[k]; pl != nil {
		return pl, nil
	}
	pl, err := kvcache.NewPlan(src, dst)
	if err != nil {
		return nil, fmt.Errorf("reshard onto the decode's ranks: %w", err)
	}
	if len(p.plans) >= maxPlans {
		clear(p.plans)
	}
	p.plans[k] = pl
	p.lg.Info("reshard plan", zap.Int("prefill_ranks", len(src)), zap.Int("decode_ranks", len(dst)), zap.Int("moves", len(pl.Moves)))
	return pl, nil
}

// room returns the room, creating it (and its worker) if needed.
func (p *Prefill) room(id uint64) (*proom, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, roomErr(id, ReasonShutdown, errors.New("prefill server shutting down"))
	}
	if t, ok := p.failed[id]; ok {
		return nil, roomErr(id, t.reason, fmt.Errorf("room already failed: %s", t.msg))
	}
	r := p.rooms[id]
	if r == nil {
		nl := p.cfg.Info.Layout.Layers
		r = &proom{p: p, id: id, kick: make(chan struct{}, 1), ready: make(chan struct{}), created: time.Now(),
			lg: p.lg.With(zap.Uint64("room", id)), layerTok: make([]int, nl), layerFence: make([]compute.Fence, nl),
			layerSent: make([]int, nl)}
		p.rooms[id] = r
		p.m.rooms.WithLabelValues("prefill", Bootstrapping.String()).Inc()
		p.wg.Add(1)
		go r.run()
	}
	return r, nil
}

// authed wraps a bootstrap handler: the body (at most 1 MiB) is read, the
// caller's proof checked before anything else happens, and the answer
// signed. A handler returns the status and the JSON value to send.
func (p *Prefill) authed(h func(r *http.Request, body []byte) (int, any)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, 1<<20))
		if err != nil {
			writeJSON(w, p.cfg.Secret, "", http.StatusBadRequest, errBody("reading the request: "+err.Error(), 400))
			return
		}
		mac, err := checkRequest(p.cfg.Secret, r, body, time.Now())
		if err != nil {
			p.m.authFailures.Inc()
			p.lg.Warn("bootstrap request refused", zap.String("remote", r.RemoteAddr), zap.String("path", r.URL.Path), zap.Error(err))
			writeJSON(w, auth.Secret{}, "", http.StatusUnauthorized, errBody("authentication failed: "+err.Error(), 401))
			return
		}
		code, v := h(r, body)
		writeJSON(w, p.cfg.Secret, mac, code, v)
	}
}

func errBody(msg string, code int) map[string]any {
	return map[string]any{"error": map[string]any{"message": msg, "code": code}}
}

// roomErrBody is a failure's JSON answer, with the reason for the decode.
func roomErrBody(e *RoomError, code int) map[string]any {
	return map[string]any{"error": map[string]any{"message": e.Err.Error(), "code": code, "reason": e.Reason}}
}

func (p *Prefill) handleHealth(r *http.Request, _ []byte) (int, any) {
	out := map[string]string{"incarnation": p.cfg.Info.Incarnation}
	if q := r.URL.Query().Get("room"); q != "" {
		id, err := strconv.ParseUint(q, 10, 64)
		if err != nil {
			return 400, errBody("room: "+err.Error(), 400)
		}
		out["room"] = p.roomState(id)
		// Why the room failed here, if it did: a decode the prefill cannot
		// notify (its descriptor is unusable, say) learns it this way.
		p.mu.Lock()
		if t, failed := p.failed[id]; failed {
			out["room_error"], out["room_reason"] = t.msg, string(t.reason)
		}
		p.mu.Unlock()
	}
	return 200, out
}

// roomState says where a room is, for decode's heartbeats: queued (the
// engine has not admitted its request yet: decode keeps waiting), running,
// failed or unknown.
func (p *Prefill) roomState(id uint64) string {
	p.mu.Lock()
	r := p.rooms[id]
	_, failed := p.failed[id]
	p.mu.Unlock()
	switch {
	case r != nil:
		r.mu.Lock()
		defer r.mu.Unlock()
		if r.pages == nil && r.err == nil {
			return "queued"
		}
		return "running"
	case failed:
		return "failed"
	}
	return "unknown"
}

func (p *Prefill) handleRoom(_ *http.Request, body []byte) (int, any) {
	var rr RoomRequest
	if err := json.Unmarshal(body, &rr); err != nil {
		return 400, errBody("bad room registration: "+err.Error(), 400)
	}
	if rr.Want != "" && rr.Want != p.cfg.Info.Incarnation {
		e := roomErr(rr.Room, ReasonPeerDead, fmt.Errorf("the room is meant for prefill incarnation %s; this is %s (restarted)", rr.Want, p.cfg.Info.Incarnation))
		return 409, roomErrBody(e, 409)
	}
	if err := p.cfg.Info.Check(rr.Decode); err != nil {
		e := roomErr(rr.Room, ReasonMismatch, fmt.Errorf("prefill refuses the room: %w", err))
		p.m.failures.WithLabelValues("prefill", string(e.Reason)).Inc()
		p.lg.Warn("room refused", zap.Uint64("room", rr.Room), zap.Error(err))
		return 400, roomErrBody(e, 400)
	}
	r, err := p.room(rr.Room)
	if err != nil {
		e := roomErr(rr.Room, ReasonRefused, err)
		code := 409
		if e.Reason == ReasonShutdown {
			code = 503
		}
		return code, roomErrBody(e, code)
	}
	if err := r.setDst(&rr); err != nil {
		return 409, roomErrBody(roomErr(rr.Room, ReasonRefused, err), 409)
	}
	return 200, map[string]string{"status": "ok"}
}

func (p *Prefill) handleCancel(r *http.Request, _ []byte) (int, any) {
	id, err := strconv.ParseUint(r.URL.Query().Get("room"), 10, 64)
	if err != nil {
		return 400, errBody("bad room: "+err.Error(), 400)
	}
	p.mu.Lock()
	rm := p.rooms[id]
	if rm == nil {
		// A cancel may overtake its room's registration: the tomb makes
		// the prefill refuse the room when it comes.
		if _, failed := p.failed[id]; !failed {
			p.bury(id, roomErr(id, ReasonCanceled, errors.New("decode canceled the request")))
		}
	}
	p.mu.Unlock()
	if rm != nil {
		rm.fail(ReasonCanceled, errors.New("decode canceled the request"))
		// Answer only once no transfer into decode's pages is in flight:
		// decode frees them as soon as we answer.
		rm.xmu.Lock()
		rm.xmu.Unlock()
	}
	return 200, map[string]string{"status": "ok"}
}

// tomb is a failed room's reason, kept for one Timeout.
type tomb struct {
	reason Reason
	msg    string
	at     time.Time
}

func (p *Prefill) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

// bury forgets room id, remembering its failure for one Timeout (pruning
// older ones). Call with p.mu held.
func (p *Prefill) bury(id uint64, err error) {
	delete(p.rooms, id)
	if err == nil {
		return
	}
	now := time.Now()
	for k, t := range p.failed {
		if now.Sub(t.at) > p.cfg.Timeout {
			delete(p.failed, k)
		}
	}
	p.failed[id] = tomb{reason: reasonOf(err, ReasonTransfer), msg: err.Error(), at: now}
}

// Prepare turns req into a prefill-only request of room: the engine will
// call the room's hooks, and the room pushes the KV to decode.
func (p *Prefill) Prepare(ctx context.Context, req *engine.Request, room uint64) error {
	r, err := p.room(room)
	if err != nil {
		return err
	}
	if err := r.setRequest(len(req.InputIDs)); err != nil {
		return err
	}
	req.Room = room
	req.Prefill = r
	if p.cfg.PushByLayer {
		req.Prefill = layeredRoom{r}
	}
	return nil
}

// Ready is closed once decode has said where the KV goes (or the room
// failed): the engine admits the request only then, so a prefill never
// holds pages for a room whose decode is still queueing (engine.PrefillGate).
func (r *proom) Ready() <-chan struct{} { return r.ready }

// layeredRoom is a room that asks the engine for layer calls.
type layeredRoom struct{ *proom }

// Layer records that layer l holds the KV of the first tokensDone prompt
// tokens once ready is done.
func (r layeredRoom) Layer(l, tokensDone int, ready compute.Fence) {
	r.mu.Lock()
	if l < len(r.layerTok) && tokensDone > r.layerTok[l] {
		r.layerTok[l], r.layerFence[l] = tokensDone, ready
	}
	r.mu.Unlock()
	r.poke()
}

// proom is one room on the prefill side. Hooks and HTTP handlers update it
// under mu and kick its worker, which does the transfers in order.
type proom struct {
	p       *Prefill
	id      uint64
	lg      *zap.Logger
	kick    chan struct{}
	ready   chan struct{} // closed by setDst or fail (readyOnce)
	created time.Time
	regAt   time.Time // when decode registered
	// xmu is held while a push writes into decode's pages, and a push
	// starts only if the room has not failed: once fail has returned and
	// xmu was taken and released, no more bytes reach decode.
	xmu sync.Mutex

	mu      sync.Mutex
	state   State
	dst     *RoomRequest
	haveReq bool
	prompt  int
	pages   []int32
	tokens  int
	done    bool
	first   int
	logprob float32
	top     []sampling.TopLogprob
	release func()
	doneAt  time.Time  // when the engine called Done
	err     *RoomError // first failure
	auxSent bool       // the first token is in decode's aux slot
	// Per layer: prompt tokens reported written by a layer call (and the
	// fence to wait for first), and pages pushed.
	layerTok   []int
	layerFence []compute.Fence
	layerSent  []int
	cached     int // prompt tokens the engine took from its prefix cache
	bytes      int64
	rankBytes  []int64 // by decode rank
	xfer       time.Duration
}

func (r *proom) poke() {
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

func (r *proom) setDst(rr *RoomRequest) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.dst != nil {
		return fmt.Errorf("room %d already registered", r.id)
	}
	ps := r.p.cfg.Info.Layout.PageSize
	if rr.Held < 0 || rr.Held%ps != 0 || rr.Held >= max(rr.Tokens, 1) || rr.Held/ps > len(rr.Pages) {
		return fmt.Errorf("room %d: decode holds %d of %d prompt tokens in %d pages: not whole pages of the prompt", r.id, rr.Held, rr.Tokens, len(rr.Pages))
	}
	for l := range r.layerSent { // decode has these pages already
		r.layerSent[l] = rr.Held / ps
	}
	r.dst, r.regAt = rr, time.Now()
	r.open()
	r.poke()
	return nil
}

// open closes ready once (mu held).
func (r *proom) open() {
	select {
	case <-r.ready:
	default:
		close(r.ready)
	}
}

func (r *proom) setRequest(prompt int) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.haveReq {
		return fmt.Errorf("room %d already has a request", r.id)
	}
	r.haveReq, r.prompt = true, prompt
	r.poke()
	return nil
}

func (r *proom) fail(reason Reason, err error) {
	r.mu.Lock()
	r.setErr(reason, err)
	r.mu.Unlock()
	r.poke()
}

// setErr records the room's first failure and opens its gate, so a queued
// request is let go (mu held).
func (r *proom) setErr(reason Reason, err error) {
	if r.err == nil {
		r.err = roomErr(r.id, reasonOf(err, reason), err)
	}
	r.open()
}

// PrefillHook: called by the engine loop.

func (r *proom) Pages(pages []int32) {
	r.mu.Lock()
	r.pages = append([]int32(nil), pages...)
	r.mu.Unlock()
	r.poke()
}

// Aborted stops the engine's work on a room that has already failed (its
// decode side is gone, canceled, or a transfer failed).
func (r *proom) Aborted() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return r.err
	}
	return nil
}

// Cached records the prompt tokens the engine took from its prefix cache
// (engine.PrefillCacheHook), for decode's report.
func (r *proom) Cached(tokens int) {
	r.mu.Lock()
	r.cached = tokens
	r.mu.Unlock()
}

func (r *proom) Chunk(tokensDone int) {
	r.mu.Lock()
	r.tokens = tokensDone
	r.mu.Unlock()
	r.poke()
}

func (r *proom) Done(first int, logprob float32, top []sampling.TopLogprob, err error, release func()) {
	if r.lg.Core().Enabled(zap.DebugLevel) {
		r.lg.Debug("prefill computed", zap.Int("first", first), zap.Error(err))
	}
	r.mu.Lock()
	r.done, r.first, r.logprob, r.top, r.release, r.doneAt = true, first, logprob, top, release, time.Now()
	if err != nil {
		r.setErr(ReasonPrefill, fmt.Errorf("prefill failed: %w", err))
	}
	r.mu.Unlock()
	r.poke()
}

func (r *proom) setState(s State) {
	m := r.p.m.rooms
	m.WithLabelValues("prefill", r.state.String()).Dec()
	m.WithLabelValues("prefill", s.String()).Inc()
	r.state = s
}

// run is the room's worker.
func (r *proom) run() {
	p := r.p
	defer p.wg.Done()
	timer := time.NewTimer(p.cfg.Timeout)
	defer timer.Stop()
	closing := p.ctx.Done()
	for {
		select {
		case <-r.kick:
		case <-timer.C:
		case <-closing:
			r.fail(ReasonShutdown, errors.New("prefill server shutting down"))
			closing = nil // keep looping until the engine calls Done
		}
		now := time.Now()
		r.mu.Lock()
		dst, haveReq := r.dst, r.haveReq
		// The bootstrap bounds: decode may queue for pages before it
		// registers; the request must follow a registration promptly.
		if r.err == nil {
			switch {
			case dst == nil && !haveReq:
			case dst == nil:
				if d := r.created.Add(p.cfg.QueueWait + p.cfg.Timeout); now.Before(d) {
					timer.Reset(d.Sub(now))
				} else {
					r.setErr(ReasonBootstrapTimeout, fmt.Errorf("decode did not register room %d within %v", r.id, p.cfg.QueueWait+p.cfg.Timeout))
				}
			case !haveReq:
				if d := r.regAt.Add(p.cfg.Timeout); now.Before(d) {
					timer.Reset(d.Sub(now))
				} else {
					r.setErr(ReasonBootstrapTimeout, fmt.Errorf("prefill did not receive the request of room %d within %v", r.id, p.cfg.Timeout))
				}
			default:
				timer.Stop() // both halves are here: the engine and transfer bounds apply
			}
		}
		if dst != nil && haveReq && r.state < WaitingForInput {
			r.setState(WaitingForInput)
		}
		if r.err == nil && dst != nil && haveReq && r.prompt != dst.Tokens {
			r.setErr(ReasonMismatch, fmt.Errorf("prompt is %d tokens here, %d on decode (tokenizers differ)", r.prompt, dst.Tokens))
		}
		ok := r.err == nil
		r.mu.Unlock()

		if ok && dst != nil && haveReq {
			if err := r.push(); err != nil {
				r.fail(ReasonTransfer, err)
			}
		}
		r.mu.Lock()
		failed, done := r.err != nil, r.done
		// Every page may already be out (a last chunk that ends on a page
		// boundary) while the first token is not: success needs both.
		finished := done && !failed && r.sentPages() == r.promptPages() && r.auxSent
		r.mu.Unlock()
		switch {
		case finished:
			r.finish()
			return
		case failed && (done || !haveReq):
			r.finish()
			return
		}
	}
}

// sentPages is how many prompt pages every layer has pushed (mu held).
func (r *proom) sentPages() int { return slices.Min(r.layerSent) }

func (r *proom) promptPages() int {
	ps := r.p.cfg.Info.Layout.PageSize
	return (r.prompt + ps - 1) / ps
}

// push writes the pages completed since the last push: per layer, the
// pages whose tokens a chunk (or a layer call) reported written; after the
// last chunk, the remaining pages and the first token go in one batch.
func (r *proom) push() error {
	r.xmu.Lock()
	defer r.xmu.Unlock()
	r.mu.Lock()
	if r.err != nil { // failed (canceled) since the worker looked
		r.mu.Unlock()
		return nil
	}
	ps := r.p.cfg.Info.Layout.PageSize
	all := min(r.promptPages(), len(r.pages))
	type span struct {
		layer, from, upto int
		ready             compute.Fence
		byLayer           bool // made ready by a layer report
	}
	var spans []span
	for l := range r.layerSent {
		tok, ready, byLayer := r.tokens, compute.Fence(nil), false
		if r.layerTok[l] > tok {
			tok, ready, byLayer = r.layerTok[l], r.layerFence[l], true
		}
		upto := tok / ps
		if r.done || tok >= r.prompt {
			upto = all
		}
		upto = min(upto, len(r.pages))
		if upto > r.layerSent[l] {
			spans = append(spans, span{l, r.layerSent[l], upto, ready, byLayer})
		}
	}
	dst, done, pages := r.dst, r.done, r.pages
	first, lp, top := r.first, r.logprob, r.top
	sendAux := done && !r.auxSent
	r.mu.Unlock()
	if len(spans) == 0 && !sendAux {
		return nil
	}
	r.mu.Lock()
	if r.state < Transferring {
		r.setState(Transferring)
	}
	r.mu.Unlock()
	p := r.p
	plan, err := p.plan(dst.Decode)
	if err != nil {
		return roomErr(r.id, ReasonMismatch, err)
	}
	src, dranks := p.cfg.Info.Ranks, dst.Decode.Ranks
	// The copies of every move, grouped by source rank, destination rank
	// and length: each group one page-list request (one check, one task).
	type key struct {
		src, dst int
		len      int64
	}
	type group struct {
		key
		pairs []kvcache.Pair
	}
	var groups []group
	index := map[key]int{}
	rankBytes := make([]int64, len(dranks))
	var n int64
	var pairs []kvcache.Pair
	for _, sp := range spans {
		if sp.upto > len(dst.Pages) {
			return fmt.Errorf("decode reserved %d pages, prompt needs %d", len(dst.Pages), sp.upto)
		}
		if sp.ready != nil {
			if err := sp.ready.Wait(); err != nil {
				return fmt.Errorf("waiting for layer %d's KV: %w", sp.layer, err)
			}
		}
		for i := range plan.Moves {
			mv := &plan.Moves[i]
			pairs = mv.Pairs(pairs[:0], sp.layer, src[mv.Src].Layout, pages[sp.from:sp.upto], dranks[mv.Dst].Layout, dst.Pages[sp.from:sp.upto])
			for _, pr := range pairs {
				k := key{mv.Src, mv.Dst, pr.Len}
				g, ok := index[k]
				if !ok {
					g = len(groups)
					index[k] = g
					groups = append(groups, group{key: k})
				}
				groups[g].pairs = append(groups[g].pairs, pr)
				rankBytes[mv.Dst] += pr.Len
				n += pr.Len
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Transfer.Timeout()+time.Second)
	defer cancel()
	segs := map[string]transfer.SegmentID{}
	open := func(name string) (transfer.SegmentID, error) {
		if id, ok := segs[name]; ok {
			return id, nil
		}
		id, err := p.cfg.Transfer.OpenSegmentCached(ctx, name)
		if err != nil {
			return id, fmt.Errorf("open decode segment %s: %w", name, err)
		}
		segs[name] = id
		return id, nil
	}
	reqs := make([]transfer.Request, 0, len(groups)+1)
	for _, g := range groups {
		seg, err := open(dranks[g.dst].Segment)
		if err != nil {
			return err
		}
		local, remote := p.cfg.Info.Ranks[g.src].PoolAddr, dranks[g.dst].PoolAddr
		if len(g.pairs) == 1 {
			pr := g.pairs[0]
			reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(local + uint64(pr.Src)), Len: uint64(pr.Len),
				Segment: seg, Remote: remote + uint64(pr.Dst)})
			continue
		}
		offs := make([]transfer.PageOffset, len(g.pairs))
		for i, pr := range g.pairs {
			offs[i] = transfer.PageOffset{Local: uint64(pr.Src), Remote: uint64(pr.Dst)}
		}
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(local), Len: uint64(g.len), Segment: seg, Remote: remote, Pages: offs})
	}
	if sendAux {
		// The first token goes once, from the prefill's aux slot.
		seg, err := open(dst.Decode.Segment)
		if err != nil {
			return err
		}
		slot, err := p.aux.get()
		if err != nil {
			return err
		}
		defer p.aux.put(slot)
		encodeAux(p.aux.slot(slot), r.id, first, lp, top)
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(p.aux.addr(slot)), Len: AuxSize,
			Segment: seg, Remote: dst.AuxAddr})
	}
	start := time.Now()
	if err := p.cfg.Transfer.Transfer(ctx, reqs); err != nil {
		return fmt.Errorf("KV transfer to %s: %w", dst.Decode.Segment, err)
	}
	el := time.Since(start)
	r.mu.Lock()
	for _, sp := range spans {
		r.layerSent[sp.layer] = sp.upto
	}
	r.auxSent = r.auxSent || sendAux
	r.bytes += n
	if r.rankBytes == nil {
		r.rankBytes = make([]int64, len(rankBytes))
	}
	for d, b := range rankBytes {
		r.rankBytes[d] += b
	}
	r.xfer += el
	r.mu.Unlock()
	p.m.xferBytes.Add(float64(n))
	by := "pass"
	for _, sp := range spans {
		if sp.byLayer {
			by = "layer"
		}
	}
	p.m.pushes.WithLabelValues(by).Inc()
	if r.lg.Core().Enabled(zap.DebugLevel) {
		r.lg.Debug("pages pushed", zap.Int("layers", len(spans)), zap.Int("requests", len(reqs)), zap.Int64("bytes", n),
			zap.Duration("took", el))
	}
	return nil
}

// finish notifies decode (if it registered) and releases the pages.
func (r *proom) finish() {
	p := r.p
	r.mu.Lock()
	dst, release, bytes, xfer, doneAt, cached, rankBytes := r.dst, r.release, r.bytes, r.xfer, r.doneAt, r.cached, r.rankBytes
	var err error
	if r.err == nil {
		r.setState(Success)
	} else {
		r.setState(Failed)
		err = r.err
	}
	r.mu.Unlock()
	res := Result{Room: r.id, OK: err == nil, Bytes: bytes, RankBytes: rankBytes, TransferSeconds: xfer.Seconds(), CachedTokens: cached}
	if err != nil {
		res.Error, res.Reason = err.Error(), reasonOf(err, ReasonTransfer)
	}
	if dst != nil {
		b, _ := json.Marshal(res)
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Transfer.Timeout())
		if nerr := p.cfg.Transfer.Notify(ctx, dst.Decode.Segment, NotifyTopic, b); nerr != nil {
			r.lg.Warn("notify decode failed", zap.String("segment", dst.Decode.Segment), zap.Error(nerr))
			if err == nil {
				err = roomErr(r.id, reasonOf(nerr, ReasonTransfer), fmt.Errorf("notify decode: %w", nerr))
			}
		}
		cancel()
		if err == nil {
			p.m.tail.Observe(time.Since(doneAt).Seconds())
		}
	}
	if release != nil {
		release()
	}
	p.mu.Lock()
	p.bury(r.id, err)
	p.mu.Unlock()
	p.m.rooms.WithLabelValues("prefill", r.state.String()).Dec()
	if err == nil {
		p.m.requests.WithLabelValues("prefill", "success").Inc()
		p.m.xferSecs.Observe(xfer.Seconds())
		if xfer > 0 {
			p.m.xferGBps.Observe(float64(bytes) / xfer.Seconds() / 1e9)
		}
		r.lg.Info("room done", zap.Int64("kv_bytes", bytes), zap.Duration("transfer", xfer),
			zap.Duration("total", time.Since(r.created)))
	} else {
		p.m.requests.WithLabelValues("prefill", "failed").Inc()
		p.m.failures.WithLabelValues("prefill", string(reasonOf(err, ReasonTransfer))).Inc()
		r.lg.Warn("room failed", zap.Error(err))
	}
}

// writeJSON answers with v, signed for the request whose MAC is reqMAC
// (nothing is signed with a zero secret).
func writeJSON(w http.ResponseWriter, s auth.Secret, reqMAC string, code int, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	if !s.IsZero() {
		w.Header().Set(bootHeader, responseMAC(s, reqMAC, code, b))
	}
	w.WriteHeader(code)
	w.Write(b)
}
