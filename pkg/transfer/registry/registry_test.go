package registry

import (
	"context"
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/httpmeta"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/registrytest"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func TestMain(m *testing.M) {
	transfertest.OpenRegistry = func(ctx context.Context, spec string, secret auth.Secret) (transfer.Registry, io.Closer, error) {
		return Open(ctx, spec, Options{Secret: secret})
	}
	transfertest.TargetMain(processTransports)
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	)
}

// newMetaServer is an HTTP metadata server with the per-user secret, as
// `mooncake-go registry` runs by default.
func newMetaServer(t *testing.T) *httpmeta.Server {
	t.Helper()
	s, err := httpmeta.NewServer(httpmeta.ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestBadSpecs(t *testing.T) {
	for _, spec := range []string{
		"", "etcd", "etcd://", "etcd://host", "etcd://h:1,", "etcd://:2379",
		"ftp://h/metadata", "http://", "127.0.0.1:2379", "embeded",
	} {
		t.Run(spec, func(t *testing.T) {
			r, c, err := Open(t.Context(), spec, Options{})
			if err == nil {
				c.Close()
				t.Fatalf("%q: no error (registry %T)", spec, r)
			}
			if !strings.Contains(err.Error(), spec) || !strings.Contains(err.Error(), Accepted) {
				t.Fatalf("%q: error %q does not name the value and the accepted forms", spec, err)
			}
		})
	}
}

func TestP2P(t *testing.T) {
	for _, spec := range []string{"p2p", "P2PHANDSHAKE", " p2p "} {
		r, c, err := Open(t.Context(), spec, Options{})
		if err != nil || r != nil || c == nil {
			t.Fatalf("%q: %v %v %v", spec, r, c, err)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
	}
}

// TestEmbeddedAndEtcd: "embedded" serves a second process's
// etcd://host:port, and both see the same segments under the same prefix.
func TestEmbeddedAndEtcd(t *testing.T) {
	r, c, err := Open(t.Context(), "embedded", Options{DataDir: t.TempDir(), Prefix: "test", TTL: 5})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
	}()
	eps := c.(Endpointer).Endpoints()
	if len(eps) != 1 {
		t.Fatalf("endpoints %v", eps)
	}
	other, oc, err := Open(t.Context(), "etcd://"+strings.TrimPrefix(eps[0], "http://"), Options{Prefix: "test"})
	if err != nil {
		t.Fatal(err)
	}
	d := registrytest.Descriptor("seg:1", "inc-1")
	if err := r.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	got, err := other.Get(t.Context(), "seg:1")
	if err != nil {
		t.Fatal(err)
	}
	if got.Incarnation != "inc-1" {
		t.Fatalf("got %+v", got)
	}
	if err := oc.Close(); err != nil {
		t.Fatal(err)
	}
	// Closing the registry itself first (as a caller may) and then the
	// closer is fine.
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestHTTP(t *testing.T) {
	hs := httptest.NewServer(newMetaServer(t))
	defer hs.Close()
	for _, spec := range []string{hs.URL + "/metadata", hs.URL} {
		r, c, err := Open(t.Context(), spec, Options{})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Put(t.Context(), registrytest.Descriptor("seg:1", "inc-1")); err != nil {
			t.Fatalf("%s: %v", spec, err)
		}
		if _, err := r.Get(t.Context(), "seg:1"); err != nil {
			t.Fatalf("%s: %v", spec, err)
		}
		c.Close()
	}
}

func TestEtcdUnreachable(t *testing.T) {
	_, _, err := Open(t.Context(), "etcd://127.0.0.1:1", Options{})
	if !errors.Is(err, transfer.ErrRegistry) || !strings.Contains(err.Error(), "127.0.0.1:1") {
		t.Fatalf("%v", err)
	}
}
