// Package server is the HTTP front end of a mooncake-go serving process: the
// SGLang /generate API, the OpenAI-compatible /v1 API, health, info and
// metrics endpoints. It turns HTTP bodies into engine.Requests, runs them on a
// Generator and writes the results back, whole or as server-sent events.
//
// The exact formats (streaming events, errors, finish_reason) follow
// DESIGN.md, "HTTP contract".
package server

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/lb/voucher"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// Generator runs requests. *engine.Engine satisfies it: cancelling ctx
// aborts the request, and the channel is closed after the event that carries
// the Finish.
type Generator interface {
	Submit(ctx context.Context, r *engine.Request) (<-chan engine.Event, error)
}

var _ Generator = (*engine.Engine)(nil)

// CacheFlusher is an optional Generator method: POST /flush_cache drops
// what the prefix cache holds and nobody uses, and answers how many pages
// went back.
type CacheFlusher interface {
	FlushCache() (pages int, err error)
}

// Tokenizer is what the server needs from a tokenizer (a subset of
// tokenizer.Tokenizer).
type Tokenizer interface {
	Encode(text string, addBOS bool) ([]int, error)
	// EncodeLimit is Encode for at most limit ids (negative: no limit); past it, it
	// returns a *tokenizer.TooLongError without encoding the rest.
	EncodeLimit(text string, addBOS bool, limit int) ([]int, error)
	VocabSize() int
	BOS() int // -1 if none
	TokenText(id int) string
}

var _ Tokenizer = tokenizer.Tokenizer(nil)

// ChatMessage is one message of a chat conversation, after the OpenAI
// content parts have been joined into plain text.
type ChatMessage struct {
	Role    string // "system", "user", "assistant" or "tool"
	Content string
}

// Bootstrap is the disaggregation triple the load balancer adds to a request.
type Bootstrap struct {
	Host string
	Port int
	Room uint64
}

// Disaggregation modes (Config.Mode).
const (
	ModeNull    = "null"
	ModePrefill = "prefill"
	ModeDecode  = "decode"
)

// DefaultMaxBodyBytes is the request body limit when Config.MaxBodyBytes is 0.
const DefaultMaxBodyBytes = 8 << 20

// DefaultReadTimeout bounds reading a request when Config.ReadTimeout is 0.
const DefaultReadTimeout = 30 * time.Second

// headerTimeout bounds reading a request's headers (at most the read timeout).
const headerTimeout = 10 * time.Second

// DefaultShutdownTimeout is how long Serve waits for requests in flight when
// its context ends and Config.ShutdownTimeout is 0.
const DefaultShutdownTimeout = 10 * time.Second

// Config configures a Server. Zero values mean the defaults noted on each
// field; Generator and Tokenizer are required.
type Config struct {
	Generator Generator
	Tokenizer Tokenizer

	// ChatTemplate renders a conversation into a prompt for
	// /v1/chat/completions, with the request's chat_template_kwargs as extra
	// template variables (nil when absent). nil:
	// tokenizer.ApplyChatTemplateKwargs when Tokenizer is a
	// tokenizer.Tokenizer (the model's template, or the tokenizer's plain
	// one), else PlainChatTemplate.
	ChatTemplate func(msgs []ChatMessage, kwargs map[string]any) (string, error)

	ModelName     string // served model name; "" means ModelPath, or "default" when that is empty too
	ModelPath     string // reported by /get_model_info and accepted as a model name
	RandomWeights bool   // the model has random weights (reported by /get_model_info)
	ContextLen    int    // prompts of this many tokens or more get 400; 0: no check
	Mode          string // "null" (""), "prefill" or "decode"

	MaxBodyBytes int64 // 0: DefaultMaxBodyBytes; larger bodies get 413
	// ReadTimeout bounds reading a request, headers and body, from its first byte:
	// a connection whose request does not arrive in time is closed. It does not
	// bound the response (a long stream). 0: DefaultReadTimeout.
	ReadTimeout     time.Duration
	ShutdownTimeout time.Duration // 0: DefaultShutdownTimeout

	Logger     *zap.Logger           // nil: no logs
	Gatherer   prometheus.Gatherer   // served on /metrics; nil: /metrics serves an empty set
	Registerer prometheus.Registerer // the server's own metrics; nil: not registered

	// Info adds fields to /get_server_info (bootstrap_port, engine stats...).
	Info func() map[string]any
	// Ready reports whether the server may take requests; while it returns
	// false, /health and the generation endpoints answer 503. nil: always ready.
	Ready func() bool
	// Profiling mounts net/http/pprof under /debug/pprof/.
	Profiling bool
	// PrepareDisagg, when set, is called for every request that carries
	// bootstrap_host, bootstrap_port or bootstrap_room, before Submit; it
	// sets the request's Room and Prefill or Preloaded. Its error fails the
	// request: an *Error keeps its status, engine sentinels map as Submit's
	// errors do, anything else is a 500.
	PrepareDisagg func(ctx context.Context, req *engine.Request, b Bootstrap) error
	// Vouchers says which requests a prefill or decode server serves: by
	// default those of the load balancer, with its voucher.
	Vouchers VoucherPolicy

	// PrefixCache says the Generator caches finished requests' KV: a prompt
	// asked for n > 1 times is then computed once first, so that its samples
	// share its pages.
	PrefixCache bool
	// MaxBatch bounds the generations of one request (prompts times n); 0:
	// DefaultMaxBatch.
	MaxBatch int
	// PageSize is the KV page size in tokens, for the token gauges
	// (sglang:num_used_tokens); 0 counts pages.
	PageSize int
	// TokenizerPath is reported by /get_model_info.
	TokenizerPath string
	// ServerArgs are the launch settings by SGLang's names (model_path,
	// tp_size, ...), answered by /get_server_args and in /server_info.
	ServerArgs map[string]any
	// Version is the build's version, reported by /server_info.
	Version string
	// APIKey, when set, is required as "Authorization: Bearer KEY" on every
	// endpoint but /health, /health_generate and /metrics (SGLang's --api-key).
	APIKey string
}

// Validate reports a configuration the server cannot run with.
func (c *Config) Validate() error {
	if c.Generator == nil {
		return errors.New("server: Config.Generator is nil")
	}
	if c.Tokenizer == nil {
		return errors.New("server: Config.Tokenizer is nil")
	}
	switch c.Mode {
	case "", ModeNull, ModePrefill, ModeDecode:
	default:
		return fmt.Errorf("server: unknown disaggregation mode %q (want null, prefill or decode)", c.Mode)
	}
	if c.ContextLen < 0 {
		return fmt.Errorf("server: negative ContextLen %d", c.ContextLen)
	}
	if c.MaxBodyBytes < 0 {
		return fmt.Errorf("server: negative MaxBodyBytes %d", c.MaxBodyBytes)
	}
	if (c.Mode == ModePrefill || c.Mode == ModeDecode) && c.Vouchers.Secret.IsZero() && !c.Vouchers.AllowUnsigned {
		return fmt.Errorf("server: a %s server needs Vouchers.Secret to check the load balancer's vouchers (or Vouchers.AllowUnsigned)", c.Mode)
	}
	if c.ReadTimeout < 0 {
		return fmt.Errorf("server: negative ReadTimeout %v", c.ReadTimeout)
	}
	if c.MaxBatch < 0 || c.PageSize < 0 {
		return fmt.Errorf("server: negative MaxBatch %d or PageSize %d", c.MaxBatch, c.PageSize)
	}
	return nil
}

// Server serves the HTTP API. It is safe for concurrent use.
type Server struct {
	cfg     Config
	lg      *zap.Logger
	mux     *http.ServeMux
	handler http.Handler // mux behind the API key check
	metrics *metrics
	created int64 // unix seconds, reported as the model's "created"

	vouchers *voucher.Checker // nil: not checked
	live     live             // generations running, for /abort_request
}

// New checks cfg, fills in its defaults and registers the server's metrics.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Mode == "" {
		cfg.Mode = ModeNull
	}
	if cfg.ModelName == "" {
		cfg.ModelName = cfg.ModelPath
	}
	if cfg.ModelName == "" {
		cfg.ModelName = "default"
	}
	if cfg.MaxBodyBytes == 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.ShutdownTimeout == 0 {
		cfg.ShutdownTimeout = DefaultShutdownTimeout
	}
	if cfg.ReadTimeout == 0 {
		cfg.ReadTimeout = DefaultReadTimeout
	}
	if cfg.ChatTemplate == nil {
		cfg.ChatTemplate = defaultChatTemplate(cfg.Tokenizer)
	}
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = DefaultMaxBatch
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	m, err := newMetrics(&cfg)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:     cfg,
		lg:      lg.Named("server"),
		metrics: m,
		created: time.Now().Unix(),
	}
	s.vouchers = newVoucherChecker(&s.cfg, s.lg)
	s.routes()
	s.handler = s.withAPIKey(s.mux)
	return s, nil
}

// Handler returns the HTTP handler of every endpoint.
func (s *Server) Handler() http.Handler { return s.handler }

// keyFree are the paths served without Config.APIKey.
var keyFree = map[string]bool{"/health": true, "/health_generate": true, "/metrics": true}

// withAPIKey requires Config.APIKey's bearer token, compared in constant time.
func (s *Server) withAPIKey(next http.Handler) http.Handler {
	if s.cfg.APIKey == "" {
		return next
	}
	want := []byte("Bearer " + s.cfg.APIKey)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !keyFree[r.URL.Path] && subtle.ConstantTimeCompare([]byte(r.Header.Get("Authorization")), want) != 1 {
			w.Header().Set("WWW-Authenticate", "Bearer")
			writeError(w, &Error{Status: http.StatusUnauthorized, Message: "this server needs its API key: send \"Authorization: Bearer KEY\""})
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Serve serves HTTP on ln until ctx ends, then shuts down gracefully: it stops
// accepting, waits up to Config.ShutdownTimeout for requests in flight, then
// closes the connections that remain (which aborts their requests). It
// returns nil after a shutdown caused by ctx, or the error that stopped it.
//
// A request must arrive whole within Config.ReadTimeout; net/http lifts the
// read deadline once it has (it starts its background read), so a response
// may take longer (TestReadTimeout).
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	hs := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: min(headerTimeout, s.cfg.ReadTimeout),
		ReadTimeout:       s.cfg.ReadTimeout,
		IdleTimeout:       2 * time.Minute,
		ErrorLog:          zap.NewStdLog(s.lg.Named("http")),
	}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("server: serve %s: %w", ln.Addr(), err)
	case <-ctx.Done():
	}
	s.lg.Info("shutting down", zap.Stringer("addr", ln.Addr()))
	sctx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
	defer cancel()
	err := hs.Shutdown(sctx)
	if err != nil {
		s.lg.Warn("graceful shutdown timed out; closing connections", zap.Error(err))
		err = hs.Close()
	}
	if serr := <-errc; serr != nil && !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	if err != nil {
		return fmt.Errorf("server: shutdown: %w", err)
	}
	return nil
}

func (s *Server) routes() {
	mux := http.NewServeMux()
	handle := func(method, path string, h http.HandlerFunc) {
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			if r.Method != method && (method != http.MethodGet || r.Method != http.MethodHead) {
				w.Header().Set("Allow", method)
				writeError(w, errorf(http.StatusMethodNotAllowed, "method %s not allowed on %s (use %s)", r.Method, path, method))
				return
			}
			h(w, r)
		})
	}
	handle(http.MethodPost, "/generate", s.handleGenerate)
	handle(http.MethodPost, "/v1/completions", s.handleCompletions)
	handle(http.MethodPost, "/v1/chat/completions", s.handleChat)
	handle(http.MethodGet, "/v1/models", s.handleModels)
	handle(http.MethodGet, "/v1/models/{model...}", s.handleModel)
	handle(http.MethodGet, "/health", s.handleHealth)
	handle(http.MethodGet, "/health_generate", s.handleHealthGenerate)
	handle(http.MethodGet, "/get_model_info", s.handleModelInfo)
	handle(http.MethodGet, "/get_server_info", s.handleServerInfo)
	handle(http.MethodGet, "/server_info", s.handleServerInfo)
	handle(http.MethodGet, "/get_server_args", s.handleServerArgs)
	handle(http.MethodPost, "/tokenize", s.handleTokenize)
	handle(http.MethodPost, "/v1/tokenize", s.handleTokenize)
	handle(http.MethodPost, "/detokenize", s.handleDetokenize)
	handle(http.MethodPost, "/v1/detokenize", s.handleDetokenize)
	handle(http.MethodPost, "/abort_request", s.handleAbort)
	handle(http.MethodGet, "/metrics", s.handleMetrics)
	handle(http.MethodPost, "/flush_cache", s.handleFlushCache)
	if s.cfg.Profiling {
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errorf(http.StatusNotFound, "no such endpoint: %s %s", r.Method, r.URL.Path))
	})
	s.mux = mux
}

func defaultChatTemplate(t Tokenizer) func([]ChatMessage, map[string]any) (string, error) {
	tt, ok := t.(tokenizer.Tokenizer)
	if !ok {
		return func(msgs []ChatMessage, _ map[string]any) (string, error) { return PlainChatTemplate(msgs) }
	}
	return func(msgs []ChatMessage, kwargs map[string]any) (string, error) {
		m := make([]tokenizer.Message, len(msgs))
		for i, c := range msgs {
			m[i] = tokenizer.Message{Role: c.Role, Content: c.Content}
		}
		return tokenizer.ApplyChatTemplateKwargs(tt, m, kwargs)
	}
}

func (s *Server) ready() bool { return s.cfg.Ready == nil || s.cfg.Ready() }

// checkModel is the 404 for a request whose "model" does not name the
// served model (its name or its path; empty means the served one), nil
// when it does.
func (s *Server) checkModel(name string) *Error {
	if name == "" || name == s.cfg.ModelName || (s.cfg.ModelPath != "" && name == s.cfg.ModelPath) {
		return nil
	}
	return &Error{Status: http.StatusNotFound, Param: "model",
		Message: "the model " + jsonQuote(name) + " does not exist; this server serves " + jsonQuote(s.cfg.ModelName)}
}

// readObject reads r's body into the JSON object v, answering the error
// itself when it cannot (false).
func (s *Server) readObject(w http.ResponseWriter, r *http.Request, v any) bool {
	body, e := readBody(w, r, s.cfg.MaxBodyBytes)
	if e == nil {
		e = unmarshalObject(body, v)
	}
	if e != nil {
		writeError(w, e)
		return false
	}
	return true
}
