package disagg

import (
	"bytes"
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/sharedtest"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
)

// tpSide is one server with tp ranks: one transfer engine, a registered
// KV pool per rank, one page allocator.
type tpSide struct {
	te    *transfer.Engine
	pools []*kvcache.Pool
	pages *kvcache.Allocator
	info  Info
}

func newTPSide(t *testing.T, cfg model.Config, tp, pages int, order kvcache.Order, onNotify func(transfer.Notification)) *tpSide {
	t.Helper()
	ctx := context.Background()
	te, err := transfer.New(ctx, transfer.Config{Listen: "127.0.0.1:0", Transports: []transfer.Transport{tcp.New(tcp.Config{})},
		Timeout: xferTimeout, OnNotify: onNotify})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { te.Close() })
	whole := cfg.KVLayout(4, pages, 4)
	whole.Order = order
	s := &tpSide{te: te, pages: kvcache.NewAllocator(pages),
		info: Info{Model: "m", Fingerprint: "tp test", DType: "float32", Layout: whole, Segment: te.Name(),
			Incarnation: te.Incarnation(), AuxBytes: AuxSize}}
	for _, sh := range cfg.KVShards(tp, 4, pages, 4, order) {
		mem, err := te.AllocHost(ctx, sh.Layout.TotalBytes(), 0, transfer.AccessReadWrite)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { te.FreeHost(context.Background(), mem) })
		pool, err := kvcache.NewPoolShared(sh.Layout, mem.Bytes(), s.pages)
		if err != nil {
			t.Fatal(err)
		}
		s.pools = append(s.pools, pool)
		s.info.Ranks = append(s.info.Ranks, Rank{Segment: te.Name(), PoolAddr: mem.Addr(), Shard: sh})
	}
	return s
}

// kvByte is the pattern byte j of the K or V of the model's KV head h at
// slot of the prompt's page i in layer l.
func kvByte(i, l int, k kvcache.Kind, h, slot, j int) byte {
	return byte(i*131 + l*71 + int(k)*37 + h*23 + slot*11 + j)
}

// writeKV writes the pattern of the prompt's page i into page of every
// rank's pool (a replicated head alike on each of its ranks), or into
// want's images of them.
func (s *tpSide) writeKV(i int, page int32, into [][]byte) {
	for r, p := range s.pools {
		mem := p.Mem
		if into != nil {
			mem = into[r]
		}
		l := p.Layout
		for layer := range l.Layers {
			for k := kvcache.K; k <= kvcache.V; k++ {
				for hl := range l.KVHeads {
					for slot := range l.PageSize {
						off := l.Entry(layer, k, int(page), slot, hl)
						for j := range l.HeadBytes() {
							mem[off+int64(j)] = kvByte(i, layer, k, s.info.Ranks[r].FirstHead+hl, slot, j)
						}
					}
				}
			}
		}
	}
}

// TestReshardTP: a prefill on tp ranks fills a decode on another number of
// ranks, KV heads split, merged or replicated (2 KV heads on 4 ranks), in
// either page order on the decode: every decode rank's pool is byte for
// byte the pattern in the room's pages and untouched elsewhere, the bytes
// moved are the ideal (each KV byte once to each decode rank that holds its
// head), and both sides get every page back.
func TestReshardTP(t *testing.T) {
	type tc struct {
		kvHeads, ptp, dtp int
		order             kvcache.Order // the decode's
	}
	var cases []tc
	for _, kv := range []int{4, 2} {
		for _, p := range [][2]int{{1, 2}, {2, 1}, {2, 4}, {4, 2}, {4, 4}, {1, 4}} {
			cases = append(cases, tc{kv, p[0], p[1], kvcache.HeadMajor})
		}
	}
	cases = append(cases, tc{4, 2, 1, kvcache.TokenMajor}, tc{2, 4, 1, kvcache.TokenMajor})
	for _, c := range cases {
		t.Run(fmt.Sprintf("kv=%d/%d->%d/%v", c.kvHeads, c.ptp, c.dtp, c.order), func(t *testing.T) {
			cfg := model.Config{Layers: 2, Heads: 8, KVHeads: c.kvHeads, HeadDim: 8}
			const pages, prompt = 16, 13
			var dec atomic.Pointer[Decode]
			pre := newTPSide(t, cfg, c.ptp, pages, kvcache.HeadMajor, nil)
			ds := newTPSide(t, cfg, c.dtp, pages, c.order, func(n transfer.Notification) {
				if d := dec.Load(); d != nil {
					d.OnNotify(n)
				}
			})
			p, err := NewPrefill(context.Background(), PrefillConfig{Transfer: pre.te, Info: pre.info, Listen: "127.0.0.1:0", AuxSlots: 4, Secret: testSecret})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Close() })
			d, err := NewDecode(context.Background(), DecodeConfig{Transfer: ds.te, Info: ds.info, Pages: ds.pages, AuxSlots: 4, Secret: testSecret})
			if err != nil {
				t.Fatal(err)
			}
			dec.Store(d)
			t.Cleanup(func() { d.Close() })

			// Page indices differ between the sides.
			skip, _ := pre.pages.Alloc(3)
			const room = 0x7e5
			dreq := &engine.Request{ID: "d", InputIDs: make([]int, prompt)}
			dch := make(chan error, 1)
			go func() { dch <- d.Prepare(context.Background(), dreq, "127.0.0.1", p.Port(), room) }()
			preq := &engine.Request{ID: "p", InputIDs: make([]int, prompt)}
			if err := p.Prepare(context.Background(), preq, room); err != nil {
				t.Fatal(err)
			}
			ppages, err := pre.pages.Alloc((prompt + 3) / 4)
			if err != nil {
				t.Fatal(err)
			}
			hook := preq.Prefill
			hook.Pages(ppages)
			released := make(chan struct{})
			for i, done := range []int{8, prompt} { // two chunks: two pushes
				for pi := i * 2; pi < (done+3)/4; pi++ {
					pre.writeKV(pi, ppages[pi], nil)
				}
				hook.Chunk(done)
			}
			hook.Done(42, -0.5, nil, nil, func() {
				pre.pages.Release(ppages)
				close(released)
			})
			select {
			case err := <-dch:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("decode did not get the room's KV within 5s")
			}
			pl := dreq.Preloaded
			if pl == nil || pl.FirstToken != 42 || pl.FirstLogprob != -0.5 {
				t.Fatalf("first token: %+v", pl)
			}
			want := make([][]byte, len(ds.pools))
			for r, pool := range ds.pools {
				want[r] = make([]byte, len(pool.Mem))
			}
			for i, pg := range pl.Table.IDs()[:(prompt+3)/4] {
				ds.writeKV(i, pg, want)
			}
			for r, pool := range ds.pools {
				if !bytes.Equal(pool.Mem, want[r]) {
					n := 0
					for j := range want[r] {
						if pool.Mem[j] != want[r][j] {
							n++
						}
					}
					t.Errorf("decode rank %d (kv heads from %d, %d of them): %d bytes differ from the pattern", r,
						ds.info.Ranks[r].FirstHead, pool.Layout.KVHeads, n)
				}
			}
			var ideal int64
			for r, rk := range ds.info.Ranks {
				share := int64(rk.Layout.KVHeads) * 2 * 4 * int64(rk.Layout.HeadBytes()) * int64(cfg.Layers) * (prompt + 3) / 4
				if got := sharedtest.Counter(d.m.rankBytes.WithLabelValues(fmt.Sprint(r))); got != float64(share) {
					t.Errorf("decode rank %d received %v KV bytes, its share is %d", r, got, share)
				}
				ideal += share
			}
			if got := sharedtest.Counter(d.m.xferBytes); got != float64(ideal) {
				t.Errorf("%v KV bytes moved, the ideal is %d", got, ideal)
			}
			if got := sharedtest.Counter(p.m.xferBytes); got != float64(ideal) {
				t.Errorf("the prefill pushed %v KV bytes, the ideal is %d", got, ideal)
			}
			if err := pl.Table.Release(); err != nil {
				t.Fatal(err)
			}
			select {
			case <-released:
			case <-time.After(2 * time.Second):
				t.Fatal("the prefill did not release its pages")
			}
			pre.pages.Release(skip)
			if pre.pages.Free() != pages || ds.pages.Free() != pages {
				t.Fatalf("free pages: prefill %d, decode %d, want %d each", pre.pages.Free(), ds.pages.Free(), pages)
			}
			if n := len(p.plans); n != 1 {
				t.Errorf("%d plans cached, want 1", n)
			}
		})
	}
}

// TestCheckRanks: the same model at different tp sizes passes; a rank list
// that does not hold the model's KV is refused, naming the field.
func TestCheckRanks(t *testing.T) {
	cfg := model.Config{Layers: 2, Heads: 8, KVHeads: 4, HeadDim: 8}
	info := func(tp int) Info {
		l := cfg.KVLayout(4, 16, 4)
		in := Info{Model: "m", DType: "float32", Layout: l, AuxBytes: AuxSize}
		for _, sh := range cfg.KVShards(tp, 4, 16, 4, kvcache.HeadMajor) {
			in.Ranks = append(in.Ranks, Rank{Segment: "s", PoolAddr: 1 << 20, Shard: sh})
		}
		return in
	}
	for _, a := range []int{1, 2, 4} {
		for _, b := range []int{1, 2, 4} {
			if err := info(a).Check(info(b)); err != nil {
				t.Errorf("tp %d against tp %d: %v", a, b, err)
			}
		}
	}
	for _, c := range []struct {
		name  string
		edit  func(*Info)
		wants []string
	}{
		{"no ranks", func(i *Info) { i.Ranks = nil }, []string{"ranks: 0"}},
		{"head missing", func(i *Info) { i.Ranks = i.Ranks[:1] }, []string{"no rank holds kv head 2 of 4"}},
		{"head dim", func(i *Info) { i.Ranks[1].Layout.HeadDim = 16 }, []string{"ranks[1].layout", "head dim 16", "8"}},
		{"pages", func(i *Info) { i.Ranks[0].Layout.Pages = 8 }, []string{"ranks[0].layout", "pages 8", "16"}},
		{"heads beyond", func(i *Info) { i.Ranks[1].FirstHead = 3 }, []string{"ranks[1]", "kv heads 3..4 outside the model's 4"}},
		{"page order", func(i *Info) { i.Ranks[0].Layout.Order = 7 }, []string{"ranks[0].layout", "page order"}},
		{"whole layout", func(i *Info) { i.Layout.KVHeads = 8 }, []string{"kv heads 4 here, 8 on the peer"}},
	} {
		peer := info(2)
		peer.Ranks = append([]Rank(nil), peer.Ranks...)
		c.edit(&peer)
		mustContain(t, info(1).Check(peer), c.wants...)
	}
}
