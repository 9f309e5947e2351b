package loadgen

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
)

func TestRunCountsTokensAndFailures(t *testing.T) {
	var calls atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
}
