package cpu

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestReferenceTP: stories260K (8 heads, 4 KV heads) on 1, 2 and 4 ranks
// reproduces every reference case: the greedy ids exactly, the last prompt
// logits within 1e-4 of llama2.c's, and every step's logits within 1e-4 of
// tp 1's.
func TestReferenceTP(t *testing.T) {
	m, err := model.LoadLlama2C(stories260K(t))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	cases := refCases(t)
	var tp1 [][][]float32
	for _, tp := range []int{1, 2, 4} {
		t.Run(fmt.Sprintf("tp=%d", tp), func(t *testing.T) {
			b := newTPBackend(t, m, 16, 8, tp, 2, Options{})
			worst := 0.0
			for ci, c := range cases {
				logits := greedy(t, b, c.PromptIDs, pagesFor(0, 8), 0, len(c.GreedyNextIDs)-1)
				if d := maxAbsDiff(logits[0], c.LastPromptLogits); d > 1e-4 {
					t.Errorf("%q: last prompt logits %g off llama2.c's", c.Prompt, d)
				}
				for i, want := range c.GreedyNextIDs {
					if got := argmax(logits[i]); got != want {
						t.Fatalf("%q: token %d is %d, want %d", c.Prompt, i, got, want)
					}
				}
				if tp == 1 {
					tp1 = append(tp1, logits)
					continue
				}
				for s := range logits {
					d := maxAbsDiff(logits[s], tp1[ci][s])
					worst = max(worst, d)
					if d > 1e-4 {
						t.Fatalf("%q step %d: logits %g off tp 1's", c.Prompt, s, d)
					}
				}
			}
			t.Logf("tp %d: largest logit difference from tp 1 over every step of every case: %.3g", tp, worst)
		})
	}
}

// TestReplicatedKVGreedy: a shape with 2 KV heads on 4 ranks (each KV head
// on two ranks) generates tp 1's greedy tokens, alone and batched.
func TestReplicatedKVGreedy(t *testing.T) {
	m, err := model.NewRandom("tiny", 5)
	if err != nil {
		t.Fatal(err)
	}
	if m.Config.KVHeads != 2 {
		t.Fatalf("tiny has %d KV heads", m.Config.KVHeads)
	}
	r := rand.New(rand.NewPCG(3, 4))
	prompts := make([][]int32, 4)
	for i := range prompts {
		prompts[i] = []int32{256}
		for range 5 + 13*i {
			prompts[i] = append(prompts[i], int32(r.IntN(256)))
		}
	}
	const steps, per = 40, 32
	one := newBackend(t, m, 4, per*len(prompts), 2)
	four := newTPBackend(t, m, 4, per*len(prompts), 4, 2, Options{})
	want := runBatch(t, one, prompts, []int{0, 3, 0, 7}, steps, per)
	got := runBatch(t, four, prompts, []int{0, 3, 0, 7}, steps, per)
	for i := range prompts {
		for s := range want[i] {
			if a, b := argmax(got[i][s]), argmax(want[i][s]); a != b {
				t.Fatalf("prompt %d step %d: tp 4 picks %d, tp 1 %d", i, s, a, b)
			}
		}
	}
}

// failingComm fails rank fail's n-th all-reduce.
type failingComm struct {
	collective.Comm
	fail  int
	left  *atomic.Int64
	cause error
}

func (c *failingComm) AllReduce(ctx context.Context, b collective.Buf) error {
	if c.Rank() == c.fail && c.left.Add(-1) == 0 {
		return c.cause
	}
	return c.Comm.AllReduce(ctx, b)
}

// TestRankFails: a rank whose collective fails ends the pass on every rank
// (no one waits for it), the pass's error names the rank and the cause,
// the failure is counted for that rank, and the next pass runs on a fresh
// communicator with the right logits.
func TestRankFails(t *testing.T) {
	m, err := model.NewRandom("tiny", 7)
	if err != nil {
		t.Fatal(err)
	}
	cause := errors.New("injected rank failure")
	var left atomic.Int64
	left.Store(5)
	reg := prometheus.NewRegistry()
	o := Options{Registerer: reg, Comms: func(tp int) []collective.Comm {
		cs := collective.NewLocal(tp)
		for i, c := range cs {
			cs[i] = &failingComm{Comm: c, fail: 2, left: &left, cause: cause}
		}
		return cs
	}}
	b := newTPBackend(t, m, 4, 16, 4, 2, o)
	ref := newBackend(t, m, 4, 16, 1)
	prompt := []int32{256, 10, 20, 30, 40, 50}
	seq := []compute.Seq{{Tokens: prompt, Pages: []int32{0, 1}, Logits: true}}
	out := [][]float32{make([]float32, m.Config.Vocab)}
	err = b.Forward(context.Background(), seq, out)
	var re *compute.RankError
	if !errors.As(err, &re) || re.Rank != 2 || !errors.Is(err, cause) {
		t.Fatalf("forward: %v, want rank 2's injected failure", err)
	}
	if !strings.Contains(err.Error(), "tp rank 2") {
		t.Fatalf("error %q does not name the rank", err)
	}
	if v := sharedtest.Counter(b.m.Failures.WithLabelValues("2")); v != 1 {
		t.Fatalf("rank 2 failures = %v", v)
	}
	if err := b.Forward(context.Background(), seq, out); err != nil {
		t.Fatalf("the pass after a failure: %v", err)
	}
	want := [][]float32{make([]float32, m.Config.Vocab)}
	if err := ref.Forward(context.Background(), seq, want); err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(out[0], want[0]); d > 1e-5 {
		t.Fatalf("logits after the failure %g off tp 1's", d)
	}
	if v := sharedtest.Counter(b.m.Forward.WithLabelValues("3")); v <= 0 {
		t.Fatalf("rank 3 forward seconds %v", v)
	}
	// A context that ends stops every rank.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := b.Forward(ctx, seq, out); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled: %v", err)
	}
}

// TestTPShapes: shapes that do not split, and pools that do not fit, are
// refused, naming why.
func TestTPShapes(t *testing.T) {
	m, err := model.NewRandom("tiny", 1) // 4 heads, 2 KV heads
	if err != nil {
		t.Fatal(err)
	}
	pools := func(n int, l kvcache.Layout, shared bool) []*kvcache.Pool {
		var out []*kvcache.Pool
		var alloc *kvcache.Allocator
		for range n {
			p, err := kvcache.NewPoolShared(l, make([]byte, l.TotalBytes()), alloc)
			if err != nil {
				t.Fatal(err)
			}
			if shared {
				alloc = p.Alloc
			}
			out = append(out, p)
		}
		return out
	}
	one := LayoutFor(m.Config, 4, 4)
	half := ShardsFor(m.Config, 2, 4, 4)[0].Layout
	for _, c := range []struct {
		pools []*kvcache.Pool
		want  string
	}{
		{pools(3, one, true), "do not split over 3 ranks"},
		{pools(8, one, true), "do not split over 8 ranks"},
		{pools(2, one, true), "does not fit the model"},
		{pools(2, half, false), "share one page allocator"},
	} {
		_, err := NewTP(m, c.pools, Options{Threads: 1})
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%d pools: %v, want %q", len(c.pools), err, c.want)
		}
	}
}
