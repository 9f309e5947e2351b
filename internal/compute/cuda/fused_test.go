package cuda

import (
	"fmt"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestFusedDecode checks the fused decode layer (gemv2_*: rmsnorm, RoPE with
// the KV write and SiLU-multiply inside the GEMVs), the skinny GEMMs
// (gemm_sk_*) and attn_decode2 against the separate kernels and cuBLAS, in
// bfloat16, over prefill and decode steps at batch sizes 1 to 4 (the fused
// path, graphs on: buckets 1, 2, 4, 4) and 6 and 13 (bucket 8 and 16: gemm_sk
// or cuBLAS): the fused GEMVs with the old attention and cuBLAS must give the
// old kernels' logits bit for bit (these dims reduce rmsnorm in its own
// order; so must the same with tuning combWo, whose wo merges one query's
// attention splits itself, gemv2_comb, and with qknFold, whose QKV GEMV
// runs qk_norm_rope's work, gemv2_qkn); all the new kernels together must stay near them (with the 4- and
// 8-warp attention), and give the same bits with attn_combine instead of
// attn_decode2's own merge and launched with programmatic dependent launch; the
// defaults (attn_decode_tc at head dim 128) stay near them too. Shapes: head dims 8 to 128,
// interleaved and half-split RoPE, QKV bias, tied embeddings, hidden sizes
// that the GEMV cannot read (172), per-head q/k norms (tiny-qwen3: the old
// kernels run qk_norm and rope_kv, the others qk_norm_rope, and the fused
// layer's QKV projection is gemv2_norm).
func TestFusedDecode(t *testing.T) {
	type shape struct {
		name string
		m    func(*testing.T) *model.Model
	}
	random := func(name string) func(*testing.T) *model.Model {
		return func(t *testing.T) *model.Model {
			m, err := model.NewRandom(name, 17)
			if err != nil {
				t.Fatal(err)
			}
			return m
		}
	}
	shapes := []shape{
		{"headdim128", headDim128},
		{"tiny", random("tiny")},
		{"tiny-qwen2", random("tiny-qwen2")},
		{"tiny-llama3", random("tiny-llama3")},
		{"stories260K", func(t *testing.T) *model.Model { m, _ := stories260K(t); return m }},
		{"tiny-qwen3", random("tiny-qwen3")},
	}
	for _, sh := range shapes {
		t.Run(sh.name, func(t *testing.T) {
			m := sh.m(t)
			V := m.Config.Vocab
			groups := []int{1, 2, 3, 4, 6, 13}
			const per, steps = 12, 9 // pages of 16: 192 positions per seq
			mk := bf16Maker(t, m, groups, per)
			old := mk(tuning{noFused: true, decodeV1: true, noQKRope: true})
			fusedOld := mk(tuning{decodeV1: true})
			nw := mk(tuning{skinnyMax: skMaxN, fuseCombine: true}) // every new kernel
			sep := mk(tuning{skinnyMax: skMaxN, noTC: true})
			pdl := mk(tuning{skinnyMax: skMaxN, fuseCombine: true, pdl: true})
			w8 := mk(tuning{decode2W8: true})
			tc := mk(tuning{}) // the defaults: attn_decode_tc where it suits the shape
			comb := mk(tuning{decodeV1: true, combWo: true})
			if comb.fn.g2Comb == nil || tc.fn.g2Comb != nil {
				t.Fatalf("gemv2_comb loaded %v with tuning combWo, %v without", comb.fn.g2Comb != nil, tc.fn.g2Comb != nil)
			}
			qkn := mk(tuning{decodeV1: true, qknFold: true})
			if (qkn.fn.g2QKN != nil) != m.Config.Spec.Attention.QKNorm || tc.fn.g2QKN != nil {
				t.Fatalf("gemv2_qkn loaded %v with tuning qknFold (q/k norm %v), %v without", qkn.fn.g2QKN != nil,
					m.Config.Spec.Attention.QKNorm, tc.fn.g2QKN != nil)
			}
			if m.Config.HeadDim == 128 && tc.fn.attnTC == nil {
				t.Errorf("attn_decode_tc not loaded")
			}
			if fusedOld.fn.g2QKV == nil || nw.fn.g2QKV == nil {
				t.Fatalf("fused decode kernels not loaded (v2: %v)", nw.fn.v2Err)
			}
			if m.Config.Spec.Attention.QKNorm && (fusedOld.bk.qkNormRope == nil || nw.bk.qkNormRope == nil) {
				t.Fatal("qk_norm_rope not loaded")
			}
			if old.fn.g2QKV != nil || old.fn.attnDecode == nil || old.fn.attnDecode2 != nil || old.fn.skPlain != nil ||
				old.bk.qkNormRope != nil {
				t.Fatal("the old-kernels backend loaded new kernels")
			}
			if nw.fn.attnDecode2 == nil || nw.fn.skPlain == nil || nw.fn.attnCnt == 0 || sep.fn.attnCnt != 0 {
				t.Fatalf("attn_decode2 %v (merging %v), gemm_sk %v: not loaded as asked", nw.fn.attnDecode2 != nil,
					nw.fn.attnCnt != 0, nw.fn.skPlain != nil)
			}
			if !pdl.fn.pdl {
				t.Logf("programmatic dependent launch not available: not compared")
			}
			hasW8 := w8.fn.d2Threads == 256
			if m.Config.Heads/m.Config.KVHeads <= 4 && !hasW8 {
				t.Errorf("attn_decode2_w8 not loaded")
			}
			bs := []*Backend{old, fusedOld, nw, sep, pdl, w8, tc, comb, qkn}
			r := newRand(uint64(len(sh.name)))
			base := 0
			for _, n := range groups {
				prompts := make([][]int32, n)
				for i := range prompts {
					prompts[i] = randPrompt(r, 5+37*i%140, V)
				}
				res := lockstep(t, bs, prompts, base, per, steps)
				base += n
				exact := func(what string, a, b int) {
					if d, _, am := compareSteps(res[a], res[b]); d != 0 || am != 0 {
						t.Errorf("batch %d: %s: max abs diff %g, %d greedy tokens differ (want bit for bit)", n, what, d, am)
					}
				}
				exact("fused GEMVs vs separate kernels", 0, 1)
				exact("wo merging one query's splits (gemv2_comb) vs attn_combine", 0, 7)
				exact("the QKV GEMV running qk_norm_rope's work (gemv2_qkn) vs qk_norm_rope", 0, 8)
				exact("attn_decode2 merging its splits vs attn_combine", 2, 3)
				if pdl.fn.pdl {
					exact("programmatic launches vs plain ones", 2, 4)
				}
				for _, k := range []int{2, 5, 6} {
					what := fmt.Sprintf("%d-thread attn_decode2", bs[k].fn.d2Threads)
					if k == 6 {
						what = fmt.Sprintf("defaults, tensor-core decode attention %v", tc.fn.attnTC != nil)
					}
					d, rel, am := compareSteps(res[0], res[k])
					t.Logf("batch %d: new kernels (%s) vs old: max abs diff %.3g, rel %.3g, %d greedy tokens differ", n, what, d, rel, am)
					if !(rel <= 2e-2) {
						t.Errorf("batch %d: new kernels (%s) vs old: relative error %g > 2e-2", n, what, rel)
					}
				}
			}
			for _, b := range []*Backend{nw, pdl} {
				// Batches of one bucket (3 and 4) share a capture.
				if st := b.GraphStats(); st.Captures == 0 || st.Replays == 0 {
					t.Errorf("pdl %v: decode graphs not captured: %+v", b.fn.pdl, st)
				}
			}
		})
	}
}

func TestResidentBlocks(t *testing.T) {
	for _, c := range []struct{ threads, regs, smem, perSM, want int }{
		{256, 64, 0, 233472, 4},          // 64 regs: 16K per block
		{256, 70, 0, 233472, 3},          // 70 regs round to 72
		{256, 72, 32 << 10, 233472, 3},   // 72 regs: 18K per block
		{256, 32, 100 << 10, 233472, 2},  // shared memory bound
		{128, 128, 16640, 233472, 4},     // attn_decode2
		{256, 255, 200 << 10, 233472, 1}, // never 0
	} {
		if got := residentBlocks(c.threads, c.regs, c.smem, c.perSM); got != c.want {
			t.Errorf("residentBlocks(%d, %d, %d, %d) = %d, want %d", c.threads, c.regs, c.smem, c.perSM, got, c.want)
		}
	}
	if got := rmsVT(4096); got != 256 {
		t.Errorf("rmsVT(4096) = %d, want 256", got)
	}
	if got := rmsVT(8192); got != 256 {
		t.Errorf("rmsVT(8192) = %d, want 256 (capped at the block)", got)
	}
	if got := rmsVT(64); got != 32 {
		t.Errorf("rmsVT(64) = %d, want 32", got)
	}
}

// TestFusedMoE checks the fused decode layer of the MoE models (bfloat16:
// gemv2_norm for the QKV projection and for the router, whose block 0 also
// writes the experts' normalised x; tiny-qwen3-moe's qk_norm_rope;
// moe_gemv_down_add for passes of at most moeAddPairs pairs; tiny-qwen2-moe
// with its gated shared expert, tiny-mixtral with top 2), and the same with
// tunings routeSiLU, combWo and qknFold (one token's routing inside
// moe_route_silu1, wo merging the attention's splits in gemv2_comb, the QKV
// GEMV running qk_norm_rope's work in gemv2_qkn), against the separate
// kernels (rmsnorm, gemv_*, qk_norm, rope_kv, moe_route, moe_gemv_silu1,
// attn_combine, moe_gemv_down, moe_combine): logits bit for bit over prefill and decode at batch sizes 1
// to 4 and 6 (past the fused layer: qk_norm_rope against qk_norm + rope_kv
// alone).
func TestFusedMoE(t *testing.T) {
	for _, shape := range []string{"tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"} {
		t.Run(shape, func(t *testing.T) {
			m, err := model.NewRandom(shape, 17)
			if err != nil {
				t.Fatal(err)
			}
			V := m.Config.Vocab
			groups := []int{1, 2, 3, 4, 6}
			const per, steps = 12, 6
			mk := bf16Maker(t, m, groups, per)
			old := mk(tuning{noFused: true, decodeV1: true, noQKRope: true, noMoEAdd: true})
			fused := mk(tuning{decodeV1: true})
			// one token's routing in moe_route_silu1, wo merging its splits
			opt := mk(tuning{decodeV1: true, routeSiLU: true, combWo: true, qknFold: true})
			if opt.bk.routeSiLU1 == nil || opt.fn.g2Comb == nil || fused.bk.routeSiLU1 != nil || fused.fn.g2Comb != nil ||
				(opt.fn.g2QKN != nil) != m.Config.Spec.Attention.QKNorm {
				t.Fatalf("moe_route_silu1 %v, gemv2_comb %v, gemv2_qkn %v with their tunings; %v, %v without",
					opt.bk.routeSiLU1 != nil, opt.fn.g2Comb != nil, opt.fn.g2QKN != nil, fused.bk.routeSiLU1 != nil,
					fused.fn.g2Comb != nil)
			}
			if fused.fn.g2Norm == nil || fused.bk.gemvDownAdd == nil || !fused.moeCapturable() ||
				m.Config.Spec.Attention.QKNorm && fused.bk.qkNormRope == nil {
				t.Fatalf("fused kernels not loaded (v2: %v), qk_norm_rope %v, moe_gemv_down_add %v, grouped experts %v",
					fused.fn.v2Err, fused.bk.qkNormRope != nil, fused.bk.gemvDownAdd != nil, fused.moeCapturable())
			}
			if old.fn.g2QKV != nil || old.bk.qkNormRope != nil || old.bk.gemvDownAdd != nil || old.bk.routeSiLU1 != nil {
				t.Fatal("the old-kernels backend loaded new kernels")
			}
			r := newRand(29)
			base := 0
			for _, n := range groups {
				prompts := make([][]int32, n)
				for i := range prompts {
					prompts[i] = randPrompt(r, 3+13*i%40, V) // 3 tokens: a prefill through the fused layer
				}
				res := lockstep(t, []*Backend{old, fused, opt}, prompts, base, per, steps)
				base += n
				if d, _, am := compareSteps(res[0], res[1]); d != 0 || am != 0 {
					t.Errorf("batch %d: fused vs separate kernels: max abs diff %g, %d greedy tokens differ (want bit for bit)", n, d, am)
				}
				if d, _, am := compareSteps(res[0], res[2]); d != 0 || am != 0 {
					t.Errorf("batch %d: moe_route_silu1, gemv2_comb and gemv2_qkn vs separate kernels: max abs diff %g, %d greedy tokens differ (want bit for bit)",
						n, d, am)
				}
			}
		})
	}
}

// bf16Maker makes bf16 backends of m with a tuning, each with per pages of
// 16 positions for every sequence of the batch groups.
func bf16Maker(t *testing.T, m *model.Model, groups []int, per int) func(tuning) *Backend {
	total := 0
	for _, g := range groups {
		total += g
	}
	return func(tu tuning) *Backend {
		return newOrSkip(t, m, Options{DType: "bfloat16", PageSize: 16, Pages: total * per, tune: tu})
	}
}
