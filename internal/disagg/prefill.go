package disagg

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// PrefillConfig configures the prefill side. Zero values mean the defaults
// noted.
type PrefillConfig struct {
	Transfer *transfer.Engine
	Info     Info   // this server's model, KV layout, segment and pool address
	Listen   string // bootstrap server address; port 0 picks a free port
	// Timeout bounds each wait for the other half of a room: decode's
	// registration after the request arrived, or the request after decode
	// registered (default 10s).
	Timeout    time.Duration
	AuxSlots   int // staging slots for first tokens (default 4096)
	Logger     *zap.Logger
	Registerer prometheus.Registerer
	// FailTransfers is fault injection for tests (serve --debug-fault
	// transfer): every KV transfer targets an address outside the decode's
	// registered regions, so the transfer engine refuses it for real.
	FailTransfers bool
	// PushByLayer pushes each layer's pages as soon as the backend reports
	// the layer written, overlapping the push with the rest of the pass,
	// instead of after each chunk's pass.
	PushByLayer bool
}

// faultRemote is where FailTransfers aims: far above any mapping.
const faultRemote = 1 << 62

// Prefill is the prefill side: the bootstrap server and the KV pushes.
type Prefill struct {
	cfg PrefillConfig
	lg  *zap.Logger
	m   *metrics
	ln  net.Listener
	srv *http.Server
	aux *auxSlots

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
	cfg.Info.AuxBytes = AuxSize
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
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
		rooms: map[uint64]*proom{}, failed: map[uint64]tomb{}}
	p.ctx, p.cancel = context.WithCancel(context.Background())
	mux := http.NewServeMux()
	mux.HandleFunc("GET /bootstrap/info", func(w http.ResponseWriter, r *http.Request) { writeJSON(w, 200, p.cfg.Info) })
	mux.HandleFunc("GET /bootstrap/health", func(w http.ResponseWriter, r *http.Request) {
		h := map[string]string{"incarnation": p.cfg.Info.Incarnation}
		// ?room=N adds why room N failed here, if it did: a decode that
		// cannot be notified (its descriptor is unusable, say) learns it.
		if id, err := strconv.ParseUint(r.URL.Query().Get("room"), 10, 64); err == nil {
			p.mu.Lock()
			t, failed := p.failed[id]
			p.mu.Unlock()
			if failed {
				h["room_error"] = t.reason
			}
		}
		writeJSON(w, 200, h)
	})
	mux.HandleFunc("POST /bootstrap/rooms", p.handleRoom)
	mux.HandleFunc("POST /bootstrap/cancel", p.handleCancel)
	p.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
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

// Close stops the bootstrap server, fails the rooms in progress and waits
// for them to release their pages.
func (p *Prefill) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err := p.srv.Shutdown(sctx)
	cancel()
	p.cancel()
	p.wg.Wait()
	return errors.Join(err, p.cfg.Transfer.FreeHost(context.Background(), p.aux.mem))
}

// room returns the room, creating it (and its worker) if needed.
func (p *Prefill) room(id uint64) (*proom, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errors.New("disagg: prefill server closing")
	}
	if t, ok := p.failed[id]; ok {
		return nil, fmt.Errorf("room %d already failed: %s", id, t.reason)
	}
	r := p.rooms[id]
	if r == nil {
		nl := p.cfg.Info.Layout.Layers
		r = &proom{p: p, id: id, kick: make(chan struct{}, 1), created: time.Now(),
			lg: p.lg.With(zap.Uint64("room", id)), layerTok: make([]int, nl), layerFence: make([]compute.Fence, nl),
			layerSent: make([]int, nl)}
		p.rooms[id] = r
		p.m.rooms.WithLabelValues("prefill", Bootstrapping.String()).Inc()
		p.wg.Add(1)
		go r.run()
	}
	return r, nil
}

func (p *Prefill) handleRoom(w http.ResponseWriter, req *http.Request) {
	var rr RoomRequest
	if err := json.NewDecoder(http.MaxBytesReader(w, req.Body, 16<<20)).Decode(&rr); err != nil {
		writeErr(w, 400, "bad room registration: "+err.Error())
		return
	}
	if err := p.cfg.Info.Check(rr.Decode); err != nil {
		p.m.failures.WithLabelValues("prefill", "mismatch").Inc()
		p.lg.Warn("room refused", zap.Uint64("room", rr.Room), zap.Error(err))
		writeErr(w, 400, "prefill refuses room: "+err.Error())
		return
	}
	r, err := p.room(rr.Room)
	if err != nil {
		code := 409
		if p.isClosed() {
			code = 503
		}
		writeErr(w, code, err.Error())
		return
	}
	if err := r.setDst(&rr); err != nil {
		writeErr(w, 409, err.Error())
		return
	}
	writeJSON(w, 200, map[string]string{"status": "ok"})
}

func (p *Prefill) handleCancel(w http.ResponseWriter, req *http.Request) {
	id, err := strconv.ParseUint(req.URL.Query().Get("room"), 10, 64)
	if err != nil {
		writeErr(w, 400, "bad room: "+err.Error())
		return
	}
	p.mu.Lock()
	r := p.rooms[id]
	p.mu.Unlock()
	if r != nil {
		r.fail("decode canceled the request")
		// Answer only once no transfer into decode's pages is in flight:
		// decode frees them as soon as we answer.
		r.xmu.Lock()
		r.xmu.Unlock()
	}
	writeJSON(w, 200, map[string]string{"status": "ok"})
}

// tomb is a failed room's reason, kept for one Timeout.
type tomb struct {
	reason string
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
	p.failed[id] = tomb{reason: err.Error(), at: now}
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
	created time.Time
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
	doneAt  time.Time // when the engine called Done
	err     error     // first failure
	auxSent bool      // the first token is in decode's aux slot
	// Per layer: prompt tokens reported written by a layer call (and the
	// fence to wait for first), and pages pushed.
	layerTok   []int
	layerFence []compute.Fence
	layerSent  []int
	bytes      int64
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
	r.dst = rr
	r.poke()
	return nil
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

func (r *proom) fail(reason string) {
	r.mu.Lock()
	if r.err == nil {
		r.err = errors.New(reason)
	}
	r.mu.Unlock()
	r.poke()
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
		return fmt.Errorf("room %d failed: %w", r.id, r.err)
	}
	return nil
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
	if err != nil && r.err == nil {
		r.err = fmt.Errorf("prefill failed: %w", err)
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
	timedOut := false
	closing := p.ctx.Done()
	for {
		select {
		case <-r.kick:
		case <-timer.C:
			timedOut = true
		case <-closing:
			r.fail("prefill server shutting down")
			closing = nil // keep looping until the engine calls Done
		}
		r.mu.Lock()
		dst, haveReq, done, err := r.dst, r.haveReq, r.done, r.err
		if timedOut && err == nil {
			switch {
			case dst == nil:
				r.err = fmt.Errorf("decode did not register room %d within %v", r.id, p.cfg.Timeout)
			case !haveReq:
				r.err = fmt.Errorf("prefill did not receive the request of room %d within %v", r.id, p.cfg.Timeout)
			}
			err = r.err
		}
		if dst != nil && haveReq && r.state < WaitingForInput {
			r.setState(WaitingForInput)
			timer.Stop() // both halves are here: the engine and transfer bounds apply
		}
		if err == nil && dst != nil && haveReq && r.prompt != dst.Tokens {
			r.err = fmt.Errorf("prompt is %d tokens here, %d on decode (tokenizers differ)", r.prompt, dst.Tokens)
			err = r.err
		}
		r.mu.Unlock()

		if err == nil && dst != nil && haveReq {
			if err = r.push(); err != nil {
				r.mu.Lock()
				if r.err == nil {
					r.err = err
				}
				r.mu.Unlock()
			}
		}
		r.mu.Lock()
		err, done = r.err, r.done
		// Every page may already be out (a last chunk that ends on a page
		// boundary) while the first token is not: success needs both.
		finished := done && err == nil && r.sentPages() == r.promptPages() && r.auxSent
		r.mu.Unlock()
		switch {
		case finished:
			r.finish(nil)
			return
		case err != nil && (done || !haveReq):
			r.finish(err)
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
	lay := p.cfg.Info.Layout
	// Runs of several pages go as requests of their own; single pages (a
	// fragmented pool) as one page-list request.
	pb := int64(lay.PageBytes())
	var runs []kvcache.Pair
	var single []transfer.PageOffset
	var n int64
	for _, sp := range spans {
		if sp.upto > len(dst.Pages) {
			return fmt.Errorf("decode reserved %d pages, prompt needs %d", len(dst.Pages), sp.upto)
		}
		if sp.ready != nil {
			if err := sp.ready.Wait(); err != nil {
				return fmt.Errorf("waiting for layer %d's KV: %w", sp.layer, err)
			}
		}
		pairs, err := lay.LayerPairs(sp.layer, pages[sp.from:sp.upto], dst.Decode.Layout, dst.Pages[sp.from:sp.upto])
		if err != nil {
			return err
		}
		for _, pr := range pairs {
			n += pr.Len
			if pr.Len == pb {
				single = append(single, transfer.PageOffset{Local: uint64(pr.Src), Remote: uint64(pr.Dst)})
			} else {
				runs = append(runs, pr)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Transfer.Timeout()+time.Second)
	defer cancel()
	seg, err := p.cfg.Transfer.OpenSegmentCached(ctx, dst.Decode.Segment)
	if err != nil {
		return fmt.Errorf("open decode segment %s: %w", dst.Decode.Segment, err)
	}
	remote := dst.Decode.PoolAddr
	if p.cfg.FailTransfers {
		remote = faultRemote
	}
	reqs := make([]transfer.Request, 0, len(runs)+2)
	for _, pr := range runs {
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(p.cfg.Info.PoolAddr + uint64(pr.Src)),
			Len: uint64(pr.Len), Segment: seg, Remote: remote + uint64(pr.Dst)})
	}
	if len(single) > 0 {
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: uintptr(p.cfg.Info.PoolAddr), Len: uint64(pb),
			Segment: seg, Remote: remote, Pages: single})
	}
	if sendAux {
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
func (r *proom) finish(err error) {
	p := r.p
	r.mu.Lock()
	dst, release, bytes, xfer, doneAt := r.dst, r.release, r.bytes, r.xfer, r.doneAt
	if err == nil {
		r.setState(Success)
	} else {
		r.setState(Failed)
	}
	r.mu.Unlock()
	res := Result{Room: r.id, OK: err == nil, Bytes: bytes, TransferSeconds: xfer.Seconds()}
	if err != nil {
		res.Error = err.Error()
	}
	if dst != nil {
		b, _ := json.Marshal(res)
		ctx, cancel := context.WithTimeout(context.Background(), p.cfg.Transfer.Timeout())
		if nerr := p.cfg.Transfer.Notify(ctx, dst.Decode.Segment, NotifyTopic, b); nerr != nil {
			r.lg.Warn("notify decode failed", zap.String("segment", dst.Decode.Segment), zap.Error(nerr))
			if err == nil {
				err = fmt.Errorf("notify decode: %w", nerr)
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
		p.m.failures.WithLabelValues("prefill", reasonOf(err)).Inc()
		r.lg.Warn("room failed", zap.Error(err))
	}
}

// reasonOf buckets an error into a bounded label value.
func reasonOf(err error) string {
	switch {
	case errors.Is(err, transfer.ErrPeerDead):
		return "peer_dead"
	case errors.Is(err, transfer.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, transfer.ErrOutOfBounds), errors.Is(err, transfer.ErrAccessDenied):
		return "bounds"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	s := err.Error()
	for _, k := range []struct{ sub, label string }{
		{"did not register", "bootstrap_timeout"}, {"did not receive", "bootstrap_timeout"},
		{"canceled", "canceled"}, {"abort", "canceled"}, {"mismatch", "mismatch"}, {"transfer", "transfer"},
		{"unreachable", "peer_dead"}, {"shutting down", "shutdown"},
	} {
		if strings.Contains(s, k.sub) {
			return k.label
		}
	}
	return "other"
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
}

func writeErr(w http.ResponseWriter, code int, msg string) {
	writeJSON(w, code, map[string]any{"error": map[string]any{"message": msg, "code": code}})
}
