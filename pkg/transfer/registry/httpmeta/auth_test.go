package httpmeta

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/registry/registrytest"
)

// request sends method key body to hs, signed with s at time at (the zero
// secret: unsigned), after edit (if any) changed the signed request.
func request(t *testing.T, url, method, key, body string, s auth.Secret, at time.Time, edit func(*http.Request)) (int, string) {
	t.Helper()
	req, err := http.NewRequestWithContext(t.Context(), method, url+"/metadata?key="+key, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if !s.IsZero() {
		var b []byte
		if method == http.MethodPut {
			b = []byte(body)
		}
		sign(s, req, key, b, at)
	}
	if edit != nil {
		edit(req)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(out)
}

// jsonError checks that body is the JSON error of code and returns its
// message.
func jsonError(t *testing.T, code int, body string) string {
	t.Helper()
	var e struct {
		Error struct {
			Message string `json:"message"`
			Type    string `json:"type"`
			Code    int    `json:"code"`
		} `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || e.Error.Code != code || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("body %q is not a JSON error of code %d", body, code)
	}
	return e.Error.Message
}

// TestServerAuth: a server with a secret refuses every /metadata request
// that is unsigned (401), signed with another secret or with a signature
// made for another method, key or body (403, 400), out of its time window
// or replayed (401), and stores nothing from them.
func TestServerAuth(t *testing.T) {
	sec := registrytest.Secret()
	other, _ := auth.New("not-the-cluster-secret", "test")
	now := time.Unix(1_800_000_000, 0)
	s, hs := serveWith(t, ServerConfig{Secret: sec, Now: func() time.Time { return now }})
	u := hs.URL
	if code, body := request(t, u, "PUT", "k", `{"v":1}`, sec, now, nil); code != 200 {
		t.Fatalf("signed put: %d %s", code, body)
	}
	var replay http.Header
	code, body := request(t, u, "GET", "k", "", sec, now, func(r *http.Request) { replay = r.Header.Clone() })
	if code != 200 || body != `{"v":1}` {
		t.Fatalf("signed get: %d %s", code, body)
	}
	for _, tc := range []struct {
		name, method, key, body string
		s                       auth.Secret
		at                      time.Time
		edit                    func(*http.Request)
		code                    int
		says                    string
	}{
		{"unsigned get", "GET", "k", "", auth.Secret{}, now, nil, 401, "--insecure-no-cluster-token"},
		{"unsigned put", "PUT", "k", `{"forged":1}`, auth.Secret{}, now, nil, 401, "signed with the cluster secret"},
		{"unsigned delete", "DELETE", "k", "", auth.Secret{}, now, nil, 401, "signed"},
		{"other secret", "PUT", "k", `{"forged":1}`, other, now, nil, 403, "does not match"},
		{"other method", "DELETE", "k", "", sec, now, func(r *http.Request) { r.Method = "GET" }, 403, "does not match"},
		{"other key", "PUT", "k", `{"forged":1}`, sec, now, func(r *http.Request) { r.URL.RawQuery = "key=k2" }, 403, "does not match"},
		{"other body", "PUT", "k", `{"forged":1}`, sec, now, func(r *http.Request) {
			r.Body, r.ContentLength = io.NopCloser(strings.NewReader(`{"forged":2}`)), 12
		}, 400, "does not match " + HeaderSHA256},
		{"too old", "PUT", "k", `{"forged":1}`, sec, now.Add(-2 * time.Minute), nil, 401, "window"},
		{"too new", "PUT", "k", `{"forged":1}`, sec, now.Add(2 * time.Minute), nil, 401, "window"},
		{"replayed", "GET", "k", "", sec, now, func(r *http.Request) { r.Header = replay }, 401, "replayed"},
		{"bad nonce", "GET", "k", "", sec, now, func(r *http.Request) { r.Header.Set(HeaderNonce, "xyz") }, 401, HeaderNonce},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, body := request(t, u, tc.method, tc.key, tc.body, tc.s, tc.at, tc.edit)
			if code != tc.code {
				t.Fatalf("%d %s, want %d", code, body, tc.code)
			}
			if msg := jsonError(t, code, body); !strings.Contains(msg, tc.says) {
				t.Fatalf("message %q does not say %q", msg, tc.says)
			}
		})
	}
	if code, body := request(t, u, "GET", "k", "", sec, now, nil); code != 200 || body != `{"v":1}` || s.Len() != 1 {
		t.Fatalf("after the refusals: %d %s, %d keys", code, body, s.Len())
	}
	if code, body := request(t, u, "GET", "", "", auth.Secret{}, now, func(r *http.Request) { r.URL.Path = "/health"; r.URL.RawQuery = "" }); code != 200 {
		t.Fatalf("/health needs no signature: %d %s", code, body)
	}
}

// TestClientAuth: the client signs; a client without the server's secret
// gets ErrAuth saying what to do, and writes nothing.
func TestClientAuth(t *testing.T) {
	s, hs := serveWith(t, ServerConfig{Secret: registrytest.Secret()})
	good := newClient(t, hs.URL+"/metadata")
	if err := good.Put(t.Context(), registrytest.Descriptor("a:1", "inc-1")); err != nil {
		t.Fatal(err)
	}
	if _, err := good.Get(t.Context(), "a:1"); err != nil {
		t.Fatal(err)
	}
	other, _ := auth.New("not-the-cluster-secret", "test token")
	for name, c := range map[string]*Client{
		"other secret": newClientWith(t, ClientConfig{URL: hs.URL + "/metadata", Secret: other}),
		"insecure":     newClientWith(t, ClientConfig{URL: hs.URL + "/metadata", Insecure: true}),
	} {
		err := c.Put(t.Context(), registrytest.Descriptor("b:1", "inc-1"))
		if !errors.Is(err, transfer.ErrAuth) || errors.Is(err, transfer.ErrRegistry) || !strings.Contains(err.Error(), "--cluster-token") {
			t.Errorf("%s: put: %v, want ErrAuth naming --cluster-token", name, err)
		}
		if _, err := c.Get(t.Context(), "a:1"); !errors.Is(err, transfer.ErrAuth) {
			t.Errorf("%s: get: %v, want ErrAuth", name, err)
		}
		if err := c.Delete(t.Context(), "a:1"); !errors.Is(err, transfer.ErrAuth) {
			t.Errorf("%s: delete: %v, want ErrAuth", name, err)
		}
	}
	if s.Len() != 2 { // a:1's descriptor and rpc_meta
		t.Fatalf("%d keys, want 2", s.Len())
	}
}

// TestLimits: values over the cap get 413, keys over the count and bytes
// over the total 507, all as JSON errors naming the field; overwriting and
// deleting keep the accounting right.
func TestLimits(t *testing.T) {
	s, hs := serveWith(t, ServerConfig{Insecure: true, MaxKeys: 3, MaxTotalBytes: 3000})
	u := hs.URL + "/metadata?key="
	put := func(key string, body io.Reader, n int64) (int, string) {
		req, _ := http.NewRequestWithContext(t.Context(), "PUT", u+key, body)
		req.ContentLength = n
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	big := int64(MaxValueBytes + 1)
	// Declared too large, and too large without a declared length.
	for _, n := range []int64{big, -1} {
		code, body := put("big", io.LimitReader(zeros{}, big), n)
		if code != http.StatusRequestEntityTooLarge || !strings.Contains(jsonError(t, code, body), "value") {
			t.Fatalf("put of %d bytes (length %d): %d %s", big, n, code, body)
		}
	}
	val := bytes.Repeat([]byte("x"), 900)
	for i := range 3 {
		if code, body := put(fmt.Sprint("k", i), bytes.NewReader(val), -1); code != 200 {
			t.Fatalf("put k%d: %d %s", i, code, body)
		}
	}
	code, body := put("k3", bytes.NewReader(val), -1)
	if code != http.StatusInsufficientStorage || !strings.Contains(jsonError(t, code, body), "keys held") {
		t.Fatalf("4th key: %d %s", code, body)
	}
	// Overwriting an existing key is not a new key, but the total counts.
	if code, body := put("k0", bytes.NewReader(val[:10]), -1); code != 200 {
		t.Fatalf("overwrite: %d %s", code, body)
	}
	code, body = put("k1", bytes.NewReader(bytes.Repeat([]byte("y"), 2200)), -1)
	if code != http.StatusInsufficientStorage || !strings.Contains(jsonError(t, code, body), "value") {
		t.Fatalf("over the total: %d %s", code, body)
	}
	if code, _ := do(t, "DELETE", u+"k1", ""); code != 200 {
		t.Fatal("delete")
	}
	if code, body := put("k3", bytes.NewReader(bytes.Repeat([]byte("z"), 2000)), -1); code != 200 {
		t.Fatalf("after a delete: %d %s", code, body)
	}
	if s.Len() != 3 {
		t.Fatalf("%d keys, want 3", s.Len())
	}
}
