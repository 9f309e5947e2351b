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
	"sort"
	"strings"
	"sync"
	"time"
)

// Config is one benchmark run. Zero values mean the defaults noted.
type Config struct {
	URL         string  // base URL, e.g. http://127.0.0.1:8000
	Concurrency int     // requests in flight at most (default 1)
	RequestRate float64 // requests per second (Poisson arrivals); 0 = as fast as concurrency allows
	NumPrompts  int     // measured requests (default 32)
	Warmup      int     // unmeasured requests first (default 1)
	InputLen    int     // prompt tokens (default 128)
	OutputLen   int     // output tokens (default 64)
	// RangeRatio draws lengths uniformly from [len*RangeRatio, len] (1 = fixed; default 1).
	RangeRatio float64
	// MaxTokenID bounds the random prompt token ids to [3, MaxTokenID]
	// (default 250: valid for every vocabulary of 256 or more).
	MaxTokenID int
	Seed       uint64
	Timeout    time.Duration // per request (default 5m)
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
	TTFT          Stats   `json:"ttft_ms"`
	ITL           Stats   `json:"itl_ms"`
	E2E           Stats   `json:"e2e_latency_ms"`
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
	err       error
}

// Run performs the benchmark.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.URL == "" {
		return nil, errors.New("--url is required")
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 1
	}
	if cfg.NumPrompts <= 0 {
		cfg.NumPrompts = 32
	}
	if cfg.InputLen <= 0 {
		cfg.InputLen = 128
	}
	if cfg.OutputLen <= 0 {
		cfg.OutputLen = 64
	}
	if cfg.RangeRatio <= 0 || cfg.RangeRatio > 1 {
		cfg.RangeRatio = 1
	}
	if cfg.MaxTokenID <= 3 {
		cfg.MaxTokenID = 250
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 5 * time.Minute
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x6d6f6f6e))
	draw := func(n int) int {
		lo := int(float64(n) * cfg.RangeRatio)
		if lo < 1 {
			lo = 1
		}
		return lo + rng.IntN(n-lo+1)
	}
	type job struct {
		ids []int
		out int
	}
	mk := func() job {
		ids := make([]int, draw(cfg.InputLen))
		for i := range ids {
			ids[i] = 3 + rng.IntN(cfg.MaxTokenID-2)
		}
		return job{ids, draw(cfg.OutputLen)}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Concurrency + 4}}
	url := strings.TrimRight(cfg.URL, "/") + "/generate"
	for i := 0; i < cfg.Warmup; i++ {
		j := mk()
		if s := one(ctx, client, url, j.ids, j.out, cfg.Timeout); s.err != nil {
			return nil, fmt.Errorf("warm-up request: %w", s.err)
		}
	}
	jobs := make([]job, cfg.NumPrompts)
	for i := range jobs {
		jobs[i] = mk()
	}
	sem := make(chan struct{}, cfg.Concurrency)
	samples := make([]sample, len(jobs))
	var wg sync.WaitGroup
	start := time.Now()
	for i, j := range jobs {
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
		go func(i int, j job) {
			defer wg.Done()
			defer func() { <-sem }()
			samples[i] = one(ctx, client, url, j.ids, j.out, cfg.Timeout)
		}(i, j)
	}
	wg.Wait()
	el := time.Since(start).Seconds()
	res := &Result{DurationS: el}
	var ttft, itl, e2e []float64
	for _, s := range samples {
		if s.err != nil || s.out == 0 {
			res.Failed++
			if res.FirstError == "" && s.err != nil {
				res.FirstError = s.err.Error()
			}
			continue
		}
		res.Completed++
		res.InputTokens += s.in
		res.OutputTokens += s.out
		ttft = append(ttft, s.ttft)
		e2e = append(e2e, s.e2e)
		itl = append(itl, s.itl...)
	}
	res.RequestRate = float64(res.Completed) / el
	res.OutputTokRate = float64(res.OutputTokens) / el
	res.TTFT, res.ITL, res.E2E = stats(ttft), stats(itl), stats(e2e)
	return res, ctx.Err()
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
			Error     *struct {
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
	for _, x := range []struct {
		n string
		s Stats
	}{{"TTFT", r.TTFT}, {"ITL", r.ITL}, {"E2E", r.E2E}} {
		fmt.Fprintf(w, "%-5s ms  mean %8.2f  p50 %8.2f  p90 %8.2f  p99 %8.2f\n", x.n, x.s.Mean, x.s.P50, x.s.P90, x.s.P99)
	}
}
