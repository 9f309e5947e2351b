// Package voucher is the load balancer's proof that it set a request's
// bootstrap fields (bootstrap_host, bootstrap_port, bootstrap_room): an
// HMAC under the cluster secret over the fields and the time, sent in a
// header to both servers of the pair. A prefill or decode server takes the
// fields only with a voucher that matches them, is fresh and that it has not
// seen before; so a client cannot make a decode server dial an address of
// its choosing, nor join a room of another request.
//
// Header value: "v1.<unix milliseconds>.<64 hex digits of HMAC-SHA256>",
// the MAC over the domain "mooncake-go lb bootstrap voucher v1" and the
// parts (time as sent, room in decimal, host, port in decimal).
package voucher

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Header is the HTTP header that carries a voucher.
const Header = "X-Mooncake-Bootstrap-Voucher"

// MaxSkew is how far a voucher's time may be from the checking server's
// clock, either way. A voucher is accepted once per server within it.
const MaxSkew = 30 * time.Second

// DefaultMaxRemembered bounds the rooms a Checker remembers (rooms
// accepted in the last 2*MaxSkew).
const DefaultMaxRemembered = 1 << 19

const (
	domain  = "mooncake-go lb bootstrap voucher v1"
	version = "v1."
	maxLen  = 128 // longer header values are malformed without parsing
)

// Errors of Check, for errors.Is.
var (
	ErrMissing   = errors.New("voucher: the request has no bootstrap voucher")
	ErrMalformed = errors.New("voucher: malformed bootstrap voucher")
	ErrMismatch  = errors.New("voucher: the bootstrap voucher does not match the bootstrap fields under this server's cluster secret")
	ErrStale     = errors.New("voucher: the bootstrap voucher is outside its time window")
	ErrReplayed  = errors.New("voucher: the bootstrap voucher was already used")
	ErrBusy      = errors.New("voucher: too many vouched requests in the replay window")
)

// Fields are what a voucher vouches for.
type Fields struct {
	Host string
	Port int
	Room uint64
}

// Sign returns the header value vouching for f at now. s must not be zero.
func Sign(s auth.Secret, f Fields, now time.Time) string {
	ts := strconv.FormatInt(now.UnixMilli(), 10)
	return version + ts + "." + s.MACHex(domain, parts(ts, f)...)
}

func parts(ts string, f Fields) [][]byte {
	return [][]byte{[]byte(ts), strconv.AppendUint(nil, f.Room, 10), []byte(f.Host), strconv.AppendInt(nil, int64(f.Port), 10)}
}

// Checker checks vouchers. It is safe for concurrent use.
type Checker struct {
	secret auth.Secret
	max    int
	now    func() time.Time

	mu    sync.Mutex
	seen  map[uint64]struct{}
	queue []seenRoom // in order of acceptance
	head  int
}

type seenRoom struct {
	room   uint64
	expiry time.Time
}

// NewChecker returns a Checker for vouchers made with s, remembering at
// most maxRemembered rooms (0: DefaultMaxRemembered). The zero secret
// accepts no voucher.
func NewChecker(s auth.Secret, maxRemembered int) *Checker {
	if maxRemembered <= 0 {
		maxRemembered = DefaultMaxRemembered
	}
	return &Checker{secret: s, max: maxRemembered, now: time.Now, seen: map[uint64]struct{}{}}
}

// Check verifies header, a voucher, for f. It fails with an error wrapping
// one of the package's sentinels.
func (c *Checker) Check(header string, f Fields) error {
	if header == "" {
		return ErrMissing
	}
	ts, mac, ok := split(header)
	if !ok {
		return ErrMalformed
	}
	if !c.secret.VerifyHex(mac, domain, parts(ts, f)...) {
		return ErrMismatch
	}
	ms, _ := strconv.ParseInt(ts, 10, 64) // split checked the digits
	now := c.now()
	if skew := now.Sub(time.UnixMilli(ms)); skew > MaxSkew || skew < -MaxSkew {
		return fmt.Errorf("%w: made %v from this server's clock, more than %v (are the clocks in step?)", ErrStale, skew.Round(time.Millisecond), MaxSkew)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	// A voucher accepted now is fresh until at most now+2*MaxSkew.
	for c.head < len(c.queue) && !now.Before(c.queue[c.head].expiry) {
		delete(c.seen, c.queue[c.head].room)
		c.queue[c.head] = seenRoom{}
		c.head++
	}
	if c.head > len(c.queue)/2 {
		c.queue = append(c.queue[:0], c.queue[c.head:]...)
		c.head = 0
	}
	if _, dup := c.seen[f.Room]; dup {
		return fmt.Errorf("%w (room %d)", ErrReplayed, f.Room)
	}
	if len(c.seen) >= c.max {
		return fmt.Errorf("%w: %d rooms in %v", ErrBusy, len(c.seen), 2*MaxSkew)
	}
	c.seen[f.Room] = struct{}{}
	c.queue = append(c.queue, seenRoom{f.Room, now.Add(2 * MaxSkew)})
	return nil
}

// split parses "v1.<digits>.<64 hex>".
func split(h string) (ts, mac string, ok bool) {
	if len(h) > maxLen || !strings.HasPrefix(h, version) {
		return "", "", false
	}
	ts, mac, ok = strings.Cut(h[len(version):], ".")
	if !ok || len(ts) == 0 || len(ts) > 16 || len(mac) != 64 {
		return "", "", false
	}
	for i := 0; i < len(ts); i++ {
		if ts[i] < '0' || ts[i] > '9' {
			return "", "", false
		}
	}
	return ts, mac, true
}
