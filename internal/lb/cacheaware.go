package lb

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// CacheAwareConfig holds the cache_aware policy's parameters, those of
// sgl-router's policy of that name. Zero values mean the defaults noted.
type CacheAwareConfig struct {
	// CacheThreshold: a request goes to the server that was sent the
	// longest prefix of its prompt when that prefix is more than this
	// share of the prompt (0 to 1; default 0.3); else to the server with
	// the smallest record (the most room for a new prefix).
	CacheThreshold float64
	// The servers are imbalanced when the most loaded has more than
	// BalanceAbsThreshold requests in flight more than the least loaded
	// (default 64; negative: no such condition) and more than
	// BalanceRelThreshold times as many (at least 1; default 1.5). Then
	// requests go to the least loaded server, wherever their prefix is.
	BalanceAbsThreshold int
	BalanceRelThreshold float64
	// MaxTreeBytes bounds the record of what was sent to each server
	// (default 64 MiB): prompt bytes plus a fixed cost per tree node.
	// Least recently used prefixes go first.
	MaxTreeBytes int64
}

// Defaults of CacheAwareConfig: sgl-router's (its tree bound counts
// characters; this one bytes and nodes).
const (
	DefaultCacheThreshold      = 0.3
	DefaultBalanceAbsThreshold = 64
	DefaultBalanceRelThreshold = 1.5
	DefaultMaxTreeBytes        = 64 << 20
)

func (c CacheAwareConfig) withDefaults() CacheAwareConfig {
	if c.CacheThreshold == 0 {
		c.CacheThreshold = DefaultCacheThreshold
	}
	if c.BalanceAbsThreshold == 0 {
		c.BalanceAbsThreshold = DefaultBalanceAbsThreshold
	}
	if c.BalanceRelThreshold == 0 {
		c.BalanceRelThreshold = DefaultBalanceRelThreshold
	}
	if c.MaxTreeBytes == 0 {
		c.MaxTreeBytes = DefaultMaxTreeBytes
	}
	return c
}

// Validate reports a parameter out of range, naming its flag.
func (c *CacheAwareConfig) Validate() error {
	switch {
	case c.CacheThreshold < 0 || c.CacheThreshold > 1 || c.CacheThreshold != c.CacheThreshold:
		return fmt.Errorf("--cache-threshold %v: want 0 to 1", c.CacheThreshold)
	case c.BalanceRelThreshold != 0 && !(c.BalanceRelThreshold >= 1):
		return fmt.Errorf("--balance-rel-threshold %v: want at least 1", c.BalanceRelThreshold)
	case c.MaxTreeBytes < 0:
		return fmt.Errorf("--max-tree-size %d is negative", c.MaxTreeBytes)
	}
	return nil
}

// cacheAware routes a request to the server most likely to hold its
// prompt's prefix, as sgl-router's cache_aware: each server has an
// approximate tree of the prompts routed to it (not of what it really
// holds), matched on the prompt's bytes as sent, so the LB neither decodes
// nor tokenizes. A request goes to the server with the longest match when
// the match is over CacheThreshold of the prompt, else to the one with the
// smallest tree (the most room for a new prefix: new prefixes spread
// evenly, whatever the momentary loads); when the servers are imbalanced,
// or the request has no prompt, to the least loaded. The prompt is then
// recorded in the chosen server's tree, which --max-tree-size bounds (its
// eviction is O(1) per node, so it runs at each insert, where sgl-router
// scans its trees every --eviction-interval).
type cacheAware struct {
	cfg   CacheAwareConfig
	trees []*prefixTree // by Candidate.ID

	hit, miss, balance prometheus.Counter
	promptBytes        prometheus.Counter
	matchedBytes       prometheus.Counter
}

func newCacheAware(env PolicyEnv) (Policy, error) {
	if err := env.CacheAware.Validate(); err != nil {
		return nil, err
	}
	if env.Servers <= 0 {
		return nil, errors.New("lb: cache_aware: no servers")
	}
	c := &cacheAware{cfg: env.CacheAware.withDefaults()}
	for range env.Servers {
		c.trees = append(c.trees, newPrefixTree(c.cfg.MaxTreeBytes))
	}
	role := prometheus.Labels{"role": env.Role}
	decisions := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "mooncake_lb_cache_aware_decisions_total", ConstLabels: role,
		Help: "cache_aware's choices: hit (the server sent the longest prefix, over --cache-threshold of the prompt), miss (no such prefix: the server with the smallest record), balance (the servers' loads were too far apart: the least loaded).",
	}, []string{"decision"})
	c.hit, c.miss, c.balance = decisions.WithLabelValues("hit"), decisions.WithLabelValues("miss"), decisions.WithLabelValues("balance")
	c.promptBytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "mooncake_lb_cache_aware_prompt_bytes_total", ConstLabels: role,
		Help: "Prompt bytes cache_aware routed (at most the first 256 KiB of each prompt).",
	})
	c.matchedBytes = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "mooncake_lb_cache_aware_matched_bytes_total", ConstLabels: role,
		Help: "Of mooncake_lb_cache_aware_prompt_bytes_total, the leading bytes the chosen server had been sent before (its expected cache hits).",
	})
	if env.Registerer != nil {
		for _, col := range []prometheus.Collector{decisions, c.promptBytes, c.matchedBytes,
			prometheus.NewGaugeFunc(prometheus.GaugeOpts{
				Name: "mooncake_lb_cache_aware_tree_bytes", ConstLabels: role,
				Help: "Size of cache_aware's record of what was sent to the servers, all servers of the role together.",
			}, func() float64 { return float64(c.sum((*prefixTree).Size)) }),
			prometheus.NewCounterFunc(prometheus.CounterOpts{
				Name: "mooncake_lb_cache_aware_evicted_bytes_total", ConstLabels: role,
				Help: "Bytes cache_aware's records dropped to stay within --max-tree-size.",
			}, func() float64 { return float64(c.sum((*prefixTree).Evicted)) }),
		} {
			if err := env.Registerer.Register(col); err != nil {
				return nil, fmt.Errorf("lb: cache_aware metrics: %w", err)
			}
		}
	}
	return c, nil
}

func (c *cacheAware) sum(f func(*prefixTree) int64) int64 {
	var n int64
	for _, t := range c.trees {
		n += f(t)
	}
	return n
}

func (c *cacheAware) Pick(cands []Candidate, key []byte) int {
	lo, hi := cands[0].Inflight, cands[0].Inflight
	for _, x := range cands[1:] {
		lo, hi = min(lo, x.Inflight), max(hi, x.Inflight)
	}
	// The longest match; ties to the less loaded.
	best, bestLen := 0, -1
	var match [8]int
	matched := match[:0]
	for i, x := range cands {
		n := c.trees[x.ID].Match(key)
		matched = append(matched, n)
		if n > bestLen || n == bestLen && x.Inflight < cands[best].Inflight {
			best, bestLen = i, n
		}
	}
	var pick int
	switch {
	case hi-lo > int64(c.cfg.BalanceAbsThreshold) && float64(hi) > float64(lo)*c.cfg.BalanceRelThreshold:
		pick = c.leastLoaded(cands)
		c.balance.Inc()
	case len(key) == 0: // nothing to place
		pick = c.leastLoaded(cands)
		c.miss.Inc()
	case float64(bestLen) > c.cfg.CacheThreshold*float64(len(key)):
		pick = best
		c.hit.Inc()
	default:
		pick = c.smallestTree(cands)
		c.miss.Inc()
	}
	c.promptBytes.Add(float64(len(key)))
	c.matchedBytes.Add(float64(matched[pick]))
	c.trees[cands[pick].ID].Insert(key)
	return pick
}

// leastLoaded is the candidate with the fewest requests in flight; ties
// go to the smallest tree, then the first.
func (c *cacheAware) leastLoaded(cands []Candidate) int {
	best, size := 0, c.trees[cands[0].ID].Size()
	for i, x := range cands[1:] {
		s := c.trees[x.ID].Size()
		if b := cands[best]; x.Inflight < b.Inflight || x.Inflight == b.Inflight && s < size {
			best, size = i+1, s
		}
	}
	return best
}

// smallestTree is the candidate with the smallest tree; ties go to the
// fewest in flight, then the first.
func (c *cacheAware) smallestTree(cands []Candidate) int {
	best, size := 0, c.trees[cands[0].ID].Size()
	for i, x := range cands[1:] {
		s := c.trees[x.ID].Size()
		if b := cands[best]; s < size || s == size && x.Inflight < b.Inflight {
			best, size = i+1, s
		}
	}
	return best
}

// Forget drops what was recorded for server id.
func (c *cacheAware) Forget(id int) {
	if id >= 0 && id < len(c.trees) {
		c.trees[id].Reset()
	}
}
