package cpu

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestReference checks stories260K against llama2.c's outputs, through the
// llama2.c file and through the converted HF directory.
func TestReference(t *testing.T) {
	bin := stories260K(t)
	cases := refCases(t)
	l2c, err := model.LoadLlama2C(bin)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := model.ConvertLlama2CToHF(bin, dir, nil, nil); err != nil {
		t.Fatal(err)
	}
	hf, err := model.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if hf.Config.Spec.Attention.Rope != model.RopeHalf || l2c.Config.Spec.Attention.Rope != model.RopeInterleaved {
		t.Fatalf("rope conventions: llama2.c %v, hf %v", l2c.Config.Spec.Attention.Rope, hf.Config.Spec.Attention.Rope)
	}
	first := map[string][][]float32{}
	for _, tc := range []struct {
		name string
		m    *model.Model
	}{{"llama2c", l2c}, {"hf", hf}} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackend(t, tc.m, 16, 8, 1)
			worst := 0.0
			for _, c := range cases {
				steps := len(c.GreedyNextIDs) - 1
				logits := greedy(t, b, c.PromptIDs, pagesFor(0, 8), 0, steps)
				first[tc.name] = append(first[tc.name], logits[0])
				d := maxAbsDiff(logits[0], c.LastPromptLogits)
				worst = max(worst, d)
				if d > 1e-4 {
					t.Errorf("%q: last prompt logits differ by %g", c.Prompt, d)
				}
				for i, want := range c.GreedyNextIDs {
					if got := argmax(logits[i]); got != want {
						t.Errorf("%q: token %d is %d, want %d", c.Prompt, i, got, want)
						break
					}
				}
			}
			t.Logf("max abs diff from llama2.c's last prompt logits: %g", worst)
		})
	}
	for i := range first["hf"] {
		if d := maxAbsDiff(first["llama2c"][i], first["hf"][i]); d > 1e-4 {
			t.Errorf("case %d: llama2.c and converted HF logits differ by %g", i, d)
		}
	}
}

// TestReferenceGeneric runs the reference and determinism checks with the
// pure-Go kernels.
func TestReferenceGeneric(t *testing.T) {
	if !hasAVX2 {
		t.Skip("already using the Go kernels")
	}
	hasAVX2 = false
	defer func() { hasAVX2 = true }()
	TestReference(t)
	TestDeterminismStories260K(t)
}

func maxAbsDiff(a, b []float32) float64 { return computetest.MaxAbsDiff(a, b) }
