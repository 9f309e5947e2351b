// Package httpmeta is Mooncake's HTTP metadata service: a server holding
// keys in memory, and a client that is a transfer.Registry.
//
// Protocol (Mooncake-compatible):
//
//	GET    /metadata?key=K   200 with the value, 404 if K is not there
//	PUT    /metadata?key=K   body is the value; 200
//	DELETE /metadata?key=K   200, 404 if K is not there
//	GET    /health           200 "ok" (readiness, not part of Mooncake's protocol)
//
// Unless the server runs insecure, every /metadata request must be signed
// with the cluster secret (headers in sign.go: a date within a window, a
// single-use nonce, the body's hash and an HMAC over them); an unsigned one
// gets 401, a wrong signature 403. Mooncake's C++ clients cannot sign: they
// need a server started insecure. Errors are JSON:
// {"error": {"message", "type", "code"}}.
//
// The client stores a segment's descriptor under mooncake/ram/<segment> and
// its {"ip_or_host_name", "rpc_port"} under mooncake/rpc_meta/<segment>, as
// the etcd registry does. Descriptors are sealed with the secret, and a
// client refuses one whose seal does not check out, whoever wrote it.
//
// There are no leases: the server keeps what it is given until it is
// deleted or the server stops. The engine deletes its entry on Close, but a
// process that crashes leaves its descriptor behind. Peers are still safe:
// they connect, and the handshake's incarnation check refuses a descriptor
// whose process is gone or restarted. Use etcd where stale entries matter.
package httpmeta

import (
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/internal/meta"
)

// Defaults of ServerConfig's zero values, and fixed limits.
const (
	// MaxValueBytes caps a PUT body. A descriptor of a few thousand
	// regions fits.
	MaxValueBytes = 1 << 20
	// MaxKeys caps the number of keys held (two per segment).
	MaxKeys = 4096
	// MaxTotalBytes caps the bytes of all keys and values held.
	MaxTotalBytes = 256 << 20
	// MaxKeyBytes caps a key.
	MaxKeyBytes = 4096
	// DefaultWindow is how far a signed request's date may be from the
	// server's clock.
	DefaultWindow = time.Minute
	// maxWriters caps the PUT bodies read at once.
	maxWriters = 16
	// maxNonces caps the nonces remembered within the window.
	maxNonces = 1 << 16
)

// ServerConfig configures a Server. Zero values mean the defaults noted.
type ServerConfig struct {
	// Secret signs every request but /health (see sign.go). The zero value
	// means the per-user secret of this host (auth.UserDefault).
	Secret auth.Secret
	// Insecure serves unsigned requests (Mooncake's C++ clients cannot
	// sign): anyone who reaches the port can read, replace and delete every
	// key. Secret must be zero.
	Insecure bool
	// MaxValueBytes, MaxKeys, MaxTotalBytes: the limits of the same names.
	MaxValueBytes int64
	MaxKeys       int
	MaxTotalBytes int64
	// Window is the accepted clock difference of a signed request
	// (default DefaultWindow).
	Window time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time
	// Logger: nil means no logs.
	Logger *zap.Logger
}

// Server is an in-memory metadata store served over HTTP. It is safe for
// concurrent use.
type Server struct {
	cfg     ServerConfig
	lg      *zap.Logger
	writers chan struct{}

	mu     sync.RWMutex
	kv     map[string][]byte
	total  int64
	nonces map[string]time.Time // nonce -> when it may be forgotten
}

var _ http.Handler = (*Server)(nil)

// NewServer returns an empty store.
func NewServer(cfg ServerConfig) (*Server, error) {
	s, err := meta.Secret(cfg.Secret, cfg.Insecure)
	if err != nil {
		return nil, fmt.Errorf("http registry server: %w", err)
	}
	cfg.Secret = s
	if cfg.MaxValueBytes <= 0 {
		cfg.MaxValueBytes = MaxValueBytes
	}
	if cfg.MaxKeys <= 0 {
		cfg.MaxKeys = MaxKeys
	}
	if cfg.MaxTotalBytes <= 0 {
		cfg.MaxTotalBytes = MaxTotalBytes
	}
	if cfg.Window <= 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	lg := cfg.Logger
	if lg == nil {
		lg = zap.NewNop()
	}
	return &Server{cfg: cfg, lg: lg.Named("registry.http"), writers: make(chan struct{}, maxWriters),
		kv: map[string][]byte{}, nonces: map[string]time.Time{}}, nil
}

// errorBody is the JSON error every refusal carries.
func writeError(w http.ResponseWriter, code int, typ, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	e.Error.Message, e.Error.Type, e.Error.Code = msg, typ, code
	_ = json.NewEncoder(w).Encode(e)
}

// ServeHTTP serves /metadata and /health.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/metadata":
	case "/health":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			writeError(w, http.StatusMethodNotAllowed, "method_not_allowed", "method "+r.Method+" not allowed on /health")
			return
		}
		io.WriteString(w, "ok\n")
		return
	default:
		writeError(w, http.StatusNotFound, "not_found", "no such path "+r.URL.Path+"; the metadata service is /metadata?key=K")
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodPut, http.MethodDelete:
	default:
		w.Header().Set("Allow", "GET, HEAD, PUT, DELETE")
		writeError(w, http.StatusMethodNotAllowed, "method_not_allowed", "method "+r.Method+" not allowed on /metadata")
		return
	}
	key := r.URL.Query().Get("key")
	if key == "" {
		writeError(w, http.StatusBadRequest, "bad_request", "missing key parameter: /metadata?key=K")
		return
	}
	if len(key) > MaxKeyBytes {
		writeError(w, http.StatusBadRequest, "bad_request", fmt.Sprintf("key: longer than %d bytes", MaxKeyBytes))
		return
	}
	sum, ok := s.authorize(w, r, key)
	if !ok {
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		s.mu.RLock()
		v, ok := s.kv[key]
		s.mu.RUnlock()
		if !ok {
			writeError(w, http.StatusNotFound, "not_found", "metadata not found: key "+key)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(v)
	case http.MethodPut:
		s.put(w, r, key, sum)
	case http.MethodDelete:
		s.mu.Lock()
		v, ok := s.kv[key]
		if ok {
			delete(s.kv, key)
			s.total -= int64(len(key) + len(v))
		}
		s.mu.Unlock()
		if !ok {
			writeError(w, http.StatusNotFound, "not_found", "metadata not found: key "+key)
			return
		}
		s.lg.Debug("delete", zap.String("key", key))
		io.WriteString(w, "metadata deleted\n")
	}
}

// authorize checks a request's signature (unless insecure) before anything
// of its body is read; it returns the body hash the signature covers.
func (s *Server) authorize(w http.ResponseWriter, r *http.Request, key string) (string, bool) {
	if s.cfg.Insecure {
		return "", true
	}
	h := r.Header
	date, nonce, sum, mac := h.Get(HeaderDate), h.Get(HeaderNonce), h.Get(HeaderSHA256), h.Get(HeaderAuth)
	refuse := func(code int, typ, msg string) (string, bool) {
		s.lg.Warn("request refused", zap.String("remote", r.RemoteAddr), zap.String("method", r.Method),
			zap.String("key", key), zap.Int("code", code), zap.String("why", msg))
		writeError(w, code, typ, msg)
		return "", false
	}
	if date == "" || nonce == "" || sum == "" || mac == "" {
		return refuse(http.StatusUnauthorized, "unauthorized", fmt.Sprintf(
			"this metadata server requires requests signed with the cluster secret (headers %s, %s, %s, %s), as mooncake-go's clients send; "+
				"Mooncake's C++ clients cannot sign: run the registry with --insecure-no-cluster-token for them", HeaderDate, HeaderNonce, HeaderSHA256, HeaderAuth))
	}
	secs, err := strconv.ParseInt(date, 10, 64)
	if err != nil {
		return refuse(http.StatusUnauthorized, "unauthorized", HeaderDate+": not unix seconds")
	}
	now := s.cfg.Now()
	if d := now.Sub(time.Unix(secs, 0)).Abs(); d > s.cfg.Window {
		return refuse(http.StatusUnauthorized, "unauthorized", fmt.Sprintf("%s: %d is %v from this server's clock, more than the %v window: check the clocks",
			HeaderDate, secs, d.Round(time.Second), s.cfg.Window))
	}
	if b, err := hex.DecodeString(nonce); err != nil || len(b) != 16 {
		return refuse(http.StatusUnauthorized, "unauthorized", HeaderNonce+": want 16 bytes in hex")
	}
	if b, err := hex.DecodeString(sum); err != nil || len(b) != 32 {
		return refuse(http.StatusUnauthorized, "unauthorized", HeaderSHA256+": want a SHA-256 in hex")
	}
	if (r.Method != http.MethodPut) && subtle.ConstantTimeCompare([]byte(sum), []byte(bodyHash(nil))) != 1 {
		return refuse(http.StatusBadRequest, "bad_request", HeaderSHA256+": a "+r.Method+" has no body")
	}
	if !s.cfg.Secret.VerifyHex(mac, requestDomain, macParts(r.Method, key, sum, date, nonce)...) {
		return refuse(http.StatusForbidden, "forbidden",
			"the request's signature does not match this metadata server's cluster secret: give the registry and every process the same --cluster-token")
	}
	s.mu.Lock()
	_, seen := s.nonces[nonce]
	full := false
	if !seen {
		if len(s.nonces) >= maxNonces {
			for n, until := range s.nonces {
				if now.After(until) {
					delete(s.nonces, n)
				}
			}
		}
		if full = len(s.nonces) >= maxNonces; !full {
			s.nonces[nonce] = now.Add(2 * s.cfg.Window)
		}
	}
	s.mu.Unlock()
	switch {
	case seen:
		return refuse(http.StatusUnauthorized, "unauthorized", HeaderNonce+": this request was seen before (replayed)")
	case full:
		return refuse(http.StatusServiceUnavailable, "busy", fmt.Sprintf("more than %d signed requests within %v; retry", maxNonces, 2*s.cfg.Window))
	}
	return sum, true
}

// put stores a value within the limits; sum, when set, is the hash the
// request's signature covers.
func (s *Server) put(w http.ResponseWriter, r *http.Request, key, sum string) {
	max := s.cfg.MaxValueBytes
	if r.ContentLength > max {
		writeError(w, http.StatusRequestEntityTooLarge, "too_large", fmt.Sprintf("value: %d bytes, larger than %d", r.ContentLength, max))
		return
	}
	select {
	case s.writers <- struct{}{}:
		defer func() { <-s.writers }()
	case <-r.Context().Done():
		return
	}
	v, err := io.ReadAll(http.MaxBytesReader(w, r.Body, max))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, "too_large", fmt.Sprintf("value: larger than %d bytes", max))
			return
		}
		writeError(w, http.StatusBadRequest, "bad_request", "value: read body: "+err.Error())
		return
	}
	if sum != "" && bodyHash(v) != sum {
		writeError(w, http.StatusBadRequest, "bad_request", "value: does not match "+HeaderSHA256)
		return
	}
	s.mu.Lock()
	old, had := s.kv[key]
	total := s.total + int64(len(v)-len(old))
	if !had {
		total += int64(len(key))
	}
	var refusal string
	switch {
	case !had && len(s.kv) >= s.cfg.MaxKeys:
		refusal = fmt.Sprintf("key: %d keys held, the most this server keeps; delete some first", len(s.kv))
	case total > s.cfg.MaxTotalBytes:
		refusal = fmt.Sprintf("value: %d bytes would make %d held, more than %d", len(v), total, s.cfg.MaxTotalBytes)
	default:
		s.kv[key] = v
		s.total = total
	}
	s.mu.Unlock()
	if refusal != "" {
		writeError(w, http.StatusInsufficientStorage, "insufficient_storage", refusal)
		return
	}
	s.lg.Debug("put", zap.String("key", key), zap.Int("bytes", len(v)))
	io.WriteString(w, "metadata updated\n")
}

// Len returns the number of keys held.
func (s *Server) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.kv)
}
