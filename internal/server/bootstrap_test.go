package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/lb/voucher"
	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

func clusterSecret(t testing.TB, tok string) auth.Secret {
	s, err := auth.New(tok, "test")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// prepared records PrepareDisagg's calls: any disaggregation work.
type prepared struct {
	mu    sync.Mutex
	boots []server.Bootstrap
}

func (p *prepared) prepare(ctx context.Context, req *engine.Request, b server.Bootstrap) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.boots = append(p.boots, b)
	return nil
}

func (p *prepared) n() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.boots)
}

func postWith(t testing.TB, url, body string, h http.Header) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for k, v := range h {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	return resp.StatusCode, b.Bytes()
}

func vouched(s auth.Secret, f voucher.Fields, at time.Time) http.Header {
	return http.Header{http.CanonicalHeaderKey(voucher.Header): {voucher.Sign(s, f, at)}}
}

// TestBootstrapVouchers: a decode server takes bootstrap fields only with
// the LB's voucher for exactly them; every refusal is a 400 naming the LB,
// and comes before any disaggregation work or generation.
func TestBootstrapVouchers(t *testing.T) {
	s := clusterSecret(t, "server-test-cluster-secret")
	gen := &servertest.Generator{}
	var p prepared
	ts, _ := newServer(t, server.Config{Generator: gen, Mode: server.ModeDecode, PrepareDisagg: p.prepare, Vouchers: server.VoucherPolicy{Secret: s}})
	f := voucher.Fields{Host: "10.0.0.1", Port: 8998, Room: 1<<62 + 1}
	body := `{"text":"Hi","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":4611686018427387905}`
	now := time.Now()
	for _, c := range []struct {
		name, body string
		h          http.Header
		want       string
		param      string // the error's param ("" = bootstrap_room)
	}{
		{"none", body, nil, "none of its vouchers", ""},
		{"other secret", body, vouched(clusterSecret(t, "another-cluster-secret"), f, now), "does not match", ""},
		{"other host", strings.Replace(body, "10.0.0.1", "10.6.6.6", 1), vouched(s, f, now), "does not match", ""},
		{"other port", strings.Replace(body, "8998", "8999", 1), vouched(s, f, now), "does not match", ""},
		// Other spellings are not fields at all: request decoding matches
		// names exactly and refuses unknown ones.
		{"host spelt otherwise", strings.Replace(body, `"text"`, `"BOOTSTRAP_HOST":"10.6.6.6","text"`, 1), vouched(s, f, now), "unknown field BOOTSTRAP_HOST", "BOOTSTRAP_HOST"},
		{"smuggled after", strings.Replace(body, `}`, `,"Bootstrap_Host":"10.6.6.6"}`, 1), vouched(s, f, now), "unknown field Bootstrap_Host", "Bootstrap_Host"},
		{"smuggled long s", strings.Replace(body, `}`, `,"bootſtrap_port":9}`, 1), vouched(s, f, now), "unknown field bootſtrap_port", "bootſtrap_port"},
		{"stale", body, vouched(s, f, now.Add(-time.Minute)), "time window", ""},
		{"garbage", body, http.Header{http.CanonicalHeaderKey(voucher.Header): {"v1.x.y"}}, "malformed", ""},
		{"completions", `{"prompt":"Hi","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":4611686018427387905}`, nil, "none of its vouchers", ""},
		{"vouched", body, vouched(s, f, now), "", ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			url := ts.URL + "/generate"
			if c.name == "completions" {
				url = ts.URL + "/v1/completions"
			}
			status, b := postWith(t, url, c.body, c.h)
			if c.want == "" {
				if status != 200 {
					t.Fatalf("status %d: %s", status, b)
				}
				return
			}
			checkError(t, status, b, 400, c.want)
			if c.param != "" {
				if !strings.Contains(string(b), `"param":"`+c.param+`"`) {
					t.Fatalf("error does not name the field %s: %s", c.param, b)
				}
				return
			}
			if !strings.Contains(string(b), "mooncake-go lb") || !strings.Contains(string(b), `"param":"bootstrap_room"`) {
				t.Fatalf("error does not name the LB and the field: %s", b)
			}
		})
	}
	if n := p.n(); n != 1 {
		t.Fatalf("PrepareDisagg ran %d times, want once (the accepted request)", n)
	}
	if n := len(gen.Requests()); n != 1 {
		t.Fatalf("%d requests reached the generator, want 1", n)
	}
	// The LB's voucher, once; then it is a replay.
	status, b := postWith(t, ts.URL+"/generate", body, vouched(s, f, now))
	checkError(t, status, b, 400, "already used")
	f2 := voucher.Fields{Host: "10.0.0.1", Port: 8998, Room: 77}
	body2 := `{"text":"Hi","bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":77}`
	if status, b := postWith(t, ts.URL+"/generate", body2, vouched(s, f2, now)); status != 200 {
		t.Fatalf("a fresh voucher: %d %s", status, b)
	}
	if got := p.boots[len(p.boots)-1]; got != (server.Bootstrap{Host: "10.0.0.1", Port: 8998, Room: 77}) {
		t.Fatalf("PrepareDisagg got %+v", got)
	}
}

// TestDirectRequests: a prefill or decode server asked directly answers 400
// naming the LB, even for zero new tokens; with AllowDirect it serves the
// request itself, with no disaggregation.
func TestDirectRequests(t *testing.T) {
	s := clusterSecret(t, "server-test-cluster-secret")
	for _, mode := range []string{server.ModePrefill, server.ModeDecode} {
		t.Run(mode, func(t *testing.T) {
			var p prepared
			gen := &servertest.Generator{}
			ts, _ := newServer(t, server.Config{Generator: gen, Mode: mode, PrepareDisagg: p.prepare, Vouchers: server.VoucherPolicy{Secret: s}})
			for _, c := range []struct{ path, body string }{
				{"/generate", `{"text":"Hi"}`},
				{"/generate", `{"text":"Hi","sampling_params":{"max_new_tokens":0}}`},
				{"/v1/completions", `{"prompt":"Hi"}`},
				{"/v1/chat/completions", `{"messages":[{"role":"user","content":"Hi"}]}`},
			} {
				status, b := post(t, ts.URL+c.path, c.body)
				checkError(t, status, b, 400, "this is a "+mode+" server: send requests to mooncake-go lb")
			}
			if len(gen.Requests()) != 0 || p.n() != 0 {
				t.Fatalf("refused requests reached the generator (%d) or PrepareDisagg (%d)", len(gen.Requests()), p.n())
			}
			ts2, _ := newServer(t, server.Config{Generator: gen, Mode: mode, PrepareDisagg: p.prepare, Vouchers: server.VoucherPolicy{Secret: s, AllowDirect: true}})
			if status, b := post(t, ts2.URL+"/generate", `{"text":"Hi","sampling_params":{"max_new_tokens":2}}`); status != 200 {
				t.Fatalf("AllowDirect: %d %s", status, b)
			}
			if len(gen.Requests()) != 1 || p.n() != 0 {
				t.Fatalf("AllowDirect: %d generations, %d disaggregations; want 1 and 0", len(gen.Requests()), p.n())
			}
			// Bootstrap fields still need a voucher with AllowDirect.
			status, b := post(t, ts2.URL+"/generate", `{"text":"Hi","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}`)
			checkError(t, status, b, 400, "none of its vouchers")
		})
	}
}

// TestUnsignedBootstrap: AllowUnsigned takes the fields as they come (and
// a null-mode server ignores the policy).
func TestUnsignedBootstrap(t *testing.T) {
	var p prepared
	ts, _ := newServer(t, server.Config{Mode: server.ModeDecode, PrepareDisagg: p.prepare, Vouchers: server.VoucherPolicy{AllowUnsigned: true}})
	if status, b := post(t, ts.URL+"/generate", `{"text":"Hi","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}`); status != 200 || p.n() != 1 {
		t.Fatalf("unsigned: %d %s, %d disaggregations", status, b, p.n())
	}
	status, b := post(t, ts.URL+"/generate", `{"text":"Hi"}`)
	checkError(t, status, b, 400, "mooncake-go lb")
	null, _ := newServer(t, server.Config{})
	if status, b := post(t, null.URL+"/generate", `{"text":"Hi"}`); status != 200 {
		t.Fatalf("null mode: %d %s", status, b)
	}
	for _, mode := range []string{server.ModePrefill, server.ModeDecode} {
		_, err := server.New(server.Config{Generator: &servertest.Generator{}, Tokenizer: servertest.Tokenizer{}, Mode: mode})
		if err == nil || !strings.Contains(err.Error(), "Vouchers.Secret") {
			t.Fatalf("%s server without a secret: %v", mode, err)
		}
	}
}

// FuzzVoucherAdmission: whatever the body and voucher header, a decode
// server does disaggregation work only for fields the secret signed.
func FuzzVoucherAdmission(f *testing.F) {
	s := clusterSecret(f, "server-test-cluster-secret")
	fl := voucher.Fields{Host: "h", Port: 1, Room: 2}
	good := voucher.Sign(s, fl, time.Now())
	f.Add([]byte(`{"text":"Hi","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}`), good)
	f.Add([]byte(`{"text":"Hi","BOOTSTRAP_HOST":"x","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":2}`), good)
	f.Add([]byte(`{"text":"Hi","bootstrap_room":2}`), good[:len(good)-1]+"0")
	f.Add([]byte(`{"text":"Hi"}`), "")
	var mu sync.Mutex
	var got []server.Bootstrap
	srv, err := server.New(server.Config{Generator: &servertest.Generator{}, Tokenizer: servertest.Tokenizer{}, Mode: server.ModeDecode,
		ContextLen: 64, MaxBodyBytes: 8 << 10, Vouchers: server.VoucherPolicy{Secret: s},
		PrepareDisagg: func(ctx context.Context, req *engine.Request, b server.Bootstrap) error {
			mu.Lock()
			got = append(got, b)
			mu.Unlock()
			return nil
		}})
	if err != nil {
		f.Fatal(err)
	}
	h := srv.Handler()
	f.Fuzz(func(t *testing.T, body []byte, header string) {
		if len(body) > fuzzMaxInput {
			t.Skip()
		}
		mu.Lock()
		got = got[:0]
		mu.Unlock()
		req := httptest.NewRequest(http.MethodPost, "/generate", bytes.NewReader(body))
		req.Header.Set(voucher.Header, header)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		mu.Lock()
		defer mu.Unlock()
		if rec.Code >= 500 {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
		for _, b := range got {
			// Only the seeds' signed fields can pass (once).
			c := voucher.NewChecker(s, 0)
			if err := c.Check(header, voucher.Fields{Host: b.Host, Port: b.Port, Room: b.Room}); err != nil && !errors.Is(err, voucher.ErrStale) {
				t.Fatalf("PrepareDisagg ran for %+v with voucher %q: %v", b, header, err)
			}
		}
		if rec.Code == 400 {
			var e struct {
				Error struct{ Message string } `json:"error"`
			}
			if json.Unmarshal(rec.Body.Bytes(), &e) != nil || e.Error.Message == "" {
				t.Fatalf("400 without a JSON error: %s", rec.Body)
			}
		}
	})
}
