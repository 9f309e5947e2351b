package registry

import (
	"context"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/embedded"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/registrytest"
)

// TestRenewAfterLeaseLoss: when the lease behind a published segment is
// lost (revoked here), the registry opens a new one and publishes the
// segment again; a deleted segment is not brought back.
func TestRenewAfterLeaseLoss(t *testing.T) {
	srv, err := embedded.Start(t.Context(), embedded.Config{Dir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ep := strings.TrimPrefix(srv.Endpoints()[0], "http://")
	reg, closer, err := Open(t.Context(), "etcd://"+ep, Options{TTL: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer closer.Close()
	raw, err := clientv3.New(clientv3.Config{Endpoints: srv.Endpoints(), DialTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()

	ctx := context.Background()
	keep, gone := registrytest.Descriptor("keep:1", "inc-a"), registrytest.Descriptor("gone:2", "inc-b")
	if err := reg.Put(ctx, keep); err != nil {
		t.Fatal(err)
	}
	if err := reg.Put(ctx, gone); err != nil {
		t.Fatal(err)
	}
	if err := reg.Delete(ctx, gone.Name); err != nil {
		t.Fatal(err)
	}
	key := "mooncake/ram/" + keep.Name
	lease := func() clientv3.LeaseID {
		r, err := raw.Get(ctx, key)
		if err != nil || len(r.Kvs) == 0 {
			return 0
		}
		return clientv3.LeaseID(r.Kvs[0].Lease)
	}
	first := lease()
	if first == 0 {
		t.Fatal("segment not published")
	}
	if _, err := raw.Revoke(ctx, first); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		if l := lease(); l != 0 && l != first {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("segment not published again under a new lease within 15s")
		}
		time.Sleep(50 * time.Millisecond)
	}
	d, err := reg.Get(ctx, keep.Name)
	if err != nil || d.Incarnation != keep.Incarnation {
		t.Fatalf("after renewal: %v %+v", err, d)
	}
	if _, err := reg.Get(ctx, gone.Name); err == nil {
		t.Fatal("a deleted segment came back")
	}
}
