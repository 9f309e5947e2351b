package cli

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
)

// TestServeTP: serve --tp-size 1, 2 and 4 on stories260K (8 heads, 4 KV
// heads) answers every reference prompt, batched, with llama2.c's greedy
// tokens; reports tp_size; a repeated prompt is served from the radix
// cache with the same tokens; /flush_cache gives every page back; a rank's
// metrics carry its tp_rank.
func TestServeTP(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three servers")
	}
	bin, tokPath := sharedtest.Stories260K(t)
	cases := sharedtest.Reference(t)
	for _, tp := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("tp=%d", tp), func(t *testing.T) {
			url := startServe(t, "--model-path", bin, "--tokenizer-path", tokPath, "--tp-size", fmt.Sprint(tp), "--threads", "2",
				"--page-size", "4", "--max-total-tokens", "1024")
			gen := func(prompt string, n int) (ids []int, cached int) {
				body, _ := json.Marshal(map[string]any{"text": prompt, "sampling_params": map[string]any{"max_new_tokens": n, "temperature": 0}})
				status, b := httpDo(t, http.MethodPost, url+"/generate", body)
				var g struct {
					OutputIDs []int `json:"output_ids"`
					MetaInfo  struct {
						CachedTokens int `json:"cached_tokens"`
					} `json:"meta_info"`
				}
				if err := json.Unmarshal(b, &g); err != nil || status != 200 {
					t.Errorf("%q: status %d: %s", prompt, status, b)
				}
				return g.OutputIDs, g.MetaInfo.CachedTokens
			}
			var wg sync.WaitGroup
			for _, c := range cases {
				wg.Go(func() {
					if got, _ := gen(c.Prompt, len(c.GreedyNextIDs)); !slices.Equal(got, sharedtest.Ints(c.GreedyNextIDs)) {
						t.Errorf("%q: output_ids\n got %v\nwant %v", c.Prompt, got, c.GreedyNextIDs)
					}
				})
			}
			wg.Wait()
			c := slices.MaxFunc(cases, func(a, b sharedtest.Case) int { return len(a.PromptIDs) - len(b.PromptIDs) })
			got, cached := gen(c.Prompt, len(c.GreedyNextIDs))
			if !slices.Equal(got, sharedtest.Ints(c.GreedyNextIDs)) || cached < 4 {
				t.Errorf("%q again: output_ids %v (want %v), %d cached tokens (want some)", c.Prompt, got, c.GreedyNextIDs, cached)
			}

			info := serverJSON(t, url+"/get_server_info")
			args := serverJSON(t, url+"/get_server_args")
			if info["tp_size"] != float64(tp) || args["tp_size"] != float64(tp) {
				t.Errorf("tp_size: /get_server_info %v, /get_server_args %v, want %d", info["tp_size"], args["tp_size"], tp)
			}
			if status, b := httpDo(t, http.MethodPost, url+"/flush_cache", nil); status != 200 {
				t.Fatalf("/flush_cache: %d %s", status, b)
			}
			info = serverJSON(t, url+"/get_server_info")
			if info["kv_pages_free"] != info["kv_pages_total"] || info["kv_pages_cached"] != float64(0) {
				t.Errorf("after /flush_cache: %v of %v pages free, %v cached", info["kv_pages_free"], info["kv_pages_total"], info["kv_pages_cached"])
			}
			_, metrics := httpDo(t, http.MethodGet, url+"/metrics", nil)
			want := fmt.Sprintf(`mooncake_tp_forward_seconds_total{tp_rank="%d"}`, tp-1)
			if has := strings.Contains(string(metrics), want); has != (tp > 1) {
				t.Errorf("/metrics has %s: %v, want %v", want, has, tp > 1)
			}
		})
	}
}

func httpDo(t *testing.T, method, url string, body []byte) (int, []byte) {
	t.Helper()
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	c := &http.Client{Timeout: 60 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

func serverJSON(t *testing.T, url string) map[string]any {
	t.Helper()
	status, b := httpDo(t, http.MethodGet, url, nil)
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil || status != 200 {
		t.Fatalf("GET %s: %d %s", url, status, b)
	}
	return m
}
