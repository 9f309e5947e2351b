package httpmeta

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/internal/meta"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/registrytest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serve starts an insecure server (the Mooncake protocol tests); secured
// ones are in auth_test.go.
func serve(t *testing.T) (*Server, *httptest.Server) {
	t.Helper()
	return serveWith(t, ServerConfig{Insecure: true})
}

func serveWith(t *testing.T, cfg ServerConfig) (*Server, *httptest.Server) {
	t.Helper()
	s, err := NewServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s)
	t.Cleanup(hs.Close)
	return s, hs
}

func newClient(t *testing.T, url string) *Client {
	return newClientWith(t, ClientConfig{URL: url, Secret: registrytest.Secret()})
}

func newClientWith(t *testing.T, cfg ClientConfig) *Client {
	t.Helper()
	c, err := NewClient(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestConformance(t *testing.T) {
	for _, insecure := range []bool{false, true} {
		t.Run(map[bool]string{false: "signed", true: "insecure server"}[insecure], func(t *testing.T) {
			registrytest.Run(t, func(t *testing.T) registrytest.Store {
				sc := ServerConfig{Secret: registrytest.Secret()}
				if insecure {
					sc = ServerConfig{Insecure: true}
				}
				_, hs := serveWith(t, sc)
				sec := registrytest.Secret()
				raw := newClientWith(t, ClientConfig{URL: hs.URL + "/metadata", Secret: sec})
				return registrytest.Store{
					Registry: newClient(t, hs.URL+"/metadata"),
					Secret:   sec,
					Raw: func(ctx context.Context, name string, value []byte) error {
						_, err := raw.do(ctx, http.MethodPut, meta.RAMKey("", name), value)
						return err
					},
				}
			})
		})
	}
}

func do(t *testing.T, method, url, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestProtocol pins the Mooncake-compatible wire behaviour.
func TestProtocol(t *testing.T) {
	s, hs := serve(t)
	u := hs.URL + "/metadata?key="
	for _, tc := range []struct {
		method, url, body string
		code              int
		resp              string
	}{
		{"GET", u + "a", "", 404, ""},
		{"PUT", u + "a", `{"x":1}`, 200, ""},
		{"GET", u + "a", "", 200, `{"x":1}`},
		{"PUT", u + "a", `{"x":2}`, 200, ""},
		{"GET", u + "a", "", 200, `{"x":2}`},
		{"DELETE", u + "a", "", 200, ""},
		{"DELETE", u + "a", "", 404, ""},
		{"GET", u + "a", "", 404, ""},
		{"GET", hs.URL + "/metadata", "", 400, ""},
		{"POST", u + "a", "x", 405, ""},
		{"GET", hs.URL + "/other?key=a", "", 404, ""},
		{"GET", u + strings.Repeat("k", MaxKeyBytes+1), "", 400, ""},
		{"GET", hs.URL + "/health", "", 200, "ok\n"},
	} {
		code, body := do(t, tc.method, tc.url, tc.body)
		if code != tc.code || (tc.resp != "" && body != tc.resp) {
			t.Errorf("%s %.60s: %d %q, want %d %q", tc.method, tc.url, code, body, tc.code, tc.resp)
		}
	}
	if s.Len() != 0 {
		t.Errorf("%d keys left", s.Len())
	}
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

// TestKeys: the client writes Mooncake's keys and rpc_meta value.
func TestKeys(t *testing.T) {
	s, hs := serve(t)
	c := newClient(t, hs.URL+"/metadata")
	d := registrytest.Descriptor("node1:7000", "inc-1")
	d.Addr = "10.1.2.3:7001"
	if err := c.Put(t.Context(), d); err != nil {
		t.Fatal(err)
	}
	code, body := do(t, "GET", hs.URL+"/metadata?key=mooncake/rpc_meta/node1:7000", "")
	if code != 200 || body != `{"ip_or_host_name":"10.1.2.3","rpc_port":7001}` {
		t.Fatalf("rpc_meta: %d %s", code, body)
	}
	if code, _ := do(t, "GET", hs.URL+"/metadata?key=mooncake/ram/node1:7000", ""); code != 200 {
		t.Fatalf("ram: %d", code)
	}
	if err := c.Delete(t.Context(), "node1:7000"); err != nil {
		t.Fatal(err)
	}
	if s.Len() != 0 {
		t.Fatalf("%d keys left after delete", s.Len())
	}
}

// TestUnreachable: nothing listening, or a server that does not answer,
// gives ErrRegistry within the bound.
func TestUnreachable(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c := newClient(t, "http://"+addr+"/metadata")
	if _, err := c.Get(t.Context(), "a:1"); !errors.Is(err, transfer.ErrRegistry) {
		t.Fatalf("get: %v, want ErrRegistry", err)
	}
	if err := c.Put(t.Context(), registrytest.Descriptor("a:1", "i")); !errors.Is(err, transfer.ErrRegistry) {
		t.Fatalf("put: %v, want ErrRegistry", err)
	}

	// A server that accepts and never answers.
	hang := make(chan struct{})
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-hang:
		case <-r.Context().Done():
		}
	}))
	defer hs.Close()
	defer close(hang)
	c = newClient(t, hs.URL+"/metadata")
	c.timeout = 300 * time.Millisecond
	start := time.Now()
	_, err = c.Get(t.Context(), "a:1")
	if !errors.Is(err, transfer.ErrRegistry) {
		t.Fatalf("get from a hung server: %v, want ErrRegistry", err)
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("took %v", el)
	}
}

// TestNotAMetadataServer: a PUT answered 404 is a misconfiguration, not a
// missing segment; other statuses are registry errors naming the status.
func TestNotAMetadataServer(t *testing.T) {
	hs := httptest.NewServer(http.NotFoundHandler())
	defer hs.Close()
	c := newClient(t, hs.URL+"/wrong")
	err := c.Put(t.Context(), registrytest.Descriptor("a:1", "i"))
	if !errors.Is(err, transfer.ErrRegistry) || errors.Is(err, transfer.ErrSegmentNotFound) {
		t.Fatalf("put: %v", err)
	}
	hs500 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "boom", 500)
	}))
	defer hs500.Close()
	c = newClient(t, hs500.URL+"/metadata")
	if _, err := c.Get(t.Context(), "a:1"); !errors.Is(err, transfer.ErrRegistry) || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("get: %v", err)
	}
}

func TestBadValue(t *testing.T) {
	_, hs := serve(t)
	do(t, "PUT", hs.URL+"/metadata?key=mooncake/ram/x:1", "not json")
	c := newClient(t, hs.URL+"/metadata")
	_, err := c.Get(context.Background(), "x:1")
	if !errors.Is(err, transfer.ErrBadDescriptor) || !strings.Contains(err.Error(), "mooncake/ram/x:1") {
		t.Fatalf("get of a bad value: %v, want ErrBadDescriptor naming the key", err)
	}
}
