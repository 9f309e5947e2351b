// Package etcd is a transfer.Registry backed by etcd, with Mooncake's key
// layout:
//
//	[<prefix>/]mooncake/ram/<segment>       the JSON descriptor
//	[<prefix>/]mooncake/rpc_meta/<segment>  {"ip_or_host_name": h, "rpc_port": p}
//
// Every key a Registry writes is attached to one lease, kept alive while the
// Registry lives. A process that crashes stops renewing it, and its segment
// disappears from etcd after the TTL; peers then get ErrSegmentNotFound
// instead of a stale descriptor.
package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/internal/meta"
)

// Defaults of Config's zero values.
const (
	DefaultTTL            = 10 // seconds
	DefaultDialTimeout    = 3 * time.Second
	DefaultRequestTimeout = 3 * time.Second
)

// Config configures a Registry. Zero values mean the defaults noted.
type Config struct {
	// Endpoints are etcd client endpoints ("host:port" or
	// "http://host:port"). Required.
	Endpoints []string
	// Prefix is the cluster prefix: keys become
	// "<Prefix>/mooncake/ram/<segment>". Empty: no prefix (Mooncake's keys).
	Prefix string
	// TTL is the lease time to live in whole seconds (default 10). etcd
	// raises very short TTLs to its minimum (about 2 s with default
	// election settings).
	TTL int
	// DialTimeout bounds connecting and granting the lease in New
	// (default 3 s).
	DialTimeout time.Duration
	// RequestTimeout bounds every Put, Get and Delete, and the lease
	// revocation in Close, on top of the caller's context (default 3 s).
	RequestTimeout time.Duration
	// Logger receives lease loss and the etcd client's warnings; nil: no
	// logs.
	Logger *zap.Logger
	// Secret seals every descriptor Put writes and is checked on every one
	// Get reads: etcd itself authenticates nobody, so a descriptor written
	// by anyone without the secret is refused (transfer.ErrBadDescriptor,
	// naming the key). The zero value means the per-user secret of this
	// host (auth.UserDefault).
	Secret auth.Secret
	// Insecure turns sealing and checking off (Secret must be zero).
	Insecure bool
}

// Validate reports a configuration New cannot use.
func (c *Config) Validate() error {
	if len(c.Endpoints) == 0 {
		return errors.New("etcd registry: config: no endpoints")
	}
	for _, ep := range c.Endpoints {
		if ep == "" {
			return errors.New("etcd registry: config: empty endpoint")
		}
	}
	if c.TTL < 0 {
		return fmt.Errorf("etcd registry: config: negative TTL %d", c.TTL)
	}
	if c.DialTimeout < 0 || c.RequestTimeout < 0 {
		return errors.New("etcd registry: config: negative timeout")
	}
	if c.Insecure && !c.Secret.IsZero() {
		return errors.New("etcd registry: config: Insecure with a Secret")
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.TTL == 0 {
		c.TTL = DefaultTTL
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = DefaultDialTimeout
	}
	if c.RequestTimeout == 0 {
		c.RequestTimeout = DefaultRequestTimeout
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Registry is a lease-backed etcd registry. It is safe for concurrent use.
type Registry struct {
	cfg     Config
	lg      *zap.Logger
	client  *clientv3.Client
	session *concurrency.Session

	closing chan struct{} // closed at the start of Close
	watched chan struct{} // closed when the lease watcher returns

	mu     sync.Mutex
	closed bool

	closeOnce sync.Once
	closeErr  error
}

var _ transfer.Registry = (*Registry)(nil)

// New connects to etcd and grants the lease. An unreachable etcd gives an
// error wrapping transfer.ErrRegistry within about cfg.DialTimeout.
func New(ctx context.Context, cfg Config) (*Registry, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	secret, err := meta.Secret(cfg.Secret, cfg.Insecure)
	if err != nil {
		return nil, err
	}
	cfg.Secret = secret
	lg := cfg.Logger.Named("registry.etcd")
	client, err := clientv3.New(clientv3.Config{
		Endpoints:   cfg.Endpoints,
		DialTimeout: cfg.DialTimeout,
		// The client logs retries at info and warn; keep only warnings.
		Logger: lg.Named("client").WithOptions(zap.IncreaseLevel(zap.WarnLevel)),
	})
	if err != nil {
		return nil, fmt.Errorf("%w: etcd %v: %w", transfer.ErrRegistry, cfg.Endpoints, err)
	}
	gctx, cancel := context.WithTimeout(ctx, cfg.DialTimeout)
	lease, err := client.Grant(gctx, int64(cfg.TTL))
	cancel()
	if err != nil {
		client.Close()
		if ctx.Err() != nil {
			return nil, fmt.Errorf("etcd registry: grant lease: %w", ctx.Err())
		}
		return nil, fmt.Errorf("%w: etcd %v: grant lease (dial timeout %v): %w",
			transfer.ErrRegistry, cfg.Endpoints, cfg.DialTimeout, err)
	}
	// The session keeps the lease alive on the client's own context (not
	// ctx, which may be short-lived) until Close.
	session, err := concurrency.NewSession(client, concurrency.WithLease(lease.ID), concurrency.WithTTL(cfg.TTL))
	if err != nil {
		rctx, cancel := context.WithTimeout(context.Background(), cfg.RequestTimeout)
		_, _ = client.Revoke(rctx, lease.ID)
		cancel()
		client.Close()
		return nil, fmt.Errorf("%w: etcd %v: keep lease alive: %w", transfer.ErrRegistry, cfg.Endpoints, err)
	}
	r := &Registry{
		cfg:     cfg,
		lg:      lg,
		client:  client,
		session: session,
		closing: make(chan struct{}),
		watched: make(chan struct{}),
	}
	go r.watchLease()
	lg.Debug("lease granted", zap.Int64("lease", int64(lease.ID)), zap.Int("ttl_s", cfg.TTL),
		zap.Strings("endpoints", cfg.Endpoints), zap.String("prefix", cfg.Prefix))
	return r, nil
}

// watchLease logs the loss of the lease (not its end in Close).
func (r *Registry) watchLease() {
	defer close(r.watched)
	select {
	case <-r.session.Done():
		select {
		case <-r.closing:
		default:
			r.lg.Error("etcd lease lost: this process's segments are no longer published",
				zap.Int64("lease", int64(r.session.Lease())), zap.Strings("endpoints", r.cfg.Endpoints))
		}
	case <-r.closing:
	}
}

// Done is closed when the lease is lost (etcd unreachable for longer than
// the TTL, the lease revoked or expired) or the Registry is closed. After
// that, what this Registry published is gone or going; a Put fails with an
// error wrapping transfer.ErrRegistry. Open a new Registry and publish again.
func (r *Registry) Done() <-chan struct{} { return r.session.Done() }

// Lease returns the id of the lease the keys are attached to.
func (r *Registry) Lease() clientv3.LeaseID { return r.session.Lease() }

// op runs fn under the request timeout and classifies its error.
func (r *Registry) op(ctx context.Context, what, key string, fn func(context.Context) error) error {
	if r.isClosed() {
		return fmt.Errorf("%w: etcd registry closed: %s %s", transfer.ErrRegistry, what, key)
	}
	octx, cancel := context.WithTimeout(ctx, r.cfg.RequestTimeout)
	defer cancel()
	err := fn(octx)
	if err == nil {
		return nil
	}
	if cerr := ctx.Err(); cerr != nil {
		// The caller gave up: say so, keeping errors.Is(err, context.Canceled).
		return fmt.Errorf("etcd registry: %s %s: %w", what, key, cerr)
	}
	var bad *badValueError
	if errors.Is(err, transfer.ErrSegmentNotFound) {
		return err
	}
	if errors.As(err, &bad) {
		return bad.err
	}
	return fmt.Errorf("%w: etcd %v: %s %s (timeout %v): %w",
		transfer.ErrRegistry, r.cfg.Endpoints, what, key, r.cfg.RequestTimeout, err)
}

func (r *Registry) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// Put publishes d under d.Name, both keys in one transaction, attached to
// the lease.
func (r *Registry) Put(ctx context.Context, d *transfer.Descriptor) error {
	desc, rpc, err := meta.Encode(r.cfg.Secret, d)
	if err != nil {
		return err
	}
	ram, rpcKey := meta.RAMKey(r.cfg.Prefix, d.Name), meta.RPCMetaKey(r.cfg.Prefix, d.Name)
	select {
	case <-r.session.Done():
		if !r.isClosed() {
			return fmt.Errorf("%w: etcd %v: put %s: lease %x lost",
				transfer.ErrRegistry, r.cfg.Endpoints, ram, int64(r.session.Lease()))
		}
	default:
	}
	lease := clientv3.WithLease(r.session.Lease())
	ops := []clientv3.Op{clientv3.OpPut(ram, string(desc), lease)}
	if rpc != nil {
		ops = append(ops, clientv3.OpPut(rpcKey, string(rpc), lease))
	} else {
		ops = append(ops, clientv3.OpDelete(rpcKey))
	}
	return r.op(ctx, "put", ram, func(ctx context.Context) error {
		_, err := r.client.Txn(ctx).Then(ops...).Commit()
		return err
	})
}

// Get returns name's descriptor, or an error wrapping
// transfer.ErrSegmentNotFound naming the key.
func (r *Registry) Get(ctx context.Context, name string) (*transfer.Descriptor, error) {
	key := meta.RAMKey(r.cfg.Prefix, name)
	var d *transfer.Descriptor
	err := r.op(ctx, "get", key, func(ctx context.Context) error {
		resp, err := r.client.Get(ctx, key)
		if err != nil {
			return err
		}
		if len(resp.Kvs) == 0 {
			return fmt.Errorf("%w: %s (no key %s in etcd)", transfer.ErrSegmentNotFound, name, key)
		}
		d, err = transfer.ReadDescriptor(r.cfg.Secret, key, name, resp.Kvs[0].Value)
		if err != nil {
			// Neither missing nor unreachable: the value is there but unusable.
			return &badValueError{err}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return d, nil
}

// Delete removes name's descriptor and rpc_meta. Deleting a name that is not
// there is not an error.
func (r *Registry) Delete(ctx context.Context, name string) error {
	ram, rpcKey := meta.RAMKey(r.cfg.Prefix, name), meta.RPCMetaKey(r.cfg.Prefix, name)
	return r.op(ctx, "delete", ram, func(ctx context.Context) error {
		_, err := r.client.Txn(ctx).Then(clientv3.OpDelete(ram), clientv3.OpDelete(rpcKey)).Commit()
		return err
	})
}

// Close stops renewing the lease, revokes it (so every key this Registry
// wrote goes at once; bounded by RequestTimeout: if etcd cannot be reached the
// keys go when the TTL runs out, and Close says so), and closes the client.
// Calling it again returns the first result.
func (r *Registry) Close() error {
	r.closeOnce.Do(func() {
		r.mu.Lock()
		r.closed = true
		r.mu.Unlock()
		close(r.closing)
		r.session.Orphan()
		<-r.watched
		ctx, cancel := context.WithTimeout(context.Background(), r.cfg.RequestTimeout)
		_, err := r.client.Revoke(ctx, r.session.Lease())
		cancel()
		if err != nil && isLeaseNotFound(err) {
			err = nil // expired already: nothing left to revoke
		}
		if err != nil {
			err = fmt.Errorf("%w: etcd %v: revoke lease %x (keys go after the %d s TTL): %w",
				transfer.ErrRegistry, r.cfg.Endpoints, int64(r.session.Lease()), r.cfg.TTL, err)
		}
		if cerr := r.client.Close(); cerr != nil && err == nil && !errors.Is(cerr, context.Canceled) {
			err = fmt.Errorf("etcd registry: close client: %w", cerr)
		}
		r.closeErr = err
	})
	return r.closeErr
}
