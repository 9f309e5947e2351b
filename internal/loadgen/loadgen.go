// Package loadgen is `mooncake-go bench serve`: a load generator for any
// server speaking /generate (a colocated server, a prefill/decode pair
// behind the LB), reporting throughput, TTFT, ITL and end-to-end latency.
package loadgen

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Config is one benchmark run. Zero values mean the defaults noted.
type Config struct {
	URL         string  // base URL, e.g. http://127.0.0.1:8000
	Concurrency int     // requests (with MultiTurn: chats) in flight at most (default 1)
	RequestRate float64 // requests (chats) per second (Poisson arrivals); 0 = as fast as concurrency allows
	NumPrompts  int     // measured requests, or chats with MultiTurn (default 32)
	Warmup      int     // unmeasured requests first (default 1), with no shared prefix
	InputLen    int     // prompt tokens, or a turn's new tokens (default 128)
	OutputLen   int     // output tokens (default 64)
	// RangeRatio draws lengths uniformly from [len*RangeRatio, len] (1 = fixed; default 1).
	RangeRatio float64
	// MaxTokenID bounds the random prompt token ids to [3, MaxTokenID]
	// (default 250: valid for every vocabulary of 256 or more).
	MaxTokenID int
	// SharedPrefixLen: each prompt (each chat's first) starts with its
	// group's prefix of this many tokens, then InputLen of its own (0: no
	// shared prefix).
	SharedPrefixLen int
	// NumGroups: prompts are in this many groups (default 1 with a shared
	// prefix), as evenly as NumPrompts allows, sent in random order.
	NumGroups int
	// MultiTurn: each of the NumPrompts is a chat of this many turns
	// (default 1). A turn's prompt is the chat so far, prompts and answers,
	// then InputLen new tokens; a chat's turns go one after another.
	MultiTurn int
	// MetricsURLs are servers whose /metrics are read before and after the
	// measured requests, for the prompt tokens they computed
	// (mooncake_engine_prefill_tokens_total). Empty: URL's, if it has them.
	MetricsURLs []string
	Seed        uint64
	Timeout     time.Duration // per request (default 5m)
}

// Result is the report of a run.
type Result struct {
	Completed     int     `json:"completed"`
	Failed        int     `json:"failed"`
	FirstError    string  `json:"first_error,omitempty"`
	DurationS     float64 `json:"duration_s"`
	RequestRate   float64 `json:"request_throughput"` // req/s
	InputTokens   int     `json:"total_input_tokens"`
	OutputTokens  int     `json:"total_output_tokens"`
	OutputTokRate float64 `json:"output_throughput"` // tok/s
	// CachedTokens are the prompt tokens the servers took from their
	// prefix caches (meta_info.cached_tokens); CachedShare is their share
	// of InputTokens.
	CachedTokens int     `json:"total_cached_tokens"`
	CachedShare  float64 `json:"cached_token_share"`
	// PrefillTokens are the prompt tokens the servers of MetricsURLs
	// computed during the measured requests; absent when unknown.
	PrefillTokens *int64 `json:"prefill_tokens_computed,omitempty"`
	MetricsError  string `json:"metrics_error,omitempty"`
	TTFT          Stats  `json:"ttft_ms"`
	ITL           Stats  `json:"itl_ms"`
	E2E           Stats  `json:"e2e_latency_ms"`
}

// Stats are latency percentiles in milliseconds.
type Stats struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

func stats(v []float64) Stats {
	if len(v) == 0 {
		return Stats{}
	}
	sort.Float64s(v)
	q := func(p float64) float64 { return v[min(len(v)-1, int(p*float64(len(v))))] }
	var sum float64
	for _, x := range v {
		sum += x
	}
	return Stats{Mean: sum / float64(len(v)), P50: q(0.5), P90: q(0.9), P99: q(0.99)}
}

type sample struct {
	ttft, e2e float64
	itl       []float64
	in, out   int
	cached    int
	ids       []int // the output
	err       error
}

// errEarlierTurn marks the turns a chat did not send after one failed.
var errEarlierTurn = errors.New("loadgen: an earlier turn of the chat failed")

// Validate reports a configuration Run cannot use, naming the flag.
func (c *Config) Validate() error {
	switch {
	case c.URL == "":
		return errors.New("--url is required")
	case c.SharedPrefixLen < 0:
		return fmt.Errorf("--shared-prefix-len %d is negative", c.SharedPrefixLen)
	case c.NumGroups < 0:
		return fmt.Errorf("--num-groups %d is negative", c.NumGroups)
	case c.NumGroups > 0 && c.SharedPrefixLen == 0:
		return errors.New("--num-groups needs --shared-prefix-len")
	case c.NumGroups > c.withDefaults().NumPrompts:
		return fmt.Errorf("--num-groups %d is more than --num-prompts", c.NumGroups)
	case c.MultiTurn < 0:
		return fmt.Errorf("--multi-turn %d is negative", c.MultiTurn)
	}
	return nil
}

// chat is one measured unit: a prompt, or the turns of a chat.
type chat struct {
	prefix []int   // the group's shared prefix, or nil
	users  [][]int // each turn's new tokens
	outs   []int   // each turn's output length
}

func (c Config) withDefaults() Config {
	if c.Concurrency <= 0 {
		c.Concurrency = 1
	}
	if c.NumPrompts <= 0 {
		c.NumPrompts = 32
	}
	if c.InputLen <= 0 {
		c.InputLen = 128
	}
	if c.OutputLen <= 0 {
		c.OutputLen = 64
	}
	if c.RangeRatio <= 0 || c.RangeRatio > 1 {
		c.RangeRatio = 1
	}
	if c.MaxTokenID <= 3 {
		c.MaxTokenID = 250
	}
	if c.NumGroups == 0 {
		c.NumGroups = 1
	}
	if c.MultiTurn == 0 {
		c.MultiTurn = 1
	}
	if c.Timeout == 0 {
		c.Timeout = 5 * time.Minute
	}
	return c
}

// Run performs the benchmark.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6d6f6f6e))
	draw := func(n int) int {
		lo := int(float64(n) * cfg.RangeRatio)
		if lo < 1 {
			lo = 1
		}
		return lo + rng.IntN(n-lo+1)
	}
	tokens := func(n int) []int {
		ids := make([]int, n)
		for i := range ids {
			ids[i] = 3 + rng.IntN(cfg.MaxTokenID-2)
		}
		return ids
	}
	prefixes := make([][]int, cfg.NumGroups)
	for g := range prefixes {
		prefixes[g] = tokens(cfg.SharedPrefixLen)
	}
	chats := make([]chat, cfg.NumPrompts)
	for i := range chats {
		c := chat{prefix: prefixes[i%cfg.NumGroups]}
		for range cfg.MultiTurn {
			c.users = append(c.users, tokens(draw(cfg.InputLen)))
			c.outs = append(c.outs, draw(cfg.OutputLen))
		}
		chats[i] = c
	}
	rng.Shuffle(len(chats), func(i, j int) { chats[i], chats[j] = chats[j], chats[i] })

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Concurrency + 4}}
	defer client.CloseIdleConnections()
	url := strings.TrimRight(cfg.URL, "/") + "/generate"
	for i := 0; i < cfg.Warmup; i++ {
		if s := one(ctx, client, url, tokens(cfg.SharedPrefixLen+draw(cfg.InputLen)), draw(cfg.OutputLen), cfg.Timeout); s.err != nil {
			return nil, fmt.Errorf("warm-up request: %w", s.err)
		}
	}
	murls, explicit := cfg.MetricsURLs, len(cfg.MetricsURLs) > 0
	if !explicit {
		murls = []string{cfg.URL}
	}
	before, berr := prefillTokens(ctx, client, murls)

	turns := cfg.MultiTurn
	sem := make(chan struct{}, cfg.Concurrency)
	samples := make([]sample, len(chats)*turns)
	for i := range samples {
		samples[i].err = context.Canceled // until sent
	}
	var wg sync.WaitGroup
	start := time.Now()
	for i, c := range chats {
		if cfg.RequestRate > 0 && i > 0 {
			select {
			case <-time.After(time.Duration(rng.ExpFloat64() / cfg.RequestRate * float64(time.Second))):
			case <-ctx.Done():
			}
		}
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func(out []sample) {
			defer wg.Done()
			defer func() { <-sem }()
			hist := c.prefix
			for t := range c.users {
				prompt := append(slices.Clone(hist), c.users[t]...)
				out[t] = one(ctx, client, url, prompt, c.outs[t], cfg.Timeout)
				if out[t].err != nil || out[t].out == 0 {
					for k := t + 1; k < len(out); k++ {
						out[k].err = errEarlierTurn
					}
					return
				}
				hist = append(prompt, out[t].ids...)
			}
		}(samples[i*turns : (i+1)*turns])
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	res := &Result{DurationS: el}
	after, aerr := prefillTokens(ctx, client, murls)
	switch err := errors.Join(berr, aerr); {
	case err != nil && explicit:
		res.MetricsError = err.Error()
	case err == nil:
		d := after - before
		res.PrefillTokens = &d
	}
	var ttft, itl, e2e []float64
	for _, s := range samples {
		if s.err != nil || s.out == 0 {
			res.Failed++
			if res.FirstError == "" && s.err != nil && s.err != errEarlierTurn {
				res.FirstError = s.err.Error()
			}
			continue
		}
		res.Completed++
		res.InputTokens += s.in
		res.OutputTokens += s.out
		res.CachedTokens += s.cached
		ttft = append(ttft, s.ttft)
		e2e = append(e2e, s.e2e)
		itl = append(itl, s.itl...)
	}
	res.RequestRate = float64(res.Completed) / el
	res.OutputTokRate = float64(res.OutputTokens) / el
	if res.InputTokens > 0 {
		res.CachedShare = float64(res.CachedTokens) / float64(res.InputTokens)
	}
	res.TTFT, res.ITL, res.E2E = stats(ttft), stats(itl), stats(e2e)
	return res, ctx.Err()
}

// errNoMetric is a /metrics without mooncake_engine_prefill_tokens_total
// (an LB's).
var errNoMetric = errors.New("no mooncake_engine_prefill_tokens_total")

// prefillTokens sums mooncake_engine_prefill_tokens_total over the
// servers' /metrics.
func prefillTokens(ctx context.Context, c *http.Client, urls []string) (int64, error) {
	const name = "mooncake_engine_prefill_tokens_total"
	var sum int64
	for _, u := range urls {
		u = strings.TrimRight(u, "/") + "/metrics"
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		resp, err := c.Do(req)
		if err != nil {
			cancel()
			return 0, fmt.Errorf("%s: %w", u, err)
		}
		found := false
		sc := bufio.NewScanner(io.LimitReader(resp.Body, 16<<20))
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			rest, ok := strings.CutPrefix(line, name)
			if !ok || rest == "" || rest[0] != ' ' && rest[0] != '{' {
				continue
			}
			v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
			if err == nil {
				sum += int64(v)
				found = true
			}
		}
		err = sc.Err()
		resp.Body.Close()
		cancel()
		switch {
		case resp.StatusCode != http.StatusOK:
			return 0, fmt.Errorf("%s: HTTP %d", u, resp.StatusCode)
		case err != nil:
			return 0, fmt.Errorf("%s: %w", u, err)
		case !found:
			return 0, fmt.Errorf("%s: %w", u, errNoMetric)
		}
	}
	return sum, nil
}

// one sends a streaming /generate request and times its events.
func one(ctx context.Context, c *http.Client, url string, ids []int, out int, timeout time.Duration) (s sample) {
	s.in = len(ids)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	body, _ := json.Marshal(map[string]any{
		"input_ids": ids, "stream": true,
		"sampling_params": map[string]any{"max_new_tokens": out, "temperature": 0, "ignore_eos": true},
	})
	start := time.Now()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		s.err = err
		return s
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 2048))
		s.err = fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return s
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 64<<20)
	last := start
	n := 0
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: ") {
			continue
		}
		data := line[len("data: "):]
		if data == "[DONE]" {
			break
		}
		var ev struct {
			OutputIDs []int `json:"output_ids"`
			MetaInfo  *struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"meta_info"`
			Error *struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &ev); err != nil {
			s.err = fmt.Errorf("bad event: %w", err)
			return s
		}
		if ev.Error != nil {
			s.err = errors.New(ev.Error.Message)
			return s
		}
		if ev.MetaInfo != nil { // the last event's is the request's
			s.cached = ev.MetaInfo.CachedTokens
		}
		now := time.Now()
		if len(ev.OutputIDs) > n {
			if n == 0 {
				s.ttft = ms(now.Sub(start))
			} else {
				// Tokens that arrive together share the gap.
				gap := ms(now.Sub(last)) / float64(len(ev.OutputIDs)-n)
				for k := n; k < len(ev.OutputIDs); k++ {
					s.itl = append(s.itl, gap)
				}
			}
			n = len(ev.OutputIDs)
			s.ids = ev.OutputIDs
			last = now
		}
	}
	if err := sc.Err(); err != nil {
		s.err = err
		return s
	}
	s.out = n
	s.e2e = ms(time.Since(start))
	return s
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Print writes a human-readable report.
func (r *Result) Print(w io.Writer) {
	fmt.Fprintf(w, "completed %d, failed %d in %.2f s\n", r.Completed, r.Failed, r.DurationS)
	if r.FirstError != "" {
		fmt.Fprintf(w, "first error: %s\n", r.FirstError)
	}
	fmt.Fprintf(w, "request throughput   %.2f req/s\n", r.RequestRate)
	fmt.Fprintf(w, "output throughput    %.1f tok/s (%d input, %d output tokens)\n", r.OutputTokRate, r.InputTokens, r.OutputTokens)
	fmt.Fprintf(w, "cached prompt tokens %d (%.1f%% of the input)\n", r.CachedTokens, 100*r.CachedShare)
	if r.PrefillTokens != nil {
		fmt.Fprintf(w, "prompt tokens computed by the servers %d\n", *r.PrefillTokens)
	}
	if r.MetricsError != "" {
		fmt.Fprintf(w, "server metrics: %s\n", r.MetricsError)
	}
	for _, x := range []struct {
		n string
		s Stats
	}{{"TTFT", r.TTFT}, {"ITL", r.ITL}, {"E2E", r.E2E}} {
		fmt.Fprintf(w, "%-5s ms  mean %8.2f  p50 %8.2f  p90 %8.2f  p99 %8.2f\n", x.n, x.s.Mean, x.s.P50, x.s.P90, x.s.P99)
	}
}
