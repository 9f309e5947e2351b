package e2e

import (
	"context"
	"slices"
	"testing"
	"time"
)

// TestPrefixCacheExact: with the prefix cache on (the default) and off,
// colocated and through 1P1D, greedy and seeded outputs are identical for
// prompts sharing prefixes of every alignment to the 16-token page; the
// cached setups report cached tokens (through PD: the prefill's hits) and
// compute fewer prompt tokens; no page is lost.
func TestPrefixCacheExact(t *testing.T) {
	shared := sharedDir(t)
	args := append(storiesArgs(shared), pdFlags...)
	plain := serve(t, serveOpts{name: "plain", args: append(args, "--disable-radix-cache")})
	colo := serve(t, serveOpts{name: "cached", args: args})
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: args})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: args})
	l := lb(t, "lb", []*server{p}, []*server{d})

	base := make([]int, 80)
	for i := range base {
		base[i] = 3 + (i*37)%500
	}
	type answer struct {
		ids    []int
		cached int
	}
	ask := func(url string, ids []int, sp map[string]any) answer {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r, err := generate(ctx, url, map[string]any{"input_ids": ids, "sampling_params": sp})
		mustOK(t, url, r, err)
		return answer{r.IDs, r.MetaInfo.CachedTokens}
	}
	for round, sp := range []map[string]any{
		{"temperature": 0, "max_new_tokens": 8, "ignore_eos": true},
		{"temperature": 0.8, "top_p": 0.9, "seed": 11, "max_new_tokens": 8, "ignore_eos": true},
	} {
		for _, url := range []string{colo.url, l.url} {
			ask(url, base, sp) // warm
		}
		for cut := 14; cut <= 50; cut += 3 {
			prompt := append(slices.Clone(base[:cut]), 300+cut+60*round, 402) // new in each round
			want := ask(plain.url, prompt, sp)
			if want.cached != 0 {
				t.Fatalf("--disable-radix-cache reported %d cached tokens", want.cached)
			}
			for _, url := range []string{colo.url, l.url} {
				got := ask(url, prompt, sp)
				if !slices.Equal(got.ids, want.ids) {
					t.Fatalf("%s, shared prefix %d, %v: %v, without the cache %v", url, cut, sp, got.ids, want.ids)
				}
				if wantCached := cut / 16 * 16; got.cached != wantCached {
					t.Errorf("%s, shared prefix %d: %d cached tokens, want %d", url, cut, got.cached, wantCached)
				}
			}
		}
	}
	pc, cc := plain.metric(t, "mooncake_engine_prefill_tokens_total"), colo.metric(t, "mooncake_engine_prefill_tokens_total")
	if cc >= pc {
		t.Errorf("cached server computed %v prompt tokens, the plain one %v", cc, pc)
	}
	if v := p.metric(t, "mooncake_radix_cache_hit_tokens_total"); v == 0 {
		t.Error("the prefill's cache hit counter did not move")
	}
	if st, body := postJSON(t, colo.url+"/flush_cache", ""); st != 200 {
		t.Fatalf("/flush_cache: %d %s", st, body)
	}
	if st, _ := postJSON(t, plain.url+"/flush_cache", ""); st != 400 {
		t.Errorf("/flush_cache without a cache: %d, want 400", st)
	}
	for _, s := range []*server{plain, colo, p, d} {
		n := int(s.info(t)["kv_pages_total"].(float64))
		s.waitFreePages(t, n, 5*time.Second)
	}
	if got := colo.info(t)["kv_pages_free"].(float64); int(got) != int(colo.info(t)["kv_pages_total"].(float64)) {
		t.Errorf("after /flush_cache %v pages free", got)
	}
}

// TestMultiTurnPD: a chat whose every turn resends the whole history moves,
// through PD, only each turn's new pages: the decode keeps the earlier
// turns' KV in its prefix cache and the prefill sends the rest. Outputs
// equal a server without any cache.
func TestMultiTurnPD(t *testing.T) {
	shared := sharedDir(t)
	args := append(storiesArgs(shared), pdFlags...) // 16-token pages
	plain := serve(t, serveOpts{name: "plain", args: append(args, "--disable-radix-cache")})
	p := serve(t, serveOpts{name: "prefill", mode: "prefill", args: args})
	d := serve(t, serveOpts{name: "decode", mode: "decode", args: args})
	l := lb(t, "lb", []*server{p}, []*server{d})
	const bytesSeries = `mooncake_disagg_transfer_bytes_total{mode="prefill"}`
	sp := map[string]any{"temperature": 0, "max_new_tokens": 8, "ignore_eos": true}
	history := make([]int, 40)
	for i := range history {
		history[i] = 3 + (i*53)%500
	}
	var perPage float64
	for turn := range 6 {
		want := func() []int {
			r, err := generate(context.Background(), plain.url, map[string]any{"input_ids": history, "sampling_params": sp})
			mustOK(t, "plain", r, err)
			return r.IDs
		}()
		before := p.metric(t, bytesSeries)
		r, err := generate(context.Background(), l.url, map[string]any{"input_ids": history, "sampling_params": sp})
		mustOK(t, "PD", r, err)
		if !slices.Equal(r.IDs, want) {
			t.Fatalf("turn %d: PD %v, without a cache %v", turn, r.IDs, want)
		}
		moved := p.metric(t, bytesSeries) - before
		pages := float64((len(history) + 15) / 16)
		if turn == 0 {
			perPage = moved / pages // nothing held yet: every page moved
		} else if moved > 3*perPage { // the new tokens (8 + 24) span at most 3 pages
			t.Errorf("turn %d (%d tokens, %v pages): moved %v bytes = %.1f pages, want only the new ones", turn, len(history), pages, moved, moved/perPage)
		}
		t.Logf("turn %d: %d prompt tokens, %.1f pages moved", turn, len(history), moved/perPage)
		history = append(history, r.IDs...)
		for i := range 24 {
			history = append(history, 3+(turn*31+i*7)%500)
		}
	}
	d.waitFreePages(t, int(d.info(t)["kv_pages_total"].(float64)), 5*time.Second)
}
