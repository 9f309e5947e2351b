package disagg

import (
	"context"
	"errors"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	"github.com/mooncake-go/mooncake-go/internal/compute/cpu"
	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
)

// tpModelSide is a server of tp CPU ranks as serve builds it: one transfer
// engine, a registered pool per rank sharing one allocator, the engine.
type tpModelSide struct {
	te    *transfer.Engine
	pages *kvcache.Allocator
	eng   *engine.Engine
	info  Info
}

func newTPModelSide(t *testing.T, m *model.Model, tp, pages int, comms func(int) []collective.Comm, onNotify func(transfer.Notification)) *tpModelSide {
	t.Helper()
	ctx := context.Background()
	te, err := transfer.New(ctx, transfer.Config{Listen: "127.0.0.1:0", Transports: []transfer.Transport{tcp.New(tcp.Config{})},
		Timeout: 5 * time.Second, OnNotify: onNotify})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { te.Close() })
	s := &tpModelSide{te: te, pages: kvcache.NewAllocator(pages),
		info: Info{Model: "m", Fingerprint: m.Config.ArchName(), DType: "float32", Layout: cpu.LayoutFor(m.Config, 4, pages),
			Segment: te.Name(), Incarnation: te.Incarnation(), AuxBytes: AuxSize}}
	var pools []*kvcache.Pool
	for _, sh := range cpu.ShardsFor(m.Config, tp, 4, pages) {
		mem, err := te.AllocHost(ctx, sh.Layout.TotalBytes(), 0, transfer.AccessReadWrite)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { te.FreeHost(context.Background(), mem) })
		pool, err := kvcache.NewPoolShared(sh.Layout, mem.Bytes(), s.pages)
		if err != nil {
			t.Fatal(err)
		}
		pools = append(pools, pool)
		s.info.Ranks = append(s.info.Ranks, Rank{Segment: te.Name(), PoolAddr: mem.Addr(), Shard: sh})
	}
	be, err := cpu.NewTP(m, pools, cpu.Options{Threads: tp, Comms: comms})
	if err != nil {
		t.Fatal(err)
	}
	s.eng, err = engine.New(engine.Config{Model: be, Pages: s.pages, Tokenizer: tokenizer.NewByteLevel(), ChunkedPrefillSize: 7})
	if err != nil {
		be.Close()
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.eng.Run(runCtx) }()
	t.Cleanup(func() {
		s.eng.Close()
		cancel()
		<-done
		be.Close()
	})
	return s
}

// failOnce fails rank 1's n-th all-reduce.
type failOnce struct {
	collective.Comm
	left  *atomic.Int64
	cause error
}

func (c *failOnce) AllReduce(ctx context.Context, b collective.Buf) error {
	if c.Rank() == 1 && c.left.Add(-1) == 0 {
		return c.cause
	}
	return c.Comm.AllReduce(ctx, b)
}

// TestTPRankFailsRoom: a real model on a tp 2 prefill and a tp 4 decode
// (2 KV heads: replicated there). A prefill rank whose all-reduce fails
// fails its room on both sides with the prefill reason and a message
// naming the rank and the cause, and every page comes back on both sides;
// the next room, on a fresh communicator, gives the colocated tokens.
func TestTPRankFailsRoom(t *testing.T) {
	m, err := model.NewRandom("tiny", 11)
	if err != nil {
		t.Fatal(err)
	}
	const pages = 64
	prompt := make([]int, 19)
	for i := range prompt {
		prompt[i] = 3 + i*7%250
	}
	params := engine.SamplingParams{MaxNewTokens: 6, IgnoreEOS: true}
	colo := newTPModelSide(t, m, 1, pages, nil, nil)
	ch, err := colo.eng.Submit(context.Background(), &engine.Request{InputIDs: prompt, Params: params})
	if err != nil {
		t.Fatal(err)
	}
	want := collect(t, ch)

	cause := errors.New("injected rank failure")
	var left atomic.Int64
	left.Store(3)
	pre := newTPModelSide(t, m, 2, pages, func(tp int) []collective.Comm {
		cs := collective.NewLocal(tp)
		for i, c := range cs {
			cs[i] = &failOnce{Comm: c, left: &left, cause: cause}
		}
		return cs
	}, nil)
	var dec atomic.Pointer[Decode]
	ds := newTPModelSide(t, m, 4, pages, nil, func(n transfer.Notification) {
		if d := dec.Load(); d != nil {
			d.OnNotify(n)
		}
	})
	ctx := context.Background()
	pf, err := NewPrefill(ctx, PrefillConfig{Transfer: pre.te, Info: pre.info, Listen: "127.0.0.1:0", Secret: testSecret, AuxSlots: 4})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pf.Close() })
	d, err := NewDecode(ctx, DecodeConfig{Transfer: ds.te, Info: ds.info, Pages: ds.pages, PagesFor: ds.eng.KVPages, Secret: testSecret, AuxSlots: 4})
	if err != nil {
		t.Fatal(err)
	}
	dec.Store(d)
	t.Cleanup(func() { d.Close() })

	run := func(room uint64) ([]int, error) {
		preq := &engine.Request{InputIDs: prompt, Params: params}
		if err := pf.Prepare(ctx, preq, room); err != nil {
			return nil, err
		}
		pch, err := pre.eng.Submit(ctx, preq)
		if err != nil {
			return nil, err
		}
		dreq := &engine.Request{InputIDs: prompt, Params: params}
		derr := d.Prepare(ctx, dreq, "127.0.0.1", pf.Port(), room)
		for ev := range pch { // the prefill request's end
			if ev.Finish != nil {
				break
			}
		}
		if derr != nil {
			return nil, derr
		}
		dch, err := ds.eng.Submit(ctx, dreq)
		if err != nil {
			return nil, err
		}
		return collect(t, dch), nil
	}
	_, err = run(1)
	var re *RoomError
	if !errors.As(err, &re) || re.Reason != ReasonPrefill {
		t.Fatalf("room with a failing rank: %v, want a RoomError with reason %s", err, ReasonPrefill)
	}
	mustContain(t, err, "tp rank 1", "injected rank failure")
	waitFor(t, "prefill rooms gone", 5*time.Second, func() bool { return pf.Rooms() == 0 })
	waitFor(t, "prefill pages free", 5*time.Second, func() bool { return pre.pages.Free() == pages })
	if ds.pages.Free() != pages {
		t.Fatalf("decode free pages %d after the failed room, want %d", ds.pages.Free(), pages)
	}
	got, err := run(2)
	if err != nil {
		t.Fatalf("the room after the failure: %v", err)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("after the failure: tp 2 -> tp 4 gives %v, colocated tp 1 %v", got, want)
	}
	waitFor(t, "decode idle", 5*time.Second, func() bool { return ds.eng.Stats().Running == 0 })
	waitFor(t, "pages free", 5*time.Second, func() bool { return pre.pages.Free() == pages && ds.pages.Free() == pages })
}
