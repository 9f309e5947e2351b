package lb

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
)

// all is every server, prefills first.
func (l *LB) all() []*backend {
	return append(append(make([]*backend, 0, len(l.prefill)+len(l.decode)), l.prefill...), l.decode...)
}

// checkAll checks every server once, at once.
func (l *LB) checkAll(ctx context.Context) {
	var wg sync.WaitGroup
	for _, b := range l.all() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.checkOne(ctx, b)
		}()
	}
	wg.Wait()
}

// checkOne checks b and logs each change of its state with the reason: its
// first verdict, healthy to unhealthy, unhealthy for another kind of
// reason, healthy again. A server of another role than its flag is
// refused: it is never routed to.
func (l *LB) checkOne(ctx context.Context, b *backend) {
	err := b.check(ctx, l.client, l.cfg.HealthInterval)
	if ctx.Err() != nil {
		return // stopping: no verdict
	}
	first, was, prev := !b.checked, b.healthy.Load(), b.why.Load()
	if err != nil && was && errors.Is(err, context.DeadlineExceeded) {
		// A busy server can miss one check's bound: a healthy one is
		// taken out after slowChecks in a row (a refused connection or a
		// wrong answer acts at once). No passed check is recorded, so the
		// upstream idle bound still runs.
		if b.slow++; b.slow < slowChecks {
			l.lg.Debug("health check timed out; still routing to the server", zap.String("role", b.role), zap.Int("index", b.id),
				zap.Int("in_a_row", b.slow), zap.String("reason", err.Msg))
			return
		}
	}
	b.slow = 0
	b.checked = true
	b.why.Store(err)
	b.healthy.Store(err == nil)
	l.m.healthy.WithLabelValues(b.role, strconv.Itoa(b.id)).Set(b2f(err == nil))
	fields := []zap.Field{zap.String("role", b.role), zap.Int("index", b.id), zap.String("url", b.String())}
	switch {
	case err == nil && (first || !was):
		msg := "server healthy: routing to it"
		if !first {
			msg = "server healthy again: routing to it"
		}
		if b.role == "prefill" {
			fields = append(fields, zap.Int64("bootstrap_port", b.bootstrapPort.Load()))
		}
		l.lg.Info(msg, fields...)
	case err != nil && (first || was || prev == nil || prev.Kind != err.Kind):
		fields = append(fields, zap.String("reason", err.Msg))
		switch {
		case err.Kind == "role":
			l.lg.Error("server refused: not routing to it", fields...)
		case first || !was:
			l.lg.Warn("server unhealthy: not routing to it", fields...)
		default:
			l.lg.Warn("server became unhealthy: not routing to it", fields...)
		}
	}
	if b.role == "prefill" && b.flagPort > 0 && b.reportedPort > 0 && b.reportedPort != int64(b.flagPort) && b.reportedPort != b.warnedPort {
		b.warnedPort = b.reportedPort
		l.lg.Warn("the bootstrap port given on the command line is not the one the prefill reports: using the command line's",
			append(fields, zap.Int("flag", b.flagPort), zap.Int64("reported", b.reportedPort))...)
	}
}

// slowChecks is how many health checks in a row must time out before a
// healthy server is taken out.
const slowChecks = 3

// healthGenerateTimeout bounds each server's answer to GET /health_generate
// (a server's own bound is 20 s).
const healthGenerateTimeout = 25 * time.Second

// serverOutcome is one server's answer to a request the LB fans out.
type serverOutcome struct {
	Role    string `json:"role"`
	Index   int    `json:"index"`
	URL     string `json:"url"`
	Status  int    `json:"status,omitempty"` // 0: no answer
	Message string `json:"message,omitempty"`
}

// fanOut sends method path to every server at once, each bounded by
// timeout, and returns their outcomes in l.all's order.
func (l *LB) fanOut(ctx context.Context, method, path string, timeout time.Duration) []serverOutcome {
	all := l.all()
	out := make([]serverOutcome, len(all))
	var wg sync.WaitGroup
	for i, b := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = serverOutcome{Role: b.role, Index: b.id, URL: b.String()}
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, method, b.endpoint(path), nil)
			resp, err := l.client.Do(req)
			if err != nil {
				out[i].Message = err.Error()
				return
			}
			defer resp.Body.Close()
			out[i].Status = resp.StatusCode
			raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
			if resp.StatusCode != http.StatusOK {
				var e struct {
					Error struct {
						Message string `json:"message"`
					} `json:"error"`
				}
				out[i].Message = strings.TrimSpace(string(raw))
				if json.Unmarshal(raw, &e) == nil && e.Error.Message != "" {
					out[i].Message = e.Error.Message
				}
			}
		}()
	}
	wg.Wait()
	return out
}

// handleHealthGenerate is SGLang's GET /health_generate for the whole
// deployment: every server generates a token; 200 when at least one
// prefill and one decode of their roles did (a pair can generate), else
// 503, naming each server's outcome.
func (l *LB) handleHealthGenerate(w http.ResponseWriter, r *http.Request) {
	out := l.fanOut(r.Context(), http.MethodGet, "/health_generate", healthGenerateTimeout)
	ok := map[string]bool{}
	var failed []string
	for i, b := range l.all() {
		o, why := out[i], b.why.Load()
		switch {
		case o.Status == http.StatusOK && why != nil && why.Kind == "role":
			out[i].Message = "refused: " + why.Msg
			failed = append(failed, fmt.Sprintf("%s server %s: %s", o.Role, o.URL, out[i].Message))
		case o.Status == http.StatusOK:
			ok[b.role] = true
		default:
			failed = append(failed, fmt.Sprintf("%s server %s: %s", o.Role, o.URL, o.Message))
		}
	}
	if !ok["prefill"] || !ok["decode"] {
		msg := "no prefill/decode pair can generate: " + strings.Join(failed, "; ")
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"error": errorObject(http.StatusServiceUnavailable, msg), "servers": out})
		return
	}
	w.WriteHeader(http.StatusOK)
}

// errorObject is the {"message", "type", "param", "code"} of an error.
func errorObject(code int, msg string) map[string]any {
	return map[string]any{"message": msg, "type": errorType(code), "param": nil, "code": code}
}
