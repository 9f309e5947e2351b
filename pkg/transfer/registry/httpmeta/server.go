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
// The client stores a segment's descriptor under mooncake/ram/<segment> and
// its {"ip_or_host_name", "rpc_port"} under mooncake/rpc_meta/<segment>, as
// the etcd registry does.
//
// There are no leases: the server keeps what it is given until it is
// deleted or the server stops. The engine deletes its entry on Close, but a
// process that crashes leaves its descriptor behind. Peers are still safe:
// they connect, and the handshake's incarnation check refuses a descriptor
// whose process is gone or restarted (a connection to a dead address fails,
// a restarted process presents a new incarnation). Use etcd where stale
// entries matter.
package httpmeta

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"

	"go.uber.org/zap"
)

// Limits of the server.
const (
	// MaxValueBytes caps a PUT body. Descriptors are a few KiB; a 1 M-region
	// registration still fits.
	MaxValueBytes = 64 << 20
	// MaxKeyBytes caps a key.
	MaxKeyBytes = 4096
)

// Server is an in-memory metadata store served over HTTP. It is safe for
// concurrent use.
type Server struct {
	lg       *zap.Logger
	maxValue int64 // MaxValueBytes; smaller in tests
	mu       sync.RWMutex
	kv       map[string][]byte
}

var _ http.Handler = (*Server)(nil)

// NewServer returns an empty store. logger nil: no logs.
func NewServer(logger *zap.Logger) *Server {
	if logger == nil {
		logger = zap.NewNop()
	}
	return &Server{lg: logger.Named("registry.http"), maxValue: MaxValueBytes, kv: map[string][]byte{}}
}

// ServeHTTP serves /metadata and /health.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch r.URL.Path {
	case "/metadata":
	case "/health":
		if r.Method != http.MethodGet && r.Method != http.MethodHead {
			w.Header().Set("Allow", "GET, HEAD")
			http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
			return
		}
		io.WriteString(w, "ok\n")
		return
	default:
		http.NotFound(w, r)
		return
	}
	key := r.URL.Query().Get("key")
	if key == "" {
		http.Error(w, "missing key parameter", http.StatusBadRequest)
		return
	}
	if len(key) > MaxKeyBytes {
		http.Error(w, fmt.Sprintf("key longer than %d bytes", MaxKeyBytes), http.StatusBadRequest)
		return
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		s.mu.RLock()
		v, ok := s.kv[key]
		s.mu.RUnlock()
		if !ok {
			http.Error(w, "metadata not found", http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Write(v)
	case http.MethodPut:
		v, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.maxValue))
		if err != nil {
			var tooBig *http.MaxBytesError
			if errors.As(err, &tooBig) {
				http.Error(w, fmt.Sprintf("value larger than %d bytes", s.maxValue), http.StatusRequestEntityTooLarge)
				return
			}
			http.Error(w, "read body: "+err.Error(), http.StatusBadRequest)
			return
		}
		s.mu.Lock()
		s.kv[key] = v
		s.mu.Unlock()
		s.lg.Debug("put", zap.String("key", key), zap.Int("bytes", len(v)))
		io.WriteString(w, "metadata updated\n")
	case http.MethodDelete:
		s.mu.Lock()
		_, ok := s.kv[key]
		delete(s.kv, key)
		s.mu.Unlock()
		if !ok {
			http.Error(w, "metadata not found", http.StatusNotFound)
			return
		}
		s.lg.Debug("delete", zap.String("key", key))
		io.WriteString(w, "metadata deleted\n")
	default:
		w.Header().Set("Allow", "GET, HEAD, PUT, DELETE")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
	}
}

// Len returns the number of keys held.
func (s *Server) Len() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.kv)
}
