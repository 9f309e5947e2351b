package transfer

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

func testSecret(t testing.TB, tok string) auth.Secret {
	t.Helper()
	s, err := auth.New(tok, "test token "+tok[:4])
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// hsEngine is an engine with a nop transport, its log and its metrics.
type hsEngine struct {
	*Engine
	logs *observer.ObservedLogs
	reg  *prometheus.Registry
}

// newHSEngine starts an engine with secret s (zero: insecure).
func newHSEngine(t testing.TB, s auth.Secret) *hsEngine {
	t.Helper()
	core, logs := observer.New(zap.InfoLevel)
	reg := prometheus.NewRegistry()
	e, err := New(context.Background(), Config{Transports: []Transport{nopTransport{}}, Secret: s, Insecure: s.IsZero(),
		Timeout: 3 * time.Second, Logger: zap.New(core), Registerer: reg})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	return &hsEngine{Engine: e, logs: logs, reg: reg}
}

func (h *hsEngine) handshakes(result string) float64 {
	var m dto.Metric
	if err := h.m.handshakes.WithLabelValues(result).Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

// waitHandshakes waits until the count of result is want (the server
// counts a handshake after its last byte reached the peer).
func (h *hsEngine) waitHandshakes(t *testing.T, result string, want float64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for h.handshakes(result) != want {
		if time.Now().After(deadline) {
			t.Fatalf("handshakes{result=%q} = %v, want %v", result, h.handshakes(result), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitLog waits for a log line whose message and error contain the given
// texts, and returns it.
func (h *hsEngine) waitLog(t *testing.T, msg string, subs ...string) string {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		for _, en := range h.logs.FilterMessage(msg).All() {
			s := en.ContextMap()["error"]
			text, _ := s.(string)
			ok := true
			for _, sub := range subs {
				ok = ok && strings.Contains(text, sub)
			}
			if ok {
				return text
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log %q with %q; have %v", msg, subs, h.logs.All())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestHandshakeAuth: peers with the same secret (or both without one)
// connect; any other pair is refused on both sides with ErrAuth and a
// message saying what to do.
func TestHandshakeAuth(t *testing.T) {
	a, b := testSecret(t, "alpha-alpha-alpha-alpha"), testSecret(t, "bravo-bravo-bravo-bravo")
	none := auth.Secret{}
	for _, tc := range []struct {
		name                   string
		client, server         auth.Secret
		ok                     bool
		clientSays, serverSays string
	}{
		{"same secret", a, a, true, "", ""},
		{"both insecure", none, none, true, "", ""},
		{"other secret", a, b, false, "does not hold this cluster secret", "does not hold this cluster secret"},
		{"insecure client", none, a, false, "requires the cluster secret", "runs without a cluster secret"},
		{"insecure server", a, none, false, "runs without authentication", "this engine runs without authentication"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, cl := newHSEngine(t, tc.server), newHSEngine(t, tc.client)
			id, err := cl.OpenSegment(context.Background(), srv.Name())
			if tc.ok {
				if err != nil {
					t.Fatalf("open: %v", err)
				}
				d, _ := cl.SegmentDescriptor(id)
				if d.Incarnation != srv.Incarnation() || (d.MAC == "") != tc.server.IsZero() {
					t.Fatalf("descriptor %+v", d)
				}
				srv.waitHandshakes(t, "accepted", 1)
				return
			}
			if !errors.Is(err, ErrAuth) {
				t.Fatalf("open: %v, want ErrAuth", err)
			}
			for _, sub := range []string{"authentication failed", srv.Addr(), tc.clientSays, "--cluster-token"} {
				if !strings.Contains(err.Error(), sub) {
					t.Errorf("client error %q does not say %q", err, sub)
				}
			}
			if !tc.client.IsZero() && !strings.Contains(err.Error(), tc.client.Fingerprint()) {
				t.Errorf("client error %q does not give this side's fingerprint", err)
			}
			msg := srv.waitLog(t, "authentication failed", tc.serverSays, "--cluster-token", "127.0.0.1:")
			if !tc.server.IsZero() && !strings.Contains(msg, tc.server.Fingerprint()) {
				t.Errorf("server log %q does not give its fingerprint", msg)
			}
			t.Logf("client: %v\nserver: %s", err, msg)
			srv.waitHandshakes(t, "auth_failed", 1)
			if got := srv.handshakes("accepted"); got != 0 {
				t.Errorf("accepted = %v", got)
			}
		})
	}
}

// rawHello writes the magic and a hello frame (mutated by mod) and returns
// the hello's bytes.
func rawHello(t *testing.T, c net.Conn, mod func(*Hello)) []byte {
	t.Helper()
	h := Hello{Kind: "ctl", Name: "intruder", Incarnation: "x", Nonce: newNonce(), Auth: authHMAC, Describe: true}
	if mod != nil {
		mod(&h)
	}
	hb, _ := json.Marshal(h)
	out := append([]byte(magic), binary.BigEndian.AppendUint32(nil, uint32(len(hb)))...)
	if _, err := c.Write(append(out, hb...)); err != nil {
		t.Fatal(err)
	}
	return hb
}

func dialRaw(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// leaks lists what of the server's descriptor shows in b.
func leaks(b []byte, e *Engine) []string {
	var l []string
	d := e.Self()
	for _, s := range []string{d.Incarnation, d.Host.BootID, d.Host.MachineID, `"pid"`, `"regions"`, `"transports"`, `"desc"`, `"inc"`} {
		if s != "" && bytes.Contains(b, []byte(s)) {
			l = append(l, s)
		}
	}
	return l
}

// TestNoDescriptorBeforeProof: a raw client that sends a hello and a bad
// proof gets a challenge and a refusal, and no byte of the descriptor; with
// the right proof (made from the same secret) it gets the descriptor.
func TestNoDescriptorBeforeProof(t *testing.T) {
	s := testSecret(t, "alpha-alpha-alpha-alpha")
	srv := newHSEngine(t, s)
	buf := make([]byte, 1<<20)
	t.Cleanup(func() { runtime.KeepAlive(buf) })
	if err := srv.RegisterMemory(context.Background(), uintptr(unsafe.Pointer(&buf[0])), uint64(len(buf)), Location{Kind: CPU}, AccessReadWrite); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		proof func(th []byte, nonce string) proofMsg
		ok    bool
	}{
		{"no proof", func([]byte, string) proofMsg { return proofMsg{} }, false},
		{"garbage proof", func([]byte, string) proofMsg { return proofMsg{Proof: strings.Repeat("ab", 32)} }, false},
		{"other secret", func(th []byte, n string) proofMsg {
			return proofMsg{Proof: testSecret(t, "bravo-bravo-bravo-bravo").MACHex(clientDomain, th, []byte(n))}
		}, false},
		{"server's own proof replayed", func(th []byte, n string) proofMsg {
			return proofMsg{Proof: s.MACHex(serverDomain, th, []byte(n))}
		}, false},
		{"proof of another hello", func(_ []byte, n string) proofMsg {
			return proofMsg{Proof: s.MACHex(clientDomain, transcript([]byte(`{"kind":"tcp"}`)), []byte(n))}
		}, false},
		{"right proof", func(th []byte, n string) proofMsg { return proofMsg{Proof: s.MACHex(clientDomain, th, []byte(n))} }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dialRaw(t, srv.Addr())
			hb := rawHello(t, c, nil)
			var ch challenge
			raw, err := decodeFrame(c, maxChallengeFrame, &ch)
			if err != nil {
				t.Fatal(err)
			}
			if l := leaks(raw, srv.Engine); len(l) > 0 || ch.Code != "" || !validNonce(ch.Nonce) || !onlyKeys(raw, "auth", "nonce", "proof") {
				t.Fatalf("challenge %s leaks %v", raw, l)
			}
			if !s.VerifyHex(ch.Proof, serverDomain, transcript(hb), []byte(ch.Nonce)) {
				t.Fatal("server proof does not verify")
			}
			if err := WriteFrame(c, tc.proof(transcript(hb), ch.Nonce)); err != nil {
				t.Fatal(err)
			}
			if !tc.ok {
				rest, _ := io.ReadAll(c)
				if l := leaks(rest, srv.Engine); len(l) > 0 || len(rest) < 4 || !onlyKeys(rest[4:], "code", "err") {
					t.Fatalf("after a bad proof the server sent %q, leaking %v", rest, l)
				}
				if !bytes.Contains(rest, []byte(`"code":"auth"`)) {
					t.Fatalf("refusal %q has no auth code", rest)
				}
				return
			}
			var v verdict
			if raw, err := decodeFrame(c, maxFrame, &v); err != nil || v.Code != "" {
				t.Fatalf("verdict %q: %v", raw, err)
			}
			d, err := ReadDescriptor(s, "test", "", v.Desc)
			if err != nil || d.Incarnation != srv.Incarnation() || len(d.Regions) != 1 {
				t.Fatalf("descriptor %+v: %v", d, err)
			}
		})
	}
	srv.waitHandshakes(t, "accepted", 1)
	srv.waitHandshakes(t, "auth_failed", 5)
}

// onlyKeys reports whether the JSON object b has no keys but these.
func onlyKeys(b []byte, keys ...string) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(b, &m) != nil {
		return false
	}
	for k := range m {
		found := false
		for _, w := range keys {
			found = found || k == w
		}
		if !found {
			return false
		}
	}
	return true
}

// TestHelloTooLarge: a hello frame declaring more than the pre-auth cap is
// refused at once, before any of it is read.
func TestHelloTooLarge(t *testing.T) {
	srv := newHSEngine(t, testSecret(t, "alpha-alpha-alpha-alpha"))
	for _, n := range []uint32{maxHelloFrame + 1, maxFrame, 1<<32 - 1} {
		c := dialRaw(t, srv.Addr())
		if _, err := c.Write(append([]byte(magic), binary.BigEndian.AppendUint32(nil, n)...)); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		b, _ := io.ReadAll(c) // only the header was sent: the server must not wait for the rest
		if el := time.Since(start); el > time.Second || len(b) != 0 {
			t.Fatalf("hello of %d bytes: closed after %v with %q", n, el, b)
		}
	}
	srv.waitLog(t, "handshake failed", "exceeds the 1024-byte limit")
	srv.waitHandshakes(t, "error", 3)
}

// TestPendingCap: with 64 connections awaiting their proof, the 65th is
// refused at once (busy); once they go, peers connect again.
func TestPendingCap(t *testing.T) {
	s := testSecret(t, "alpha-alpha-alpha-alpha")
	srv := newHSEngine(t, s)
	var conns []net.Conn
	for range maxPending {
		conns = append(conns, dialRaw(t, srv.Addr()))
	}
	deadline := time.Now().Add(2 * time.Second)
	for len(srv.pending) != maxPending {
		if time.Now().After(deadline) {
			t.Fatalf("%d pending, want %d", len(srv.pending), maxPending)
		}
		time.Sleep(5 * time.Millisecond)
	}
	c := dialRaw(t, srv.Addr())
	start := time.Now()
	var ch challenge
	if _, err := decodeFrame(c, maxChallengeFrame, &ch); err != nil || ch.Code != codeBusy {
		t.Fatalf("65th connection: %+v, %v", ch, err)
	}
	if n, err := c.Read(make([]byte, 1)); err == nil || n != 0 {
		t.Fatal("65th connection left open")
	}
	if el := time.Since(start); el > time.Second {
		t.Fatalf("65th connection refused after %v", el)
	}
	srv.waitHandshakes(t, "busy", 1)
	// An engine's own dial says what happened.
	cl := newHSEngine(t, s)
	if _, err := cl.OpenSegment(context.Background(), srv.Name()); err == nil || !strings.Contains(err.Error(), "busy") {
		t.Fatalf("open while busy: %v", err)
	}
	conns[0].SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := conns[0].Read(make([]byte, 1)); !errors.Is(err, deadlineErr(err)) {
		t.Fatalf("a pending connection ended early: %v", err)
	}
	for _, c := range conns {
		c.Close()
	}
	for {
		_, err := cl.OpenSegment(context.Background(), srv.Name())
		if err == nil {
			break
		}
		if time.Now().After(start.Add(5 * time.Second)) {
			t.Fatalf("open after the pending connections left: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// deadlineErr returns err when it is a timeout (so errors.Is holds), else
// a sentinel that never matches.
func deadlineErr(err error) error {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return err
	}
	return errors.New("not a timeout")
}

// TestProofDeadline: a connection that says nothing, or stops after its
// hello, is closed within the proof deadline.
func TestProofDeadline(t *testing.T) {
	srv := newHSEngine(t, testSecret(t, "alpha-alpha-alpha-alpha"))
	for _, tc := range []struct {
		name string
		send func(net.Conn)
	}{
		{"silent", func(net.Conn) {}},
		{"half a magic", func(c net.Conn) { c.Write([]byte("MC")) }},
		{"no proof", func(c net.Conn) { rawHello(t, c, nil) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := dialRaw(t, srv.Addr())
			start := time.Now()
			tc.send(c)
			io.Copy(io.Discard, c)
			el := time.Since(start)
			if el < proofTime-100*time.Millisecond || el > proofTime+time.Second {
				t.Fatalf("closed after %v, deadline %v", el, proofTime)
			}
		})
	}
}

// TestHelloChecked: a hello with a bad nonce, an unknown auth mode or a
// previous-version magic is refused, saying why.
func TestHelloChecked(t *testing.T) {
	srv := newHSEngine(t, testSecret(t, "alpha-alpha-alpha-alpha"))
	for _, mod := range []func(*Hello){
		func(h *Hello) { h.Nonce = "short" },
		func(h *Hello) { h.Auth = "rot13" },
	} {
		c := dialRaw(t, srv.Addr())
		rawHello(t, c, mod)
		if b, _ := io.ReadAll(c); len(leaks(b, srv.Engine)) > 0 || bytes.Contains(b, []byte(`"nonce"`)) {
			t.Fatalf("bad hello answered %q", b)
		}
	}
	c := dialRaw(t, srv.Addr())
	c.Write(append([]byte(magicV1), 0, 0, 0, 2, '{', '}'))
	var w struct{ Err string }
	if err := ReadFrame(c, &w); err != nil || !strings.Contains(w.Err, "same mooncake-go version") {
		t.Fatalf("v1 peer told %+v, %v", w, err)
	}
}

// TestIncarnationAfterProof: a dial for a gone incarnation fails with
// ErrPeerRestarted, learnt only after the proof.
func TestIncarnationAfterProof(t *testing.T) {
	s := testSecret(t, "alpha-alpha-alpha-alpha")
	srv, cl := newHSEngine(t, s), newHSEngine(t, s)
	d := srv.Self()
	d.Incarnation = "gone"
	if _, err := cl.Dial(context.Background(), d, "ctl"); !errors.Is(err, ErrPeerRestarted) || !strings.Contains(err.Error(), srv.Incarnation()) {
		t.Fatalf("dial of a gone incarnation: %v", err)
	}
	if _, err := cl.Dial(context.Background(), srv.Self(), "no-such-kind"); err == nil || !strings.Contains(err.Error(), "no-such-kind") {
		t.Fatalf("dial of an unknown kind: %v", err)
	}
	c, err := cl.Dial(context.Background(), srv.Self(), "ctl")
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}

// FuzzServerHandshake feeds arbitrary bytes to the server side: it must
// never accept (the fuzzer holds no secret), never send a descriptor, and
// never answer more than a challenge and a refusal.
func FuzzServerHandshake(f *testing.F) {
	s := testSecret(f, "alpha-alpha-alpha-alpha")
	srv := newHSEngine(f, s)
	hello := func(h Hello) []byte {
		hb, _ := json.Marshal(h)
		return append(append([]byte(magic), binary.BigEndian.AppendUint32(nil, uint32(len(hb)))...), hb...)
	}
	good := Hello{Kind: "ctl", Name: "n", Incarnation: "i", Nonce: newNonce(), Auth: authHMAC, Describe: true}
	f.Add(hello(good))
	f.Add(append(hello(good), []byte("\x00\x00\x00\x0c{\"proof\":\"\"}")...))
	f.Add(append(hello(good), []byte("\x00\x00\x00\x0b{\"err\":\"x\"}")...))
	f.Add([]byte(magicV1 + "\x00\x00\x00\x02{}"))
	f.Add([]byte(magic + "\xff\xff\xff\xff"))
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) > 4096 {
			return
		}
		conn := &fakeConn{r: bytes.NewReader(in)}
		h, err := srv.serverHandshake(conn)
		if err == nil {
			t.Fatalf("accepted %+v from %q", h, in)
		}
		if l := leaks(conn.w.Bytes(), srv.Engine); len(l) > 0 {
			t.Fatalf("answered %q, leaking %v", conn.w.Bytes(), l)
		}
		if conn.w.Len() > 2*maxChallengeFrame {
			t.Fatalf("answered %d bytes", conn.w.Len())
		}
	})
}

// FuzzReadFrame: a frame is never longer than its cap, and a cap is never
// exceeded by what is allocated for it.
func FuzzReadFrame(f *testing.F) {
	f.Add([]byte("\x00\x00\x00\x02{}"), uint16(16))
	f.Add([]byte("\xff\xff\xff\xff"), uint16(1024))
	f.Fuzz(func(t *testing.T, in []byte, limit uint16) {
		b, err := readFrame(bytes.NewReader(in), uint32(limit))
		if err != nil {
			var tl *FrameTooLargeError
			if errors.As(err, &tl) && tl.Len <= uint32(limit) {
				t.Fatalf("refused %d bytes under a cap of %d", tl.Len, limit)
			}
			return
		}
		if len(b) > int(limit) || len(in) < 4 || int(binary.BigEndian.Uint32(in)) != len(b) {
			t.Fatalf("read %d bytes under a cap of %d from %q", len(b), limit, in)
		}
	})
}

// fakeConn reads a fixed input and records what is written.
type fakeConn struct {
	net.Conn
	r *bytes.Reader
	w bytes.Buffer
}

func (c *fakeConn) Read(p []byte) (int, error)  { return c.r.Read(p) }
func (c *fakeConn) Write(p []byte) (int, error) { return c.w.Write(p) }
func (c *fakeConn) RemoteAddr() net.Addr        { return &net.TCPAddr{IP: net.IPv4(192, 0, 2, 1), Port: 555} }
