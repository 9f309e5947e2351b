package e2e

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// pdFlags are the serve flags every server of a comparison shares: small
// pages and chunks that do not line up with them, so long prompts take
// several pushes with partial pages.
var pdFlags = []string{"--served-model-name", "stories260K", "--page-size", "16", "--chunked-prefill-size", "40", "--max-total-tokens", "8192"}

type refCase struct {
	Prompt string `json:"prompt"`
	Next   []int  `json:"greedy_next_ids"`
}

// workload is one request of the comparison.
type workload struct {
	body map[string]any
	ref  []int // llama2.c's greedy output, when known
}

func loadRefs(t *testing.T, shared string) []refCase {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(shared, "reference", "stories260K-greedy.json"))
	if err != nil {
		t.Skipf("reference outputs: %v", err)
	}
	var f struct {
		Cases []refCase `json:"cases"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	return f.Cases
}

// workloads are the reference cases plus n generated prompts (fixed seed),
// some streamed, some seeded at a temperature, some with a logit bias.
func workloads(refs []refCase, n int) []workload {
	var out []workload
	for _, c := range refs {
		out = append(out, workload{ref: c.Next, body: map[string]any{"text": c.Prompt,
			"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": len(c.Next)}}})
	}
	bias := refBias(refs)
	words := strings.Fields(`once upon a time there was a little girl named Lily she loved to play outside
		in the park one day saw big red ball Tom and Ben went dog cat bird tree happy sad mom said let's go
		home sun was shining they ran fast jumped over the fence found a box with toys inside`)
	rng := rand.New(rand.NewPCG(42, 7))
	for i := range n {
		k := 1 + rng.IntN(140)
		if i%8 == 0 {
			k = 150 + rng.IntN(100) // several chunks and pages
		}
		ws := make([]string, k)
		for j := range ws {
			ws[j] = words[rng.IntN(len(words))]
		}
		sp := map[string]any{"temperature": 0, "max_new_tokens": 1 + rng.IntN(60)}
		if i%5 == 0 {
			sp["ignore_eos"] = true
		}
		if i%7 == 0 { // over the prompt and the output: prefill and decode must both apply it
			sp["repetition_penalty"] = 1.3
		}
		if i%6 == 1 { // prefill and decode must both apply it
			sp["logit_bias"] = bias
		}
		if i%4 == 3 { // prefill samples step 0, decode steps 1 on: the colocated draws
			sp["temperature"] = 0.9
			sp[[]string{"seed", "sampling_seed"}[i/4%2]] = 1000 + i
			if i%8 == 7 {
				sp["top_p"], sp["top_k"], sp["min_p"] = 0.9, 40, 0.02
			}
		}
		body := map[string]any{"text": strings.Join(ws, " "), "sampling_params": sp}
		if i%3 == 0 {
			body["stream"] = true
		}
		out = append(out, workload{body: body})
	}
	return out
}

// refBias bans the three tokens the reference answers use most and favours
// a fourth.
func refBias(refs []refCase) map[string]any {
	counts := map[int]int{}
	for _, c := range refs {
		for _, id := range c.Next {
			counts[id]++
		}
	}
	ids := slices.Collect(maps.Keys(counts))
	slices.SortFunc(ids, func(a, b int) int { return cmp.Or(counts[b]-counts[a], a-b) })
	bias := map[string]any{}
	for i, id := range ids[:min(4, len(ids))] {
		v := any(-100)
		if i == 3 {
			v = 2.5
		}
		bias[strconv.Itoa(id)] = v
	}
	return bias
}

// runAll sends every workload to url, conc at a time; outputs by index.
func runAll(t *testing.T, url string, ws []workload, conc int) [][]int {
	t.Helper()
	out := make([][]int, len(ws))
	errs := make([]string, len(ws))
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	for i, w := range ws {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			r, err := generate(ctx, url, w.body)
			switch {
			case err != nil:
				errs[i] = err.Error()
			case r.Status != 200 || r.StreamErr != "":
				errs[i] = fmt.Sprintf("status %d %s %s", r.Status, r.Raw, r.StreamErr)
			case w.body["stream"] == true && !r.Done:
				errs[i] = "stream ended without [DONE]"
			default:
				out[i] = r.IDs
			}
		}()
	}
	wg.Wait()
	for i, e := range errs {
		if e != "" {
			t.Errorf("request %d (%s): %s", i, url, e)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	return out
}

// compare fails on the first request whose tokens differ.
func compare(t *testing.T, what string, ws []workload, want, got [][]int) {
	t.Helper()
	bad := 0
	for i := range ws {
		if !slices.Equal(want[i], got[i]) {
			if bad++; bad <= 3 {
				t.Errorf("%s: request %d (%q...): colocated %v, disaggregated %v", what, i,
					trunc(fmt.Sprint(ws[i].body["text"]), 40), want[i], got[i])
			}
		}
	}
	if bad > 0 {
		t.Fatalf("%s: %d of %d requests differ", what, bad, len(ws))
	}
}

func trunc(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// TestDisaggMatchesColocated: for the reference cases and generated prompts
// at concurrency 16, 1P1D (shm, tcp) and 2P2D through the LB give the
// colocated server's tokens, token for token; metrics move as they should
// and every page comes back.
func TestDisaggMatchesColocated(t *testing.T) {
	shared := sharedDir(t)
	refs := loadRefs(t, shared)
	model := storiesArgs(shared)
	ws := workloads(refs, 96)
	args := append(append([]string{}, model...), pdFlags...)

	colo := serve(t, serveOpts{name: "colocated", args: args})
	want := runAll(t, colo.url, ws, 16)
	for i, w := range ws {
		if w.ref != nil && !slices.Equal(want[i], w.ref) {
			t.Errorf("colocated output of %q differs from llama2.c's:\n got %v\nwant %v", w.body["text"], want[i], w.ref)
		}
	}
	// Logprobs and top logprobs: the disaggregated runs must give the same.
	lpBody := map[string]any{"text": "Once upon a time there was", "return_logprob": true, "top_logprobs_num": 5,
		"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 8, "ignore_eos": true}}
	lpWant, err := generate(context.Background(), colo.url, lpBody)
	if err != nil || lpWant.Status != 200 || len(lpWant.MetaInfo.OutputTopLogprobs) != 8 || len(lpWant.MetaInfo.OutputTopLogprobs[0]) != 5 {
		t.Fatalf("colocated top logprobs: %v %+v", err, lpWant)
	}
	// The repetition penalty changes what the model says.
	plain := map[string]any{"text": "Once upon a time", "sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 48, "ignore_eos": true}}
	penal := map[string]any{"text": "Once upon a time", "sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 48, "ignore_eos": true,
		"repetition_penalty": 1.5}}
	rp, err := generate(context.Background(), colo.url, plain)
	if err != nil {
		t.Fatal(err)
	}
	rq, err := generate(context.Background(), colo.url, penal)
	if err != nil {
		t.Fatal(err)
	}
	if rp.Status != 200 || rq.Status != 200 || slices.Equal(rp.IDs, rq.IDs) {
		t.Fatalf("repetition_penalty 1.5 gave the same 48 tokens as none (status %d/%d): %v", rp.Status, rq.Status, rq.IDs)
	}
	// So does logit_bias: the banned tokens never appear.
	biased := map[string]any{"text": "Once upon a time", "sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 48,
		"ignore_eos": true, "logit_bias": refBias(refs)}}
	rb, err := generate(context.Background(), colo.url, biased)
	if err != nil {
		t.Fatal(err)
	}
	if rb.Status != 200 || slices.Equal(rp.IDs, rb.IDs) || slices.ContainsFunc(rb.IDs, func(id int) bool {
		return refBias(refs)[strconv.Itoa(id)] == -100
	}) {
		t.Fatalf("logit_bias %v: status %d, tokens %v (unbiased %v)", refBias(refs), rb.Status, rb.IDs, rp.IDs)
	}
	colo.kill()

	for _, tc := range []struct {
		name      string
		transport string
		pEnv      []string
		pArgs     []string
		dArgs     []string
	}{
		// shm with each layer pushed as soon as it is computed.
		{name: "1P1D/shm", transport: "shm", pArgs: []string{"--disaggregation-push-by-layer"}},
		// tcp forced both ways: the environment on one side, the flag on the other.
		{name: "1P1D/tcp", transport: "tcp", pEnv: []string{"MC_FORCE_TCP=1"},
			dArgs: []string{"--disaggregation-transfer-backend", "tcp"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := serve(t, serveOpts{name: "prefill", mode: "prefill", env: tc.pEnv, args: append(slices.Clone(args), tc.pArgs...)})
			d := serve(t, serveOpts{name: "decode", mode: "decode", args: append(slices.Clone(args), tc.dArgs...)})
			l := lb(t, "lb", []*server{p}, []*server{d})
			pFree, dFree := p.freePages(t), d.freePages(t)
			got := runAll(t, l.url, ws, 16)
			compare(t, tc.name, ws, want, got)
			lpGot, err := generate(context.Background(), l.url, lpBody)
			if err != nil || fmt.Sprint(lpGot.MetaInfo.OutputTokenLogprobs) != fmt.Sprint(lpWant.MetaInfo.OutputTokenLogprobs) ||
				fmt.Sprint(lpGot.MetaInfo.OutputTopLogprobs) != fmt.Sprint(lpWant.MetaInfo.OutputTopLogprobs) {
				t.Fatalf("%s logprobs differ from colocated (%v):\n got %v %v\nwant %v %v", tc.name, err,
					lpGot.MetaInfo.OutputTokenLogprobs, lpGot.MetaInfo.OutputTopLogprobs, lpWant.MetaInfo.OutputTokenLogprobs, lpWant.MetaInfo.OutputTopLogprobs)
			}

			openAIThroughLB(t, l)
			pm, dm, lm := p.metrics(t), d.metrics(t), l.metrics(t)
			if v := dm["mooncake_engine_prefill_tokens_total"]; v != 0 {
				t.Errorf("decode computed %v prompt tokens; disaggregated requests must not be recomputed", v)
			}
			if v := pm["mooncake_engine_prefill_tokens_total"]; v == 0 {
				t.Errorf("prefill computed no prompt tokens")
			}
			other := map[string]string{"shm": "tcp", "tcp": "shm"}[tc.transport]
			byLayer := pm[`mooncake_disagg_pushes_total{by="layer",mode="prefill"}`]
			if wantLayer := slices.Contains(tc.pArgs, "--disaggregation-push-by-layer"); wantLayer != (byLayer > 0) {
				t.Errorf("prefill made %v pushes by layer report (push by layer: %v); metrics: %v", byLayer, wantLayer,
					grep(pm, "mooncake_disagg_pushes"))
			}
			if v := pm[`mooncake_transfer_bytes_total{op="write",transport="`+tc.transport+`"}`]; v == 0 {
				t.Errorf("prefill moved no bytes over %s; metrics: %v", tc.transport, grep(pm, "mooncake_transfer_bytes"))
			}
			if v := pm[`mooncake_transfer_bytes_total{op="write",transport="`+other+`"}`]; v != 0 {
				t.Errorf("prefill moved %v bytes over %s, want only %s", v, other, tc.transport)
			}
			n := len(ws) + 5 // and the OpenAI requests and the logprob one
			if v := lm[`mooncake_lb_requests_total{code="200"}`]; int(v) != n {
				t.Errorf("LB counted %v requests with code 200, want %d", v, n)
			}
			if v := dm[`mooncake_disagg_requests_total{mode="decode",result="success"}`]; int(v) != n {
				t.Errorf("decode counted %v successful rooms, want %d", v, n)
			}
			// The prefill counts a room after decode acknowledged its
			// notification, which may be after the client got its answer.
			p.waitMetric(t, `mooncake_disagg_requests_total{mode="prefill",result="success"}`, 5*time.Second,
				func(v float64) bool { return int(v) == n })
			if v := p.metric(t, `mooncake_disagg_kv_tail_seconds_count{mode="prefill"}`); int(v) != n {
				t.Errorf("prefill observed %v KV tails, want %d", v, n)
			}
			p.waitFreePages(t, pFree, 5*time.Second)
			d.waitFreePages(t, dFree, 5*time.Second)
		})
	}

	t.Run("2P2D", func(t *testing.T) {
		// Two prefill servers on one node: bootstrap port 0 each.
		p1 := serve(t, serveOpts{name: "prefill1", mode: "prefill", args: args})
		p2 := serve(t, serveOpts{name: "prefill2", mode: "prefill", args: args})
		d1 := serve(t, serveOpts{name: "decode1", mode: "decode", args: args})
		d2 := serve(t, serveOpts{name: "decode2", mode: "decode", args: args})
		b1, b2 := p1.info(t)["bootstrap_port"], p2.info(t)["bootstrap_port"]
		if b1 == nil || b1 == b2 {
			t.Fatalf("prefill bootstrap ports %v and %v: want two distinct ports", b1, b2)
		}
		// The LB's default policy (random): every server gets requests.
		l := lb(t, "lb", []*server{p1, p2}, []*server{d1, d2})
		got := runAll(t, l.url, ws, 16)
		compare(t, "2P2D", ws, want, got)
		for _, s := range []*server{p1, p2, d1, d2} {
			mode := "decode"
			if strings.HasPrefix(s.name, "prefill") {
				mode = "prefill"
			}
			if v := s.metric(t, `mooncake_disagg_requests_total{mode="`+mode+`",result="success"}`); v == 0 {
				t.Errorf("%s served no disaggregated request", s.name)
			}
			if strings.HasPrefix(s.name, "decode") {
				if v := s.metric(t, "mooncake_engine_prefill_tokens_total"); v != 0 {
					t.Errorf("%s computed %v prompt tokens", s.name, v)
				}
			}
			s.waitFreePages(t, int(s.info(t)["kv_pages_total"].(float64)), 5*time.Second)
		}
		if v := l.metric(t, `mooncake_lb_requests_total{code="200"}`); int(v) != len(ws) {
			t.Errorf("LB counted %v requests with code 200, want %d", v, len(ws))
		}
	})
}

// grep returns the series whose name starts with prefix.
func grep(m map[string]float64, prefix string) map[string]float64 {
	out := map[string]float64{}
	for k, v := range m {
		if strings.HasPrefix(k, prefix) {
			out[k] = v
		}
	}
	return out
}

// openAIThroughLB sends /v1/completions and /v1/chat/completions, plain and
// streamed, through the LB: 4 disaggregated requests.
func openAIThroughLB(t *testing.T, l *server) {
	t.Helper()
	for _, ep := range []string{"/v1/completions", "/v1/chat/completions"} {
		for _, stream := range []bool{false, true} {
			body := map[string]any{"model": "stories260K", "max_tokens": 16, "temperature": 0, "stream": stream}
			if ep == "/v1/completions" {
				body["prompt"] = "Once upon a time"
			} else {
				body["messages"] = []map[string]string{{"role": "user", "content": "Tell me a story"}}
			}
			b, _ := json.Marshal(body)
			resp, err := client.Post(l.url+ep, "application/json", strings.NewReader(string(b)))
			if err != nil {
				t.Fatalf("%s: %v", ep, err)
			}
			raw, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("%s (stream %v) through the LB: %d %s", ep, stream, resp.StatusCode, raw)
			}
			if stream && !strings.Contains(string(raw), "data: [DONE]") {
				t.Fatalf("%s stream through the LB has no [DONE]: %s", ep, raw)
			}
			if !stream && !strings.Contains(string(raw), `"choices"`) {
				t.Fatalf("%s through the LB: no choices: %s", ep, raw)
			}
		}
	}
}
