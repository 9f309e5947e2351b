package transfer

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Every connection to an engine starts with the handshake below (byte layout
// in docs/format/handshake.md). The peer proves the cluster secret before it
// learns anything about the engine or gets any resource:
//
//	client: magic "MCG2", frame(Hello)     kind, name, incarnation, nonce, want
//	server: frame(Challenge)               server nonce, server proof
//	client: frame(Proof)                   client proof (after checking the server's)
//	server: frame(Verdict)                 accepted (+ descriptor) or the reason
//
// A frame is a 4-byte big-endian length followed by that many bytes of JSON.
// Frames before the verdict are capped at a few hundred bytes; the cap is
// checked before anything is allocated. After the verdict the connection
// belongs to the handler of Hello.Kind.

const (
	magic = "MCG2"
	// magicV1 is the previous version's magic: such a peer is told to
	// upgrade.
	magicV1 = "MCG1"
	// maxFrame caps frames on authenticated connections.
	maxFrame = 16 << 20
	// Caps of the frames exchanged before a peer proved the secret.
	maxHelloFrame     = 1 << 10
	maxChallengeFrame = 1 << 10
	maxProofFrame     = 256
	// handshakeTime bounds the client side of the handshake.
	handshakeTime = 5 * time.Second
	// proofTime bounds the server side from accept to the verdict: a peer
	// that has not proved the secret by then is closed.
	proofTime = 3 * time.Second
	// maxPending caps the connections of an engine awaiting proof; more are
	// refused at accept.
	maxPending = 64
)

// Authentication modes a side announces.
const (
	authHMAC = "hmac-sha256"
	authNone = "none"
)

// MAC domains of the two proofs.
const (
	serverDomain = "mooncake handshake v2 server"
	clientDomain = "mooncake handshake v2 client"
)

// Refusal codes of challenges and verdicts.
const (
	codeBusy = "busy" // challenge: too many connections await proof
	codeAuth = "auth" // challenge or verdict: authentication failed
	codeGone = "gone" // verdict: the wanted incarnation is not this one
	codeKind = "kind" // verdict: no handler for the connection kind
)

// Hello is what a connecting peer says about itself. Its fields are bound
// to both proofs, so they cannot be altered in flight.
type Hello struct {
	Kind        string `json:"kind"`
	Name        string `json:"name"`
	Incarnation string `json:"incarnation"`
	Nonce       string `json:"nonce"`
	// Want is the incarnation the client expects to reach ("" = any).
	Want string `json:"want,omitempty"`
	// Auth is the client's mode: "hmac-sha256" or "none".
	Auth string `json:"auth"`
	// Describe asks for the server's descriptor in the verdict.
	Describe bool `json:"describe,omitempty"`
}

type challenge struct {
	Code  string `json:"code,omitempty"`
	Err   string `json:"err,omitempty"`
	Auth  string `json:"auth,omitempty"`
	Nonce string `json:"nonce,omitempty"`
	Proof string `json:"proof,omitempty"`
}

type proofMsg struct {
	Proof string `json:"proof,omitempty"`
	// Err is set when the client refuses the server's proof.
	Err string `json:"err,omitempty"`
}

type verdict struct {
	Code string `json:"code,omitempty"`
	Err  string `json:"err,omitempty"`
	// Inc is the server's incarnation; Desc its sealed descriptor when the
	// hello asked for it.
	Inc  string          `json:"inc,omitempty"`
	Desc json.RawMessage `json:"desc,omitempty"`
}

// FrameTooLargeError is a frame whose declared length exceeds the cap of
// where it was read; nothing of it was read or allocated.
type FrameTooLargeError struct {
	Len, Max uint32
}

func (e *FrameTooLargeError) Error() string {
	return fmt.Sprintf("transfer: frame of %d bytes exceeds the %d-byte limit", e.Len, e.Max)
}

// WriteFrame writes one length-prefixed frame.
func WriteFrame(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(b) > maxFrame {
		return &FrameTooLargeError{Len: uint32(min(len(b), 1<<32-1)), Max: maxFrame}
	}
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	_, err = w.Write(buf)
	return err
}

// ReadFrame reads one length-prefixed frame of an authenticated connection
// into v.
func ReadFrame(r io.Reader, v any) error {
	b, err := readFrame(r, maxFrame)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// readFrame reads one frame's bytes, refusing (before reading or
// allocating them) a declared length above limit.
func readFrame(r io.Reader, limit uint32) ([]byte, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > limit {
		return nil, &FrameTooLargeError{Len: n, Max: limit}
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	return b, nil
}

// decodeFrame reads a capped frame into v.
func decodeFrame(r io.Reader, limit uint32, v any) ([]byte, error) {
	b, err := readFrame(r, limit)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return nil, fmt.Errorf("bad frame: %w", err)
	}
	return b, nil
}

func newNonce() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// validNonce: 16 bytes in lower-case hex, as newNonce makes.
func validNonce(s string) bool {
	if len(s) != 32 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// transcript is the hash both proofs cover: the magic and the hello's
// bytes as sent, so no hello field can be changed without failing them.
func transcript(hello []byte) []byte {
	h := sha256.New()
	h.Write([]byte(magic))
	h.Write(hello)
	return h.Sum(nil)
}

func authMode(s auth.Secret) string {
	if s.IsZero() {
		return authNone
	}
	return authHMAC
}

// side describes this engine's secret for messages (never the secret).
func side(s auth.Secret) string {
	if s.IsZero() {
		return "this side: no cluster secret (--insecure-no-cluster-token)"
	}
	return fmt.Sprintf("this side: %s, fingerprint %s", s.Source(), s.Fingerprint())
}

const fix = "give both the same --cluster-token (or --cluster-token-file, MOONCAKE_CLUSTER_TOKEN)"

// authFailed builds an ErrAuth error about peer.
func authFailed(s auth.Secret, peer, what string) error {
	return fmt.Errorf("%w: peer %s %s (%s); %s", ErrAuth, peer, what, side(s), fix)
}

// dialHandshake connects to addr and runs the client side. It returns the
// connection and, when describe is set, the server's descriptor (checked
// against this engine's secret).
func (e *Engine) dialHandshake(ctx context.Context, addr, kind, want string, describe bool) (net.Conn, *Descriptor, error) {
	d := net.Dialer{Timeout: e.cfg.Timeout}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: dial %s: %v", ErrPeerDead, addr, err)
	}
	dl := time.Now().Add(handshakeTime)
	if t, ok := ctx.Deadline(); ok && t.Before(dl) {
		dl = t
	}
	conn.SetDeadline(dl)
	desc, err := e.clientHandshake(conn, addr, kind, want, describe)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	conn.SetDeadline(time.Time{})
	return conn, desc, nil
}

func (e *Engine) clientHandshake(conn net.Conn, addr, kind, want string, describe bool) (*Descriptor, error) {
	s := e.cfg.Secret
	self := e.selfRef()
	h := Hello{Kind: kind, Name: self.Name, Incarnation: self.Incarnation, Nonce: newNonce(), Want: want,
		Auth: authMode(s), Describe: describe}
	hb, _ := json.Marshal(h)
	out := make([]byte, 0, len(magic)+4+len(hb))
	out = append(out, magic...)
	out = binary.BigEndian.AppendUint32(out, uint32(len(hb)))
	out = append(out, hb...)
	ioErr := func(step string, err error) error {
		return fmt.Errorf("%w: handshake with %s: %s: %v", ErrPeerDead, addr, step, err)
	}
	if _, err := conn.Write(out); err != nil {
		return nil, ioErr("hello", err)
	}
	var ch challenge
	if _, err := decodeFrame(conn, maxChallengeFrame, &ch); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) || isReset(err) {
			return nil, fmt.Errorf("%w: handshake with %s: the peer closed the connection before its challenge "+
				"(busy: too many connections await authentication there; or not a mooncake-go engine of this version): %v", ErrPeerDead, addr, err)
		}
		return nil, ioErr("challenge", err)
	}
	switch ch.Code {
	case "":
	case codeBusy:
		return nil, fmt.Errorf("transfer: %s refused the connection: %s", addr, ch.Err)
	case codeAuth:
		return nil, authFailed(s, addr, "refused this side: "+ch.Err)
	default:
		return nil, fmt.Errorf("transfer: %s refused the connection (%s): %s", addr, ch.Code, ch.Err)
	}
	th := transcript(hb)
	switch {
	case ch.Auth != h.Auth && s.IsZero():
		return nil, authFailed(s, addr, "requires a cluster secret and this side runs without one")
	case ch.Auth != h.Auth:
		_ = WriteFrame(conn, proofMsg{Err: "the server runs without authentication"})
		return nil, authFailed(s, addr, "runs without authentication (--insecure-no-cluster-token) and this side requires the cluster secret")
	case !validNonce(ch.Nonce):
		return nil, fmt.Errorf("transfer: handshake with %s: bad server nonce", addr)
	}
	var p proofMsg
	if !s.IsZero() {
		if !s.VerifyHex(ch.Proof, serverDomain, th, []byte(ch.Nonce)) {
			_ = WriteFrame(conn, proofMsg{Err: "the server's proof does not match the client's cluster secret"})
			return nil, authFailed(s, addr, "does not hold this cluster secret")
		}
		p.Proof = s.MACHex(clientDomain, th, []byte(ch.Nonce))
	}
	if err := WriteFrame(conn, p); err != nil {
		return nil, ioErr("proof", err)
	}
	// The server proved the secret (or both sides run without one): its
	// verdict may be large.
	var v verdict
	if _, err := decodeFrame(conn, maxFrame, &v); err != nil {
		return nil, ioErr("verdict", err)
	}
	switch v.Code {
	case "":
	case codeAuth:
		return nil, authFailed(s, addr, "refused this side's proof: "+v.Err)
	case codeGone:
		return nil, fmt.Errorf("%w: %s is now incarnation %s, expected %s", ErrPeerRestarted, addr, v.Inc, want)
	default:
		return nil, fmt.Errorf("transfer: %s refused the connection (%s): %s", addr, v.Code, v.Err)
	}
	if want != "" && v.Inc != want {
		return nil, fmt.Errorf("%w: %s is now incarnation %s, expected %s", ErrPeerRestarted, addr, v.Inc, want)
	}
	if !describe {
		return nil, nil
	}
	d, err := ReadDescriptor(s, "handshake with "+addr, "", v.Desc)
	if err != nil {
		return nil, err
	}
	if d.Incarnation != v.Inc {
		return nil, &DescriptorError{Key: "handshake with " + addr,
			Err: fmt.Errorf("descriptor of incarnation %s from incarnation %s", d.Incarnation, v.Inc)}
	}
	return d, nil
}

// handshakeError is a refused or failed server-side handshake, with the
// result label it counts under.
type handshakeError struct {
	result string // auth_failed, error
	err    error
}

func (e *handshakeError) Error() string { return e.err.Error() }
func (e *handshakeError) Unwrap() error { return e.err }

// serverHandshake runs the server side on an accepted connection (whose
// deadline the caller set). Nothing about this engine is sent before the
// peer's proof checks out.
func (e *Engine) serverHandshake(conn net.Conn) (Hello, error) {
	var h Hello
	peer := conn.RemoteAddr().String()
	fail := func(err error) (Hello, error) {
		result := "error"
		if errors.Is(err, ErrAuth) {
			result = "auth_failed"
		}
		return h, &handshakeError{result: result, err: err}
	}
	var m [4]byte
	if _, err := io.ReadFull(conn, m[:]); err != nil {
		return fail(fmt.Errorf("peer %s: no magic: %w", peer, err))
	}
	switch string(m[:]) {
	case magic:
	case magicV1:
		// A peer of the previous version reads a welcome frame with err.
		_, _ = readFrame(conn, maxHelloFrame)
		_ = WriteFrame(conn, challenge{Err: "this engine speaks handshake " + magic + "; run the same mooncake-go version on both sides"})
		return fail(fmt.Errorf("peer %s speaks the previous handshake version (%s); run the same mooncake-go version on both sides", peer, magicV1))
	default:
		return fail(fmt.Errorf("peer %s: bad magic %q", peer, m[:]))
	}
	hb, err := decodeFrame(conn, maxHelloFrame, &h)
	if err != nil {
		return fail(fmt.Errorf("peer %s: hello: %w", peer, err))
	}
	if !validNonce(h.Nonce) {
		return fail(fmt.Errorf("peer %s: hello: bad nonce", peer))
	}
	s := e.cfg.Secret
	who := fmt.Sprintf("%s (says it is segment %q)", peer, h.Name)
	switch mode := authMode(s); {
	case h.Auth == authNone && mode == authHMAC:
		_ = WriteFrame(conn, challenge{Code: codeAuth, Err: "this engine requires the cluster secret and the peer has none"})
		return fail(authFailed(s, who, "runs without a cluster secret (--insecure-no-cluster-token) and this engine requires one"))
	case h.Auth == authHMAC && mode == authNone:
		_ = WriteFrame(conn, challenge{Code: codeAuth, Err: "this engine runs without authentication (--insecure-no-cluster-token)"})
		return fail(authFailed(s, who, "proves a cluster secret and this engine runs without authentication"))
	case h.Auth != mode:
		return fail(fmt.Errorf("peer %s: hello: unknown auth mode %q", who, h.Auth))
	}
	th := transcript(hb)
	ch := challenge{Auth: authMode(s), Nonce: newNonce()}
	if !s.IsZero() {
		ch.Proof = s.MACHex(serverDomain, th, []byte(ch.Nonce))
	}
	if err := WriteFrame(conn, ch); err != nil {
		return fail(fmt.Errorf("peer %s: challenge: %w", who, err))
	}
	var p proofMsg
	if _, err := decodeFrame(conn, maxProofFrame, &p); err != nil {
		return fail(fmt.Errorf("peer %s: no proof: %w", who, err))
	}
	if p.Err != "" {
		return fail(authFailed(s, who, "does not hold this cluster secret (it refused this engine's proof)"))
	}
	if !s.IsZero() && !s.VerifyHex(p.Proof, clientDomain, th, []byte(ch.Nonce)) {
		_ = WriteFrame(conn, verdict{Code: codeAuth, Err: "the proof does not match this engine's cluster secret"})
		return fail(authFailed(s, who, "does not hold this cluster secret"))
	}
	// Accepted: from here on the peer may learn about this engine.
	self := e.selfRef()
	if h.Want != "" && h.Want != self.Incarnation {
		_ = WriteFrame(conn, verdict{Code: codeGone, Inc: self.Incarnation, Err: "incarnation " + h.Want + " is gone"})
		return fail(fmt.Errorf("peer %s wants incarnation %s; this is %s", who, h.Want, self.Incarnation))
	}
	e.mu.RLock()
	_, ok := e.handlers[h.Kind]
	e.mu.RUnlock()
	if !ok {
		_ = WriteFrame(conn, verdict{Code: codeKind, Err: "no handler for connections of kind " + h.Kind})
		return fail(fmt.Errorf("peer %s: connection of unknown kind %q", who, h.Kind))
	}
	v := verdict{Inc: self.Incarnation}
	if h.Describe {
		v.Desc, _ = json.Marshal(self)
	}
	return h, WriteFrame(conn, v)
}

// busyFrame is the challenge a connection refused at accept gets before it
// is closed.
var busyFrame = func() []byte {
	b, _ := json.Marshal(challenge{Code: codeBusy,
		Err: fmt.Sprintf("busy: %d connections await authentication there; retry", maxPending)})
	return append(binary.BigEndian.AppendUint32(nil, uint32(len(b))), b...)
}()

// refuseBusy closes a connection over the pending cap at once, telling the
// peer why (best effort: it never blocks the accept loop).
func refuseBusy(conn net.Conn) {
	conn.SetWriteDeadline(time.Now().Add(10 * time.Millisecond))
	_, _ = conn.Write(busyFrame)
	conn.Close()
}

// isReset reports a connection reset by the peer.
func isReset(err error) bool { return errors.Is(err, syscall.ECONNRESET) }

// limiter lets one log line through per interval and counts the others,
// so a flood of refused connections cannot flood the log.
type limiter struct {
	mu      sync.Mutex
	next    time.Time
	dropped int
}

// allow reports whether to log now, and how many lines were dropped since
// the last one logged.
func (l *limiter) allow(now time.Time, every time.Duration) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Before(l.next) {
		l.dropped++
		return false, 0
	}
	l.next = now.Add(every)
	n := l.dropped
	l.dropped = 0
	return true, n
}
