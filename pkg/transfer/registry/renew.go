package registry

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/etcd"
)

// renewing is an etcd registry that outlives its lease: when the lease is
// lost (etcd unreachable for longer than the TTL, or the lease revoked), it
// opens a new session and publishes again every descriptor it holds, so a
// process's segments come back once etcd does.
type renewing struct {
	open func(context.Context) (*etcd.Registry, error)
	lg   *zap.Logger

	mu     sync.Mutex
	cur    *etcd.Registry
	held   map[string]*transfer.Descriptor
	closed bool

	done chan struct{}
	wg   sync.WaitGroup
}

// The wait between attempts to get a new lease grows from renewMin to
// renewMax.
const (
	renewMin = 200 * time.Millisecond
	renewMax = 5 * time.Second
)

func newRenewing(ctx context.Context, lg *zap.Logger, open func(context.Context) (*etcd.Registry, error)) (*renewing, error) {
	cur, err := open(ctx)
	if err != nil {
		return nil, err
	}
	if lg == nil {
		lg = zap.NewNop()
	}
	r := &renewing{open: open, lg: lg.Named("registry"), cur: cur, held: map[string]*transfer.Descriptor{}, done: make(chan struct{})}
	r.wg.Add(1)
	go r.watch()
	return r, nil
}

func (r *renewing) current() *etcd.Registry {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cur
}

// Put publishes d and remembers it for the next lease.
func (r *renewing) Put(ctx context.Context, d *transfer.Descriptor) error {
	r.mu.Lock()
	if d != nil && d.Name != "" {
		r.held[d.Name] = d.Clone()
	}
	cur := r.cur
	r.mu.Unlock()
	return cur.Put(ctx, d)
}

func (r *renewing) Get(ctx context.Context, name string) (*transfer.Descriptor, error) {
	return r.current().Get(ctx, name)
}

// Delete unpublishes name and forgets it.
func (r *renewing) Delete(ctx context.Context, name string) error {
	r.mu.Lock()
	delete(r.held, name)
	cur := r.cur
	r.mu.Unlock()
	return cur.Delete(ctx, name)
}

// Close stops renewing and closes the current session (revoking its lease).
func (r *renewing) Close() error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		return nil
	}
	r.closed = true
	close(r.done)
	r.mu.Unlock()
	r.wg.Wait()
	return r.current().Close()
}

// watch waits for the current lease to be lost, then renews it.
func (r *renewing) watch() {
	defer r.wg.Done()
	for {
		cur := r.current()
		select {
		case <-r.done:
			return
		case <-cur.Done():
		}
		select {
		case <-r.done:
			return
		default:
		}
		r.lg.Warn("etcd lease lost: opening a new one to publish this process's segments again",
			zap.Int64("lease", int64(cur.Lease())))
		next := r.renew()
		if next == nil {
			return // closed
		}
		cur.Close()
		r.mu.Lock()
		r.cur = next
		held := make([]*transfer.Descriptor, 0, len(r.held))
		for _, d := range r.held {
			held = append(held, d)
		}
		r.mu.Unlock()
		for _, d := range held {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			err := next.Put(ctx, d)
			cancel()
			if err != nil {
				r.lg.Error("republishing a segment failed", zap.String("segment", d.Name), zap.Error(err))
				continue
			}
			r.lg.Info("segment published again", zap.String("segment", d.Name), zap.Int64("lease", int64(next.Lease())))
		}
	}
}

// renew opens a new session, retrying with backoff until it works or the
// registry is closed (nil).
func (r *renewing) renew() *etcd.Registry {
	wait := renewMin
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		next, err := r.open(ctx)
		cancel()
		if err == nil {
			return next
		}
		r.lg.Warn("etcd still unreachable", zap.Error(err), zap.Duration("retry_in", wait))
		select {
		case <-r.done:
			return nil
		case <-time.After(wait):
		}
		wait = min(2*wait, renewMax)
	}
}
