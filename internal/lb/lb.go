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

	"github.com/mooncake-go/mooncake-go/internal/lb/voucher"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Config configures a load balancer. Zero values mean the defaults noted.
type Config struct {
	Prefill []string // prefill server URLs (at least one)
	Decode  []string // decode server URLs (at least one)
	// Policy names the policy that picks each role's server (default
	// random); Policies has the names (nil: BuiltinPolicies). A request
	// goes to a server with room when one has room, whatever the policy.
	Policy     string
	Policies   *Policies
	CacheAware CacheAwareConfig // cache_aware's parameters
	// HealthInterval is the period of health checks (default 1s). A server
	// that fails a check stops receiving requests; one that passes again is
	// used from the next check on. Each check also reads the server's load:
	// servers with room are preferred to full ones.
	HealthInterval time.Duration
	// UpstreamIdleTimeout bounds how long an upstream answer may show no
	// sign of life (default 30s): a stream that sent no bytes for that
	// long, or an answer sent whole whose server passed no health check
	// for that long, is ended: with a 504 if nothing reached the client
	// yet, else with an SSE error event and no [DONE].
	UpstreamIdleTimeout time.Duration
	// HTTPReadTimeout bounds reading a client's request, body included, on
	// the server HTTPServer returns (default 30s).
	HTTPReadTimeout time.Duration
	// MaxBodyBytes caps a request body (default 8 MiB).
	MaxBodyBytes int64
	// Secret signs a voucher for the bootstrap fields of each request
	// (header voucher.Header), which the servers check. The zero Secret
	// sends none: the servers must then take unsigned bootstrap fields.
	Secret     auth.Secret
	Logger     *zap.Logger
	Registerer prometheus.Registerer
	Gatherer   prometheus.Gatherer // for /metrics
}

// Defaults of Config.
const (
	DefaultHealthInterval      = time.Second
	DefaultUpstreamIdleTimeout = 30 * time.Second
	DefaultHTTPReadTimeout     = 30 * time.Second
	DefaultMaxBodyBytes        = 8 << 20
)

// withDefaults is c with its zero values replaced by the defaults.
func (c Config) withDefaults() Config {
	if c.Policy == "" {
		c.Policy = "random"
	}
	if c.Policies == nil {
		c.Policies = BuiltinPolicies()
	}
	if c.HealthInterval == 0 {
		c.HealthInterval = DefaultHealthInterval
	}
	if c.UpstreamIdleTimeout == 0 {
		c.UpstreamIdleTimeout = DefaultUpstreamIdleTimeout
	}
	if c.HTTPReadTimeout == 0 {
		c.HTTPReadTimeout = DefaultHTTPReadTimeout
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = DefaultMaxBodyBytes
	}
	return c
}

// Validate reports a configuration New cannot use, naming the flag.
func (c *Config) Validate() error {
	if len(c.Prefill) == 0 {
		return errors.New("--prefill: at least one prefill server is required")
	}
	if len(c.Decode) == 0 {
		return errors.New("--decode: at least one decode server is required")
	}
	if e := c.withDefaults(); e.Policies.m[e.Policy] == nil {
		return e.Policies.unknown(e.Policy)
	}
	if err := c.CacheAware.Validate(); err != nil {
		return err
	}
	for _, d := range []struct {
		flag string
		v    time.Duration
	}{{"--health-check-interval", c.HealthInterval}, {"--upstream-idle-timeout", c.UpstreamIdleTimeout}, {"--http-read-timeout", c.HTTPReadTimeout}} {
		if d.v < 0 {
			return fmt.Errorf("%s %v is negative", d.flag, d.v)
		}
	}
	if c.MaxBodyBytes < 0 {
		return fmt.Errorf("MaxBodyBytes %d is negative", c.MaxBodyBytes)
	}
	// An answer sent whole is alive while its server passes health checks.
	if e := c.withDefaults(); e.HealthInterval >= e.UpstreamIdleTimeout {
		return fmt.Errorf("--health-check-interval %v must be shorter than --upstream-idle-timeout %v", e.HealthInterval, e.UpstreamIdleTimeout)
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
	policy  map[string]Policy // by role
	m       *metrics
	ready   chan struct{}
	once    sync.Once
}

// New builds a load balancer; Run starts its health checks.
func New(cfg Config) (*LB, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	l := &LB{cfg: cfg, lg: lg.Named("lb"), m: newMetrics(cfg.Registerer), ready: make(chan struct{}),
		policy: map[string]Policy{},
		client: &http.Client{Transport: &http.Transport{
			MaxIdleConnsPerHost: 256, IdleConnTimeout: 90 * time.Second,
			DialContext: (&net.Dialer{Timeout: 3 * time.Second}).DialContext,
		}}}
	for _, r := range []struct {
		role string
		urls []string
		bs   *[]*backend
	}{{"prefill", cfg.Prefill, &l.prefill}, {"decode", cfg.Decode, &l.decode}} {
		for i, u := range r.urls {
			b, err := newBackend(r.role, i, u)
			if err != nil {
				return nil, err
			}
			*r.bs = append(*r.bs, b)
		}
		p, err := cfg.Policies.New(cfg.Policy, PolicyEnv{Role: r.role, Servers: len(r.urls), CacheAware: cfg.CacheAware, Registerer: cfg.Registerer})
		if err != nil {
			return nil, err
		}
		l.policy[r.role] = p
	}
	if cfg.Secret.IsZero() {
		l.lg.Warn("no cluster secret: the bootstrap fields go without vouchers, which the servers accept only with --allow-unsigned-bootstrap")
	}
	return l, nil
}

// HTTPServer is an http.Server for Handler with the LB's bounds on reading
// requests.
func (l *LB) HTTPServer() *http.Server {
	return &http.Server{
		Handler:           l.Handler(),
		ReadHeaderTimeout: min(10*time.Second, l.cfg.HTTPReadTimeout),
		ReadTimeout:       l.cfg.HTTPReadTimeout,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          zap.NewStdLog(l.lg.Named("http")),
	}
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
			case err == nil && !was && b.role == "prefill":
				l.lg.Info("server healthy: routing to it", zap.String("role", b.role), zap.String("url", b.String()),
					zap.Int64("bootstrap_port", b.bootstrapPort.Load()))
			case err == nil && !was:
				l.lg.Info("server healthy: routing to it", zap.String("role", b.role), zap.String("url", b.String()))
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

// candidates are the usable backends other than not: those with room, or
// all if none has room.
func candidates(bs []*backend, not *backend) []*backend {
	var roomy, full []*backend
	for _, b := range bs {
		switch {
		case b == not || !b.usable():
		case b.full():
			full = append(full, b)
		default:
			roomy = append(roomy, b)
		}
	}
	if len(roomy) > 0 {
		return roomy
	}
	return full
}

// pick chooses a usable backend other than not by the role's policy, among
// those with room if any has room, for a request whose prompt is key.
func (l *LB) pick(bs []*backend, not *backend, key []byte) *backend {
	ok := candidates(bs, not)
	if len(ok) == 0 {
		return nil
	}
	cands := make([]Candidate, len(ok))
	for i, b := range ok {
		cands[i] = Candidate{ID: b.id, Inflight: b.inflight.Load()}
	}
	role := ok[0].role
	i := l.policy[role].Pick(cands, key)
	if i < 0 || i >= len(ok) {
		l.lg.Error("policy picked no candidate; taking the first", zap.String("policy", l.cfg.Policy), zap.String("role", role), zap.Int("index", i))
		i = 0
	}
	return ok[i]
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
	mux.HandleFunc("POST /flush_cache", l.handleFlushCache)
	g := l.cfg.Gatherer
	if g == nil {
		g = prometheus.NewRegistry()
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(g, promhttp.HandlerOpts{}))
	return mux
}

func (l *LB) handleHealth(w http.ResponseWriter, r *http.Request) {
	if len(candidates(l.prefill, nil)) == 0 || len(candidates(l.decode, nil)) == 0 {
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
		Full          bool   `json:"full"`
		Load          *load  `json:"load,omitempty"`
	}
	list := func(bs []*backend) []srv {
		var out []srv
		for _, b := range bs {
			ld := b.load.Load()
			out = append(out, srv{b.String(), b.healthy.Load(), b.inflight.Load(), b.bootstrapPort.Load(), b.full(), ld})
		}
		return out
	}
	writeJSON(w, http.StatusOK, map[string]any{"role": "lb", "policy": l.cfg.Policy,
		"prefill": list(l.prefill), "decode": list(l.decode)})
}

func (l *LB) proxyGet(w http.ResponseWriter, r *http.Request) {
	b := l.pick(l.decode, nil, nil)
	if b == nil {
		l.m.requests.WithLabelValues("503").Inc()
		writeError(w, http.StatusServiceUnavailable, "no healthy decode server")
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), l.cfg.UpstreamIdleTimeout)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.endpoint(r.URL.RequestURI()), nil)
	resp, err := l.client.Do(req)
	if err != nil {
		writeError(w, http.StatusBadGateway, fmt.Sprintf("decode server %s: %v", b, err))
		return
	}
	defer resp.Body.Close()
	copyHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, io.LimitReader(resp.Body, 16<<20))
}

// prefillDrain bounds how long a prefill answer may keep streaming after
// its request succeeded.
const prefillDrain = 30 * time.Second

// statusClientClosed is the status counted (never sent) for a request whose
// client went away.
const statusClientClosed = 499

func newRoom() uint64 {
	var b [8]byte
	rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:]) >> 1 // 63 bits, as SGLang's LB
}

// handleGenerate sends one request to a (prefill, decode) pair and streams
// the decode server's answer back. A pair that fails before anything reached
// the client is replaced once (see generate).
func (l *LB) handleGenerate(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	code := l.generate(w, r)
	l.m.requests.WithLabelValues(strconv.Itoa(code)).Inc()
	l.m.seconds.Observe(time.Since(start).Seconds())
}

// generate runs the request on a pair; when the attempt fails before any
// byte reached the client and another pair may do better (a server
// unreachable, a 5xx other than 504, overloaded), it runs once more on a
// pair without the server that failed. The client then gets the second
// attempt's outcome; its error names both causes.
func (l *LB) generate(w http.ResponseWriter, r *http.Request) int {
	body, err := readBody(w, r, l.cfg.MaxBodyBytes)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body over %d bytes", mbe.Limit))
		}
		return writeError(w, http.StatusBadRequest, "reading request body: "+err.Error())
	}
	req, err := parseRequest(body)
	if err != nil {
		return writeError(w, http.StatusBadRequest, err.Error())
	}
	key := req.key()
	p, d := l.pick(l.prefill, nil, key), l.pick(l.decode, nil, key)
	if p == nil || d == nil {
		return writeError(w, http.StatusServiceUnavailable, "no healthy prefill/decode pair")
	}
	code, first := l.attempt(w, r, req, p, d)
	if first == nil {
		return code
	}
	if r.Context().Err() != nil {
		return statusClientClosed
	}
	if !first.retry {
		return first.write(w)
	}
	if first.role == "prefill" {
		p = l.pick(l.prefill, p, key)
	} else {
		d = l.pick(l.decode, d, key)
	}
	if p == nil || d == nil { // no other pair: the first failure stands
		return first.write(w)
	}
	l.m.retries.WithLabelValues(first.role, first.cause).Inc()
	l.lg.Warn("retrying on another pair", zap.String("role", first.role), zap.String("cause", first.cause), zap.String("error", first.msg))
	code, f := l.attempt(w, r, req, p, d)
	if f == nil {
		return code
	}
	if f.raw == nil {
		f.msg += "; first attempt: " + first.msg
	}
	return f.write(w)
}

// failure is an attempt that failed before anything was written to the
// client.
type failure struct {
	code  int    // status for the client
	msg   string // names the server and the cause
	raw   []byte // a server's own 4xx error body, passed on as is
	role  string // the side that failed: prefill or decode
	cause string // metric label: unreachable, overloaded, error, rejected, idle
	retry bool   // another pair may do better
}

func (f *failure) write(w http.ResponseWriter) int {
	if f.raw != nil {
		return writeRaw(w, f.code, f.raw)
	}
	return writeError(w, f.code, f.msg)
}

// connFailure is a server that did not answer.
func connFailure(b *backend, err error) *failure {
	return &failure{code: http.StatusBadGateway, msg: fmt.Sprintf("%s server %s: %v", b.role, b, err), role: b.role, cause: "unreachable", retry: true}
}

// upstreamFailure reads a server's error answer (status >= 400).
func upstreamFailure(b *backend, resp *http.Response) *failure {
	raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var e struct {
		Error struct {
			Message string  `json:"message"`
			Param   *string `json:"param"`
		} `json:"error"`
	}
	msg := strings.TrimSpace(string(raw))
	if json.Unmarshal(raw, &e) == nil && e.Error.Message != "" {
		msg = e.Error.Message
	}
	f := &failure{role: b.role, msg: fmt.Sprintf("%s server %s answered %d: %s", b.role, b, resp.StatusCode, msg)}
	switch code := resp.StatusCode; {
	case code < 500 && e.Error.Param != nil && isBootstrapName(*e.Error.Param):
		// The bootstrap fields are the LB's: its fault, not the client's.
		f.code, f.cause, f.retry = http.StatusBadGateway, "rejected", true
		f.msg = fmt.Sprintf("%s server %s refused the LB's bootstrap fields (do the LB and the servers share the cluster secret?): %s", b.role, b, msg)
	case code < 500: // the client's error: pass it on
		f.code, f.raw, f.cause = code, raw, "client"
	case code == http.StatusServiceUnavailable:
		f.code, f.cause, f.retry = code, "overloaded", true
	case code == http.StatusGatewayTimeout: // its time bound passed already
		f.code, f.cause = code, "timeout"
	case code == http.StatusBadGateway && b.role == "decode":
		// The decode's own upstream, the prefill, failed it: replace that.
		f.code, f.role, f.cause, f.retry = code, "prefill", "unreachable", true
	default:
		f.code, f.cause, f.retry = http.StatusBadGateway, "error", true
	}
	return f
}

// attempt runs the request on the pair (p, d). It returns the status sent
// to the client, or a failure when nothing was sent.
func (l *LB) attempt(w http.ResponseWriter, r *http.Request, req *request, p, d *backend) (int, *failure) {
	room := newRoom()
	host, port := p.url.Hostname(), p.bootstrapPort.Load()
	body := req.with(host, port, room)
	var vouch string
	if !l.cfg.Secret.IsZero() {
		vouch = voucher.Sign(l.cfg.Secret, voucher.Fields{Host: host, Port: int(port), Room: room}, time.Now())
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
			hreq, _ := http.NewRequestWithContext(ctx, http.MethodPost, b.endpoint(r.URL.Path), bytes.NewReader(body))
			hreq.Header.Set("Content-Type", "application/json")
			if vouch != "" {
				hreq.Header.Set(voucher.Header, vouch)
			}
			resp, err := l.client.Do(hreq)
			ch <- result{resp, err}
		}()
		return ch
	}
	wd := l.watch(d, req.stream, cancel)
	defer wd.stop()
	pc, dc := send(pctx, p), send(ctx, d)
	// Drain the prefill answer; if it fails before decode answers, report it.
	prefillFailed := make(chan *failure, 1)
	go func() {
		res := <-pc
		if res.err != nil {
			if pctx.Err() == nil {
				prefillFailed <- connFailure(p, res.err)
			}
			return
		}
		defer res.resp.Body.Close()
		if res.resp.StatusCode < 400 {
			io.Copy(io.Discard, res.resp.Body)
			return
		}
		prefillFailed <- upstreamFailure(p, res.resp)
	}()
	var dres result
	select {
	case dres = <-dc:
	case f := <-prefillFailed:
		cancel()
		lg.Warn("prefill failed; decode request canceled", zap.Int("code", f.code), zap.String("error", f.msg))
		return 0, f
	}
	if dres.err != nil {
		switch {
		case wd.fired.Load():
			l.m.idle.WithLabelValues("before_response").Inc()
			lg.Warn("decode answered nothing in time; canceled", zap.String("bound", wd.what()))
			return 0, &failure{code: http.StatusGatewayTimeout, role: "decode", cause: "idle",
				msg: fmt.Sprintf("decode server %s answered nothing: %s", d, wd.what())}
		case r.Context().Err() != nil:
			return statusClientClosed, nil
		}
		select {
		case f := <-prefillFailed:
			return 0, f
		default:
		}
		lg.Warn("decode request failed", zap.Error(dres.err))
		return 0, connFailure(d, dres.err)
	}
	defer dres.resp.Body.Close()
	if dres.resp.StatusCode >= 400 {
		f := upstreamFailure(d, dres.resp)
		lg.Warn("decode failed", zap.Int("code", dres.resp.StatusCode), zap.String("error", f.msg))
		return 0, f
	}
	copyHeader(w.Header(), dres.resp.Header)
	w.WriteHeader(dres.resp.StatusCode)
	fl, _ := w.(http.Flusher)
	stream := strings.HasPrefix(dres.resp.Header.Get("Content-Type"), "text/event-stream")
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	for {
		n, err := dres.resp.Body.Read(buf)
		if n > 0 {
			wd.kick()
			if _, werr := w.Write(buf[:n]); werr != nil {
				return dres.resp.StatusCode, nil // client went away; ctx cancels both sides
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err == nil {
			continue
		}
		var cause string
		code := http.StatusBadGateway
		switch {
		case err == io.EOF:
			succeeded = true
			return dres.resp.StatusCode, nil
		case wd.fired.Load():
			l.m.idle.WithLabelValues("mid_response").Inc()
			code, cause = http.StatusGatewayTimeout, fmt.Sprintf("decode server %s stalled mid-stream: %s", d, wd.what())
			lg.Warn("decode stalled mid-stream; ended", zap.String("bound", wd.what()))
		case r.Context().Err() != nil:
			return statusClientClosed, nil
		default:
			cause = fmt.Sprintf("decode server %s failed mid-stream: %v", d, err)
			lg.Warn("decode response broke off", zap.Error(err))
		}
		// A stream ends with an error event and no [DONE], as the HTTP
		// contract says.
		if stream {
			fmt.Fprintf(w, "data: %s\n\n", errorBody(code, cause))
			if fl != nil {
				fl.Flush()
			}
		}
		return code, nil
	}
}

// watchdog cancels an upstream request that shows no sign of life for the
// idle timeout: on a stream, no bytes; on an answer sent whole, no bytes
// and no passed health check of its server.
type watchdog struct {
	idle   time.Duration
	whole  *backend // nil for a stream
	last   atomic.Int64
	fired  atomic.Bool
	cancel context.CancelFunc
	mu     sync.Mutex
	t      *time.Timer
}

func (l *LB) watch(b *backend, stream bool, cancel context.CancelFunc) *watchdog {
	wd := &watchdog{idle: l.cfg.UpstreamIdleTimeout, cancel: cancel}
	if !stream {
		wd.whole = b
	}
	wd.kick()
	wd.mu.Lock()
	defer wd.mu.Unlock()
	wd.t = time.AfterFunc(wd.idle, wd.check)
	return wd
}

// kick records a sign of life.
func (wd *watchdog) kick() { wd.last.Store(time.Now().UnixNano()) }

func (wd *watchdog) check() {
	since := wd.last.Load()
	if wd.whole != nil {
		since = max(since, wd.whole.lastOK.Load())
	}
	if rest := time.Duration(since + int64(wd.idle) - time.Now().UnixNano()); rest > 0 {
		wd.mu.Lock()
		wd.t.Reset(rest)
		wd.mu.Unlock()
		return
	}
	wd.fired.Store(true)
	wd.cancel()
}

func (wd *watchdog) stop() {
	wd.mu.Lock()
	defer wd.mu.Unlock()
	wd.t.Stop()
}

// what says which bound passed.
func (wd *watchdog) what() string {
	if wd.whole != nil {
		return fmt.Sprintf("no bytes and no passed health check for %v (--upstream-idle-timeout)", wd.idle)
	}
	return fmt.Sprintf("no bytes for %v (--upstream-idle-timeout)", wd.idle)
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

func errorBody(code int, msg string) []byte {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": errorType(code), "code": code}})
	return b
}

func errorType(code int) string {
	if code >= 500 {
		return "server_error"
	}
	return "invalid_request_error"
}

func writeRaw(w http.ResponseWriter, code int, b []byte) int {
	if !json.Valid(b) {
		b = errorBody(code, string(b))
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
	return writeJSON(w, code, map[string]any{"error": map[string]any{"message": msg, "type": errorType(code), "code": code}})
}
