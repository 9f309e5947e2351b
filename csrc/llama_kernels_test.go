package csrc

import (
	"strings"
	"testing"
)

// TestLlamaKernelIncludes: every kernel set comes back with its headers
// inlined (NVRTC gets none), the shared q/k-norm code in both sets that use
// it, and an unknown set is an error.
func TestLlamaKernelIncludes(t *testing.T) {
	for _, name := range []string{LlamaKernels, "blocks", "attn", "sample"} {
		src, err := LlamaKernel(name)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(src, "#include") {
			t.Errorf("%s: an #include is left", name)
		}
		if want := name == LlamaKernels || name == "blocks"; strings.Contains(src, "qkn_rope_head(") != want {
			t.Errorf("%s: qkn.cuh inlined %v, want %v", name, !want, want)
		}
	}
	if _, err := LlamaKernel("nope"); err == nil {
		t.Error("an unknown kernel set loaded")
	}
}
