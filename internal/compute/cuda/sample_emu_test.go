package cuda

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// tiedLogits has few distinct values (many ties, in and across blocks of
// 256 and windows), some -Inf, and a wide range (as sampling's rule tests).
func tiedLogits(rng *rand.Rand, V int) []float32 {
	l := make([]float32, V)
	levels := 2 + rng.IntN(30)
	scale := []float32{0.05, 0.5, 2, 8}[rng.IntN(4)]
	for i := range l {
		l[i] = float32(rng.IntN(levels)) * scale
		if rng.IntN(50) == 0 {
			l[i] = float32(math.Inf(-1))
		}
	}
	return l
}

// smoothLogits are distinct normal logits (a peaked, LLM-like row).
func smoothLogits(rng *rand.Rand, V int) []float32 {
	l := make([]float32, V)
	for i := range l {
		l[i] = float32(rng.NormFloat64() * 3)
	}
	return l
}

// sampleModes are every combination of the filters, plain and with
// penalties and bias (sampling's ruleModes and more), with the logprobs
// asked for on some.
func sampleModes(V int) []sampling.Params {
	var out []sampling.Params
	for _, k := range []int{0, 1, 3, 40, 300, 2000} {
		for _, p := range []float64{0, 0.3, 0.9, 1 - 1e-12} {
			for _, mp := range []float64{0, 0.05, 0.6} {
				for _, temp := range []float64{0, 0.7, 1.3} {
					out = append(out, sampling.Params{Temperature: temp, TopK: k, TopP: p, MinP: mp})
				}
			}
		}
	}
	bias := map[int]float64{0: 5, 3: -100, 7 % V: 2.5, (V - 1): 1}
	out = append(out,
		sampling.Params{Temperature: 1, FrequencyPenalty: 0.7, PresencePenalty: -0.3, RepetitionPenalty: 1.3},
		sampling.Params{Temperature: 0.9, TopP: 0.8, RepetitionPenalty: 0.8, LogitBias: bias},
		sampling.Params{Temperature: 2, TopK: 20, MinP: 0.01, LogitBias: map[int]float64{1 % V: 100}},
		sampling.Params{LogitBias: map[int]float64{2 % V: 3.25}, FrequencyPenalty: 1},
		sampling.Params{RepetitionPenalty: 1.7},
		sampling.Params{Temperature: 1.1, TopK: 60, TopP: 0.95, FrequencyPenalty: -1.5, PresencePenalty: 2},
	)
	return out
}

// emuRow is one row of an emulated run: a request, its prompt and the
// tokens it is handed before each step.
type emuRow struct {
	p      sampling.Params
	seed   uint64
	prompt []int32
	accept [][]int32 // per step
	lp     bool
	top    int
}

// emuBuild compiles testdata/sample_emu.cpp with the kernels.
func emuBuild(t *testing.T) string {
	t.Helper()
	src, _ := filepath.Abs("../../../csrc/llama/sample.cu")
	return emuCompile(t, "sample_emu", "-DWIN=512", `-DSAMPLE_CU="`+src+`"`)
}

// emuRun runs the kernels over rows for steps steps of logits (logits[s][r])
// and returns each step's results as the backend parses them.
func emuRun(t *testing.T, bin string, V int, rows []emuRow, logits [][][]float32) [][]compute.Sampled {
	t.Helper()
	var in bytes.Buffer
	w := func(v ...any) {
		for _, x := range v {
			if err := binary.Write(&in, binary.LittleEndian, x); err != nil {
				t.Fatal(err)
			}
		}
	}
	steps := len(logits)
	w(int32(V), int32(len(rows)), int32(steps))
	states := make([]*samplerState, len(rows))
	for r, row := range rows {
		st := &samplerState{p: row.p, seed: row.seed, nbias: len(row.p.LogitBias)}
		has := len(row.p.LogitBias) > 0 || penalised(&row.p) || repeats(&row.p)
		if has {
			st.slot = 1 // any address: the harness puts the row's own
		}
		states[r] = st
		var prompt []int32
		if has && repeats(&row.p) {
			prompt = row.prompt
		}
		ids := slices.Sorted(func(yield func(int) bool) {
			for id := range row.p.LogitBias {
				if !yield(id) {
					return
				}
			}
		})
		w(int32(b2i(has)), int32(len(prompt)), prompt, int32(len(ids)))
		for _, id := range ids {
			w(int32(id))
		}
		for _, id := range ids {
			w(float32(row.p.LogitBias[id]))
		}
	}
	jobs := make([]*sampleJob, steps)
	for s := range steps {
		j := &sampleJob{states: states}
		for r, row := range rows {
			j.reqs = append(j.reqs, compute.Sample{State: states[r], Step: uint64(s), Accept: row.accept[s], Logprob: row.lp,
				TopLogprobs: row.top})
			j.seqIdx = append(j.seqIdx, r)
		}
		jobs[s] = j
		img := make([]byte, len(rows)*sampleRowBytes)
		sampleParams(img, j, len(rows), V, 0)
		in.Write(img)
		for r := range rows {
			w(logits[s][r])
		}
		var na int32
		for _, row := range rows {
			na += int32(len(row.accept[s]))
		}
		w(na)
		for r, row := range rows {
			for _, tok := range row.accept[s] {
				w(int32(r), tok)
			}
		}
	}
	dir := t.TempDir()
	inPath, outPath := filepath.Join(dir, "in"), filepath.Join(dir, "out")
	if err := os.WriteFile(inPath, in.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	if out, err := exec.Command(bin, inPath, outPath).CombinedOutput(); err != nil {
		t.Fatalf("kernel emulation: %v\n%s", err, out)
	}
	t.Logf("emulated %d rows x %d steps of V %d in %v", len(rows), steps, V, time.Since(t0))
	raw, err := os.ReadFile(outPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(raw) != steps*len(rows)*sampleOutBytes {
		t.Fatalf("emulation wrote %d bytes, want %d", len(raw), steps*len(rows)*sampleOutBytes)
	}
	res := make([][]compute.Sampled, steps)
	for s := range steps {
		res[s] = make([]compute.Sampled, len(rows))
		if err := jobs[s].results(raw[s*len(rows)*sampleOutBytes:], V, res[s]); err != nil {
			t.Fatalf("step %d: %v", s, err)
		}
	}
	return res
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// checkSampled compares a device result with the host sampler's for the
// same row: the token exactly, the logprobs within float32 rounding, the
// top ids exactly.
func checkSampled(t *testing.T, what string, got compute.Sampled, want int, logits []float32, lp bool, top int) {
	t.Helper()
	if got.Token != want {
		t.Fatalf("%s: token %d, the host sampler %d", what, got.Token, want)
	}
	if !lp && top == 0 {
		return
	}
	wlp, wtop := sampling.Logprobs(logits, want, top)
	close := func(a, b float32) bool {
		return a == b || math.Abs(float64(a-b)) <= 1e-6+2e-7*math.Abs(float64(b))
	}
	if lp && !close(got.Logprob, wlp) {
		t.Fatalf("%s: logprob %v, the host %v", what, got.Logprob, wlp)
	}
	if !lp && got.Logprob != 0 {
		t.Fatalf("%s: logprob %v not asked for", what, got.Logprob)
	}
	if len(got.Top) != len(wtop) {
		t.Fatalf("%s: %d top logprobs, the host %d", what, len(got.Top), len(wtop))
	}
	for k := range wtop {
		if got.Top[k].Token != wtop[k].Token || !close(got.Top[k].Logprob, wtop[k].Logprob) {
			t.Fatalf("%s: top %d is %+v, the host %+v", what, k, got.Top[k], wtop[k])
		}
	}
}

// TestSampleKernelsEmulated runs sample.cu's kernels on the host (their
// block sizes; windows of 512 so that rows span many windows) for every
// sampling mode over tied and smooth logits, with penalties, bias and
// tokens handed in, over three steps (the kernels count their own tokens),
// and checks every token against internal/sampling and the logprobs
// against sampling.Logprobs. It needs a C++20 compiler, not a GPU.
func TestSampleKernelsEmulated(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the kernel emulation")
	}
	bin := emuBuild(t)
	rng := rand.New(rand.NewPCG(9, 9))
	for _, V := range []int{7, 300, 1300, 5000} {
		modes := sampleModes(V)
		var rows []emuRow
		for i, p := range modes {
			if i%3 != V%3 && i < len(modes)-6 {
				continue // a third of the filter grid (another third for each V), every penalty mode
			}
			row := emuRow{p: p, seed: rng.Uint64(), lp: i%4 == 1, top: []int{0, 0, 3, 20}[i%4]}
			row.prompt = []int32{int32(rng.IntN(V)), int32(rng.IntN(V)), int32(rng.IntN(V))}
			for s := range 3 {
				var a []int32
				for range []int{3, 0, 1}[s] {
					a = append(a, int32(rng.IntN(V)))
				}
				row.accept = append(row.accept, a)
			}
			rows = append(rows, row)
		}
		logits := make([][][]float32, 3)
		for s := range logits {
			for r := range rows {
				l := tiedLogits(rng, V)
				if r%3 == 2 {
					l = smoothLogits(rng, V)
				}
				logits[s] = append(logits[s], l)
			}
		}
		if V == 7 {
			rows, logits = emuEdges(rng, rows, logits)
		}
		got := emuRun(t, bin, V, rows, logits)
		for r, row := range rows {
			cpu := sampling.New(row.p, row.seed)
			cpu.SetPrompt(row.prompt)
			for s := range logits {
				for _, a := range row.accept[s] {
					cpu.Accept(int(a))
				}
				want := cpu.Sample(uint64(s), logits[s][r])
				cpu.Accept(want)
				checkSampled(t, fmt.Sprintf("V %d row %d step %d %+v", V, r, s, row.p), got[s][r], want,
					logits[s][r], row.lp, min(row.top, V))
			}
		}
	}
}

// emuEdges adds rows of V 7 where the rule's comparisons meet equality:
// flat rows under top_p 3/7 (C(2) = 3 equals p*S: the fourth candidate
// stays) and min_p 1 (every weight is 1), many seeds; a NaN row, an
// all -Inf row and a +Inf row.
func emuEdges(rng *rand.Rand, rows []emuRow, logits [][][]float32) ([]emuRow, [][][]float32) {
	const V = 7
	add := func(p sampling.Params, l []float32) {
		rows = append(rows, emuRow{p: p, seed: rng.Uint64(), accept: make([][]int32, len(logits))})
		for s := range logits {
			logits[s] = append(logits[s], l)
		}
	}
	flat := make([]float32, V)
	for range 16 {
		add(sampling.Params{Temperature: 1, TopP: 3.0 / 7}, flat)
		add(sampling.Params{Temperature: 1, MinP: 1}, flat)
		add(sampling.Params{Temperature: 1, TopK: 5, MinP: 1}, flat)
	}
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	add(sampling.Params{Temperature: 1}, []float32{1, 2, nan, 5, 5, 0, 1})
	add(sampling.Params{Temperature: 1, TopP: 0.5}, []float32{-inf, -inf, -inf, -inf, -inf, -inf, -inf})
	add(sampling.Params{Temperature: 1, TopK: 3}, []float32{1, inf, 2, inf, 0, 0, 0})
	add(sampling.Params{}, []float32{nan, nan, nan, nan, nan, nan, nan})
	return rows, logits
}
