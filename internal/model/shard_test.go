package model

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

func TestShardHeads(t *testing.T) {
	for _, c := range []struct{ heads, kv int }{{8, 4}, {4, 2}, {4, 1}, {12, 12}, {32, 8}, {6, 2}} {
		cfg := Config{Heads: c.heads, KVHeads: c.kv, Vocab: 513}
		for tp := 1; tp <= 2*c.heads; tp++ {
			err := cfg.CheckTP(tp)
			valid := c.heads%tp == 0 && (c.kv%tp == 0 || tp%c.kv == 0)
			if (err == nil) != valid {
				t.Fatalf("%+v tp %d: CheckTP %v, valid %v", c, tp, err, valid)
			}
			if !valid {
				continue
			}
			group := c.heads / c.kv
			held := make([]int, c.kv)
			for r := range tp {
				qlo, qhi := cfg.QHeads(tp, r)
				lo, hi := cfg.KVHeadsOf(tp, r)
				if qhi-qlo != c.heads/tp || hi <= lo {
					t.Fatalf("%+v tp %d rank %d: q heads %d..%d, kv heads %d..%d", c, tp, r, qlo, qhi, lo, hi)
				}
				for q := qlo; q < qhi; q++ { // a rank's query heads read its KV heads only
					if kv := q / group; kv < lo || kv >= hi {
						t.Fatalf("%+v tp %d rank %d: query head %d reads KV head %d, rank holds %d..%d", c, tp, r, q, kv, lo, hi-1)
					}
				}
				for h := lo; h < hi; h++ {
					held[h]++
				}
			}
			for h, n := range held {
				if want := max(1, tp/c.kv); n != want {
					t.Fatalf("%+v tp %d: KV head %d held by %d ranks, want %d", c, tp, h, n, want)
				}
			}
			rows := 0
			for r := range tp {
				lo, hi := cfg.VocabRows(tp, r)
				if lo != rows || hi-lo > cfg.VocabShard(tp) {
					t.Fatalf("tp %d rank %d: vocab rows %d..%d after %d", tp, r, lo, hi, rows)
				}
				rows = hi
				if a, b := Split(172, tp, r); r > 0 {
					if pa, _ := Split(172, tp, r-1); a <= pa && b-a > 0 {
						t.Fatalf("split not increasing")
					}
				}
			}
			if rows != cfg.Vocab {
				t.Fatalf("tp %d: vocab rows cover %d of %d", tp, rows, cfg.Vocab)
			}
		}
	}
}

func TestKVShards(t *testing.T) {
	c, err := RandomConfig("tiny")
	if err != nil {
		t.Fatal(err)
	}
	sh := c.KVShards(4, 16, 10, 4, kvcache.HeadMajor)
	if len(sh) != 4 {
		t.Fatal(len(sh))
	}
	for r, s := range sh {
		if s.Layout.KVHeads != 1 || s.FirstHead != r/2 || s.Layout.Order != kvcache.HeadMajor || s.Layout.Pages != 10 || s.Layout.Validate() != nil {
			t.Fatalf("rank %d: %+v", r, s)
		}
	}
	total := 0
	for r := range 7 {
		lo, hi := Split(172, 7, r)
		total += hi - lo
	}
	if total != 172 {
		t.Fatalf("split covers %d of 172", total)
	}
}
