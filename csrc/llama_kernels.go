package csrc

import (
	"embed"
	"strings"
)

// The Llama forward kernels (csrc/llama/*.cu), compiled at run time by the
// CUDA model backend with the model's head dimension and dtype as macros.

//go:embed llama/*.cu
var llamaFS embed.FS

// LlamaKernels is the name of the Llama forward kernel set.
const LlamaKernels = "llama"

// LlamaKernel returns the CUDA C source of a Llama kernel set ("llama").
func LlamaKernel(name string) (string, error) {
	b, err := llamaFS.ReadFile("llama/" + strings.TrimSuffix(name, ".cu") + ".cu")
	if err != nil {
		return "", err
	}
	return string(b), nil
}
