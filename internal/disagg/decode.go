package disagg

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// DecodeConfig configures the decode side. Zero values mean the defaults
// noted.
type DecodeConfig struct {
	Transfer Transfer
	Info     Info
	Pages    *kvcache.Allocator
	// PagesFor is how many pages a request needs in all (engine.KVPages):
	// they are reserved before the KV arrives, so the request never waits
	// for pages once it is in the engine. nil: the prompt's pages only.
	PagesFor func(*engine.Request) (int, error)
	// Cache, if set, is the decode's prefix cache (the engine's): a room's
	// leading pages it already holds are shared, not reserved, and the
	// prefill is told to send only the rest.
	Cache *kvcache.Radix
	// QueueWait bounds the wait for those pages, in arrival order (default
	// 60s). The bootstrap and KV bound, Timeout, starts once they are
	// reserved.
	QueueWait time.Duration
	// Timeout bounds the bootstrap and the wait for a room's KV (default
	// 10s); it restarts while the prefill reports the room still queued
	// for its own pages.
	Timeout time.Duration
	// Heartbeat is the period of checks on the prefill's bootstrap server
	// while waiting (default 500ms); two misses in a row fail the room.
	Heartbeat time.Duration
	AuxSlots  int // default 4096
	// Secret authenticates this side to the bootstrap server and checks its
	// answers (zero: no authentication).
	Secret     auth.Secret
	Logger     *zap.Logger
	Registerer prometheus.Registerer
}

// Decode is the decode side of disaggregation.
type Decode struct {
	cfg    DecodeConfig
	lg     *zap.Logger
	m      *metrics
	aux    *auxSlots
	client *http.Client

	mu    sync.Mutex
	rooms map[uint64]chan Result
	infos map[string]Info // prefill bootstrap URL -> its info, until it restarts
	wg    sync.WaitGroup  // Prepares in flight
	// ctx ends at Close (cancel, under mu): Prepare refuses new rooms and
	// the ones waiting end.
	ctx    context.Context
	cancel context.CancelFunc
}

// NewDecode prepares the decode side; wire OnNotify to the transfer
// engine's notifications.
func NewDecode(ctx context.Context, cfg DecodeConfig) (*Decode, error) {
	if cfg.Transfer == nil || cfg.Pages == nil {
		return nil, errors.New("disagg: decode needs a transfer engine and a page allocator")
	}
	if err := cfg.Info.checkRanks(); err != nil {
		return nil, fmt.Errorf("disagg: decode %w", err)
	}
	cfg.Info.AuxBytes = AuxSize
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
	}
	if cfg.QueueWait == 0 {
		cfg.QueueWait = 60 * time.Second
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 500 * time.Millisecond
	}
	if cfg.AuxSlots == 0 {
		cfg.AuxSlots = 4096
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	aux, err := newAuxSlots(ctx, cfg.Transfer, cfg.AuxSlots)
	if err != nil {
		return nil, err
	}
	cctx, cancel := context.WithCancel(context.Background())
	return &Decode{cfg: cfg, lg: lg.Named("disagg.decode"), m: newMetrics(cfg.Registerer, "decode"), aux: aux,
		rooms: map[uint64]chan Result{}, infos: map[string]Info{}, ctx: cctx, cancel: cancel,
		client: &http.Client{Transport: &http.Transport{
			DialContext: (&net.Dialer{Timeout: 2 * time.Second}).DialContext, MaxIdleConnsPerHost: 64,
			ResponseHeaderTimeout: 5 * time.Second,
		}}}, nil
}

// Close refuses new rooms, ends the ones waiting (each asks its prefill to
// drop the room, bounded), then releases the aux buffer.
func (d *Decode) Close() error {
	d.mu.Lock()
	closed := d.ctx.Err() != nil
	d.cancel()
	d.mu.Unlock()
	if closed {
		return nil
	}
	d.wg.Wait()
	d.client.CloseIdleConnections()
	return d.cfg.Transfer.FreeHost(context.Background(), d.aux.mem)
}

// OnNotify receives the prefill's Results (transfer.Config.OnNotify).
func (d *Decode) OnNotify(n transfer.Notification) {
	if n.Topic != NotifyTopic {
		return
	}
	var res Result
	if err := json.Unmarshal(n.Data, &res); err != nil {
		d.lg.Warn("bad notification", zap.String("from", n.From), zap.Error(err))
		return
	}
	if d.lg.Core().Enabled(zap.DebugLevel) {
		d.lg.Debug("room result", zap.Uint64("room", res.Room), zap.Bool("ok", res.OK), zap.Float64("transfer_seconds", res.TransferSeconds))
	}
	d.mu.Lock()
	ch := d.rooms[res.Room]
	d.mu.Unlock()
	if ch == nil {
		d.lg.Debug("notification for an unknown room", zap.Uint64("room", res.Room), zap.String("from", n.From))
		return
	}
	select {
	case ch <- res:
	default:
	}
}

// Prepare reserves every page req needs (waiting in arrival order up to
// QueueWait), registers the room with the prefill server at host:port, and
// waits (bounded) until the prefill has written the KV and the first token.
// On success req is a Preloaded request holding the pages' table (which
// passes to the engine with Submit); on failure every page is released and
// the error, a *RoomError, says why.
func (d *Decode) Prepare(ctx context.Context, req *engine.Request, host string, port int, room uint64) (err error) {
	d.mu.Lock()
	if d.ctx.Err() != nil {
		d.mu.Unlock()
		return roomErr(room, ReasonShutdown, ErrDecodeClosing)
	}
	d.wg.Add(1)
	d.mu.Unlock()
	defer d.wg.Done()
	start := time.Now()
	lg := d.lg.With(zap.Uint64("room", room), zap.String("rid", req.ID))
	boot := "http://" + net.JoinHostPort(host, strconv.Itoa(port))
	req.Room = room
	d.m.rooms.WithLabelValues("decode", Bootstrapping.String()).Inc()
	state := Bootstrapping
	setState := func(s State) {
		d.m.rooms.WithLabelValues("decode", state.String()).Dec()
		d.m.rooms.WithLabelValues("decode", s.String()).Inc()
		state = s
	}
	defer func() {
		d.m.rooms.WithLabelValues("decode", state.String()).Dec()
		if err != nil {
			re := roomErr(room, ReasonTransfer, err)
			err = re
			d.m.requests.WithLabelValues("decode", "failed").Inc()
			d.m.failures.WithLabelValues("decode", string(re.Reason)).Inc()
			lg.Warn("room failed", zap.Error(err), zap.Duration("after", time.Since(start)))
		} else {
			d.m.requests.WithLabelValues("decode", "success").Inc()
		}
	}()

	// ctx ends with the client, Close, or the bounds below.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(d.ctx, cancel)()
	why := func(reason Reason, err error) *RoomError { // a wait ended: say by what
		switch {
		case d.ctx.Err() != nil:
			return roomErr(room, ReasonShutdown, fmt.Errorf("%w while waiting for room %d", ErrDecodeClosing, room))
		case ctx.Err() != nil && context.Cause(ctx) == context.Canceled:
			return roomErr(room, ReasonCanceled, fmt.Errorf("request aborted: %w", err))
		}
		return roomErr(room, reason, err)
	}

	table, held, err := d.reserve(ctx, req)
	if err != nil {
		if errors.Is(err, kvcache.ErrOutOfPages) {
			return why(ReasonPoolFull, err)
		}
		return err
	}
	slot, err := d.aux.get()
	if err != nil {
		table.Release()
		return roomErr(room, ReasonPoolFull, err)
	}
	ch := make(chan Result, 1)
	d.mu.Lock()
	d.rooms[room] = ch
	d.mu.Unlock()
	cleanup := func() {
		d.mu.Lock()
		delete(d.rooms, room)
		d.mu.Unlock()
		d.aux.put(slot)
	}
	releaseAll := func() {
		cleanup()
		if rerr := table.Release(); rerr != nil {
			lg.Error("releasing pages", zap.Error(rerr))
		}
	}

	// The bootstrap and KV bound starts now that the pages are ours.
	deadline := time.Now().Add(d.cfg.Timeout)
	bctx, bcancel := context.WithDeadline(ctx, deadline)
	forget := func() { // the prefill may have changed: ask it next time
		d.mu.Lock()
		delete(d.infos, boot)
		d.mu.Unlock()
	}
	ps := d.cfg.Info.Layout.PageSize
	prompt := (len(req.InputIDs) + ps - 1) / ps
	var info Info
	posted := false // a registration went out: the prefill may hold the room
	// Two tries: a remembered info may belong to a prefill that restarted
	// since, which refuses the registration as meant for another process.
	for try := 0; try < 2; try++ {
		if info, err = d.prefillInfo(bctx, boot); err != nil {
			break
		}
		if err = d.cfg.Info.Check(info); err != nil {
			err = roomErr(room, ReasonMismatch, fmt.Errorf("prefill %s: %w", boot, err))
			break
		}
		rr := RoomRequest{Room: room, Decode: d.cfg.Info, Pages: table.IDs()[:prompt], AuxAddr: d.aux.addr(slot),
			Tokens: len(req.InputIDs), Held: held, Want: info.Incarnation}
		posted = true
		if err = d.post(bctx, boot+"/bootstrap/rooms", rr); err == nil {
			break
		}
		err = fmt.Errorf("register room with prefill %s: %w", boot, err)
		forget()
		if reasonOf(err, "") != ReasonPeerDead {
			break
		}
	}
	bcancel()
	if err != nil {
		forget()
		ended := ctx.Err() != nil || errors.Is(err, context.DeadlineExceeded)
		if posted && ended {
			// The registration may have landed after all: have the
			// prefill drop (or refuse) the room rather than keep it.
			d.cancelRemote(boot, room, lg)
		}
		releaseAll()
		if ended {
			return why(ReasonBootstrapTimeout, fmt.Errorf("bootstrap with prefill %s within %v: %w", boot, d.cfg.Timeout, err))
		}
		return roomErr(room, reasonOf(err, ReasonPeerDead), err)
	}
	setState(WaitingForInput)
	d.m.bootstrap.Observe(time.Since(start).Seconds())
	waitStart := time.Now()

	hb := time.NewTicker(d.cfg.Heartbeat)
	defer hb.Stop()
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	misses := 0
	for {
		select {
		case res := <-ch:
			if !res.OK {
				releaseAll()
				return roomErr(room, knownReason(res.Reason), fmt.Errorf("prefill %s failed the room: %s", boot, res.Error))
			}
			if err := d.checkShares(res, prompt-held/ps); err != nil {
				releaseAll()
				return roomErr(room, ReasonTransfer, fmt.Errorf("prefill %s: %w", boot, err))
			}
			r, tok, lp, top := decodeAux(d.aux.slot(slot))
			if r != room {
				releaseAll()
				return roomErr(room, ReasonTransfer, fmt.Errorf("aux slot holds room %d, want %d: first token missing", r, room))
			}
			cleanup()
			setState(Success)
			d.m.wait.Observe(time.Since(waitStart).Seconds())
			d.m.xferBytes.Add(float64(res.Bytes)) // what the prefill wrote into this server's pages
			for r, b := range res.RankBytes {
				d.m.rankBytes.WithLabelValues(strconv.Itoa(r)).Add(float64(b))
			}
			req.Preloaded = &engine.Preloaded{Table: table, FirstToken: tok, FirstLogprob: lp, FirstTop: top, CachedTokens: res.CachedTokens}
			lg.Debug("kv in place", zap.Int("pages", prompt), zap.Int64("bytes", res.Bytes),
				zap.Float64("transfer_seconds", res.TransferSeconds), zap.Duration("wait", time.Since(waitStart)))
			return nil
		case <-hb.C:
			h, herr := d.health(ctx, boot, room)
			switch {
			case herr == nil && h.RoomError != "":
				releaseAll() // the prefill buried the room: no transfer of it is in flight
				return roomErr(room, knownReason(Reason(h.RoomReason)), fmt.Errorf("prefill %s failed the room: %s", boot, h.RoomError))
			case herr == nil && h.Incarnation != info.Incarnation:
				forget()
				releaseAll() // a restarted prefill will never write into these pages
				return roomErr(room, ReasonPeerDead, fmt.Errorf("%w: %s restarted (incarnation %s, was %s)", ErrPrefillUnreachable, boot, h.Incarnation, info.Incarnation))
			case herr != nil && errors.Is(herr, ErrAuth):
				releaseAll()
				return roomErr(room, ReasonAuth, herr)
			case herr != nil && ctx.Err() == nil:
				if misses++; misses >= 2 {
					releaseAll()
					return roomErr(room, ReasonPeerDead, fmt.Errorf("%w: bootstrap server %s: %w", ErrPrefillUnreachable, boot, herr))
				}
			default:
				misses = 0
				if h.Room == "queued" {
					// The prefill waits for its own pages (bounded there):
					// the KV bound runs from when it starts.
					deadline = time.Now().Add(d.cfg.Timeout)
					timer.Reset(d.cfg.Timeout)
				}
			}
		case <-timer.C:
			d.cancelRemote(boot, room, lg)
			releaseAll()
			return roomErr(room, ReasonKVTimeout, fmt.Errorf("%w: KV for room %d did not arrive within %v", ErrKVTimeout, room, d.cfg.Timeout))
		case <-ctx.Done():
			d.cancelRemote(boot, room, lg)
			releaseAll()
			return why(ReasonCanceled, context.Cause(ctx))
		}
	}
}

// checkShares reports a decode rank that did not get its share of the
// room's KV: each of its heads' K and V for each of the pages sent, in
// every layer.
func (d *Decode) checkShares(res Result, pages int) error {
	ranks := d.cfg.Info.Ranks
	if len(res.RankBytes) != len(ranks) {
		return fmt.Errorf("the room's KV went to %d decode ranks, this server has %d", len(res.RankBytes), len(ranks))
	}
	for r, x := range ranks {
		want := 2 * int64(x.Layout.PageBytes()) * int64(x.Layout.Layers) * int64(pages)
		if res.RankBytes[r] != want {
			return fmt.Errorf("decode rank %d got %d KV bytes, its share is %d", r, res.RankBytes[r], want)
		}
	}
	return nil
}

// reserve takes every page req will need, waiting up to QueueWait: the
// leading ones from the prefix cache where it holds them (whole pages of
// all but the last prompt token), the rest fresh. held is how many prompt
// tokens the cached pages cover.
func (d *Decode) reserve(ctx context.Context, req *engine.Request) (_ *kvcache.Table, held int, err error) {
	ps := d.cfg.Info.Layout.PageSize
	n := (len(req.InputIDs) + ps - 1) / ps
	if d.cfg.PagesFor != nil {
		need, err := d.cfg.PagesFor(req)
		if err != nil {
			return nil, 0, roomErr(req.Room, ReasonInvalid, err)
		}
		n = max(n, need)
	}
	table := d.cfg.Pages.NewTable()
	if c := d.cfg.Cache; c != nil && len(req.InputIDs) > 1 {
		prompt := make([]int32, len(req.InputIDs)-1)
		for i, id := range req.InputIDs[:len(prompt)] {
			prompt[i] = int32(id)
		}
		m := c.Lookup(prompt)
		if err := table.Share(m.Pages); err == nil {
			held = m.Tokens()
		}
		m.Done()
	}
	rest, err := d.cfg.Pages.Take(n - table.Len())
	if err != nil && table.Len() > 0 {
		// Short of pages: wait without holding the cached ones, which a
		// waiter holding them could keep from everyone (eviction cannot
		// take a page a table holds), and send the whole prompt then.
		table.Release()
		table, held = d.cfg.Pages.NewTable(), 0
	}
	if err != nil {
		qctx, cancel := context.WithTimeout(ctx, d.cfg.QueueWait)
		defer cancel()
		rest, err = d.cfg.Pages.TakeWait(qctx, n)
	}
	if err != nil {
		table.Release()
		if n > d.cfg.Pages.Total() {
			return nil, 0, roomErr(req.Room, ReasonInvalid, fmt.Errorf("decode KV pool: %w", err))
		}
		return nil, 0, fmt.Errorf("%w: %d pages within %v (--max-queue-wait): %w", ErrPoolFull, n, d.cfg.QueueWait, err)
	}
	if err := table.Adopt(rest); err != nil {
		return nil, 0, err
	}
	return table, held, nil
}

// cancelRemote asks the prefill to drop the room. The prefill answers once
// no transfer into our pages is in flight, and starts none after (bounded
// by the transfer engine's own bound), so the pages can be released when
// this returns.
func (d *Decode) cancelRemote(boot string, room uint64, lg *zap.Logger) {
	ctx, cancel := context.WithTimeout(context.Background(), d.cfg.Transfer.Timeout()+time.Second)
	defer cancel()
	u := boot + "/bootstrap/cancel?room=" + strconv.FormatUint(room, 10)
	if err := d.post(ctx, u, struct{}{}); err != nil {
		lg.Warn("cancel at prefill failed; releasing the pages (a transfer in flight is bounded by the transfer timeout)", zap.Error(err))
	}
}

// prefillInfo is the prefill's info, asked once per prefill incarnation
// (the heartbeats and a failed registration notice a change).
func (d *Decode) prefillInfo(ctx context.Context, boot string) (Info, error) {
	d.mu.Lock()
	info, ok := d.infos[boot]
	d.mu.Unlock()
	if ok {
		return info, nil
	}
	if err := d.call(ctx, http.MethodGet, boot+"/bootstrap/info", nil, &info); err != nil {
		return info, err
	}
	d.mu.Lock()
	d.infos[boot] = info
	d.mu.Unlock()
	return info, nil
}

type health struct {
	Incarnation string `json:"incarnation"`
	Room        string `json:"room"`
	RoomError   string `json:"room_error"`
	RoomReason  string `json:"room_reason"`
}

func (d *Decode) health(ctx context.Context, boot string, room uint64) (health, error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.Heartbeat*2)
	defer cancel()
	var h health
	err := d.call(ctx, http.MethodGet, boot+"/bootstrap/health?room="+strconv.FormatUint(room, 10), nil, &h)
	return h, err
}

func (d *Decode) post(ctx context.Context, url string, v any) error {
	b, _ := json.Marshal(v)
	return d.call(ctx, http.MethodPost, url, b, nil)
}

// call makes one signed bootstrap request and checks the answer's proof
// before decoding it into out (if not nil). A non-200 answer is an error
// with the prefill's message (a *RoomError with its reason when it gave
// one).
func (d *Decode) call(ctx context.Context, method, url string, body []byte, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
		// Registering or canceling a room twice is harmless (the second is
		// refused), so the transport may resend on a pooled connection that
		// turned out dead (a prefill that restarted).
		req.Header.Set("Idempotency-Key", url)
	}
	mac := signRequest(d.cfg.Secret, req, body, time.Now())
	resp, err := d.client.Do(req)
	if err != nil {
		return fmt.Errorf("%w: bootstrap server %s: %w", ErrPrefillUnreachable, req.URL.Host, err)
	}
	defer resp.Body.Close()
	rb, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return fmt.Errorf("%w: bootstrap server %s: %w", ErrPrefillUnreachable, req.URL.Host, err)
	}
	if err := checkResponse(d.cfg.Secret, mac, resp, rb); err != nil {
		d.m.authFailures.Inc()
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if resp.StatusCode == http.StatusUnauthorized && json.Unmarshal(rb, &e) == nil && e.Error.Message != "" {
			return fmt.Errorf("%w: bootstrap server %s refused us: %s", ErrAuth, req.URL.Host, e.Error.Message)
		}
		return fmt.Errorf("bootstrap server %s: %w", req.URL.Host, err)
	}
	if resp.StatusCode != http.StatusOK {
		var e struct {
			Error struct {
				Message string `json:"message"`
				Reason  Reason `json:"reason"`
			} `json:"error"`
		}
		if json.Unmarshal(rb, &e) == nil && e.Error.Message != "" {
			if e.Error.Reason != "" {
				return &RoomError{Reason: knownReason(e.Error.Reason), Err: errors.New(e.Error.Message)}
			}
			return errors.New(e.Error.Message)
		}
		return fmt.Errorf("%s %s: HTTP %d: %s", method, req.URL.Path, resp.StatusCode, rb)
	}
	if out != nil {
		if err := json.Unmarshal(rb, out); err != nil {
			return fmt.Errorf("bootstrap server %s: bad answer to %s: %w", req.URL.Host, req.URL.Path, err)
		}
	}
	return nil
}
