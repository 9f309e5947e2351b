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
	// PrefillBootstrapPorts are the prefills' bootstrap ports, in Prefill's
	// order (nil, or one per prefill; 0: the port the server reports). A
	// port given here is used instead of the server's; a mismatch is
	// logged.
	PrefillBootstrapPorts []int
	Decode                []string // decode server URLs (at least one)
	// Policy names the policy that picks each role's server (default
	// random); Policies has the names (nil: BuiltinPolicies). A request
	// goes to a server with room when one has room, whatever the policy.
	Policy     string
	Policies   *Policies
	CacheAware CacheAwareConfig // cache_aware's parameters
	// HealthInterval is the period of health checks (default 1s), and each
	// check's bound. A server that fails a check stops receiving requests
	// (one that was healthy, after 3 checks in a row that timed out); one
	// that passes again is used from the next check on. Each check also reads the server's load:
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
	// MaxBatch bounds the generations of one request, prompts times n
	// (default 256): the LB sends each as a request of its own.
	MaxBatch int
	// BatchConcurrency bounds how many of one request's generations are in
	// flight at once (default 64).
	BatchConcurrency int
	// MaxAnswerBytes bounds the answers of one batch read whole, all
	// together (default 256 MiB).
	MaxAnswerBytes int64
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
	DefaultMaxBatch            = 256
	DefaultBatchConcurrency    = 64
	DefaultMaxAnswerBytes      = 256 << 20
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
	if c.MaxBatch == 0 {
		c.MaxBatch = DefaultMaxBatch
	}
	if c.BatchConcurrency == 0 {
		c.BatchConcurrency = DefaultBatchConcurrency
	}
	if c.MaxAnswerBytes == 0 {
		c.MaxAnswerBytes = DefaultMaxAnswerBytes
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
	if n := len(c.PrefillBootstrapPorts); n != 0 && n != len(c.Prefill) {
		return fmt.Errorf("--prefill-bootstrap-ports: %d ports for %d prefill servers", n, len(c.Prefill))
	}
	for i, p := range c.PrefillBootstrapPorts {
		if p < 0 || p > 65535 {
			return fmt.Errorf("--prefill %s: bootstrap port %d: want 1 to 65535", c.Prefill[i], p)
		}
	}
	switch {
	case c.MaxBatch < 0:
		return fmt.Errorf("--max-batch %d is negative", c.MaxBatch)
	case c.BatchConcurrency < 0:
		return fmt.Errorf("--batch-concurrency %d is negative", c.BatchConcurrency)
	case c.MaxAnswerBytes < 0:
		return fmt.Errorf("MaxAnswerBytes %d is negative", c.MaxAnswerBytes)
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
			port := 0
			if r.role == "prefill" && len(cfg.PrefillBootstrapPorts) > 0 {
				port = cfg.PrefillBootstrapPorts[i]
			}
			b, err := newBackend(r.role, i, u, port)
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

// Handler serves the LB's HTTP API. Every error, an unknown path's
// included, is {"error": {message, type, param, code}}.
func (l *LB) Handler() http.Handler {
	mux := http.NewServeMux()
	handle := func(method, path string, h http.HandlerFunc) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			if r.Method != method && (method != http.MethodGet || r.Method != http.MethodHead) {
				w.Header().Set("Allow", method)
				writeError(w, http.StatusMethodNotAllowed, fmt.Sprintf("method %s not allowed on %s (use %s)", r.Method, path, method))
				return
			}
			h(w, r)
		})
	}
	for _, p := range []string{"/generate", "/v1/completions", "/v1/chat/completions"} {
		handle(http.MethodPost, p, l.handleGenerate)
	}
	handle(http.MethodGet, "/v1/models", l.proxyGet)
	handle(http.MethodGet, "/v1/models/{model...}", l.proxyGet)
	handle(http.MethodGet, "/get_model_info", l.proxyGet)
	handle(http.MethodGet, "/health", l.handleHealth)
	handle(http.MethodGet, "/health_generate", l.handleHealthGenerate)
	handle(http.MethodGet, "/get_server_info", l.handleInfo)
	handle(http.MethodGet, "/server_info", l.handleInfo)
	handle(http.MethodPost, "/flush_cache", l.handleFlushCache)
	g := l.cfg.Gatherer
	if g == nil {
		g = prometheus.NewRegistry()
	}
	metrics := promhttp.HandlerFor(g, promhttp.HandlerOpts{})
	handle(http.MethodGet, "/metrics", metrics.ServeHTTP)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, fmt.Sprintf("no such endpoint: %s %s", r.Method, r.URL.Path))
	})
	return mux
}

func (l *LB) handleHealth(w http.ResponseWriter, r *http.Request) {
	if len(candidates(l.prefill, nil)) == 0 || len(candidates(l.decode, nil)) == 0 {
		writeError(w, http.StatusServiceUnavailable, "no healthy prefill/decode pair")
		return
	}
	w.WriteHeader(http.StatusOK)
}

// handleInfo is the LB's /get_server_info: each server by role and index
// (the index is the label of the LB's per-server metrics), its URL and
// state.
func (l *LB) handleInfo(w http.ResponseWriter, r *http.Request) {
	type srv struct {
		Index         int    `json:"index"`
		URL           string `json:"url"`
		Healthy       bool   `json:"healthy"`
		Reason        string `json:"reason,omitempty"` // why it is not routed to
		Inflight      int64  `json:"inflight"`
		BootstrapPort int64  `json:"bootstrap_port,omitempty"`
		Full          bool   `json:"full"`
		Load          *load  `json:"load,omitempty"`
	}
	list := func(bs []*backend) []srv {
		out := []srv{}
		for _, b := range bs {
			s := srv{Index: b.id, URL: b.String(), Healthy: b.healthy.Load(), Inflight: b.inflight.Load(),
				BootstrapPort: b.bootstrapPort.Load(), Full: b.full(), Load: b.load.Load()}
			if why := b.why.Load(); why != nil {
				s.Reason = why.Msg
			}
			out = append(out, s)
		}
		return out
	}
	writeJSON(w, http.StatusOK, map[string]any{"role": "lb", "policy": l.cfg.Policy, "max_batch": l.cfg.MaxBatch,
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
// the decode server's answer back; a batch or n > 1 is split first, one
// room per generation (see split). A pair that fails before anything
// reached the client is replaced once (see run).
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
	req, err := parseRequest(body)
	if err != nil {
		return writeError(w, http.StatusBadRequest, err.Error())
	}
	sp, f := l.split(r.URL.Path, req)
	switch {
	case f != nil:
		return f.write(w)
	case sp != nil:
		return l.generateSplit(w, r, sp)
	}
	key := req.key()
	p, d := l.pick(l.prefill, nil, key), l.pick(l.decode, nil, key)
	if p == nil || d == nil {
		return writeError(w, http.StatusServiceUnavailable, "no healthy prefill/decode pair")
	}
	up, f := l.run(r.Context(), r.URL.Path, req, p, d)
	if f != nil {
		if f.gone {
			return statusClientClosed
		}
		return f.write(w)
	}
	return l.relay(w, r, up)
}

// run runs the request on the pair (p, d) until the decode's answer
// starts; when the attempt fails and another pair may do better (a server
// unreachable, a 5xx other than 504, overloaded), it runs once more on a
// pair without the server that failed. The caller gets the second
// attempt's outcome; its error names both causes.
func (l *LB) run(ctx context.Context, path string, req *request, p, d *backend) (*upstream, *failure) {
	up, first := l.open(ctx, path, req, p, d)
	if first == nil || first.gone || !first.retry {
		return up, first
	}
	key := req.key()
	if first.role == "prefill" {
		p = l.pick(l.prefill, p, key)
	} else {
		d = l.pick(l.decode, d, key)
	}
	if p == nil || d == nil { // no other pair: the first failure stands
		return nil, first
	}
	l.m.retries.WithLabelValues(first.role, first.cause).Inc()
	l.lg.Warn("retrying on another pair", zap.String("role", first.role), zap.String("cause", first.cause), zap.String("error", first.msg))
	up, f := l.open(ctx, path, req, p, d)
	if f != nil && f.raw == nil && !f.gone {
		f.msg += "; first attempt: " + first.msg
	}
	return up, f
}

// failure is an attempt that failed before anything was written to the
// client.
type failure struct {
	code  int    // status for the client
	msg   string // names the server and the cause
	param string // the request field at fault, if the LB knows it
	raw   []byte // a server's own 4xx error body, passed on as is
	role  string // the side that failed: prefill or decode
	cause string // metric label: unreachable, overloaded, error, rejected, idle
	retry bool   // another pair may do better
	gone  bool   // the client went away (or the request was canceled): nothing to answer
}

func (f *failure) write(w http.ResponseWriter) int {
	if f.raw != nil {
		return writeRaw(w, f.code, f.raw)
	}
	return writeErrorParam(w, f.code, f.msg, f.param)
}

// body is the failure's error object, as an HTTP body or an SSE event.
func (f *failure) body() []byte {
	if f.raw != nil && json.Valid(f.raw) {
		return f.raw
	}
	return errorBody(f.code, f.msg, f.param)
}

var errGone = &failure{code: statusClientClosed, msg: "the client went away", gone: true}

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

// upstream is a decode answer that started (status below 400). Its reader
// reads resp.Body and then calls done once.
type upstream struct {
	resp   *http.Response
	d      *backend
	wd     *watchdog
	lg     *zap.Logger
	stream bool // the answer is an event stream
	finish func(ok bool)
}

// done releases the attempt: ok, the answer was read to its end (the
// prefill's own answer may then drain, bounded); else both sides are
// canceled.
func (u *upstream) done(ok bool) { u.finish(ok) }

// open sends the request to the pair (p, d) under a new room and waits
// for the decode's answer to start: an upstream for its reader, or a
// failure when nothing can be sent to the client.
func (l *LB) open(ctx context.Context, path string, req *request, p, d *backend) (*upstream, *failure) {
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
	// The decode request lives as long as the client's. The prefill request
	// is canceled with it on every failure path (client gone, decode
	// failed), but on success it may finish its answer after the decode
	// stream ended: it is left to drain, bounded.
	ctx, cancel := context.WithCancel(ctx)
	pctx, pcancel := context.WithCancel(context.WithoutCancel(ctx))
	stopP := context.AfterFunc(ctx, pcancel)
	wd := l.watch(d, req.stream, cancel)
	var resp *http.Response
	finish := func(ok bool) {
		if resp != nil {
			resp.Body.Close()
		}
		wd.stop()
		if ok && stopP() {
			time.AfterFunc(prefillDrain, pcancel)
		} else {
			pcancel()
		}
		cancel()
		d.inflight.Add(-1)
		p.inflight.Add(-1)
	}
	type result struct {
		resp *http.Response
		err  error
	}
	send := func(ctx context.Context, b *backend) chan result {
		ch := make(chan result, 1)
		go func() {
			hreq, _ := http.NewRequestWithContext(ctx, http.MethodPost, b.endpoint(path), bytes.NewReader(body))
			hreq.Header.Set("Content-Type", "application/json")
			if vouch != "" {
				hreq.Header.Set(voucher.Header, vouch)
			}
			resp, err := l.client.Do(hreq)
			ch <- result{resp, err}
		}()
		return ch
	}
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
	fail := func(f *failure) (*upstream, *failure) {
		finish(false)
		return nil, f
	}
	var dres result
	select {
	case dres = <-dc:
	case f := <-prefillFailed:
		cancel()
		lg.Warn("prefill failed; decode request canceled", zap.Int("code", f.code), zap.String("error", f.msg))
		return fail(f)
	}
	if dres.err != nil {
		switch {
		case wd.fired.Load():
			l.m.idle.WithLabelValues("before_response").Inc()
			lg.Warn("decode answered nothing in time; canceled", zap.String("bound", wd.what()))
			return fail(&failure{code: http.StatusGatewayTimeout, role: "decode", cause: "idle",
				msg: fmt.Sprintf("decode server %s answered nothing: %s", d, wd.what())})
		case ctx.Err() != nil:
			return fail(errGone)
		}
		select {
		case f := <-prefillFailed:
			return fail(f)
		default:
		}
		lg.Warn("decode request failed", zap.Error(dres.err))
		return fail(connFailure(d, dres.err))
	}
	resp = dres.resp
	if resp.StatusCode >= 400 {
		f := upstreamFailure(d, resp)
		lg.Warn("decode failed", zap.Int("code", resp.StatusCode), zap.String("error", f.msg))
		return fail(f)
	}
	return &upstream{resp: resp, d: d, wd: wd, lg: lg, finish: finish,
		stream: strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")}, nil
}

// relay copies the decode's answer to the client as it comes.
func (l *LB) relay(w http.ResponseWriter, r *http.Request, up *upstream) int {
	ok := false
	defer func() { up.done(ok) }()
	resp, wd := up.resp, up.wd
	copyHeader(w.Header(), resp.Header)
	w.WriteHeader(resp.StatusCode)
	fl, _ := w.(http.Flusher)
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			wd.kick()
			if _, werr := w.Write(buf[:n]); werr != nil {
				return resp.StatusCode // client went away; ctx cancels both sides
			}
			if fl != nil {
				fl.Flush()
			}
		}
		if err == nil {
			continue
		}
		if err == io.EOF {
			ok = true
			return resp.StatusCode
		}
		if r.Context().Err() != nil && !wd.fired.Load() {
			return statusClientClosed
		}
		code, cause := l.broken(up, err)
		// A stream ends with an error event and no [DONE], as the HTTP
		// contract says.
		if up.stream {
			fmt.Fprintf(w, "data: %s\n\n", errorBody(code, cause, ""))
			if fl != nil {
				fl.Flush()
			}
		}
		return code
	}
}

// broken names an answer that broke off with err: the status and message
// for the client.
func (l *LB) broken(up *upstream, err error) (int, string) {
	if up.wd.fired.Load() {
		l.m.idle.WithLabelValues("mid_response").Inc()
		up.lg.Warn("decode stalled mid-answer; ended", zap.String("bound", up.wd.what()))
		return http.StatusGatewayTimeout, fmt.Sprintf("decode server %s stalled mid-stream: %s", up.d, up.wd.what())
	}
	up.lg.Warn("decode response broke off", zap.Error(err))
	return http.StatusBadGateway, fmt.Sprintf("decode server %s failed mid-stream: %v", up.d, err)
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

func errorBody(code int, msg, param string) []byte {
	var p any
	if param != "" {
		p = param
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": errorType(code), "param": p, "code": code}})
	return b
}

// errorType is the OpenAI "type" of an error with this status, as the
// servers name them.
func errorType(code int) string {
	switch {
	case code == http.StatusUnauthorized:
		return "authentication_error"
	case code == http.StatusNotFound:
		return "not_found_error"
	case code == http.StatusServiceUnavailable:
		return "service_unavailable_error"
	case code >= 500:
		return "internal_server_error"
	}
	return "invalid_request_error"
}

func writeRaw(w http.ResponseWriter, code int, b []byte) int {
	if !json.Valid(b) {
		b = errorBody(code, string(b), "")
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
	return writeErrorParam(w, code, msg, "")
}

func writeErrorParam(w http.ResponseWriter, code int, msg, param string) int {
	if code == http.StatusServiceUnavailable {
		w.Header().Set("Retry-After", "1")
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	w.Write(append(errorBody(code, msg, param), '\n'))
	return code
}
