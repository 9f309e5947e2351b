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
)

// DecodeConfig configures the decode side. Zero values mean the defaults
// noted.
type DecodeConfig struct {
	Transfer *transfer.Engine
	Info     Info
	Pages    *kvcache.Allocator
	// Timeout bounds the whole wait for a room's KV, bootstrap included
	// (default 10s).
	Timeout time.Duration
	// Heartbeat is the period of checks on the prefill's bootstrap server
	// while waiting (default 500ms); two misses in a row fail the room.
	Heartbeat  time.Duration
	AuxSlots   int // default 4096
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
	wg    sync.WaitGroup // Prepares in flight
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
	cfg.Info.AuxBytes = AuxSize
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Second
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
		rooms: map[uint64]chan Result{}, ctx: cctx, cancel: cancel,
		client: &http.Client{Transport: &http.Transport{
			DialContext: (&net.Dialer{Timeout: 2 * time.Second}).DialContext, MaxIdleConnsPerHost: 64,
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

// Prepare reserves pages for req's prompt, registers the room with the
// prefill server at host:port, and waits (bounded) until the prefill has
// written the KV and the first token. On success req is a Preloaded request
// owning the pages; on failure every page is released and the error says
// why.
func (d *Decode) Prepare(ctx context.Context, req *engine.Request, host string, port int, room uint64) (err error) {
	d.mu.Lock()
	if d.ctx.Err() != nil {
		d.mu.Unlock()
		return ErrDecodeClosing
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
			d.m.requests.WithLabelValues("decode", "failed").Inc()
			d.m.failures.WithLabelValues("decode", reasonOf(err)).Inc()
			lg.Warn("room failed", zap.Error(err), zap.Duration("after", time.Since(start)))
		} else {
			d.m.requests.WithLabelValues("decode", "success").Inc()
		}
	}()

	wctx, cancel := context.WithTimeout(ctx, d.cfg.Timeout)
	defer cancel()
	defer context.AfterFunc(d.ctx, cancel)() // Close ends the wait
	ps := d.cfg.Info.Layout.PageSize
	n := (len(req.InputIDs) + ps - 1) / ps
	pages, err := d.allocPages(wctx, n)
	if err != nil {
		return err
	}
	slot, err := d.aux.get()
	if err != nil {
		d.cfg.Pages.Release(pages)
		return err
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
		if rerr := d.cfg.Pages.Release(pages); rerr != nil {
			lg.Error("releasing pages", zap.Error(rerr))
		}
	}

	info, err := d.prefillInfo(wctx, boot)
	if err != nil {
		releaseAll()
		return err
	}
	if err := d.cfg.Info.Check(info); err != nil {
		releaseAll()
		return fmt.Errorf("prefill %s: %w", boot, err)
	}
	rr := RoomRequest{Room: room, Decode: d.cfg.Info, Pages: pages, AuxAddr: d.aux.addr(slot), Tokens: len(req.InputIDs)}
	if err := d.post(wctx, boot+"/bootstrap/rooms", rr); err != nil {
		releaseAll()
		return fmt.Errorf("register room with prefill %s: %w", boot, err)
	}
	setState(WaitingForInput)
	d.m.bootstrap.Observe(time.Since(start).Seconds())
	waitStart := time.Now()

	hb := time.NewTicker(d.cfg.Heartbeat)
	defer hb.Stop()
	misses := 0
	for {
		select {
		case res := <-ch:
			if !res.OK {
				releaseAll()
				return fmt.Errorf("prefill %s failed the room: %s", boot, res.Error)
			}
			r, tok, lp, top := decodeAux(d.aux.slot(slot))
			if r != room {
				releaseAll()
				return fmt.Errorf("aux slot holds room %d, want %d: first token missing", r, room)
			}
			cleanup()
			setState(Success)
			d.m.wait.Observe(time.Since(waitStart).Seconds())
			req.Preloaded = &engine.Preloaded{Pages: pages, FirstToken: tok, FirstLogprob: lp, FirstTop: top}
			lg.Debug("kv in place", zap.Int("pages", len(pages)), zap.Int64("bytes", res.Bytes),
				zap.Float64("transfer_seconds", res.TransferSeconds), zap.Duration("wait", time.Since(waitStart)))
			return nil
		case <-hb.C:
			inc, roomErr, herr := d.health(wctx, boot, room)
			switch {
			case herr == nil && roomErr != "":
				releaseAll() // the prefill buried the room: no transfer of it is in flight
				return fmt.Errorf("prefill %s failed the room: %s", boot, roomErr)
			case herr == nil && inc != info.Incarnation:
				releaseAll() // a restarted prefill will never write into these pages
				return fmt.Errorf("%w: %s restarted (incarnation %s, was %s)", ErrPrefillUnreachable, boot, inc, info.Incarnation)
			case herr != nil && wctx.Err() == nil:
				if misses++; misses >= 2 {
					releaseAll()
					return fmt.Errorf("%w: bootstrap server %s: %w", ErrPrefillUnreachable, boot, herr)
				}
			default:
				misses = 0
			}
		case <-wctx.Done():
			why := fmt.Errorf("%w: KV for room %d did not arrive within %v", ErrKVTimeout, room, d.cfg.Timeout)
			switch {
			case ctx.Err() != nil:
				why = fmt.Errorf("request aborted while waiting for KV: %w", ctx.Err())
			case d.ctx.Err() != nil:
				why = fmt.Errorf("%w while waiting for the KV of room %d", ErrDecodeClosing, room)
			}
			d.cancelRemote(boot, room, lg)
			releaseAll()
			return why
		}
	}
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

func (d *Decode) allocPages(ctx context.Context, n int) ([]int32, error) {
	for {
		pages, err := d.cfg.Pages.Alloc(n)
		if err == nil {
			return pages, nil
		}
		if !errors.Is(err, kvcache.ErrOutOfPages) || n > d.cfg.Pages.Total() {
			return nil, fmt.Errorf("decode KV pool: %w", err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: %w", ErrPoolFull, err)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

func (d *Decode) prefillInfo(ctx context.Context, boot string) (Info, error) {
	var info Info
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, boot+"/bootstrap/info", nil)
	resp, err := d.client.Do(req)
	if err != nil {
		return info, fmt.Errorf("%w: bootstrap server %s: %w", ErrPrefillUnreachable, boot, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return info, fmt.Errorf("prefill bootstrap server %s: /bootstrap/info answered %d", boot, resp.StatusCode)
	}
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil {
		return info, fmt.Errorf("prefill bootstrap server %s: bad info: %w", boot, err)
	}
	return info, nil
}

// health returns the prefill's incarnation and, if the prefill failed the
// room, why.
func (d *Decode) health(ctx context.Context, boot string, room uint64) (inc, roomErr string, err error) {
	ctx, cancel := context.WithTimeout(ctx, d.cfg.Heartbeat*2)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, boot+"/bootstrap/health?room="+strconv.FormatUint(room, 10), nil)
	resp, err := d.client.Do(req)
	if err != nil {
		return "", "", err
	}
	defer resp.Body.Close()
	var h struct {
		Incarnation string `json:"incarnation"`
		RoomError   string `json:"room_error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		return "", "", err
	}
	return h.Incarnation, h.RoomError, nil
}

func (d *Decode) post(ctx context.Context, url string, v any) error {
	b, _ := json.Marshal(v)
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	resp, err := d.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if json.Unmarshal(body, &e) == nil && e.Error.Message != "" {
			return errors.New(e.Error.Message)
		}
		return fmt.Errorf("HTTP %d: %s", resp.StatusCode, body)
	}
	return nil
}
