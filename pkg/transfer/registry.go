package transfer

import "context"

// Registry stores segment descriptors. Implementations: etcd (lease-backed:
// a crashed process's segment disappears), the HTTP metadata server, and
// none at all (P2P, Config.Registry nil).
type Registry interface {
	// Put publishes d under d.Name, replacing what was there.
	Put(ctx context.Context, d *Descriptor) error
	// Get returns the descriptor of name, or an error wrapping
	// ErrSegmentNotFound; an unreachable store gives an error wrapping
	// ErrRegistry.
	Get(ctx context.Context, name string) (*Descriptor, error)
	// Delete removes name's descriptor.
	Delete(ctx context.Context, name string) error
	Close() error
}
