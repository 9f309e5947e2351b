// Package lbtest runs real servers (internal/server over the real engine,
// the built-in random-weight model on the CPU backend) as a load
// balancer's prefill and decode, in one process, for tests of what the LB
// answers. The two are colocated servers that report the roles on
// /get_server_info: each computes a request whole, so no KV moves, but
// they answer as the servers do, refusing a batch or n > 1 that carries
// bootstrap fields (one generation per room) as a prefill or decode does.
package lbtest

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// BootstrapPort is the bootstrap port the prefill reports.
const BootstrapPort = 9123

// Model is the served model's name.
const Model = "builtin"

// Servers are the URLs of a prefill, a decode, and a colocated server over
// the decode's engine (the answers to compare the LB's with).
type Servers struct {
	Prefill, Decode, Colocated string
}

// Start starts the servers; the test's cleanup stops them.
func Start(t testing.TB) *Servers {
	t.Helper()
	pre := Server(t, nil)
	dec := Server(t, nil)
	return &Servers{
		Prefill:   serve(t, asRole(pre, map[string]any{"disaggregation_mode": "prefill", "bootstrap_port": BootstrapPort})),
		Decode:    serve(t, asRole(dec, map[string]any{"disaggregation_mode": "decode"})),
		Colocated: serve(t, dec),
	}
}

func serve(t testing.TB, h http.Handler) string {
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)
	return ts.URL
}

// asRole is h with /get_server_info saying info (and the load h reports).
func asRole(h http.Handler, info map[string]any) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/get_server_info" {
			h.ServeHTTP(w, r)
			return
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, r)
		var m map[string]any
		if json.Unmarshal(rec.Body.Bytes(), &m) != nil {
			m = map[string]any{}
		}
		for k, v := range info {
			m[k] = v
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(m)
	})
}

// Server is a colocated server over its own engine (the built-in model on
// the CPU backend, with a prefix cache) reporting args as its server args;
// the test's cleanup stops it.
func Server(t testing.TB, args map[string]any) http.Handler {
	t.Helper()
	m, tok := model.Builtin(), tokenizer.NewByteLevel()
	l := cpu.LayoutFor(m.Config, 16, 64)
	pool, err := kvcache.NewPool(l, make([]byte, l.TotalBytes()))
	if err != nil {
		t.Fatal(err)
	}
	b, err := cpu.New(m, pool, 1)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	e, err := engine.New(engine.Config{Model: b, Pages: pool.Alloc, Cache: kvcache.NewRadix(pool.Alloc, l.PageSize), Tokenizer: tok, Registerer: reg})
	if err != nil {
		b.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = e.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		_ = e.Close()
		wg.Wait()
		b.Close()
	})
	s, err := server.New(server.Config{Generator: e, Tokenizer: tok, ModelName: Model, RandomWeights: true,
		ContextLen: m.Config.MaxSeqLen, PrefixCache: true, PageSize: l.PageSize, Version: "test", Registerer: reg, Gatherer: reg,
		ServerArgs: args})
	if err != nil {
		t.Fatal(err)
	}
	return s.Handler()
}
