package embedded

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
	)
}

func roundTrip(t *testing.T, s *Server) {
	t.Helper()
	c, err := clientv3.New(clientv3.Config{Endpoints: s.Endpoints(), DialTimeout: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if _, err := c.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	resp, err := c.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("got %v", resp.Kvs)
	}
}

// TestTempDir: the default data dir is temporary and goes with Close.
func TestTempDir(t *testing.T) {
	s, err := Start(t.Context(), Config{})
	if err != nil {
		t.Fatal(err)
	}
	dir := s.tempDir
	if dir == "" {
		t.Fatal("no temp dir")
	}
	if eps := s.Endpoints(); len(eps) != 1 || !strings.HasPrefix(eps[0], "http://127.0.0.1:") {
		t.Fatalf("endpoints %v", eps)
	}
	roundTrip(t, s)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Fatalf("temp dir %s still there: %v", dir, err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
}

// TestGivenDirAndURL: a configured dir stays, and the server listens where
// it is told; a second server on the same client URL fails with an error.
func TestGivenDirAndURL(t *testing.T) {
	dir := t.TempDir()
	url := "http://" + freeAddr(t)
	s, err := Start(t.Context(), Config{Dir: dir, ClientURL: url})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if eps := s.Endpoints(); len(eps) != 1 || eps[0] != url {
		t.Fatalf("endpoints %v, want [%s]", eps, url)
	}
	roundTrip(t, s)
	if _, err := Start(t.Context(), Config{Dir: t.TempDir(), ClientURL: url}); err == nil {
		t.Fatal("second server on the same port started")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir + "/member"); err != nil {
		t.Fatalf("configured data dir emptied: %v", err)
	}
}

func TestBadURL(t *testing.T) {
	for _, u := range []string{"127.0.0.1:2379", "unix:///tmp/x", "http://"} {
		if _, err := Start(t.Context(), Config{ClientURL: u}); err == nil {
			t.Errorf("%q: no error", u)
		}
	}
}

func TestCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := Start(ctx, Config{Dir: t.TempDir()}); err == nil {
		t.Fatal("started with a canceled context")
	}
}
