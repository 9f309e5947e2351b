package rdma_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// onFabric returns a newTransports for the conformance suite: every engine
// gets a host of its own on fab with the named NICs.
func onFabric(fab *fake.Fabric, cfg rdma.Config, nics ...string) func() []transfer.Transport {
	return func() []transfer.Transport {
		c := cfg
		c.Provider = fab.NewHost(nics...)
		return []transfer.Transport{rdma.New(c)}
	}
}

func TestConformance(t *testing.T) {
	transfertest.Run(t, onFabric(fake.NewFabric(), rdma.Config{}, "mlx5_0"))
}

// Two NICs per host, small slices and few outstanding requests: tasks are
// cut and spread over both queue pairs, and posting waits for credits.
func TestConformanceTwoNICsSmallSlices(t *testing.T) {
	transfertest.Run(t, onFabric(fake.NewFabric(), rdma.Config{SliceSize: 4096 + 3, MaxWR: 4, CQDepth: 6}, "mlx5_0", "mlx5_1"))
}
