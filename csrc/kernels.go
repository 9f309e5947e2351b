// Package csrc holds the C shims (compiled into internal/cuda) and the CUDA
// kernel sources, embedded into the binary and compiled at run time by NVRTC
// for the device found. Add a kernel set by dropping a .cu file here: it is
// picked up by name (file name without .cu).
package csrc

import (
	"embed"
	"strings"
)

//go:embed *.cu
var kernelFS embed.FS

// Kernel returns the CUDA C source of the kernel set name ("copy_kernels").
func Kernel(name string) (string, error) {
	b, err := kernelFS.ReadFile(strings.TrimSuffix(name, ".cu") + ".cu")
	if err != nil {
		return "", err
	}
	return string(b), nil
}

// CopyKernels is the name of the gather/scatter copy kernel set.
const CopyKernels = "copy_kernels"
