package lb

import (
	"fmt"
	"net/http"
	"strings"
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
	out := l.fanOut(r.Context(), http.MethodPost, "/flush_cache", flushTimeout)
	for _, b := range l.all() {
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
		writeJSON(w, code, map[string]any{"error": errorObject(code, "flushing the servers' caches: "+strings.Join(failed, "; ")), "servers": out})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"message": "Cache flushed.", "servers": out})
}
