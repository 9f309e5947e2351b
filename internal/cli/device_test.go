package cli

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestCUDARuns: --device cuda (and auto) takes every tiny architecture
// (sliding windows included), and refuses MoE shapes past the routing
// kernels' limits.
func TestCUDARuns(t *testing.T) {
	for shape, arch := range model.TinyShapes() {
		c, err := model.RandomConfig(shape)
		if err != nil {
			t.Fatal(err)
		}
		if !cudaRuns(c) {
			t.Errorf("%s (%s, sliding window %d): cudaRuns false", shape, arch, c.SlidingWindow)
		}
	}
	for _, arch := range []string{"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM"} {
		if c := (model.Config{Spec: model.MustSpec(arch)}); !cudaRuns(c) {
			t.Errorf("%s: cudaRuns false", arch)
		}
	}
	if c := (model.Config{Spec: model.MustSpec("Qwen3MoeForCausalLM"), Experts: 1024, TopK: 8}); cudaRuns(c) {
		t.Error("1024 experts run on CUDA (moe_sort takes 512)")
	}
	if cudaRuns(model.Config{}) {
		t.Error("a config without an architecture runs on CUDA")
	}
}
