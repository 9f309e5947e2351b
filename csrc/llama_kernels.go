package csrc

import (
	"embed"
	"fmt"
	"strings"
)

// The Llama forward kernels (csrc/llama/*.cu), compiled at run time by the
// CUDA model backend with the model's head dimension and dtype as macros.

//go:embed llama/*.cu llama/*.cuh
var llamaFS embed.FS

// LlamaKernels is the name of the Llama forward kernel set.
const LlamaKernels = "llama"

// LlamaKernel returns the CUDA C source of a Llama kernel set ("llama"),
// each line `#include "x.cuh"` replaced by llama/x.cuh (NVRTC is given no
// headers; the host emulation of the kernels includes them as written).
func LlamaKernel(name string) (string, error) {
	b, err := llamaFS.ReadFile("llama/" + strings.TrimSuffix(name, ".cu") + ".cu")
	if err != nil {
		return "", err
	}
	var out strings.Builder
	for line := range strings.Lines(string(b)) {
		inc, ok := strings.CutPrefix(strings.TrimSpace(line), `#include "`)
		if !ok {
			out.WriteString(line)
			continue
		}
		h, ok := strings.CutSuffix(inc, `"`)
		if !ok || !strings.HasSuffix(h, ".cuh") || strings.Contains(h, "/") {
			return "", fmt.Errorf("csrc: %s: unsupported include %s", name, strings.TrimSpace(line))
		}
		hb, err := llamaFS.ReadFile("llama/" + h)
		if err != nil {
			return "", fmt.Errorf("csrc: %s: %w", name, err)
		}
		out.Write(hb)
		out.WriteString("\n")
	}
	return out.String(), nil
}
