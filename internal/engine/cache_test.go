package engine

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

func withCache(pageSize int) func(*Config) {
	return func(c *Config) { c.Cache = kvcache.NewRadix(c.Pages, pageSize) }
}

// TestPrefixCache: a repeated prompt, one sharing a prefix, and one that
// continues an earlier answer reuse their cached pages (whole pages of all
// but the last prompt token); outputs stay those of a full computation; the
// prefill counter drops by the cached tokens and Finish reports them.
func TestPrefixCache(t *testing.T) {
	const ps = 4
	te := startEngine(t, 64, ps, withCache(ps))
	prefill := func() float64 { return counter(t, te.reg, "mooncake_engine_prefill_tokens_total", "") }
	gen := func(prompt []int, n int) result {
		t.Helper()
		r := te.generate(t, &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: n, IgnoreEOS: true}})
		if want := expectGreedy(i32(prompt), nil, n, true); !slices.Equal(r.tokens, want) {
			t.Fatalf("prompt of %d tokens: got %v, want %v", len(prompt), r.tokens, want)
		}
		return r
	}
	a := ids("the cat sat on the mat and then it slept") // 42 tokens
	before := prefill()
	first := gen(a, 6)
	if first.finish.CachedTokens != 0 || prefill()-before != float64(len(a)) {
		t.Fatalf("cold: cached %d, computed %v", first.finish.CachedTokens, prefill()-before)
	}
	for _, tc := range []struct {
		name   string
		prompt []int
		cached int
	}{
		{"same prompt", a, (len(a) - 1) / ps * ps},
		{"shared prefix", append(slices.Clone(a[:22]), ids("xyz")...), 20},
		{"continues the answer", append(slices.Clone(a), first.tokens[:5]...), (len(a) + 4) / ps * ps},
		{"nothing shared", ids("zzzzzzzzzzzz"), 0},
	} {
		before := prefill()
		r := gen(tc.prompt, 5)
		if r.finish.CachedTokens != tc.cached || prefill()-before != float64(len(tc.prompt)-tc.cached) {
			t.Errorf("%s: cached %d (want %d), computed %v of %d", tc.name, r.finish.CachedTokens, tc.cached, prefill()-before, len(tc.prompt))
		}
	}
	if v := counter(t, te.reg, "mooncake_radix_cache_hit_tokens_total", ""); v == 0 {
		t.Error("hit tokens counter did not move")
	}
}

// TestPrefixCacheEvictionStorm: many distinct prompts through a small pool
// all complete with the right output; afterwards every page is either free
// or cached, and a flush frees them all.
func TestPrefixCacheEvictionStorm(t *testing.T) {
	const ps, pages = 4, 24
	te := startEngine(t, pages, ps, withCache(ps))
	rng := rand.New(rand.NewPCG(3, 4))
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 64 {
		prompt := make([]int, 5+rng.IntN(30))
		for j := range prompt {
			prompt[j] = 'a' + rng.IntN(3) // a small alphabet: many shared prefixes
		}
		if i%4 == 0 && i > 0 {
			prompt = append(ids("shared prefix "), prompt...)
		}
		wg.Go(func() {
			ch, err := te.Submit(context.Background(), &Request{InputIDs: prompt, Params: SamplingParams{MaxNewTokens: 8, IgnoreEOS: true}})
			if err != nil {
				errs <- err
				return
			}
			r := collect(t, ch)
			if want := expectGreedy(i32(prompt), nil, 8, true); !slices.Equal(r.tokens, want) {
				errs <- fmt.Errorf("request %d: got %v, want %v (finish %+v)", i, r.tokens, want, r.finish)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	c := te.cfg.Cache
	waitFor(t, "pages accounted for", func() bool { return te.pages.Free()+c.Pages() == pages })
	if c.Evicted() == 0 {
		t.Error("the storm evicted nothing: the test did not press the cache")
	}
	c.Flush()
	if te.pages.Free() != pages {
		t.Fatalf("after flush %d of %d pages free", te.pages.Free(), pages)
	}
}

// TestPrefixCacheExactCPU: on the real CPU backend, greedy and seeded
// outputs are identical with and without the cache, for shared prefixes of
// every alignment to the page size.
func TestPrefixCacheExactCPU(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	const ps = 8
	tok := tokenizer.NewByteLevel()
	plain, _ := cpuEngine(t, model.Builtin(), tok, 128, ps, 16, 1)
	cached, _ := cpuEngine(t, model.Builtin(), tok, 128, ps, 16, 1, withCache(ps))
	base := ids("a long shared beginning of a story about a dog, a cat and a bird")
	run := func(e *Engine, prompt []int, p SamplingParams) result {
		ch, err := e.Submit(context.Background(), &Request{InputIDs: prompt, Params: p})
		if err != nil {
			t.Fatal(err)
		}
		return collect(t, ch)
	}
	seed := int64(7)
	for _, p := range []SamplingParams{
		{MaxNewTokens: 12, IgnoreEOS: true},
		{MaxNewTokens: 12, IgnoreEOS: true, Temperature: 0.9, TopP: 0.9, Seed: &seed},
	} {
		run(cached, base, p) // warm the cache
		for cut := ps - 2; cut <= 3*ps+2; cut++ {
			prompt := append(slices.Clone(base[:cut+ps]), ids(fmt.Sprintf(" then %d", cut))...)
			want, got := run(plain, prompt, p), run(cached, prompt, p)
			if !slices.Equal(got.tokens, want.tokens) {
				t.Fatalf("prefix %d (temperature %v): cached %v, plain %v", cut+ps, p.Temperature, got.tokens, want.tokens)
			}
			if got.finish.CachedTokens == 0 {
				t.Fatalf("prefix %d: nothing came from the cache", cut+ps)
			}
		}
	}
}
