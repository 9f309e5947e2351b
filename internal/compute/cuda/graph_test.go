package cuda

import (
	"context"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// lockstep prefills each prompt alone on every backend, then runs steps
// decode steps of all seqs at once (seq i on pages base+i*per...), feeding
// every backend the argmax of the first backend's logits. It returns
// logits[backend][step][seq]; step 0 is the prompt's.
func lockstep(t *testing.T, bs []*Backend, prompts [][]int32, base, per, steps int) [][][][]float32 {
	t.Helper()
	ctx := context.Background()
	V := bs[0].Config().Vocab
	res := make([][][][]float32, len(bs))
	for k, b := range bs {
		res[k] = append(res[k], make([][]float32, len(prompts)))
		for i, p := range prompts {
			out := [][]float32{make([]float32, V)}
			if err := b.Forward(ctx, []compute.Seq{{Tokens: p, Pages: pagesFor(base+i, per), Logits: true}}, out); err != nil {
				t.Fatal(err)
			}
			res[k][0][i] = out[0]
		}
	}
	for s := 1; s <= steps; s++ {
		seqs := make([]compute.Seq, len(prompts))
		for i, p := range prompts {
			seqs[i] = compute.Seq{Tokens: []int32{argmax(res[0][s-1][i])}, Pos: len(p) + s - 1, Pages: pagesFor(base+i, per), Logits: true}
		}
		for k, b := range bs {
			out := make([][]float32, len(prompts))
			for i := range out {
				out[i] = make([]float32, V)
			}
			if err := b.Forward(ctx, seqs, out); err != nil {
				t.Fatalf("step %d: %v", s, err)
			}
			res[k] = append(res[k], out)
		}
	}
	return res
}

// compareSteps reports the largest abs difference and the greedy tokens
// that differ between two lockstep results.
func compareSteps(a, b [][][]float32) (worst float64, rel float64, argmaxDiffs int) {
	for s := range a {
		for i := range a[s] {
			worst = max(worst, maxAbsDiff(a[s][i], b[s][i]))
			rel = max(rel, relErr(a[s][i], b[s][i]))
			if argmax(a[s][i]) != argmax(b[s][i]) {
				argmaxDiffs++
			}
		}
	}
	return worst, rel, argmaxDiffs
}

// graphTestModel: the tiny llama3 shape (head dim 32, GQA 4, 8K context).
func graphTestModel(t *testing.T) *model.Model {
	m, err := model.NewRandom("tiny-llama3", 13)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// TestGraphEqualsEager: decode steps replayed from CUDA graphs give the
// logits of eager passes bit for bit: in float32 with the batch-invariant
// GEMMs against plain eager passes (unpadded); with cuBLAS (float32 and
// bfloat16) against eager passes of the same padded shape, and near the
// unpadded ones. Batch sizes 1, 3, 5, 8, 13 (buckets 1, 4, 8, 8, 16: 0 to 3
// padding rows), 12 steps whose contexts cross split buckets (16 keys per
// split here), and one seq over 200 steps through 6 split buckets (more
// than a bucket keeps graphs for: the exec-update path).
func TestGraphEqualsEager(t *testing.T) {
	m := graphTestModel(t)
	V := m.Config.Vocab
	r := newRand(21)
	groups := []int{1, 3, 5, 8, 13}
	const per, steps = 8, 12 // pages of 16: 128 positions per seq
	total := 0
	for _, g := range groups {
		total += g
	}
	tu := tuning{split: 16}
	for _, tc := range []struct {
		name  string
		o     Options
		exact int // backend that must equal the graph one bit for bit
	}{
		{"float32-invariant", Options{DType: "float32", BatchInvariant: true}, graphsOff},
		{"float32-cublas", Options{DType: "float32"}, graphsPadded},
		{"bfloat16-cublas", Options{DType: "bfloat16"}, graphsPadded},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.o.PageSize, tc.o.Pages, tc.o.tune = 16, total*per+16, tu
			gb := newOrSkip(t, m, tc.o)
			padded := newOrSkip(t, m, tc.o)
			padded.setGraphMode(graphsPadded)
			off := newOrSkip(t, m, tc.o)
			off.setGraphMode(graphsOff)
			exact, near := padded, off
			if tc.exact == graphsOff {
				exact, near = off, padded
			}
			base := 0
			for _, n := range groups {
				prompts := make([][]int32, n)
				for i := range prompts {
					prompts[i] = randPrompt(r, 27+9*i%70, V)
				}
				res := lockstep(t, []*Backend{gb, exact, near}, prompts, base, per, steps)
				base += n
				d, _, am := compareSteps(res[0], res[1])
				if d != 0 || am != 0 {
					t.Errorf("batch %d: graph vs exact eager: max abs diff %g, %d greedy tokens differ", n, d, am)
				}
				d, rel, am := compareSteps(res[0], res[2])
				t.Logf("batch %d: graph vs the other eager: max abs diff %.3g, rel %.3g, %d greedy tokens differ", n, d, rel, am)
				tol := 1e-4
				if tc.o.DType == "bfloat16" {
					tol = 3e-2
				}
				if !(rel <= tol) {
					t.Errorf("batch %d: graph vs the other eager: relative error %g > %g", n, rel, tol)
				}
				// Greedy tokens with graphs equal those without (float32;
				// bf16 roundings may part near-ties).
				if tc.o.DType == "float32" && am != 0 {
					t.Errorf("batch %d: %d greedy tokens differ from the other eager", n, am)
				}
			}
			st := gb.GraphStats()
			t.Logf("graphs: %+v", st)
			if st.Captures < len(groups) || st.Replays < len(groups)*(steps/2) {
				t.Errorf("graphs barely used: %+v", st)
			}
			if ps := padded.GraphStats(); ps.Captures != 0 || ps.Replays != 0 {
				t.Errorf("padded-eager backend used graphs: %+v", ps)
			}
			if tc.exact != graphsOff {
				return
			}
			// One seq through 6 split buckets (1, 2, 4, 8, 10, 12).
			res := lockstep(t, []*Backend{gb, exact}, [][]int32{randPrompt(r, 3, V)}, 0, 16, 185)
			if d, _, am := compareSteps(res[0], res[1]); d != 0 || am != 0 {
				t.Errorf("long run: graph vs eager: max abs diff %g, %d greedy tokens differ", d, am)
			}
			st2 := gb.GraphStats()
			t.Logf("long run: %+v", st2)
			// Split buckets 2 and 4 of batch 1 may be left from the first
			// group; 1, 8, 10 and 12 are new, the last two on a full bucket.
			if st2.Captures-st.Captures < 4 {
				t.Errorf("long run captured %d graphs, want at least 4", st2.Captures-st.Captures)
			}
			if n := len(gb.graphs.slots[1]); n != graphsPerBucket {
				t.Errorf("bucket 1 keeps %d graphs, want %d", n, graphsPerBucket)
			}
		})
	}
}

// TestGraphCaptureFailure: a broken capture leaves the shape eager with a
// warning; the step and the later ones still give the right logits.
func TestGraphCaptureFailure(t *testing.T) {
	m := graphTestModel(t)
	core, logs := observer.New(zap.WarnLevel)
	o := Options{DType: "float32", BatchInvariant: true, PageSize: 16, Pages: 64, Logger: zap.New(core)}
	gb := newOrSkip(t, m, o)
	gb.graphs.breakCapture = true
	o.Logger = nil
	off := newOrSkip(t, m, o)
	off.setGraphMode(graphsOff)
	r := newRand(5)
	prompts := [][]int32{randPrompt(r, 20, m.Config.Vocab), randPrompt(r, 9, m.Config.Vocab)}
	res := lockstep(t, []*Backend{gb, off}, prompts, 0, 8, 5)
	if d, _, am := compareSteps(res[0], res[1]); d != 0 || am != 0 {
		t.Errorf("after failed captures: max abs diff %g, %d greedy tokens differ", d, am)
	}
	st := gb.GraphStats()
	if st.Captures != 0 || st.Replays != 0 || st.Eager != 5 {
		t.Errorf("stats %+v: want 5 eager decode passes, no graph", st)
	}
	if n := logs.FilterMessage("CUDA graph capture failed; this decode shape stays eager").Len(); n != 1 {
		t.Errorf("%d capture warnings, want 1 (the shape is not retried)", n)
	}
}

// TestStepTimes: with TimeSteps the backend sums pass times and the gaps
// between passes.
func TestStepTimes(t *testing.T) {
	m := graphTestModel(t)
	b := newOrSkip(t, m, Options{DType: "float32", PageSize: 16, Pages: 16, TimeSteps: true})
	r := newRand(6)
	lockstep(t, []*Backend{b}, [][]int32{randPrompt(r, 10, m.Config.Vocab)}, 0, 8, 6)
	st := b.StepTimes()
	t.Logf("step times: %+v, mean gap %v", st, st.GapMean())
	if st.Passes != 7 || st.Gaps != 6 || st.Busy <= 0 || st.GapMin < 0 || st.GapMax < st.GapMin || st.GapMean() != st.GapSum/6 {
		t.Errorf("step times %+v", st)
	}
	b.ResetStepTimes()
	if st := b.StepTimes(); st.Passes != 0 || st.Gaps != 0 {
		t.Errorf("after reset: %+v", st)
	}
}

// TestGraphMoE: MoE models' decode steps run captured (the routing and the
// grouped expert GEMMs on the device; moe_gemv at batches 1..8, moe_sk in
// bf16 above): replay equals eager passes of the same padded shape bit for
// bit and stays near packed eager passes; a long prompt in one pass (one
// GEMM per expert after the host reads the offsets) matches the same
// prompt in chunks of 25 (the grouped GEMMs, split-K in bf16).
func TestGraphMoE(t *testing.T) {
	for _, tc := range []struct{ name, dtype string }{{"tiny-qwen3-moe", "bfloat16"}, {"tiny-qwen2-moe", "bfloat16"},
		{"tiny-qwen3-moe", "float32"}} {
		name := tc.name
		t.Run(name+"-"+tc.dtype, func(t *testing.T) {
			m, err := model.NewRandom(name, 17)
			if err != nil {
				t.Fatal(err)
			}
			V := m.Config.Vocab
			r := newRand(23)
			o := Options{DType: tc.dtype, PageSize: 16, Pages: 224, tune: tuning{split: 16}}
			gb := newOrSkip(t, m, o)
			if !gb.moeCapturable() || gb.graphs == nil {
				t.Fatalf("%s: no grouped expert GEMMs or no graphs (v2 build error: %v)", name, gb.fn.v2Err)
			}
			padded := newOrSkip(t, m, o)
			padded.setGraphMode(graphsPadded)
			off := newOrSkip(t, m, o)
			off.setGraphMode(graphsOff)
			base := 0
			for _, n := range []int{1, 3, 8, 13} {
				prompts := make([][]int32, n)
				for i := range prompts {
					prompts[i] = randPrompt(r, 11+7*i, V)
				}
				res := lockstep(t, []*Backend{gb, padded, off}, prompts, base, 8, 6)
				base += n
				if d, _, am := compareSteps(res[0], res[1]); d != 0 || am != 0 {
					t.Errorf("batch %d: graph vs padded eager: max abs diff %g, %d greedy tokens differ", n, d, am)
				}
				d, rel, am := compareSteps(res[0], res[2])
				t.Logf("batch %d: graph vs packed eager: max abs diff %.3g, rel %.3g, %d greedy tokens differ", n, d, rel, am)
				if !(rel <= 3e-2) {
					t.Errorf("batch %d: graph vs packed eager: relative error %g > 3e-2", n, rel)
				}
			}
			if st := gb.GraphStats(); st.Captures < 4 || st.Replays < 12 {
				t.Errorf("graphs barely used: %+v", st)
			}
			// 400 tokens: above the grouped bound for both shapes in one
			// pass, under it in chunks of 25.
			c := &m.Config
			long := randPrompt(r, 400, V)
			if !gb.moeGroupedFor(25) || gb.moeGroupedFor(len(long)) {
				t.Fatalf("grouped bound: 25 tokens %v, %d tokens %v (experts %d, top %d)", gb.moeGroupedFor(25), len(long),
					gb.moeGroupedFor(len(long)), c.Experts, c.TopK)
			}
			pages := pagesFor(0, 26) // the decode seqs are done with them
			whole := [][]float32{make([]float32, V)}
			if err := off.Forward(context.Background(), []compute.Seq{{Tokens: long, Pages: pages, Logits: true}}, whole); err != nil {
				t.Fatal(err)
			}
			chunked := [][]float32{make([]float32, V)}
			for p := 0; p < len(long); p += 25 {
				seq := compute.Seq{Tokens: long[p : p+25], Pos: p, Pages: pages, Logits: p+25 == len(long)}
				if err := off.Forward(context.Background(), []compute.Seq{seq}, chunked); err != nil {
					t.Fatal(err)
				}
			}
			rel := relErr(whole[0], chunked[0])
			t.Logf("400-token prompt, one pass vs chunks of 25: rel %.3g, argmax %d vs %d", rel, argmax(whole[0]), argmax(chunked[0]))
			if !(rel <= 3e-2) {
				t.Errorf("one pass vs chunks: relative error %g > 3e-2", rel)
			}
		})
	}
}

// TestSlidingWindowDecode: models with a sliding window (tiny-mistral; and
// tiny-mixtral, with experts) run prefill and captured decode steps on the
// split-K kernels, windows spanning partial splits (16 keys each here):
// replay equals padded eager bit for bit, and the logits differ from the
// same weights with full attention once the context passes the window.
func TestSlidingWindowDecode(t *testing.T) {
	for _, name := range []string{"tiny-mistral", "tiny-mixtral"} {
		t.Run(name, func(t *testing.T) {
			m, err := model.NewRandom(name, 5)
			if err != nil {
				t.Fatal(err)
			}
			if m.Config.SlidingWindow == 0 {
				t.Fatalf("%s has no sliding window", name)
			}
			o := Options{DType: "bfloat16", PageSize: 16, Pages: 64, tune: tuning{split: 16}}
			gb := newOrSkip(t, m, o)
			if gb.graphs == nil || gb.fn.attnDecode2 != nil || gb.flash {
				t.Fatalf("graphs %v, attn_decode2 %v, flash %v: want graphs on the split-K kernels", gb.graphs != nil,
					gb.fn.attnDecode2 != nil, gb.flash)
			}
			padded := newOrSkip(t, m, o)
			padded.setGraphMode(graphsPadded)
			fm := *m
			fm.Config.SlidingWindow = 0
			full := newOrSkip(t, &fm, o)
			r := newRand(9)
			prompts := [][]int32{randPrompt(r, 41, m.Config.Vocab), randPrompt(r, 60, m.Config.Vocab)}
			res := lockstep(t, []*Backend{gb, padded, full}, prompts, 0, 8, 30)
			if d, _, am := compareSteps(res[0], res[1]); d != 0 || am != 0 {
				t.Errorf("graph vs padded eager: max abs diff %g, %d greedy tokens differ", d, am)
			}
			_, rel, _ := compareSteps(res[0], res[2])
			t.Logf("window %d vs full attention: rel %.3g", m.Config.SlidingWindow, rel)
			if !(rel > 1e-2) {
				t.Errorf("window %d: logits within %g of full attention's at contexts past the window", m.Config.SlidingWindow, rel)
			}
			if st := gb.GraphStats(); st.Replays < 20 {
				t.Errorf("graphs barely used: %+v", st)
			}
		})
	}
}
