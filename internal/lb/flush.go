package lb

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// flushTimeout bounds each server's answer to POST /flush_cache.
const flushTimeout = 10 * time.Second

// handleFlushCache is SGLang's router's POST /flush_cache: every server,
// healthy or not, flushes its prefix cache, and the policy forgets what it
// recorded. 200 when every server did; else the worst answer's class (400
// when the failures are the servers' 4xx, as from one without a prefix
// cache; 502 otherwise), with each server's outcome.
func (l *LB) handleFlushCache(w http.ResponseWriter, r *http.Request) {
	type outcome struct {
		URL     string `json:"url"`
		Role    string `json:"role"`
		Status  int    `json:"status,omitempty"`
		Message string `json:"message,omitempty"`
	}
	all := append(append([]*backend{}, l.prefill...), l.decode...)
	out := make([]outcome, len(all))
	var wg sync.WaitGroup
	for i, b := range all {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = outcome{URL: b.String(), Role: b.role}
			ctx, cancel := context.WithTimeout(r.Context(), flushTimeout)
			defer cancel()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, b.endpoint("/flush_cache"), nil)
			resp, err := l.client.Do(req)
			if err != nil {
				out[i].Message = err.Error()
				return
			}
			defer resp.Body.Close()
			out[i].Status = resp.StatusCode
			if resp.StatusCode != http.StatusOK {
				raw, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
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
	for _, b := range all {
		if f, ok := l.policy[b.role].(Forgetter); ok {
			f.Forget(b.id)
		}
	}
	code := http.StatusOK
	var failed []string
	for _, o := range out {
		switch {
		case o.Status == http.StatusOK:
			continue
		case o.Status >= 400 && o.Status < 500:
			if code == http.StatusOK {
				code = http.StatusBadRequest
			}
		default:
			code = http.StatusBadGateway
		}
		failed = append(failed, fmt.Sprintf("%s server %s: %s", o.Role, o.URL, o.Message))
	}
	if code != http.StatusOK {
		writeJSON(w, code, map[string]any{"error": map[string]any{"message": "flushing the servers' caches: " + strings.Join(failed, "; "),
			"type": errorType(code), "code": code}, "servers": out})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"message": "Cache flushed.", "servers": out})
}
