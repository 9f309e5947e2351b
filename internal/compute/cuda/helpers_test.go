package cuda

import (
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/compute/computetest"
	"github.com/mooncake-go/mooncake-go/internal/cublas"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
)

// newOrSkip makes a backend, skipping the test when no GPU, driver, NVRTC
// or cuBLAS is found.
func newOrSkip(tb testing.TB, m *model.Model, o Options) *Backend {
	tb.Helper()
	return loadOrSkip(tb, &o, func(o Options) (*Backend, error) { return New(m, o) })
}

// loadOrSkip makes a model with load (the test's kernel cache set in o),
// skipping the test when no GPU, driver, NVRTC or cuBLAS is found, and
// closes it when the test ends.
func loadOrSkip[B interface{ Close() error }](tb testing.TB, o *Options, load func(Options) (B, error)) B {
	tb.Helper()
	if o.KernelCache.CacheDir == "" {
		o.KernelCache.CacheDir = filepath.Join(os.TempDir(), "mooncake-kernels-test")
	}
	b, err := load(*o)
	if err != nil {
		if errors.Is(err, cu.ErrNoDriver) || errors.Is(err, cu.ErrNoDevice) || errors.Is(err, cu.ErrNoNVRTC) ||
			errors.Is(err, cublas.ErrNoLibrary) {
			tb.Skipf("no usable GPU: %v", err)
		}
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		if err := b.Close(); err != nil {
			tb.Error(err)
		}
	})
	return b
}

// stories260K loads the model and llama2.c's reference outputs.
func stories260K(tb testing.TB) (*model.Model, []sharedtest.Case) {
	bin, _ := sharedtest.Stories260K(tb)
	cases := sharedtest.Reference(tb)
	m, err := model.LoadLlama2C(bin)
	if err != nil {
		tb.Fatal(err)
	}
	return m, cases
}

func pagesFor(i, per int) []int32 { return computetest.PagesFor(i, per) }

func argmax(x []float32) int32 { return computetest.Argmax(x) }

func runBatch(tb testing.TB, b compute.Model, prompts [][]int32, chunks []int, steps, pagesPer int) [][][]float32 {
	return computetest.RunBatch(tb, b, prompts, chunks, steps, pagesPer)
}

func randPrompt(r *rand.Rand, n, vocab int) []int32 {
	p := make([]int32, n)
	for i := range p {
		p[i] = int32(r.IntN(vocab))
	}
	return p
}

func maxAbsDiff(a, b []float32) float64 { return computetest.MaxAbsDiff(a, b) }

func relErr(a, b []float32) float64 { return computetest.RelErr(a, b) }
