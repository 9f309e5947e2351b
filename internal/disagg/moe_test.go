package disagg

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/shm"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
)

// modelSide is one server's half with a real model: a transfer engine, a KV
// pool in its host memory, the CPU backend and an engine over them.
type modelSide struct {
	te   *transfer.Engine
	pool *kvcache.Pool
	eng  *engine.Engine
	info Info
}

func newModelSide(t *testing.T, m *model.Model, transport string, pages int, onNotify func(transfer.Notification)) *modelSide {
	t.Helper()
	ctx := context.Background()
	var tr transfer.Transport = tcp.New(tcp.Config{})
	if transport == "shm" {
		tr = shm.New(shm.Config{})
	}
	te, err := transfer.New(ctx, transfer.Config{Listen: "127.0.0.1:0", Transports: []transfer.Transport{tr},
		Timeout: 5 * time.Second, OnNotify: onNotify})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { te.Close() })
	// The KV layout comes from the model's Spec, as serve's does.
	lay := cpu.LayoutFor(m.Config, 4, pages)
	mem, err := te.AllocHost(ctx, lay.TotalBytes(), 0, transfer.AccessReadWrite)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { te.FreeHost(context.Background(), mem) })
	pool, err := kvcache.NewPool(lay, mem.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	be, err := cpu.New(m, pool, 1)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := engine.New(engine.Config{Model: be, Pages: pool.Alloc, Tokenizer: tokenizer.NewByteLevel(), ChunkedPrefillSize: 7})
	if err != nil {
		be.Close()
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- eng.Run(runCtx) }()
	t.Cleanup(func() {
		eng.Close()
		cancel()
		<-done
		be.Close()
	})
	return &modelSide{te: te, pool: pool, eng: eng, info: Info{Model: "m", Fingerprint: m.Config.ArchName(), DType: "float32",
		Layout: lay, Segment: te.Name(), Ranks: []Rank{{Segment: te.Name(), PoolAddr: mem.Addr(), Shard: kvcache.Shard{Layout: lay}}},
		Incarnation: te.Incarnation(), AuxBytes: AuxSize}}
}

// collect drains a request's events into its tokens.
func collect(t *testing.T, ch <-chan engine.Event) []int {
	t.Helper()
	var toks []int
	timeout := time.After(30 * time.Second)
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				t.Error("event channel closed without a finish")
				return toks
			}
			if ev.Token >= 0 {
				toks = append(toks, ev.Token)
			}
			if ev.Finish != nil {
				if ev.Finish.Err != nil {
					t.Errorf("request finished with %v", ev.Finish.Err)
				}
				return toks
			}
		case <-timeout:
			t.Error("request did not finish in 30s")
			return toks
		}
	}
}

// TestMoEThroughPD: a tiny Qwen3-MoE (bf16 weights, mapped from disk)
// served disaggregated, over tcp and over shm, gives the colocated
// engine's greedy tokens token for token for prompts of several pages and
// chunks, run concurrently.
func TestMoEThroughPD(t *testing.T) {
	dir := t.TempDir()
	if err := model.WriteRandom("tiny-qwen3-moe", dir, 3, ""); err != nil {
		t.Fatal(err)
	}
	m, err := model.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	r := rand.New(rand.NewPCG(8, 9))
	prompts := make([][]int, 6)
	for i := range prompts {
		prompts[i] = make([]int, 1+r.IntN(30))
		for j := range prompts[i] {
			prompts[i][j] = r.IntN(256)
		}
	}
	params := engine.SamplingParams{MaxNewTokens: 12, IgnoreEOS: true}
	colo := newModelSide(t, m, "tcp", 128, nil)
	want := make([][]int, len(prompts))
	for i, p := range prompts {
		ch, err := colo.eng.Submit(context.Background(), &engine.Request{InputIDs: p, Params: params})
		if err != nil {
			t.Fatal(err)
		}
		want[i] = collect(t, ch)
		if len(want[i]) != params.MaxNewTokens {
			t.Fatalf("colocated prompt %d: %d tokens", i, len(want[i]))
		}
	}
	for _, transport := range []string{"tcp", "shm"} {
		t.Run(transport, func(t *testing.T) {
			var dec *Decode
			var mu sync.Mutex
			pre := newModelSide(t, m, transport, 128, nil)
			dside := newModelSide(t, m, transport, 128, func(n transfer.Notification) {
				mu.Lock()
				d := dec
				mu.Unlock()
				if d != nil {
					d.OnNotify(n)
				}
			})
			ctx := context.Background()
			pf, err := NewPrefill(ctx, PrefillConfig{Transfer: pre.te, Info: pre.info, Listen: "127.0.0.1:0", Secret: testSecret, AuxSlots: 8})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { pf.Close() })
			d, err := NewDecode(ctx, DecodeConfig{Transfer: dside.te, Info: dside.info, Pages: dside.pool.Alloc,
				PagesFor: dside.eng.KVPages, Secret: testSecret, AuxSlots: 8})
			if err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			dec = d
			mu.Unlock()
			t.Cleanup(func() { d.Close() })

			got := make([][]int, len(prompts))
			var wg sync.WaitGroup
			for i, p := range prompts {
				wg.Add(1)
				go func() {
					defer wg.Done()
					room := uint64(0x3e0000 + i)
					preq := &engine.Request{InputIDs: p, Params: params}
					if err := pf.Prepare(ctx, preq, room); err != nil {
						t.Error(err)
						return
					}
					pch, err := pre.eng.Submit(ctx, preq)
					if err != nil {
						t.Error(err)
						return
					}
					dreq := &engine.Request{InputIDs: p, Params: params}
					if err := d.Prepare(ctx, dreq, "127.0.0.1", pf.Port(), room); err != nil {
						t.Errorf("prompt %d: decode: %v", i, err)
						collect(t, pch)
						return
					}
					dch, err := dside.eng.Submit(ctx, dreq)
					if err != nil {
						t.Error(err)
						return
					}
					first := collect(t, pch)
					got[i] = collect(t, dch)
					if len(first) != 1 || len(got[i]) == 0 || first[0] != got[i][0] {
						t.Errorf("prompt %d: prefill's first token %v, decode's output %v", i, first, got[i])
					}
				}()
			}
			wg.Wait()
			for i := range prompts {
				if !slices.Equal(got[i], want[i]) {
					t.Errorf("prompt %d (%d tokens): disaggregated %v, colocated %v", i, len(prompts[i]), got[i], want[i])
				}
			}
			// A request's stream ends before the loop retires it.
			waitFor(t, "decode idle", 5*time.Second, func() bool { return dside.eng.Stats().Running == 0 })
			waitFor(t, "prefill rooms gone", 5*time.Second, func() bool { return pf.Rooms() == 0 })
			waitFor(t, "prefill pages free", 5*time.Second, func() bool { return pre.pool.Alloc.Free() == pre.info.Layout.Pages })
		})
	}
}
