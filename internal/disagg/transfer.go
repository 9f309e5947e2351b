package disagg

import (
	"context"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Transfer is what disaggregation needs of the transfer engine
// (*transfer.Engine): registered host memory for the aux slots, KV writes
// into a peer's segment, and notifications. Tests inject faults through a
// fake.
type Transfer interface {
	AllocHost(ctx context.Context, size int64, numa int, access transfer.Access, opts ...transfer.RegisterOption) (*transfer.HostMemory, error)
	FreeHost(ctx context.Context, m *transfer.HostMemory) error
	OpenSegmentCached(ctx context.Context, name string) (transfer.SegmentID, error)
	Transfer(ctx context.Context, reqs []transfer.Request) error
	Notify(ctx context.Context, segment, topic string, data []byte) error
	// Timeout is the bound on one transfer batch.
	Timeout() time.Duration
}

var _ Transfer = (*transfer.Engine)(nil)
