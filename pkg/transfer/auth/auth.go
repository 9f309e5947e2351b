// Package auth holds the cluster secret that peers of one mooncake-go
// cluster prove to each other: transfer engines in their handshake, the
// registry's descriptors, the bootstrap server's requests and the load
// balancer's vouchers. The secret never crosses the wire; every proof is an
// HMAC-SHA256 over a domain name and length-prefixed parts, so a MAC made for
// one purpose cannot be replayed as another.
//
// Where the secret comes from is the caller's choice: an operator's token
// (New), a file (FromFile), or, for processes of one user on one host, a
// per-user file created on first use (UserDefault).
package auth

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ErrNoSecret is returned where a secret is required and none was given.
var ErrNoSecret = errors.New("auth: no cluster secret")

// MinTokenLen is the shortest token New accepts.
const MinTokenLen = 16

// Secret is a cluster secret. The zero value is "no secret": IsZero reports
// it, and MAC on it panics, so a caller that forgot to load one fails
// loudly instead of authenticating with an empty key.
type Secret struct {
	key    []byte
	source string
}

// New makes a secret from an operator's token (--cluster-token and the
// like). source names where it came from, for messages ("--cluster-token").
func New(token, source string) (Secret, error) {
	token = strings.TrimSpace(token)
	if len(token) < MinTokenLen {
		return Secret{}, fmt.Errorf("auth: %s: a cluster token needs at least %d characters, got %d", source, MinTokenLen, len(token))
	}
	return Secret{key: []byte(token), source: source}, nil
}

// FromFile reads a token from path (surrounding white space is dropped). The
// file must not be readable or writable by group or others.
func FromFile(path string) (Secret, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return Secret{}, fmt.Errorf("auth: cluster token file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Secret{}, fmt.Errorf("auth: cluster token file: %w", err)
	}
	if !st.Mode().IsRegular() {
		return Secret{}, fmt.Errorf("auth: cluster token file %s is not a regular file", path)
	}
	if st.Mode().Perm()&0o077 != 0 {
		return Secret{}, fmt.Errorf("auth: cluster token file %s has mode %v: it must be readable by its owner only (chmod 600)", path, st.Mode().Perm())
	}
	b := make([]byte, 4097)
	n, _ := f.Read(b)
	if n > 4096 {
		return Secret{}, fmt.Errorf("auth: cluster token file %s is larger than 4 KiB", path)
	}
	return New(string(b[:n]), "cluster token file "+path)
}

// IsZero reports whether s holds no secret.
func (s Secret) IsZero() bool { return len(s.key) == 0 }

// Source says where the secret came from ("--cluster-token", "per-user
// secret /tmp/...").
func (s Secret) Source() string {
	if s.IsZero() {
		return "none"
	}
	return s.source
}

// Fingerprint is a short public id of the secret, safe to log and compare:
// two processes with the same fingerprint hold the same secret.
func (s Secret) Fingerprint() string {
	if s.IsZero() {
		return "none"
	}
	return hex.EncodeToString(s.MAC("mooncake fingerprint")[:6])
}

// MAC is HMAC-SHA256 under the secret over domain and each part, every one
// prefixed by its length.
func (s Secret) MAC(domain string, parts ...[]byte) []byte {
	if s.IsZero() {
		panic("auth: MAC with no secret")
	}
	m := hmac.New(sha256.New, s.key)
	var n [4]byte
	write := func(b []byte) {
		binary.BigEndian.PutUint32(n[:], uint32(len(b)))
		m.Write(n[:])
		m.Write(b)
	}
	write([]byte(domain))
	for _, p := range parts {
		write(p)
	}
	return m.Sum(nil)
}

// MACHex is MAC in lower-case hex.
func (s Secret) MACHex(domain string, parts ...[]byte) string {
	return hex.EncodeToString(s.MAC(domain, parts...))
}

// Verify reports, in constant time, whether mac is MAC(domain, parts...).
// It is false for the zero secret.
func (s Secret) Verify(mac []byte, domain string, parts ...[]byte) bool {
	if s.IsZero() || len(mac) != sha256.Size {
		return false
	}
	return hmac.Equal(mac, s.MAC(domain, parts...))
}

// VerifyHex is Verify of a hex MAC.
func (s Secret) VerifyHex(mac, domain string, parts ...[]byte) bool {
	b, err := hex.DecodeString(mac)
	return err == nil && s.Verify(b, domain, parts...)
}

// UserDefault returns the secret shared by the processes of the calling
// user on this host, creating it on first use. It lives in a directory of
// that user's own, whose place and owner come from the real uid (not from
// $HOME, $TMPDIR or $XDG_RUNTIME_DIR, which a process of another user may
// have inherited): /run/user/<uid>/mooncake-go when /run/user/<uid> is the
// user's, else /tmp/mooncake-go-<uid>.
func UserDefault() (Secret, error) {
	uid := os.Getuid()
	base := filepath.Join("/tmp", "mooncake-go-"+strconv.Itoa(uid))
	if run := filepath.Join("/run/user", strconv.Itoa(uid)); ownedPrivateDir(run, uid) == nil {
		base = filepath.Join(run, "mooncake-go")
	}
	return UserDefaultIn(base)
}

// UserDefaultIn is UserDefault with its directory given: dir is created
// 0700 if missing and must be a directory (not a link) owned by the caller
// with no access for group or others; the secret is dir/cluster-secret,
// 0600, 32 random bytes in hex, made atomically by whichever process comes
// first.
func UserDefaultIn(dir string) (Secret, error) {
	uid := os.Getuid()
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return Secret{}, fmt.Errorf("auth: per-user secret directory: %w", err)
	}
	if err := ownedPrivateDir(dir, uid); err != nil {
		return Secret{}, fmt.Errorf("auth: per-user secret directory: %w (remove it, or give --cluster-token)", err)
	}
	path := filepath.Join(dir, "cluster-secret")
	s, err := readUserSecret(path, uid)
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		return s, err
	}
	// Write a fresh secret under a unique name, then link it into place:
	// exactly one process's link succeeds and every process reads that.
	var raw [32]byte
	if _, err := rand.Read(raw[:]); err != nil {
		return Secret{}, fmt.Errorf("auth: make per-user secret: %w", err)
	}
	tmp, err := os.CreateTemp(dir, ".cluster-secret-*")
	if err != nil {
		return Secret{}, fmt.Errorf("auth: make per-user secret: %w", err)
	}
	defer os.Remove(tmp.Name())
	_, werr := tmp.WriteString(hex.EncodeToString(raw[:]) + "\n")
	if cerr := tmp.Close(); werr == nil {
		werr = cerr
	}
	if werr != nil {
		return Secret{}, fmt.Errorf("auth: make per-user secret: %w", werr)
	}
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, os.ErrExist) {
		return Secret{}, fmt.Errorf("auth: make per-user secret: %w", err)
	}
	return readUserSecret(path, uid)
}

func readUserSecret(path string, uid int) (Secret, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return Secret{}, err
		}
		return Secret{}, fmt.Errorf("auth: per-user secret: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Secret{}, fmt.Errorf("auth: per-user secret: %w", err)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	switch {
	case !st.Mode().IsRegular():
		return Secret{}, fmt.Errorf("auth: per-user secret %s is not a regular file", path)
	case !ok || int(sys.Uid) != uid:
		return Secret{}, fmt.Errorf("auth: per-user secret %s is not owned by uid %d", path, uid)
	case st.Mode().Perm()&0o077 != 0:
		return Secret{}, fmt.Errorf("auth: per-user secret %s has mode %v, want 0600", path, st.Mode().Perm())
	}
	b := make([]byte, 129)
	n, _ := f.Read(b)
	tok := strings.TrimSpace(string(b[:n]))
	if len(tok) < MinTokenLen || n > 128 {
		return Secret{}, fmt.Errorf("auth: per-user secret %s is malformed (remove it to make a new one)", path)
	}
	return Secret{key: []byte(tok), source: "per-user secret " + path}, nil
}

// ownedPrivateDir checks that dir is a directory, not a link, owned by uid
// and closed to group and others.
func ownedPrivateDir(dir string, uid int) error {
	st, err := os.Lstat(dir)
	if err != nil {
		return err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	switch {
	case st.Mode()&os.ModeSymlink != 0:
		return fmt.Errorf("%s is a symbolic link", dir)
	case !st.IsDir():
		return fmt.Errorf("%s is not a directory", dir)
	case !ok || int(sys.Uid) != uid:
		return fmt.Errorf("%s is not owned by uid %d", dir, uid)
	case st.Mode().Perm()&0o077 != 0:
		return fmt.Errorf("%s has mode %v, want 0700", dir, st.Mode().Perm())
	}
	return nil
}
