package loadgen

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestRunCountsTokensAndFailures(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/generate" {
			return // /metrics without the engine's: not reported
		}
		var req struct {
			InputIDs []int `json:"input_ids"`
			Params   struct {
				MaxNew int `json:"max_new_tokens"`
			} `json:"sampling_params"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		if calls.Add(1) == 3 {
			http.Error(w, `{"error":{"message":"boom"}}`, 500)
			return
		}
		var ids []int
		for i := 0; i < req.Params.MaxNew; i++ {
			ids = append(ids, i)
			b, _ := json.Marshal(map[string]any{"output_ids": ids})
			fmt.Fprintf(w, "data: %s\n\n", b)
			w.(http.Flusher).Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	res, err := Run(context.Background(), Config{URL: srv.URL, Concurrency: 2, NumPrompts: 6, Warmup: 1, InputLen: 16, OutputLen: 5})
	if err != nil {
		t.Fatal(err)
	}
	// The warm-up is call 1; call 3 is the second measured request.
	if res.Completed != 5 || res.Failed != 1 || res.OutputTokens != 25 || res.InputTokens != 5*16 {
		t.Fatalf("result %+v", res)
	}
	if res.FirstError == "" || res.TTFT.P50 <= 0 || res.E2E.P99 < res.TTFT.P50 {
		t.Fatalf("latencies %+v", res)
	}
	if res.PrefillTokens != nil || res.MetricsError != "" {
		t.Fatalf("a server without the engine's metrics: prefill tokens %v, error %q", res.PrefillTokens, res.MetricsError)
	}
	// Named explicitly, a server without them is an error in the report.
	res, err = Run(context.Background(), Config{URL: srv.URL, NumPrompts: 1, Warmup: 0, InputLen: 4, OutputLen: 2, MetricsURLs: []string{srv.URL}})
	if err != nil || !strings.Contains(res.MetricsError, "mooncake_engine_prefill_tokens_total") {
		t.Fatalf("explicit metrics URL without the metric: %v, %q", err, res.MetricsError)
	}
}

// recordingServer answers /generate with output ids that depend on the
// prompt, reports as cached the longest prefix it saw before (as a prefix
// cache would), and counts the rest in /metrics.
type recordingServer struct {
	*httptest.Server
	mu       sync.Mutex
	prompts  [][]int
	seen     [][]int // prompts and prompt+output of finished requests
	computed int64
	inflight map[string]bool // chats (by first 4 ids) with a request running
	overlap  bool            // two turns of one chat ran at once
}

func newRecordingServer(t *testing.T) *recordingServer {
	rs := &recordingServer{inflight: map[string]bool{}}
	rs.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			rs.mu.Lock()
			fmt.Fprintf(w, "# TYPE mooncake_engine_prefill_tokens_total counter\nmooncake_engine_prefill_tokens_total %d\n", rs.computed)
			rs.mu.Unlock()
			return
		}
		var req struct {
			InputIDs []int `json:"input_ids"`
			Params   struct {
				MaxNew int `json:"max_new_tokens"`
			} `json:"sampling_params"`
		}
		json.NewDecoder(r.Body).Decode(&req)
		chat := fmt.Sprint(req.InputIDs[:4])
		rs.mu.Lock()
		rs.overlap = rs.overlap || rs.inflight[chat]
		rs.inflight[chat] = true
		cached := 0
		for _, p := range rs.seen {
			n := 0
			for n < len(p) && n < len(req.InputIDs) && p[n] == req.InputIDs[n] {
				n++
			}
			cached = max(cached, n)
		}
		rs.computed += int64(len(req.InputIDs) - cached)
		rs.prompts = append(rs.prompts, slices.Clone(req.InputIDs))
		rs.mu.Unlock()
		time.Sleep(2 * time.Millisecond)
		var ids []int
		for i := 0; i < req.Params.MaxNew; i++ {
			ids = append(ids, 7+(len(req.InputIDs)+i)%50)
			b, _ := json.Marshal(map[string]any{"output_ids": ids, "meta_info": map[string]any{"cached_tokens": 0}})
			fmt.Fprintf(w, "data: %s\n\n", b)
		}
		b, _ := json.Marshal(map[string]any{"output_ids": ids, "meta_info": map[string]any{"cached_tokens": cached, "finish_reason": "length"}})
		fmt.Fprintf(w, "data: %s\n\ndata: [DONE]\n\n", b)
		rs.mu.Lock()
		rs.seen = append(rs.seen, slices.Clone(req.InputIDs), append(slices.Clone(req.InputIDs), ids...))
		delete(rs.inflight, chat)
		rs.mu.Unlock()
	}))
	t.Cleanup(rs.Close)
	return rs
}

// TestSharedPrefixWorkload: prompts of NumGroups groups, each the group's
// SharedPrefixLen tokens then InputLen of its own, as many per group,
// not sent group by group; the report's cached share and computed tokens
// are the server's.
func TestSharedPrefixWorkload(t *testing.T) {
	rs := newRecordingServer(t)
	res, err := Run(context.Background(), Config{URL: rs.URL, Concurrency: 1, NumPrompts: 12, Warmup: 1,
		SharedPrefixLen: 20, NumGroups: 3, InputLen: 5, OutputLen: 3, Seed: 9})
	if err != nil {
		t.Fatal(err)
	}
	if res.Completed != 12 || res.Failed != 0 {
		t.Fatalf("result %+v", res)
	}
	measured := rs.prompts[1:] // after the warm-up
	groups := map[string]int{}
	var order []string
	suffixes := map[string]bool{}
	for _, p := range measured {
		if len(p) != 25 {
			t.Fatalf("prompt of %d tokens, want 20 + 5", len(p))
		}
		g := fmt.Sprint(p[:20])
		groups[g]++
		order = append(order, g)
		suffixes[fmt.Sprint(p[20:])] = true
	}
	if len(groups) != 3 || len(suffixes) != 12 {
		t.Fatalf("%d groups, %d distinct suffixes: want 3 and 12", len(groups), len(suffixes))
	}
	for g, n := range groups {
		if n != 4 {
			t.Fatalf("group %s has %d prompts, want 4", g, n)
		}
	}
	runs := 1
	for i := 1; i < len(order); i++ {
		if order[i] != order[i-1] {
			runs++
		}
	}
	if runs <= 3 {
		t.Errorf("prompts sent group by group (%d runs)", runs)
	}
	if fmt.Sprint(rs.prompts[0][:20]) == order[0] {
		t.Error("the warm-up shares a group's prefix")
	}
	// Each group's first prompt computes its prefix; the others hit it.
	if res.InputTokens != 12*25 || res.CachedTokens < 9*20 {
		t.Errorf("input %d, cached %d: want 300 and at least 180", res.InputTokens, res.CachedTokens)
	}
	if want := float64(res.CachedTokens) / 300; res.CachedShare != want {
		t.Errorf("cached share %v, want %v", res.CachedShare, want)
	}
	if res.PrefillTokens == nil || *res.PrefillTokens != int64(res.InputTokens-res.CachedTokens) {
		t.Errorf("prefill tokens computed %v, want input - cached = %d", res.PrefillTokens, res.InputTokens-res.CachedTokens)
	}
}

// TestMultiTurnWorkload: each turn's prompt is the chat so far (its
// prompts and answers) and InputLen new tokens; a chat's turns run one
// after another while chats run at once.
func TestMultiTurnWorkload(t *testing.T) {
	rs := newRecordingServer(t)
	res, err := Run(context.Background(), Config{URL: rs.URL, Concurrency: 3, NumPrompts: 3, Warmup: 0,
		MultiTurn: 4, InputLen: 6, OutputLen: 2, Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	if res.Completed != 12 || res.Failed != 0 {
		t.Fatalf("result %+v", res)
	}
	if rs.overlap {
		t.Error("two turns of one chat ran at once")
	}
	byChat := map[string][][]int{}
	for _, p := range rs.prompts {
		k := fmt.Sprint(p[:4])
		byChat[k] = append(byChat[k], p)
	}
	if len(byChat) != 3 {
		t.Fatalf("%d chats, want 3", len(byChat))
	}
	for k, turns := range byChat {
		if len(turns) != 4 {
			t.Fatalf("chat %s has %d turns", k, len(turns))
		}
		for i := 1; i < 4; i++ {
			prev, cur := turns[i-1], turns[i]
			// prev, its 2 output tokens (which depend on its length), 6 new.
			want := append(slices.Clone(prev), 7+len(prev)%50, 7+(len(prev)+1)%50)
			if len(cur) != len(prev)+8 || !slices.Equal(cur[:len(want)], want) {
				t.Fatalf("chat %s turn %d: %v does not extend turn %d %v with its answer", k, i, cur, i-1, prev)
			}
		}
	}
	// Every later turn hits its whole history.
	if res.CachedTokens != 3*(8+16+24) {
		t.Errorf("cached %d, want %d", res.CachedTokens, 3*(8+16+24))
	}
}

func TestWorkloadFlagErrors(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		flag string
	}{
		{Config{URL: "http://x", NumGroups: 4}, "--shared-prefix-len"},
		{Config{URL: "http://x", SharedPrefixLen: -1}, "--shared-prefix-len"},
		{Config{URL: "http://x", SharedPrefixLen: 8, NumGroups: 10, NumPrompts: 4}, "--num-groups"},
		{Config{URL: "http://x", MultiTurn: -2}, "--multi-turn"},
	} {
		if _, err := Run(context.Background(), c.cfg); err == nil || !strings.Contains(err.Error(), c.flag) {
			t.Errorf("%+v: %v, want an error naming %s", c.cfg, err, c.flag)
		}
	}
}
