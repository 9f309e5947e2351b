// Package registry opens the transfer.Registry a --metadata-server value
// names:
//
//	p2p                       no registry (nil): the P2P handshake; Mooncake's
//	                          P2PHANDSHAKE is accepted too
//	embedded                  an etcd server started in this process, and a
//	                          client of it
//	etcd://host:port[,h:p]    an etcd cluster (lease-backed: a crashed
//	                          process's segment disappears after the TTL)
//	http://host:port/metadata a Mooncake HTTP metadata server (no leases)
//
// Every registry seals the descriptors it writes with the cluster secret
// (Options.Secret) and refuses, with transfer.ErrBadDescriptor naming the
// key, those it reads whose seal does not check out; the HTTP client also
// signs its requests.
//
// The core (pkg/transfer) does not import this package; internal/cli does.
package registry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/embedded"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/etcd"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/httpmeta"
)

// Accepted lists the forms of a spec, for messages.
const Accepted = "p2p | embedded | etcd://host:port[,host:port...] | http://host:port/metadata"

// Options tune what Open builds. Zero values mean the defaults noted.
type Options struct {
	// Prefix is the etcd cluster prefix (etcd and embedded only).
	Prefix string
	// TTL is the etcd lease in whole seconds (default 10).
	TTL int
	// DataDir is the embedded etcd's data directory (default: a temporary
	// one, removed on Close).
	DataDir string
	// ClientURL is the embedded etcd's client URL (default: a free port on
	// 127.0.0.1). Other processes reach it with etcd://host:port.
	ClientURL string
	// Logger: nil means no logs.
	Logger *zap.Logger
	// Secret is the cluster secret: every registry seals the descriptors
	// it writes with it and refuses those it reads whose seal does not
	// check out (transfer.ErrBadDescriptor naming the key); the HTTP client
	// also signs its requests. The zero value means the per-user secret of
	// this host.
	Secret auth.Secret
	// Insecure: no seals, no signatures (Secret must be zero).
	Insecure bool
}

// Endpointer is implemented by the io.Closer Open returns for "embedded":
// the client URLs of the server it started, for other processes.
type Endpointer interface {
	Endpoints() []string
}

// Open builds the registry spec names. The io.Closer is never nil: it
// closes the registry and, for "embedded", then stops the server. For
// "p2p" the Registry is nil (the engine's P2P mode) and the closer does
// nothing.
func Open(ctx context.Context, spec string, opts Options) (transfer.Registry, io.Closer, error) {
	s := strings.TrimSpace(spec)
	switch {
	case strings.EqualFold(s, "p2p"), strings.EqualFold(s, "P2PHANDSHAKE"):
		return nil, nopCloser{}, nil
	case strings.EqualFold(s, "embedded"):
		return openEmbedded(ctx, opts)
	case strings.HasPrefix(s, "etcd://"):
		eps, err := etcdEndpoints(strings.TrimPrefix(s, "etcd://"))
		if err != nil {
			return nil, nil, badSpec(spec, err)
		}
		r, err := newRenewing(ctx, opts.Logger, func(ctx context.Context) (*etcd.Registry, error) {
			return etcd.New(ctx, etcd.Config{Endpoints: eps, Prefix: opts.Prefix, TTL: opts.TTL, Logger: opts.Logger,
				Secret: opts.Secret, Insecure: opts.Insecure})
		})
		if err != nil {
			return nil, nil, fmt.Errorf("--metadata-server %s: %w", spec, err)
		}
		return r, r, nil
	case strings.HasPrefix(s, "http://"), strings.HasPrefix(s, "https://"):
		u, err := url.Parse(s)
		if err != nil {
			return nil, nil, badSpec(spec, err)
		}
		if u.Host == "" {
			return nil, nil, badSpec(spec, errors.New("no host"))
		}
		if u.Path == "" || u.Path == "/" {
			u.Path = "/metadata" // Mooncake's path
		}
		c, err := httpmeta.NewClient(httpmeta.ClientConfig{URL: u.String(), Secret: opts.Secret, Insecure: opts.Insecure})
		if err != nil {
			return nil, nil, fmt.Errorf("--metadata-server %s: %w", spec, err)
		}
		return c, c, nil
	}
	return nil, nil, badSpec(spec, nil)
}

func badSpec(spec string, err error) error {
	if err != nil {
		return fmt.Errorf("--metadata-server %q: %v; accepted: %s", spec, err, Accepted)
	}
	return fmt.Errorf("--metadata-server %q: unknown form; accepted: %s", spec, Accepted)
}

func etcdEndpoints(s string) ([]string, error) {
	if s == "" {
		return nil, errors.New("no etcd endpoint")
	}
	var eps []string
	for ep := range strings.SplitSeq(s, ",") {
		ep = strings.TrimSpace(ep)
		host, port, err := net.SplitHostPort(ep)
		if err != nil || host == "" || port == "" {
			return nil, fmt.Errorf("etcd endpoint %q: want host:port", ep)
		}
		eps = append(eps, ep)
	}
	return eps, nil
}

func openEmbedded(ctx context.Context, opts Options) (transfer.Registry, io.Closer, error) {
	srv, err := embedded.Start(ctx, embedded.Config{Dir: opts.DataDir, ClientURL: opts.ClientURL, Logger: opts.Logger})
	if err != nil {
		return nil, nil, fmt.Errorf("--metadata-server embedded: %w", err)
	}
	r, err := newRenewing(ctx, opts.Logger, func(ctx context.Context) (*etcd.Registry, error) {
		return etcd.New(ctx, etcd.Config{Endpoints: srv.Endpoints(), Prefix: opts.Prefix, TTL: opts.TTL, Logger: opts.Logger,
			Secret: opts.Secret, Insecure: opts.Insecure})
	})
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("--metadata-server embedded: %w", err), srv.Close())
	}
	if opts.Logger != nil {
		opts.Logger.Named("registry").Info("embedded etcd serving", zap.Strings("endpoints", srv.Endpoints()))
	}
	return r, &embeddedCloser{reg: r, srv: srv}, nil
}

// embeddedCloser closes the client first (revoking its lease while the
// server is still up), then the server.
type embeddedCloser struct {
	reg *renewing
	srv *embedded.Server
}

func (c *embeddedCloser) Close() error {
	return errors.Join(c.reg.Close(), c.srv.Close())
}

func (c *embeddedCloser) Endpoints() []string { return c.srv.Endpoints() }

type nopCloser struct{}

func (nopCloser) Close() error { return nil }
