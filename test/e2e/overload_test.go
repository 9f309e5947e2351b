package e2e

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// roomsLive sums a server's mooncake_disagg_rooms gauge over every state.
func (s *server) roomsLive(t *testing.T) float64 {
	t.Helper()
	var n float64
	for k, v := range s.metrics(t) {
		if strings.HasPrefix(k, "mooncake_disagg_rooms{") {
			n += v
		}
	}
	return n
}

// terminate sends SIGTERM and reports how long the process took to exit.
func (p *proc) terminate(t *testing.T, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	syscall.Kill(p.cmd.Process.Pid, syscall.SIGTERM)
	select {
	case <-p.done:
		return time.Since(start)
	case <-time.After(within):
		t.Fatalf("%s did not exit within %v of SIGTERM:\n%s", p.name, within, p.tail(30))
		return 0
	}
}

// TestZeroNewTokensPD: max_new_tokens 0 (and max_tokens 0) through the LB is
// answered at once, as colocated, opens no room on either side and leaks no
// page; SIGTERM then ends both servers promptly.
func TestZeroNewTokensPD(t *testing.T) {
	shared := sharedDir(t)
	args := append(storiesArgs(shared), pdFlags...)
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: args})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: args})
	l := lb(t, "lb", []*server{p}, []*server{d})
	for i := 0; i < 20; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		r, err := generate(ctx, l.url, map[string]any{"text": "Once upon a time",
			"sampling_params": map[string]any{"max_new_tokens": 0}, "stream": i%2 == 1})
		cancel()
		mustOK(t, "max_new_tokens 0", r, err)
		if r.Took > time.Second || len(r.IDs) != 0 || r.MetaInfo.FinishReason["type"] != "length" {
			t.Fatalf("max_new_tokens 0: took %v, ids %v, finish %v", r.Took, r.IDs, r.MetaInfo.FinishReason)
		}
	}
	if st, body := postJSON(t, l.url+"/v1/completions", `{"prompt": "Once upon a time", "max_tokens": 0}`); st != 200 {
		t.Fatalf("max_tokens 0 through the LB: %d %s", st, body)
	}
	for _, s := range []*server{p, d} {
		if n := s.roomsLive(t); n != 0 {
			t.Errorf("%s has %v live rooms after zero-token requests", s.name, n)
		}
	}
	p.waitFreePages(t, int(p.info(t)["kv_pages_total"].(float64)), 2*time.Second)
	d.waitFreePages(t, int(d.info(t)["kv_pages_total"].(float64)), 2*time.Second)
	for _, s := range []*server{p, d} {
		if took := s.terminate(t, 10*time.Second); took > 10*time.Second {
			t.Errorf("%s took %v to exit", s.name, took)
		}
	}
}

// TestOverloadQueues: 200 concurrent 500-token prompts against a decode pool
// of 512 pages (16 such requests at a time) and a prefill of the same size
// all complete: requests queue for pages instead of failing with 503 or 504.
func TestOverloadQueues(t *testing.T) {
	t.Run("distinct", func(t *testing.T) { overload(t, 0) })
	// Groups sharing a prefix: the decode's prefix cache shares pages
	// between waiting rooms; they must never hold back the queue's head.
	t.Run("shared prefixes", func(t *testing.T) { overload(t, 400) })
}

func overload(t *testing.T, prefix int) {
	shared := sharedDir(t)
	args := append(storiesArgs(shared), pdFlags...) // 8192 tokens of 16 a page: 512 pages
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: args})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: args})
	if n := int(d.info(t)["kv_pages_total"].(float64)); n != 512 {
		t.Fatalf("decode pool has %d pages, want 512", n)
	}
	l := lb(t, "lb", []*server{p}, []*server{d})
	const n, promptLen = 200, 500
	rng := rand.New(rand.NewPCG(5, 6))
	var wg sync.WaitGroup
	errs := make(chan string, n)
	start := time.Now()
	groups := make([][]int, 8)
	for g := range groups {
		groups[g] = make([]int, prefix)
		for j := range groups[g] {
			groups[g][j] = 3 + rng.IntN(500)
		}
	}
	for i := range n {
		ids := make([]int, promptLen)
		copy(ids, groups[i%8])
		for j := prefix; j < len(ids); j++ {
			ids[j] = 3 + rng.IntN(500)
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
			defer cancel()
			r, err := generate(ctx, l.url, map[string]any{"input_ids": ids,
				"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 6, "ignore_eos": true}, "stream": i%3 == 0})
			switch {
			case err != nil:
				errs <- fmt.Sprintf("request %d: %v", i, err)
			case r.Status != 200 || r.StreamErr != "" || len(r.IDs) != 6:
				errs <- fmt.Sprintf("request %d: status %d, %d ids, stream error %q, body %.200s", i, r.Status, len(r.IDs), r.StreamErr, r.Raw)
			}
		})
	}
	wg.Wait()
	close(errs)
	var failed []string
	for e := range errs {
		failed = append(failed, e)
	}
	if len(failed) > 0 {
		t.Fatalf("%d of %d requests failed under overload (took %v); first: %s", len(failed), n, time.Since(start), strings.Join(failed[:min(5, len(failed))], "\n"))
	}
	t.Logf("%d requests of %d tokens through a 512-page decode in %v", n, promptLen, time.Since(start))
	p.waitFreePages(t, 512, 5*time.Second)
	d.waitFreePages(t, 512, 5*time.Second)
	for _, s := range []*server{p, d} {
		if v := s.roomsLive(t); v != 0 {
			t.Errorf("%s has %v live rooms afterwards", s.name, v)
		}
	}
}

// TestShutdownWithRooms: SIGTERM while rooms are in every state (queued for
// pages, waiting for KV, decoding) ends each server within 10 s.
func TestShutdownWithRooms(t *testing.T) {
	shared := sharedDir(t)
	args := append(storiesArgs(shared), pdFlags...)
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: args})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: args})
	l := lb(t, "lb", []*server{p}, []*server{d})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	for i := range 60 {
		ids := make([]int, 400)
		for j := range ids {
			ids[j] = 3 + (i*7+j)%500
		}
		wg.Go(func() {
			generate(ctx, l.url, map[string]any{"input_ids": ids, "stream": true,
				"sampling_params": map[string]any{"max_new_tokens": 100, "ignore_eos": true}})
		})
	}
	d.waitMetric(t, `mooncake_disagg_requests_total{mode="decode",result="success"}`, 30*time.Second, func(v float64) bool { return v >= 2 })
	for _, s := range []*server{d, p} {
		took := s.terminate(t, 10*time.Second)
		t.Logf("%s exited %v after SIGTERM", s.name, took)
	}
	cancel()
}

// postJSON posts a raw JSON body and returns the status and body.
func postJSON(t *testing.T, url, body string) (int, string) {
	t.Helper()
	resp, err := client.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
