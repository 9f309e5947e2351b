package lb

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// BenchmarkHop is the LB's added latency per request: a 1K-token
// /generate sent straight to a stub decode server, and through the LB to
// stub prefill and decode servers, one request at a time.
func BenchmarkHop(b *testing.B) {
	ids := make([]int, 1024)
	for i := range ids {
		ids[i] = 1000 + i*7
	}
	body, _ := json.Marshal(map[string]any{"input_ids": ids, "sampling_params": map[string]any{"max_new_tokens": 1}, "stream": true})
	stub := func(mode string) *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/get_server_info":
				json.NewEncoder(w).Encode(map[string]any{"disaggregation_mode": mode, "bootstrap_port": 9123})
			case "/generate":
				io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "text/event-stream")
				w.Write([]byte("data: {\"text\":\"a\"}\n\ndata: [DONE]\n\n"))
			}
		}))
	}
	p, d := stub("prefill"), stub("decode")
	defer p.Close()
	defer d.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	defer client.CloseIdleConnections()
	do := func(url string) {
		resp, err := client.Post(url+"/generate", "application/json", bytes.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(out), "[DONE]") {
			b.Fatalf("status %d: %s", resp.StatusCode, out)
		}
	}
	b.Run("direct", func(b *testing.B) {
		for b.Loop() {
			do(d.URL)
		}
	})
	// cache_aware matches and records the prompt's 6 KB on each side.
	for _, policy := range []string{"random", "cache_aware"} {
		b.Run("lb/policy="+policy, func(b *testing.B) {
			l, err := New(Config{Prefill: []string{p.URL}, Decode: []string{d.URL}, Policy: policy, HealthInterval: time.Hour, UpstreamIdleTimeout: 2 * time.Hour})
			if err != nil {
				b.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { l.Run(ctx); close(done) }()
			defer func() { cancel(); <-done }()
			<-l.Ready()
			srv := httptest.NewServer(l.Handler())
			defer srv.Close()
			for b.Loop() {
				do(srv.URL)
			}
		})
	}
}

// BenchmarkInject is the splice alone on a 1K-token /generate body.
func BenchmarkInject(b *testing.B) {
	ids := make([]int, 1024)
	for i := range ids {
		ids[i] = 1000 + i*7
	}
	body, _ := json.Marshal(map[string]any{"input_ids": ids, "sampling_params": map[string]any{"max_new_tokens": 1}, "stream": true})
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := inject(body, "10.0.0.1", 8998, 1<<62); err != nil {
			b.Fatal(err)
		}
	}
}
