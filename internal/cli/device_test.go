package cli

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestCUDARuns: --device cuda (and auto) takes every tiny architecture
// but those with a sliding window, which the CUDA backend lacks.
func TestCUDARuns(t *testing.T) {
	for shape, arch := range model.TinyShapes() {
		c, err := model.RandomConfig(shape)
		if err != nil {
			t.Fatal(err)
		}
		want := c.SlidingWindow == 0
		if got := cudaRuns(c); got != want {
			t.Errorf("%s (%s, sliding window %d): cudaRuns %v, want %v", shape, arch, c.SlidingWindow, got, want)
		}
	}
	for _, arch := range []string{"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"} {
		if c := (model.Config{Spec: model.MustSpec(arch)}); !cudaRuns(c) {
			t.Errorf("%s without a sliding window: cudaRuns false", arch)
		}
	}
	if cudaRuns(model.Config{}) {
		t.Error("a config without an architecture runs on CUDA")
	}
}
