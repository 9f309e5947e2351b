package e2e

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// tpFlags are the serve flags of the TP comparison: pages of 4 tokens and
// chunks of 7, so a prompt spans several pages and pushes; the decodes keep
// no prefix cache, so every room moves its whole prompt.
var tpFlags = []string{"--served-model-name", "stories260K", "--page-size", "4", "--chunked-prefill-size", "7", "--max-total-tokens", "2048"}

// TestDisaggTP: every (prefill tp, decode tp) in {1, 2, 4} x {1, 2, 4}
// through the LB gives the colocated tp 1 server's greedy tokens exactly;
// the decode computes no prompt token; the prefill's transfer engine moves
// exactly the ideal bytes (each KV byte once to each decode rank that holds
// its head, and one aux slot per room); every page comes back.
func TestDisaggTP(t *testing.T) {
	shared := sharedDir(t)
	refs := loadRefs(t, shared)
	args := append(storiesArgs(shared), tpFlags...)
	const newTokens = 8
	var ws []workload
	var long []string
	for _, c := range refs {
		ws = append(ws, workload{ref: c.Next[:newTokens], body: map[string]any{"text": c.Prompt,
			"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": newTokens}}})
		long = append(long, c.Prompt)
	}
	ws = append(ws, workload{body: map[string]any{"text": strings.Join(long, " "),
		"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": newTokens, "ignore_eos": true}}})

	colo := serve(t, serveOpts{name: "colocated", args: args})
	want := runAll(t, colo.url, ws, 4)
	var pages int // prompt pages of the workload
	for i, w := range ws {
		if w.ref != nil && !slices.Equal(want[i], w.ref) {
			t.Errorf("colocated output of %q differs from llama2.c's:\n got %v\nwant %v", w.body["text"], want[i], w.ref)
		}
		r, err := generate(t.Context(), colo.url, w.body)
		mustOK(t, "colocated", r, err)
		pages += (r.MetaInfo.PromptTokens + 3) / 4
	}
	colo.kill()
	layers, kvHeads, headDim := llama2cShape(t, storiesArgs(shared)[1])
	ideal := float64(pages * layers * 2 * 4 * kvHeads * headDim * 4) // pages x layers x K,V x slots x heads x head dim x float32
	const auxSize = 192
	t.Logf("%d prompt pages: the ideal is %v KV bytes per run", pages, ideal)

	tps := []int{1, 2, 4}
	var pre, dec []*server
	for _, tp := range tps {
		pre = append(pre, serve(t, serveOpts{name: fmt.Sprintf("prefill-tp%d", tp), mode: "prefill",
			args: append(slices.Clone(args), "--tp-size", fmt.Sprint(tp))}))
		dec = append(dec, serve(t, serveOpts{name: fmt.Sprintf("decode-tp%d", tp), mode: "decode",
			args: append(slices.Clone(args), "--tp-size", fmt.Sprint(tp), "--disable-radix-cache")}))
	}
	for i, p := range pre {
		for j, d := range dec {
			t.Run(fmt.Sprintf("P%d-D%d", tps[i], tps[j]), func(t *testing.T) {
				if pt, dt := p.info(t)["tp_size"], d.info(t)["tp_size"]; pt != float64(tps[i]) || dt != float64(tps[j]) {
					t.Fatalf("tp_size: prefill %v, decode %v", pt, dt)
				}
				pm0, dm0 := p.metrics(t), d.metrics(t)
				l := lb(t, "lb", []*server{p}, []*server{d})
				got := runAll(t, l.url, ws, 4)
				compare(t, fmt.Sprintf("prefill tp %d, decode tp %d", tps[i], tps[j]), ws, want, got)
				n := float64(len(ws))
				p.waitMetric(t, `mooncake_disagg_requests_total{mode="prefill",result="success"}`, 5*time.Second,
					func(v float64) bool {
						return v-pm0[`mooncake_disagg_requests_total{mode="prefill",result="success"}`] == n
					})
				pm, dm := p.metrics(t), d.metrics(t)
				delta := func(m, m0 map[string]float64, series string) float64 { return m[series] - m0[series] }
				if v := delta(dm, dm0, "mooncake_engine_prefill_tokens_total"); v != 0 {
					t.Errorf("decode computed %v prompt tokens", v)
				}
				var moved float64
				for k := range pm {
					if strings.HasPrefix(k, `mooncake_transfer_bytes_total{op="write"`) {
						moved += delta(pm, pm0, k)
					}
				}
				if moved != ideal+auxSize*n {
					t.Errorf("the prefill's transfer engine wrote %v bytes; the ideal is %v of KV and %v of aux slots (metrics: %v)",
						moved, ideal, auxSize*n, grep(pm, "mooncake_transfer_bytes_total"))
				}
				if v := delta(dm, dm0, `mooncake_disagg_transfer_bytes_total{mode="decode"}`); v != ideal {
					t.Errorf("decode received %v KV bytes, the ideal is %v", v, ideal)
				}
				for _, s := range []*server{p, d} {
					s.waitFreePages(t, int(s.info(t)["kv_pages_total"].(float64)), 5*time.Second)
				}
				l.kill()
			})
		}
	}
}

// llama2cShape reads a llama2.c checkpoint's layers, KV heads and head
// dimension from its header.
func llama2cShape(t *testing.T, path string) (layers, kvHeads, headDim int) {
	t.Helper()
	f, err := os.Open(filepath.Clean(path))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var h [7]int32 // dim, hidden, layers, heads, kv heads, vocab, seq len
	if err := binary.Read(f, binary.LittleEndian, &h); err != nil {
		t.Fatal(err)
	}
	return int(h[2]), int(h[4]), int(h[0] / h[3])
}

// TestDisaggTPReplicated: shapes with 2 KV heads (a dense one and a MoE
// one, seeded random weights), prefill at tp 2 and decode at tp 4, where
// every KV head lives on two decode ranks: the colocated tp 1 tokens
// exactly, and each KV byte moved once to each of the two ranks holding it.
func TestDisaggTPReplicated(t *testing.T) {
	for _, shape := range []string{"tiny", "tiny-qwen3-moe"} {
		t.Run(shape, func(t *testing.T) {
			cfg, err := model.RandomConfig(shape)
			if err != nil {
				t.Fatal(err)
			}
			if cfg.KVHeads != 2 {
				t.Fatalf("%s has %d KV heads, want 2", shape, cfg.KVHeads)
			}
			args := []string{"--random-weights", shape, "--random-seed", "7", "--page-size", "4", "--chunked-prefill-size", "7",
				"--max-total-tokens", "2048", "--disable-radix-cache"}
			var ws []workload
			for _, p := range []string{"Once upon a time", "The quick brown fox jumps over the lazy dog, twice.", "a b c d e f g h i j k"} {
				ws = append(ws, workload{body: map[string]any{"text": p,
					"sampling_params": map[string]any{"temperature": 0, "max_new_tokens": 6, "ignore_eos": true}}})
			}
			colo := serve(t, serveOpts{name: "colocated", args: args})
			want := runAll(t, colo.url, ws, 3)
			pages := 0
			for _, w := range ws {
				r, err := generate(t.Context(), colo.url, w.body)
				mustOK(t, "colocated", r, err)
				pages += (r.MetaInfo.PromptTokens + 3) / 4
			}
			colo.kill()
			p := serve(t, serveOpts{name: "prefill-tp2", mode: "prefill", args: append(slices.Clone(args), "--tp-size", "2")})
			d := serve(t, serveOpts{name: "decode-tp4", mode: "decode", args: append(slices.Clone(args), "--tp-size", "4")})
			l := lb(t, "lb", []*server{p}, []*server{d})
			got := runAll(t, l.url, ws, 3)
			compare(t, shape+" prefill tp 2, decode tp 4", ws, want, got)
			// Four decode ranks of one KV head each: twice the model's KV.
			ideal := float64(pages * cfg.Layers * 2 * 4 * 4 * cfg.HeadDim * 4)
			if v := d.metric(t, `mooncake_disagg_transfer_bytes_total{mode="decode"}`); v != ideal {
				t.Errorf("decode received %v KV bytes, the ideal is %v", v, ideal)
			}
			if v := d.metric(t, "mooncake_engine_prefill_tokens_total"); v != 0 {
				t.Errorf("decode computed %v prompt tokens", v)
			}
			for _, s := range []*server{p, d} {
				s.waitFreePages(t, int(s.info(t)["kv_pages_total"].(float64)), 5*time.Second)
			}
		})
	}
}
