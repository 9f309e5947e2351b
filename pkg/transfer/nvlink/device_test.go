package nvlink

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/cuda/cudatest"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// TestConformanceDevice runs the device cases of the conformance suite for
// nvlink between two engines of this process on GPU 0, the pools given
// WithMemory (skips without a GPU).
func TestConformanceDevice(t *testing.T) {
	needGPU(t)
	transfertest.RunDevice(t, func() []transfer.Transport {
		nv, err := New(Config{})
		if err != nil {
			t.Fatal(err)
		}
		return []transfer.Transport{nv}
	}, cudatest.NewPool)
}
