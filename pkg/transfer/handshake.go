package transfer

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Every connection to an engine starts with the handshake below (byte layout
// in docs/format/handshake.md):
//
//	client: magic "MCG1", frame(Hello)
//	server: frame(Welcome)     descriptor, server nonce, server proof
//	client: frame(Proof)       client proof ("" when no token is set)
//	server: frame(Verdict)     "" = accepted, else the reason
//
// A frame is a 4-byte big-endian length followed by that many bytes of JSON.
// After the verdict the connection belongs to the handler of Hello.Kind.

const (
	magic         = "MCG1"
	maxFrame      = 16 << 20
	handshakeTime = 5 * time.Second
)

// Hello is what a connecting peer says about itself.
type Hello struct {
	Kind        string `json:"kind"`
	Name        string `json:"name"`
	Incarnation string `json:"incarnation"`
	Nonce       string `json:"nonce"`
	// Want is the incarnation the client expects to reach ("" = any).
	Want string `json:"want,omitempty"`
}

type welcome struct {
	Err   string          `json:"err,omitempty"`
	Desc  json.RawMessage `json:"desc,omitempty"`
	Nonce string          `json:"nonce"`
	Proof string          `json:"proof,omitempty"`
}

type proofMsg struct {
	Proof string `json:"proof"`
}

type verdict struct {
	Err string `json:"err,omitempty"`
}

// WriteFrame writes one length-prefixed frame.
func WriteFrame(w io.Writer, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(b) > maxFrame {
		return fmt.Errorf("transfer: frame of %d bytes exceeds %d", len(b), maxFrame)
	}
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	_, err = w.Write(buf)
	return err
}

// ReadFrame reads one length-prefixed frame into v.
func ReadFrame(r io.Reader, v any) error {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxFrame {
		return fmt.Errorf("transfer: frame of %d bytes exceeds %d", n, maxFrame)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

func newNonce() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func proof(s auth.Secret, role, a, b string) string {
	if s.IsZero() {
		return ""
	}
	return s.MACHex("mooncake handshake "+role, []byte(a), []byte(b))
}

// dialHandshake connects to addr and runs the client side. It returns the
// connection and the server's descriptor.
func (e *Engine) dialHandshake(ctx context.Context, addr, kind, want string) (net.Conn, *Descriptor, error) {
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
	desc, err := e.clientHandshake(conn, kind, want)
	if err != nil {
		conn.Close()
		return nil, nil, err
	}
	conn.SetDeadline(time.Time{})
	return conn, desc, nil
}

func (e *Engine) clientHandshake(conn net.Conn, kind, want string) (*Descriptor, error) {
	self := e.selfRef()
	h := Hello{Kind: kind, Name: self.Name, Incarnation: self.Incarnation, Nonce: newNonce(), Want: want}
	if _, err := conn.Write([]byte(magic)); err != nil {
		return nil, fmt.Errorf("%w: handshake: %v", ErrPeerDead, err)
	}
	if err := WriteFrame(conn, h); err != nil {
		return nil, fmt.Errorf("%w: handshake: %v", ErrPeerDead, err)
	}
	var w welcome
	if err := ReadFrame(conn, &w); err != nil {
		return nil, fmt.Errorf("%w: handshake: %v", ErrPeerDead, err)
	}
	if w.Err != "" {
		return nil, errors.New("transfer: peer refused: " + w.Err)
	}
	desc, err := DecodeDescriptor(w.Desc)
	if err != nil {
		return nil, err
	}
	tok := e.cfg.Secret
	if desc.TokenRequired && tok.IsZero() {
		return nil, fmt.Errorf("%w: %s requires a cluster token and none is configured here", ErrAuth, desc.Name)
	}
	if !tok.IsZero() {
		if !hmac.Equal([]byte(w.Proof), []byte(proof(tok, "server", h.Nonce, w.Nonce))) {
			return nil, fmt.Errorf("%w: %s did not prove the cluster token", ErrAuth, desc.Name)
		}
	}
	if err := WriteFrame(conn, proofMsg{Proof: proof(tok, "client", w.Nonce, h.Nonce)}); err != nil {
		return nil, fmt.Errorf("%w: handshake: %v", ErrPeerDead, err)
	}
	var v verdict
	if err := ReadFrame(conn, &v); err != nil {
		return nil, fmt.Errorf("%w: handshake: %v", ErrPeerDead, err)
	}
	if v.Err != "" {
		if want != "" && desc.Incarnation != want {
			// The server refuses a stale incarnation; say so as a restart.
			return nil, fmt.Errorf("%w: %s is now incarnation %s, expected %s", ErrPeerRestarted, desc.Name, desc.Incarnation, want)
		}
		if v.Err == errTokenMsg {
			return nil, fmt.Errorf("%w by %s", ErrAuth, desc.Name)
		}
		return nil, errors.New("transfer: peer refused: " + v.Err)
	}
	if want != "" && desc.Incarnation != want {
		return nil, fmt.Errorf("%w: %s is now incarnation %s, expected %s", ErrPeerRestarted, desc.Name, desc.Incarnation, want)
	}
	return desc, nil
}

const errTokenMsg = "cluster token rejected"

// serverHandshake runs the server side on an accepted connection.
func (e *Engine) serverHandshake(conn net.Conn) (Hello, error) {
	var h Hello
	var m [4]byte
	if _, err := io.ReadFull(conn, m[:]); err != nil {
		return h, err
	}
	if string(m[:]) != magic {
		return h, fmt.Errorf("bad magic %q", m[:])
	}
	if err := ReadFrame(conn, &h); err != nil {
		return h, err
	}
	self := e.selfRef()
	tok := e.cfg.Secret
	desc, _ := json.Marshal(self)
	w := welcome{Desc: desc, Nonce: newNonce()}
	w.Proof = proof(tok, "server", h.Nonce, w.Nonce)
	if err := WriteFrame(conn, w); err != nil {
		return h, err
	}
	var p proofMsg
	if err := ReadFrame(conn, &p); err != nil {
		return h, err
	}
	if !tok.IsZero() && !hmac.Equal([]byte(p.Proof), []byte(proof(tok, "client", w.Nonce, h.Nonce))) {
		_ = WriteFrame(conn, verdict{Err: errTokenMsg})
		return h, fmt.Errorf("%w: peer %q did not prove the cluster token", ErrAuth, h.Name)
	}
	if h.Want != "" && h.Want != self.Incarnation {
		_ = WriteFrame(conn, verdict{Err: "incarnation " + h.Want + " is gone; this is " + self.Incarnation})
		return h, fmt.Errorf("peer %q wants incarnation %s", h.Name, h.Want)
	}
	return h, WriteFrame(conn, verdict{})
}
