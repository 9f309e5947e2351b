package lb

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// Config configures a load balancer. Zero values mean the defaults noted.
type Config struct {
	Prefill []string // prefill server URLs (at least one)
	Decode  []string // decode server URLs (at least one)
	Policy  string   // random (default), round_robin, least_load
	// HealthInterval is the period of health checks (default 1s). A server
	// that fails a check stops receiving requests; one that passes again is
	// used from the next check on.
	HealthInterval time.Duration
	// MaxBodyBytes caps a request body (default 8 MiB).
	MaxBodyBytes int64
	Logger       *zap.Logger
	Registerer   prometheus.Registerer
	Gatherer     prometheus.Gatherer // for /metrics
}

// Validate reports a configuration New cannot use, naming the flag.
func (c *Config) Validate() error {
	if len(c.Prefill) == 0 {
		return errors.New("--prefill: at least one prefill server is required")
	}
	if len(c.Decode) == 0 {
		return errors.New("--decode: at least one decode server is required")
	}
	switch c.Policy {
	case "", "random", "round_robin", "least_load":
	default:
		return fmt.Errorf("--policy %q: want random, round_robin or least_load", c.Policy)
	}
	if c.HealthInterval < 0 {
		return fmt.Errorf("--health-check-interval %v is negative", c.HealthInterval)
	}
	return nil
}

// LB is the load balancer.
type LB struct {
	cfg     Config
	lg      *zap.Logger
	prefill []*backend
	decode  []*backend
	client  *http.Client
	rr      map[string]*atomic.Uint64 // round-robin position per role
	m       *metrics
	ready   chan struct{}
	once    sync.Once
}

// New builds a load balancer; Run starts its health checks.
func New(cfg Config) (*LB, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Policy == "" {
		cfg.Policy = "random"
	}
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = time.Second
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = 8 << 20
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	l := &LB{cfg: cfg, lg: lg.Named("lb"), m: newMetrics(cfg.Registerer), ready: make(chan struct{}),
		rr: map[string]*atomic.Uint64{"prefill": new(atomic.Uint64), "decode": new(atomic.Uint64)},
		client: &http.Client{Transport: &http.Transport{
			MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second,
			DialContext: (&net.Dialer{Timeout: 3 * time.Second}).DialContext,
		}}}
	for _, u := range cfg.Prefill {
		b, err := newBackend("prefill", u)
		if err != nil {
			return nil, err
		}
		l.prefill = append(l.prefill, b)
	}
	for _, u := range cfg.Decode {
		b, err := newBackend("decode", u)
		if err != nil {
			return nil, err
		}
		l.decode = append(l.decode, b)
	}
	return l, nil
}

// Run checks every server's health each interval until ctx ends.
func (l *LB) Run(ctx context.Context) error {
	t := time.NewTicker(l.cfg.HealthInterval)
	defer t.Stop()
	for {
		l.checkAll(ctx)
		l.once.Do(func() { close(l.ready) })
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// Ready is closed after the first round of health checks.
func (l *LB) Ready() <-chan struct{} { return l.ready }

func (l *LB) checkAll(ctx context.Context) {
	var wg sync.WaitGroup
	for _, b := range append(append([]*backend{}, l.prefill...), l.decode...) {
		wg.Add(1)
		go func(b *backend) {
			defer wg.Done()
			err := b.check(ctx, l.client, l.cfg.HealthInterval)
			was := b.healthy.Load()
			b.healthy.Store(err == nil)
			l.m.healthy.WithLabelValues(b.role, b.String()).Set(b2f(err == nil))
			switch {
			case err != nil && was:
				l.lg.Warn("server unhealthy: not routing to it", zap.String("role", b.role), zap.String("url", b.String()), zap.Error(err))
			case err == nil && !was:
				l.lg.Info("server healthy: routing to it", zap.String("role", b.role), zap.String("url", b.String()),
					zap.Int64("bootstrap_port", b.bootstrapPort.Load()))
			}
		}(b)
	}
	wg.Wait()
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// pick chooses a healthy backend by the policy.
func (l *LB) pick(bs []*backend) *backend {
	var ok []*backend
	for _, b := range bs {
		if b.healthy.Load() && (b.role != "prefill" || b.bootstrapPort.Load() > 0) {
			ok = append(ok, b)
		}
	}
	if len(ok) == 0 {
		return nil
	}
	switch l.cfg.Policy {
	case "round_robin":
		return ok[int(l.rr[ok[0].role].Add(1)-1)%len(ok)]
	case "least_load":
		best := ok[0]
		for _, b := range ok[1:] {
			if b.inflight.Load() < best.inflight.Load() {
				best = b
			}
		}
		return best
	default:
		return ok[mrand.IntN(len(ok))]
	}
}

// Handler serves the LB's HTTP API.
func (l *LB) Handler() http.Handler {
	mux := http.NewServeMux()
	for _, p := range []string{"/generate", "/v1/completions", "/v1/chat/completions"} {
		mux.HandleFunc("POST "+p, l.handleGenerate)
	}
	mux.HandleFunc("GET /v1/models", l.proxyGet)
	mux.HandleFunc("GET /get_model_info", l.proxyGet)
	mux.HandleFunc("GET /health", l.handleHealth)
	mux.HandleFunc("GET /get_server_info", l.handleInfo)
	g := l.cfg.Gatherer
	if g == nil {
		g = prometheus.NewRegistry()
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	return mux
}

func (l *LB) handleHealth(w http.ResponseWriter, r *http.Request) {
	if l.pick(l.prefill) == nil || l.pick(l.decode) == nil {
		writeError(w, http.StatusServiceUnavailable, "no healthy prefill/decode pair")
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (l *LB) handleInfo(w http.ResponseWriter, r *http.Request) {
	type srv struct {
		URL           string `json:"url"`
		Healthy       bool   `json:"healthy"`
		Inflight      int64  `json:"inflight"`
		BootstrapPort int64  `json:"bootstrap_port,omitempty"`
	}
	list := func(bs []*backend) []srv {
		var out []srv
		for _, b := range bs {
			out = append(out, srv{b.String(), b.healthy.Load(), b.inflight.Load(), b.bootstrapPort.Load()})
		}
		return out
	}
	writeJSON(w, http.StatusOK, map[string]any{"role": "lb", "policy": l.cfg.Policy,
		"prefill": list(l.prefill), "decode": list(l.decode)})
}

func (l *LB) proxyGet(w http.ResponseWriter, r *http.Request) {
	b := l.pick(l.decode)
	if b == nil {
		l.m.requests.WithLabelValues("503").Inc()
		writeError(w, http.StatusServiceUnavailable, "no healthy decode server")
		return
	}
	req, _ := http.NewRequestWithContext(r.Context(), http.MethodGet, b.endpoint(r.URL.RequestURI()), nil)
	resp, err := l.client.Do(req)
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode server %s: %v", b, err))
		return
	}
	defer resp.Body.Close()
	copyHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
}

// prefillDrain bounds how long a prefill answer may keep streaming after
// its request succeeded.
const prefillDrain = 30 * time.Second

func newRoom() uint64 {
	var b [8]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:]) >> 1 // 63 bits, as SGLang's LB
}

// handleGenerate sends one request to a (prefill, decode) pair and streams
// the decode server's answer back. If the prefill server fails first, its
// error goes to the client and the decode request is canceled.
func (l *LB) handleGenerate(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	code := l.generate(w, r)
	l.m.requests.WithLabelValues(strconv.Itoa(code)).Inc()
	l.m.seconds.Observe(time.Since(start).Seconds())
}

func (l *LB) generate(w http.ResponseWriter, r *http.Request) int {
	body, err := readBody(w, r, l.cfg.MaxBodyBytes)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes", mbe.Limit))
		}
		return writeError(w, http.StatusBadRequest, "reading request body: "+err.Error())
	}
	p, d := l.pick(l.prefill), l.pick(l.decode)
	if p == nil || d == nil {
		return writeError(w, http.StatusServiceUnavailable, "no healthy prefill/decode pair")
	}
	room := newRoom()
	body, err = inject(body, p.url.Hostname(), p.bootstrapPort.Load(), room)
	if err != nil {
		return writeError(w, http.StatusBadRequest, err.Error())
	}
	lg := l.lg.With(zap.Uint64("room", room), zap.String("prefill", p.String()), zap.String("decode", d.String()))

	p.inflight.Add(1)
	d.inflight.Add(1)
	defer p.inflight.Add(-1)
	defer d.inflight.Add(-1)

	// The decode request lives as long as the client's. The prefill request
	// is canceled with it on every failure path (client gone, decode
	// failed), but on success it may finish its answer after the decode
	// stream ended: it is left to drain, bounded.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	pctx, pcancel := context.WithCancel(context.WithoutCancel(r.Context()))
	stopP := context.AfterFunc(ctx, pcancel)
	succeeded := false
	defer func() {
		if succeeded && stopP() {
			time.AfterFunc(prefillDrain, pcancel)
		} else {
			pcancel()
		}
	}()
	type result struct {
		resp *http.Response
		err  error
	}
	send := func(ctx context.Context, b *backend) chan result {
		ch := make(chan result, 1)
		go func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, b.endpoint(r.URL.Path), bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := l.client.Do(req)
			ch <- result{resp, err}
		}()
		return ch
	}
	pc, dc := send(pctx, p), send(ctx, d)
	// Drain the prefill answer; if it fails before decode answers, report it.
	type failure struct {
		code int
		body []byte
	}
	prefillFailed := make(chan failure, 1)
	go func() {
		res := <-pc
		if res.err != nil {
			if pctx.Err() == nil {
				prefillFailed <- failure{http.StatusBadGateway, errorBody(fmt.Sprintf("prefill server %s: %v", p, res.err))}
			}
			return
		}
		defer res.resp.Body.Close()
		if res.resp.StatusCode < 400 {
			io.Copy(io.Discard, res.resp.Body)
			return
		}
		b, _ := io.ReadAll(io.LimitReader(res.resp.Body, 1<<20))
		code := res.resp.StatusCode // a 4xx is the client's error: pass it on
		if code >= 500 {
			code = http.StatusBadGateway
		}
		prefillFailed <- failure{code, b}
	}()
	var dres result
	select {
	case dres = <-dc:
	case f := <-prefillFailed:
		cancel()
		lg.Warn("prefill failed; decode request canceled", zap.Int("code", f.code), zap.ByteString("error", f.body))
		return writeRaw(w, f.code, f.body)
	}
	if dres.err != nil {
		select {
		case f := <-prefillFailed:
			return writeRaw(w, f.code, f.body)
		default:
		}
		lg.Warn("decode request failed", zap.Error(dres.err))
		return writeError(w, http.StatusBadGateway, fmt.Sprintf("decode server %s: %v", d, dres.err))
	}
	defer dres.resp.Body.Close()
	copyHeader(w.Header(), dres.resp.Header)
	w.WriteHeader(dres.resp.StatusCode)
	fl, _ := w.(http.Flusher)
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	for {
		n, err := dres.resp.Body.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				return dres.resp.StatusCode // client went away; ctx cancels both sides
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err == nil {
			continue
		}
		if err != io.EOF && r.Context().Err() == nil {
			// The decode server died mid-response. A stream ends with an
			// error event and no [DONE], as the HTTP contract says.
			lg.Warn("decode response broke off", zap.Error(err))
			if strings.HasPrefix(dres.resp.Header.Get("Content-Type"), "text/event-stream") {
				fmt.Fprintf(w, "data: %s\n\n", errorBody(fmt.Sprintf("decode server %s failed mid-stream: %v", d, err)))
				if fl != nil {
					fl.Flush()
				}
			}
			return http.StatusBadGateway
		}
		succeeded = dres.resp.StatusCode < 400
		return dres.resp.StatusCode
	}
}

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// readBody reads a request body of at most max bytes, in one allocation
// when the client sent its length.
func readBody(w http.ResponseWriter, r *http.Request, max int64) ([]byte, error) {
	rd := http.MaxBytesReader(w, r.Body, max)
	if n := r.ContentLength; n > 0 && n <= max {
		b := make([]byte, n)
		if _, err := io.ReadFull(rd, b); err != nil {
			return nil, err
		}
		return b, nil
	}
	return io.ReadAll(rd)
}

func copyHeader(dst, src http.Header) {
	for _, k := range []string{"Content-Type", "Cache-Control"} {
		if v := src.Get(k); v != "" {
			dst.Set(k, v)
		}
	}
}

func errorBody(msg string) []byte {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "upstream_error", "code": http.StatusBadGateway}})
	return b
}

func writeRaw(w http.ResponseWriter, code int, b []byte) int {
	if !json.Valid(b) {
		b = errorBody(string(b))
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(b)
	return code
}

func writeJSON(w http.ResponseWriter, code int, v any) int {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	json.NewEncoder(w).Encode(v)
	return code
}

func writeError(w http.ResponseWriter, code int, msg string) int {
	typ := "invalid_request_error"
	if code >= 500 {
		typ = "server_error"
	}
	return writeJSON(w, code, map[string]any{"error": map[string]any{"message": msg, "type": typ, "code": code}})
}
