package e2e

import (
	"context"
	"encoding/json"
	"math/rand/v2"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

// routeRun is one policy's pass over the shared-prefix workload.
type routeRun struct {
	out              [][]int
	cached, prompt   int     // tokens, as the servers reported them
	computed         float64 // prompt tokens the prefill servers computed
	seconds, hitRate float64
}

// runRouted sends the prompts through url, conc at a time (greedy, 8
// tokens each), and sums what the servers report.
func runRouted(t *testing.T, url string, prompts [][]int, conc int) routeRun {
	t.Helper()
	r := routeRun{out: make([][]int, len(prompts))}
	errs := make([]string, len(prompts))
	meta := make([][2]int, len(prompts))
	sem := make(chan struct{}, conc)
	var wg sync.WaitGroup
	start := time.Now()
	for i, p := range prompts {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			res, err := generate(ctx, url, map[string]any{"input_ids": p,
				"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 8, "ignore_eos": true}})
			switch {
			case err != nil:
				errs[i] = err.Error()
			case res.Status != 200:
				errs[i] = "status " + strconv.Itoa(res.Status) + ": " + res.Raw
			default:
				r.out[i] = res.IDs
				meta[i] = [2]int{res.MetaInfo.CachedTokens, res.MetaInfo.PromptTokens}
			}
		}()
	}
	wg.Wait()
	r.seconds = time.Since(start).Seconds()
	for i, e := range errs {
		if e != "" {
			t.Fatalf("request %d through %s: %s", i, url, e)
		}
		r.cached += meta[i][0]
		r.prompt += meta[i][1]
	}
	r.hitRate = float64(r.cached) / float64(r.prompt)
	return r
}

// TestCacheAwareRouting: two prefill and two decode servers whose prefill
// KV pools hold about half of 8 groups' shared prefixes. round_robin sends
// every group to both prefills, whose caches then thrash; cache_aware sends
// each group to one, whose cache keeps it: its hit rate (cached / prompt
// tokens, as the servers report them) is well above round_robin's and its
// prefills compute several times fewer prompt tokens, at no lower
// throughput; the outputs are those of a server without a cache. Then
// bench serve's --shared-prefix-len and --multi-turn report the hits
// through the cache_aware LB.
func TestCacheAwareRouting(t *testing.T) {
	shared := sharedDir(t)
	args := func(maxTokens string, more ...string) []string {
		return append(append(storiesArgs(shared), "--served-model-name", "stories260K", "--page-size", "16",
			"--chunked-prefill-size", "40", "--max-total-tokens", maxTokens), more...)
	}
	// 80 pages of 16 tokens: four 256-token prefixes and room for the
	// requests in flight.
	const prefillPool = "1280"
	plain := serve(t, serveOpts{name: "plain", args: args("8192", "--disable-radix-cache")})
	p1 := serve(t, serveOpts{name: "prefill1", mode: "prefill", args: args(prefillPool)})
	p2 := serve(t, serveOpts{name: "prefill2", mode: "prefill", args: args(prefillPool)})
	d1 := serve(t, serveOpts{name: "decode1", mode: "decode", args: args("8192")})
	d2 := serve(t, serveOpts{name: "decode2", mode: "decode", args: args("8192")})

	// 8 groups of 12 prompts: the group's 256 tokens, then 8 of its own
	// (a partial page: only the prefix can be cached), in random order.
	rng := rand.New(rand.NewPCG(14, 5))
	tok := func(n int) []int {
		ids := make([]int, n)
		for i := range ids {
			ids[i] = 3 + rng.IntN(497)
		}
		return ids
	}
	var prompts [][]int
	for range 8 {
		prefix := tok(256)
		for range 12 {
			prompts = append(prompts, append(slices.Clone(prefix), tok(8)...))
		}
	}
	rng.Shuffle(len(prompts), func(i, j int) { prompts[i], prompts[j] = prompts[j], prompts[i] })
	want := runRouted(t, plain.url, prompts, 4)
	if want.cached != 0 {
		t.Fatalf("--disable-radix-cache reported %d cached tokens", want.cached)
	}

	prefillTokens := func() float64 {
		return p1.metric(t, "mooncake_engine_prefill_tokens_total") + p2.metric(t, "mooncake_engine_prefill_tokens_total")
	}
	runs := map[string]routeRun{}
	var caLB *server
	for _, policy := range []string{"round_robin", "cache_aware"} {
		// Checks at 1 s: one that times out on this busy machine takes a
		// server out of the rotation, and its groups elsewhere.
		l := lb(t, "lb-"+policy, []*server{p1, p2}, []*server{d1, d2}, "--policy", policy, "--health-check-interval", "1s")
		if st, body := postJSON(t, l.url+"/flush_cache", ""); st != 200 {
			t.Fatalf("%s: /flush_cache through the LB: %d %s", policy, st, body)
		}
		before := prefillTokens()
		r := runRouted(t, l.url, prompts, 2)
		r.computed = prefillTokens() - before
		for i := range prompts {
			if !slices.Equal(r.out[i], want.out[i]) {
				t.Fatalf("%s: prompt %d gave %v, the server without a cache %v", policy, i, r.out[i], want.out[i])
			}
		}
		t.Logf("%s: hit rate %.3f (%d of %d prompt tokens cached), prefills computed %.0f prompt tokens, %.1f req/s",
			policy, r.hitRate, r.cached, r.prompt, r.computed, float64(len(prompts))/r.seconds)
		runs[policy] = r
		if policy == "cache_aware" {
			caLB = l
			m := l.metrics(t)
			hit, miss := m[`mooncake_lb_cache_aware_decisions_total{decision="hit",role="prefill"}`],
				m[`mooncake_lb_cache_aware_decisions_total{decision="miss",role="prefill"}`]
			t.Logf("cache_aware's prefill decisions: %v hits, %v misses (8 groups)", hit, miss)
			if hit+miss != float64(len(prompts)) || hit < 4*miss {
				t.Errorf("cache_aware: %v prefill hits, %v misses: want most of the %d requests sent where their prefix is", hit, miss, len(prompts))
			}
		} else {
			l.kill()
		}
	}
	rr, ca := runs["round_robin"], runs["cache_aware"]
	t.Logf("cache_aware / round_robin: hit rate %.2fx, prompt tokens computed %.2fx fewer, throughput %.2fx",
		ca.hitRate/rr.hitRate, rr.computed/ca.computed, rr.seconds/ca.seconds)
	// The ideal is 2x (half of the groups fit each cache); the first
	// prompt of each group and partial hits keep it below.
	if ca.hitRate < 1.4*rr.hitRate || ca.hitRate < 0.7 {
		t.Errorf("cache_aware's hit rate %.3f, round_robin's %.3f: want cache_aware's at least 0.7 and 1.4x", ca.hitRate, rr.hitRate)
	}
	if ca.computed*2 > rr.computed {
		t.Errorf("cache_aware's prefills computed %.0f prompt tokens, round_robin's %.0f: want at most half", ca.computed, rr.computed)
	}
	if ca.seconds > 1.5*rr.seconds {
		t.Errorf("cache_aware took %.2f s, round_robin %.2f s", ca.seconds, rr.seconds)
	}

	// bench serve through the cache_aware LB: fresh groups, then chats.
	bench := func(extra ...string) map[string]any {
		t.Helper()
		argv := append([]string{"bench", "serve", "--url", caLB.url, "--max-token-id", "500", "--concurrency", "2", "--output-len", "8",
			"--metrics-url", p1.url, "--metrics-url", p2.url, "--json"}, extra...)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		out, err := exec.CommandContext(ctx, bin, argv...).CombinedOutput()
		if err != nil {
			t.Fatalf("bench serve %v: %v\n%s", extra, err, out)
		}
		var res map[string]any
		if err := json.Unmarshal(out, &res); err != nil {
			t.Fatalf("bench serve %v: %v\n%s", extra, err, out)
		}
		return res
	}
	res := bench("--shared-prefix-len", "256", "--num-groups", "4", "--input-len", "8", "--num-prompts", "32", "--seed", "7")
	in, cached := res["total_input_tokens"].(float64), res["total_cached_tokens"].(float64)
	computed, ok := res["prefill_tokens_computed"].(float64)
	if res["completed"] != 32.0 || in != 32*264 || res["cached_token_share"].(float64) < 0.6 || !ok || computed != in-cached {
		t.Errorf("bench serve --shared-prefix-len: %v: want 32 prompts of 264 tokens, most cached, computed = input - cached", res)
	}
	res = bench("--multi-turn", "3", "--input-len", "40", "--num-prompts", "6", "--concurrency", "3")
	// Turns of 40, 88 and 136 tokens; the prefill holds each turn's prompt
	// for the next (whole pages: 32 and 80 tokens).
	if res["completed"] != 18.0 || res["total_input_tokens"] != 6*(40+88+136.0) || res["cached_token_share"].(float64) < 0.3 {
		t.Errorf("bench serve --multi-turn: %v: want 18 turns of 40, 88, 136 tokens, at least 30%% cached", res)
	}
	for _, s := range []*server{p1, p2, d1, d2} {
		n := int(s.info(t)["kv_pages_total"].(float64))
		s.waitFreePages(t, n, 5*time.Second)
	}
}
