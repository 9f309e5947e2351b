package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/embedded"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/internal/meta"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/registrytest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// grpc's and etcd's process-wide helpers, started once.
		goleak.IgnoreTopFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/pkg/v3/traceutil.init"),
	)
}

func startServer(t *testing.T) *embedded.Server {
	t.Helper()
	srv, err := embedded.Start(t.Context(), embedded.Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
	})
	return srv
}

func newRegistry(t *testing.T, cfg Config) *Registry {
	t.Helper()
	r, err := New(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Error(err)
		}
	})
	return r
}

func TestConformance(t *testing.T) {
	srv := startServer(t)
	raw := rawClient(t, srv)
	var n atomic.Int64
	registrytest.Run(t, func(t *testing.T) registrytest.Store {
		// A fresh prefix per subtest: a store nobody else sees.
		prefix := "conf" + string(rune('a'+n.Add(1)))
		s := registrytest.Secret()
		return registrytest.Store{
			Registry: newRegistry(t, Config{Endpoints: srv.Endpoints(), Prefix: prefix, Secret: s}),
			Secret:   s,
			Raw: func(ctx context.Context, name string, value []byte) error {
				_, err := raw.Put(ctx, meta.RAMKey(prefix, name), string(value))
				return err
			},
		}
	})
}

func rawClient(t *testing.T, srv *embedded.Server) *clientv3.Client {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func keys(t *testing.T, c *clientv3.Client) map[string]string {
	t.Helper()
	resp, err := c.Get(t.Context(), "", clientv3.WithFromKey())
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, kv := range resp.Kvs {
		m[string(kv.Key)] = string(kv.Value)
	}
	return m
}

// TestKeysAndPrefix checks Mooncake's key names, the rpc_meta value, the
// lease on both keys, and that two prefixes do not see each other.
func TestKeysAndPrefix(t *testing.T) {
	srv := startServer(t)
	raw := rawClient(t, srv)
	plain := newRegistry(t, Config{Endpoints: srv.Endpoints()})
	a := newRegistry(t, Config{Endpoints: srv.Endpoints(), Prefix: "clusterA/"})
	b := newRegistry(t, Config{Endpoints: srv.Endpoints(), Prefix: "clusterB"})

	d := registrytest.Descriptor("node1:7000", "inc-1")
	d.Addr = "10.1.2.3:7001"
	if err := plain.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	if err := a.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Get(t.Context(), "node1:7000"); !errors.Is(err, transfer.ErrSegmentNotFound) {
		t.Fatalf("prefix B sees prefix A's segment: %v", err)
	}
	if _, err := a.Get(t.Context(), "node1:7000"); err != nil {
		t.Fatal(err)
	}
	kv := keys(t, raw)
	for _, k := range []string{
		"mooncake/ram/node1:7000", "mooncake/rpc_meta/node1:7000",
		"clusterA/mooncake/ram/node1:7000", "clusterA/mooncake/rpc_meta/node1:7000",
	} {
		if _, ok := kv[k]; !ok {
			t.Errorf("key %s missing; have %v", k, kv)
		}
	}
	if len(kv) != 4 {
		t.Errorf("%d keys, want 4: %v", len(kv), kv)
	}
	var rpc meta.RPCMeta
	if err := json.Unmarshal([]byte(kv["mooncake/rpc_meta/node1:7000"]), &rpc); err != nil {
		t.Fatal(err)
	}
	if rpc != (meta.RPCMeta{IPOrHostName: "10.1.2.3", RPCPort: 7001}) {
		t.Errorf("rpc_meta %+v", rpc)
	}
	for _, k := range []string{"mooncake/ram/node1:7000", "mooncake/rpc_meta/node1:7000"} {
		resp, err := raw.Get(t.Context(), k)
		if err != nil {
			t.Fatal(err)
		}
		if got := clientv3.LeaseID(resp.Kvs[0].Lease); got != plain.Lease() {
			t.Errorf("%s on lease %x, want %x", k, got, plain.Lease())
		}
	}
	if err := plain.Delete(t.Context(), "node1:7000"); err != nil {
		t.Fatal(err)
	}
	kv = keys(t, raw)
	if len(kv) != 2 {
		t.Errorf("after delete: %v", kv)
	}
	// Close revokes the lease: A's keys go at once.
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if kv := keys(t, raw); len(kv) != 0 {
		t.Errorf("after close: %v", kv)
	}
	if err := a.Put(t.Context(), d); !errors.Is(err, transfer.ErrRegistry) {
		t.Errorf("put after close: %v", err)
	}
	select {
	case <-a.Done():
	default:
		t.Error("Done not closed after Close")
	}
}

// TestLeaseExpiry: a process that stops renewing (here: its client closes
// without revoking, as a crash would) loses its segment after the TTL.
func TestLeaseExpiry(t *testing.T) {
	srv := startServer(t)
	core, logs := observer.New(zap.WarnLevel)
	r, err := New(t.Context(), Config{Endpoints: srv.Endpoints(), TTL: 1, RequestTimeout: 500 * time.Millisecond, Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	observer := newRegistry(t, Config{Endpoints: srv.Endpoints()})
	if err := r.Put(t.Context(), registrytest.Descriptor("crash:1", "inc-1")); err != nil {
		t.Fatal(err)
	}
	if _, err := observer.Get(t.Context(), "crash:1"); err != nil {
		t.Fatal(err)
	}
	// Crash: the keepalive stops, nothing is revoked.
	start := time.Now()
	r.client.Close()
	select {
	case <-r.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("Done not closed after the client went away")
	}
	t.Logf("Done after %v", time.Since(start).Round(10*time.Millisecond))
	waitFor(t, func() bool { return logs.FilterMessageSnippet("lease lost").Len() == 1 }, "the lease loss to be logged")
	for {
		_, err := observer.Get(t.Context(), "crash:1")
		if errors.Is(err, transfer.ErrSegmentNotFound) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if time.Since(start) > 6*time.Second {
			t.Fatal("segment still there 6 s after its process stopped renewing a 1 s lease")
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("gone after %v", time.Since(start).Round(10*time.Millisecond))
	// Close after the loss returns within the request timeout, and says the
	// lease could not be revoked.
	start = time.Now()
	err = r.Close()
	if !errors.Is(err, transfer.ErrRegistry) {
		t.Errorf("close after loss: %v, want ErrRegistry", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("close after loss took %v", el)
	}
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	for start := time.Now(); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Since(start) > 2*time.Second {
			t.Fatalf("waited 2 s for %s", what)
		}
	}
}

func freePort(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestUnreachable: nothing listening gives ErrRegistry within the bound.
func TestUnreachable(t *testing.T) {
	start := time.Now()
	_, err := New(t.Context(), Config{Endpoints: []string{freePort(t)}, DialTimeout: time.Second})
	if !errors.Is(err, transfer.ErrRegistry) {
		t.Fatalf("New: %v, want ErrRegistry", err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Fatalf("New took %v with a 1 s dial timeout", el)
	}
	t.Logf("New: %v (after %v)", err, time.Since(start).Round(time.Millisecond))
}

// TestServerGone: once etcd stops, every operation fails with ErrRegistry
// within the request timeout, and Close still returns.
func TestServerGone(t *testing.T) {
	srv, err := embedded.Start(t.Context(), embedded.Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(t.Context(), Config{Endpoints: srv.Endpoints(), RequestTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Put(t.Context(), registrytest.Descriptor("a:1", "inc-1")); err != nil {
		t.Fatal(err)
	}
	if err := srv.Close(); err != nil {
		t.Fatal(err)
	}
	check := func(op string, f func(context.Context) error) {
		start := time.Now()
		err := f(t.Context())
		if !errors.Is(err, transfer.ErrRegistry) {
			t.Errorf("%s: %v, want ErrRegistry", op, err)
		}
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("%s took %v with a 0.5 s request timeout", op, el)
		}
		if err != nil && !strings.Contains(err.Error(), "a:1") {
			t.Errorf("%s: %v does not name the key", op, err)
		}
	}
	t0 := time.Now()
	defer func() { t.Logf("ops and close: %v", time.Since(t0).Round(10*time.Millisecond)) }()
	check("get", func(ctx context.Context) error { _, err := r.Get(ctx, "a:1"); return err })
	check("put", func(ctx context.Context) error { return r.Put(ctx, registrytest.Descriptor("a:1", "inc-2")) })
	check("delete", func(ctx context.Context) error { return r.Delete(ctx, "a:1") })
	start := time.Now()
	err = r.Close()
	if el := time.Since(start); el > 2*time.Second {
		t.Errorf("close took %v", el)
	}
	if !errors.Is(err, transfer.ErrRegistry) {
		t.Errorf("close with etcd gone: %v, want ErrRegistry", err)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"no endpoints", Config{}},
		{"empty endpoint", Config{Endpoints: []string{""}}},
		{"negative ttl", Config{Endpoints: []string{"h:1"}, TTL: -1}},
		{"negative timeout", Config{Endpoints: []string{"h:1"}, DialTimeout: -1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := New(t.Context(), tc.cfg); err == nil {
				t.Fatal("no error")
			}
		})
	}
}
