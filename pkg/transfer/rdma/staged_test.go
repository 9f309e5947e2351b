package rdma_test

import (
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

// GPU memory without a dma-buf (transfertest's fake devices: host memory
// behind an inaccessible address range, reached only through their copies)
// on either side and both: staged through host buffers.
func TestConformanceDevice(t *testing.T) {
	transfertest.RunDevice(t, onFabric(fake.NewFabric(), rdma.Config{}, "mlx5_0"), transfertest.FakeDevices)
}

// Two NICs, small slices and little staging (pieces of 4099 bytes, 16 of
// them per ring): pieces wait for staging, spans wrap.
func TestConformanceDeviceSmallStaging(t *testing.T) {
	transfertest.RunDevice(t, onFabric(fake.NewFabric(), rdma.Config{SliceSize: 4096 + 3, MaxWR: 4, CQDepth: 6, StagingSize: 64 << 10}, "mlx5_0", "mlx5_1"),
		transfertest.FakeDevices)
}
