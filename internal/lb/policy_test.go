package lb

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestPoliciesRegistration(t *testing.T) {
	p := BuiltinPolicies()
	if got, want := p.Names(), []string{"random", "round_robin", "least_load", "cache_aware"}; !slices.Equal(got, want) {
		t.Fatalf("builtin policies %v, want %v", got, want)
	}
	if err := p.Register("random", func(PolicyEnv) (Policy, error) { return leastLoad{}, nil }); err == nil {
		t.Fatal("a second random was registered")
	}
	for _, name := range []string{"", "two words", "a,b"} {
		if err := p.Register(name, func(PolicyEnv) (Policy, error) { return leastLoad{}, nil }); err == nil {
			t.Fatalf("name %q was registered", name)
		}
	}
	if err := p.Register("none", nil); err == nil {
		t.Fatal("a nil constructor was registered")
	}
	_, err := p.New("fastest", PolicyEnv{Role: "decode", Servers: 1})
	if err == nil || !strings.Contains(err.Error(), "--policy") || !strings.Contains(err.Error(), "cache_aware") {
		t.Fatalf("unknown policy: %v, want the flag and the names", err)
	}
	// The LB refuses what is not registered, naming the flag.
	if _, err := New(Config{Prefill: []string{"http://x"}, Decode: []string{"http://y"}, Policy: "fastest", Policies: NewPolicies()}); err == nil ||
		!strings.Contains(err.Error(), "--policy") {
		t.Fatalf("an empty registry: %v", err)
	}
}

func TestBuiltinPolicies(t *testing.T) {
	cands := []Candidate{{ID: 0, Inflight: 3}, {ID: 1, Inflight: 1}, {ID: 2, Inflight: 1}, {ID: 3, Inflight: 2}}
	rr := new(roundRobin)
	var got []int
	for range 6 {
		got = append(got, rr.Pick(cands, nil))
	}
	if want := []int{0, 1, 2, 3, 0, 1}; !slices.Equal(got, want) {
		t.Errorf("round_robin picked %v, want %v", got, want)
	}
	if i := (leastLoad{}).Pick(cands, nil); i != 1 {
		t.Errorf("least_load picked %d, want 1 (the first of the least loaded)", i)
	}
	seen := map[int]int{}
	for range 400 {
		seen[randomPolicy{}.Pick(cands, nil)]++
	}
	for i := range cands {
		if seen[i] < 50 {
			t.Errorf("random picked %d %d times of 400: %v", i, seen[i], seen)
		}
	}
}

// recorder is a registered policy that records what the LB gave it and
// picks the last candidate (or an index out of range, when bad).
type recorder struct {
	mu    sync.Mutex
	role  string
	calls [][]Candidate
	keys  []string
	bad   bool
}

func (r *recorder) Pick(c []Candidate, key []byte) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, slices.Clone(c))
	r.keys = append(r.keys, string(key))
	if r.bad {
		return len(c)
	}
	return len(c) - 1
}

// TestLBUsesRegisteredPolicy: a policy registered by the caller gets each
// role's usable servers and the prompt's bytes as sent; what it picks is
// used; an index out of range falls back to the first candidate.
func TestLBUsesRegisteredPolicy(t *testing.T) {
	p1, p2 := newFake(t, "prefill"), newFake(t, "prefill")
	d1, d2 := newFake(t, "decode"), newFake(t, "decode")
	recs := map[string]*recorder{}
	var mu sync.Mutex
	pols := NewPolicies()
	if err := pols.Register("last", func(env PolicyEnv) (Policy, error) {
		mu.Lock()
		defer mu.Unlock()
		if env.Servers != 2 {
			t.Errorf("%s policy built for %d servers, want 2", env.Role, env.Servers)
		}
		r := &recorder{role: env.Role, bad: env.Role == "decode"}
		recs[env.Role] = r
		return r, nil
	}); err != nil {
		t.Fatal(err)
	}
	_, srv, _ := startLB(t, Config{Prefill: []string{p1.URL, p2.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "last", Policies: pols})
	for _, body := range []string{`{"text":"Once upon a time","stream":false}`, `{"stream":false,"input_ids":[1, 2,3]}`, `{"sampling_params":{}}`} {
		if code, out := post(t, srv.URL+"/generate", body); code != 200 {
			t.Fatalf("%s: %d %s", body, code, out)
		}
	}
	waitFor(t, 5*time.Second, func() bool { return p1.count()+p2.count() == 3 }) // the prefill's may end after the answer
	if p1.count() != 0 || p2.count() != 3 || d1.count() != 3 || d2.count() != 0 {
		t.Fatalf("prefill got %d/%d, decode %d/%d: want the policy's last prefill and, its index out of range, the first decode",
			p1.count(), p2.count(), d1.count(), d2.count())
	}
	for _, role := range []string{"prefill", "decode"} {
		r := recs[role]
		if want := []string{`"Once upon a time"`, `[1, 2,3]`, ``}; !slices.Equal(r.keys, want) {
			t.Errorf("%s policy saw prompts %q, want %q", role, r.keys, want)
		}
		for _, c := range r.calls {
			if len(c) != 2 || c[0].ID != 0 || c[1].ID != 1 {
				t.Errorf("%s policy got candidates %+v", role, c)
			}
		}
	}
}

func newTestCacheAware(t *testing.T, servers int, cfg CacheAwareConfig, reg prometheus.Registerer) *cacheAware {
	t.Helper()
	p, err := newCacheAware(PolicyEnv{Role: "prefill", Servers: servers, CacheAware: cfg, Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	return p.(*cacheAware)
}

func groupPrompt(g, q int) []byte {
	return fmt.Appendf(nil, `"%c: the system prompt of group %d, which is long enough to be most of the prompt. Question %d?"`, 'A'+g, g, q)
}

func TestCacheAwareChoosesTheServerWithThePrefix(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := newTestCacheAware(t, 3, CacheAwareConfig{}, reg)
	idle := []Candidate{{ID: 0}, {ID: 1}, {ID: 2}}
	// First questions of three groups: no match, so the smallest tree:
	// one group per server.
	home := map[int]int{}
	for g := range 3 {
		home[g] = idle[c.Pick(idle, groupPrompt(g, 0))].ID
	}
	if len(map[int]bool{home[0]: true, home[1]: true, home[2]: true}) != 3 {
		t.Fatalf("three new groups went to servers %v: want one each (smallest tree on a tie)", home)
	}
	// Later questions go where their group went, under load differences
	// within the balance thresholds.
	for q := 1; q < 20; q++ {
		for g := range 3 {
			cands := []Candidate{{ID: 0, Inflight: int64(q % 5)}, {ID: 1, Inflight: 3}, {ID: 2, Inflight: int64(q % 7)}}
			if got := cands[c.Pick(cands, groupPrompt(g, q))].ID; got != home[g] {
				t.Fatalf("group %d question %d went to server %d, its prefix is on %d", g, q, got, home[g])
			}
		}
	}
	if n := metricValue(t, reg, "mooncake_lb_cache_aware_decisions_total", "role", "prefill", "decision", "hit"); n != 57 {
		t.Errorf("hit decisions %v, want 57", n)
	}
	if n := metricValue(t, reg, "mooncake_lb_cache_aware_decisions_total", "decision", "miss"); n != 3 {
		t.Errorf("miss decisions %v, want 3", n)
	}
	promptBytes := metricValue(t, reg, "mooncake_lb_cache_aware_prompt_bytes_total")
	matched := metricValue(t, reg, "mooncake_lb_cache_aware_matched_bytes_total")
	if promptBytes == 0 || matched/promptBytes < 0.8 {
		t.Errorf("matched %v of %v prompt bytes", matched, promptBytes)
	}
	// A prompt sharing less than the threshold goes to the smallest tree,
	// whatever the loads.
	short := []byte(`"A: something else entirely, which shares four bytes with group A and is long"`)
	smallest := home[2]
	c.Forget(smallest)
	cands := []Candidate{{ID: 0, Inflight: 2}, {ID: 1, Inflight: 2}, {ID: 2, Inflight: 2}}
	cands[smallest].Inflight = 9
	if got := cands[c.Pick(cands, short)].ID; got != smallest {
		t.Errorf("a prompt matching 4 of its %d bytes went to server %d, not to the smallest tree's %d", len(short), got, smallest)
	}
	// No prompt: the least loaded.
	cands = []Candidate{{ID: 0, Inflight: 5}, {ID: 1, Inflight: 1}, {ID: 2, Inflight: 5}}
	if got := c.Pick(cands, nil); got != 1 {
		t.Errorf("no prompt: picked %d, want the least loaded 1", got)
	}
	// Forget: group 0 is new again.
	c.Forget(home[0])
	if n := c.trees[home[0]].Match(groupPrompt(0, 1)); n != 0 {
		t.Errorf("after Forget the tree matched %d bytes", n)
	}
}

// TestCacheAwareBalances: when the most loaded server is more than
// --balance-abs-threshold requests and --balance-rel-threshold times
// above the least loaded, requests go to the least loaded, prefix or not;
// only one of the two conditions is not enough.
func TestCacheAwareBalances(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := newTestCacheAware(t, 2, CacheAwareConfig{BalanceAbsThreshold: 4, BalanceRelThreshold: 2}, reg)
	k := groupPrompt(0, 0)
	c.Pick([]Candidate{{ID: 0}, {ID: 1, Inflight: 1}}, k) // group 0 is on server 0
	for _, tc := range []struct {
		hot, cold int64
		want      int
	}{
		{4, 0, 0},  // difference 4: not more than 4
		{5, 0, 1},  // 5 more and infinitely more: balance
		{12, 7, 0}, // 5 more but less than twice
		{15, 7, 1}, // 8 more and more than twice
		{14, 7, 0}, // exactly twice is not more
	} {
		cands := []Candidate{{ID: 0, Inflight: tc.hot}, {ID: 1, Inflight: tc.cold}}
		if got := c.Pick(cands, k); got != tc.want {
			t.Errorf("load %d (with the prefix) vs %d: picked %d, want %d", tc.hot, tc.cold, got, tc.want)
		}
		c.Forget(1) // keep the prefix only on server 0
	}
	if n := metricValue(t, reg, "mooncake_lb_cache_aware_decisions_total", "decision", "balance"); n != 2 {
		t.Errorf("balance decisions %v, want 2", n)
	}
}

func TestCacheAwareConfigValidate(t *testing.T) {
	for _, c := range []struct {
		cfg  CacheAwareConfig
		flag string
	}{
		{CacheAwareConfig{CacheThreshold: 1.5}, "--cache-threshold"},
		{CacheAwareConfig{CacheThreshold: -0.1}, "--cache-threshold"},
		{CacheAwareConfig{BalanceRelThreshold: 0.5}, "--balance-rel-threshold"},
		{CacheAwareConfig{MaxTreeBytes: -1}, "--max-tree-size"},
	} {
		_, err := New(Config{Prefill: []string{"http://x"}, Decode: []string{"http://y"}, Policy: "cache_aware", CacheAware: c.cfg})
		if err == nil || !strings.Contains(err.Error(), c.flag) {
			t.Errorf("%+v: error %v, want one naming %s", c.cfg, err, c.flag)
		}
	}
	// A negative absolute threshold leaves only the relative condition.
	c := newTestCacheAware(t, 2, CacheAwareConfig{BalanceAbsThreshold: -1, BalanceRelThreshold: 1}, nil)
	c.Pick([]Candidate{{ID: 0}, {ID: 1, Inflight: 1}}, groupPrompt(0, 0))
	if got := c.Pick([]Candidate{{ID: 0, Inflight: 2}, {ID: 1, Inflight: 1}}, groupPrompt(0, 1)); got != 1 {
		t.Errorf("any imbalance should balance: picked %d", got)
	}
}

// TestCacheAwareTreesBounded: under a storm of distinct prompts each
// server's record stays within --max-tree-size.
func TestCacheAwareTreesBounded(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := newTestCacheAware(t, 2, CacheAwareConfig{MaxTreeBytes: 8 << 10}, reg)
	rng := rand.New(rand.NewPCG(5, 6))
	cands := []Candidate{{ID: 0}, {ID: 1}}
	for i := range 2000 {
		b := make([]byte, 50+rng.IntN(500))
		for j := range b {
			b[j] = byte('a' + rng.IntN(26))
		}
		c.Pick(cands, b)
		if i%100 == 0 {
			for _, tr := range c.trees {
				tr.check(t)
			}
		}
	}
	for i, tr := range c.trees {
		if s := tr.Size(); s > 8<<10 || s < 4<<10 {
			t.Errorf("tree %d holds %d bytes, bound 8 KiB", i, s)
		}
	}
	if n := metricValue(t, reg, "mooncake_lb_cache_aware_evicted_bytes_total"); n == 0 {
		t.Error("no eviction counted")
	}
}

// TestCacheAwareThroughLB: with two servers of each role, every question
// of a group goes to the same prefill and the same decode; the prompts are
// matched as sent, whatever member holds them.
func TestCacheAwareThroughLB(t *testing.T) {
	p1, p2 := newFake(t, "prefill"), newFake(t, "prefill")
	d1, d2 := newFake(t, "decode"), newFake(t, "decode")
	_, srv, reg := startLB(t, Config{Prefill: []string{p1.URL, p2.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "cache_aware"})
	type where struct{ p, d string }
	home := map[string]where{}
	bodies := func(g, q int) []string {
		ids := make([]int, 64)
		for i := range ids {
			ids[i] = 1000*g + i
		}
		ids = append(ids, q)
		idsJSON, _ := json.Marshal(ids)
		return []string{
			fmt.Sprintf(`{"text":%s}`, groupPrompt(g, q)),
			fmt.Sprintf(`{"sampling_params":{"max_new_tokens":1},"input_ids":%s}`, idsJSON),
		}
	}
	last := func(f *fakeServer) string {
		b, _ := json.Marshal(f.last())
		return string(b)
	}
	for q := range 6 {
		for g := range 4 {
			for k, body := range bodies(g, q) {
				np1, np, nd1 := p1.count(), p1.count()+p2.count(), d1.count()
				if code, out := post(t, srv.URL+"/generate", body); code != 200 {
					t.Fatalf("%s: %d %s", body, code, out)
				}
				// The prefill's request may end after the answer.
				waitFor(t, 5*time.Second, func() bool { return p1.count()+p2.count() == np+1 })
				w := where{"p2", "d2"}
				if p1.count() > np1 {
					w.p = "p1"
				}
				if d1.count() > nd1 {
					w.d = "d1"
				}
				name := fmt.Sprint(g, k)
				if h, ok := home[name]; !ok {
					home[name] = w
				} else if h != w {
					t.Fatalf("group %s question %d went to %v, its first to %v (prefill bodies %s / %s)", name, q, w, h, last(p1), last(p2))
				}
			}
		}
	}
	perP := map[string]int{}
	for _, w := range home {
		perP[w.p]++
	}
	if perP["p1"] == 0 || perP["p2"] == 0 {
		t.Errorf("all groups on one prefill: %v", home)
	}
	if n := metricValue(t, reg, "mooncake_lb_cache_aware_decisions_total", "role", "decode", "decision", "hit"); n != 8*5 {
		t.Errorf("decode hit decisions %v, want 40", n)
	}
}

// TestFlushCache: POST /flush_cache reaches every server and the policy
// forgets; a server without a cache (400) makes it a 400 that names it.
func TestFlushCache(t *testing.T) {
	p := newFake(t, "prefill")
	d1, d2 := newFake(t, "decode"), newFake(t, "decode")
	l, srv, reg := startLB(t, Config{Prefill: []string{p.URL}, Decode: []string{d1.URL, d2.URL}, Policy: "cache_aware"})
	body := fmt.Sprintf(`{"text":%s}`, groupPrompt(0, 0))
	for range 2 {
		if code, out := post(t, srv.URL+"/generate", body); code != 200 {
			t.Fatalf("%d %s", code, out)
		}
	}
	if n := metricValue(t, reg, "mooncake_lb_cache_aware_decisions_total", "role", "decode", "decision", "hit"); n != 1 {
		t.Fatalf("hit decisions %v before the flush, want 1", n)
	}
	code, out := post(t, srv.URL+"/flush_cache", "")
	if code != 200 || !strings.Contains(out, "Cache flushed.") {
		t.Fatalf("/flush_cache: %d %s", code, out)
	}
	for _, f := range []*fakeServer{p, d1, d2} {
		if n := f.flushes.Load(); n != 1 {
			t.Errorf("%s %s flushed %d times", f.mode, f.URL, n)
		}
	}
	if s := l.policy["decode"].(*cacheAware).sum((*prefixTree).Size); s != 0 {
		t.Errorf("the policy still records %d bytes after the flush", s)
	}
	d2.flushStatus.Store(400)
	code, out = post(t, srv.URL+"/flush_cache", "")
	if code != 400 || !strings.Contains(out, d2.URL) || !strings.Contains(out, "no prefix cache") {
		t.Fatalf("/flush_cache with a server without a cache: %d %s", code, out)
	}
	d1.Close() // unreachable: 502
	code, out = post(t, srv.URL+"/flush_cache", "")
	if code != 502 || !strings.Contains(out, d1.URL) {
		t.Fatalf("/flush_cache with a server down: %d %s", code, out)
	}
}
