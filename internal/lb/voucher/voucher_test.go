package voucher

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

func secret(t testing.TB, tok string) auth.Secret {
	s, err := auth.New(tok, "test")
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// clock is a Checker's clock under a test's control.
type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func checker(t testing.TB, s auth.Secret, max int) (*Checker, *clock) {
	c := NewChecker(s, max)
	clk := &clock{time.UnixMilli(1_800_000_000_000)}
	c.now = clk.now
	return c, clk
}

func TestCheck(t *testing.T) {
	s := secret(t, "0123456789abcdef-cluster")
	f := Fields{Host: "10.0.0.7", Port: 8998, Room: 1<<62 + 5}
	c, clk := checker(t, s, 0)
	v := Sign(s, f, clk.t)
	if !strings.HasPrefix(v, "v1.1800000000000.") || len(v) != len("v1.1800000000000.")+64 {
		t.Fatalf("voucher %q: want v1.<ms>.<64 hex>", v)
	}
	for _, c2 := range []struct {
		name   string
		header string
		f      Fields
		want   error
	}{
		{"missing", "", f, ErrMissing},
		{"other host", v, Fields{"10.0.0.8", f.Port, f.Room}, ErrMismatch},
		{"other port", v, Fields{f.Host, 8999, f.Room}, ErrMismatch},
		{"other room", v, Fields{f.Host, f.Port, f.Room + 1}, ErrMismatch},
		{"other secret", Sign(secret(t, "another-secret-of-16"), f, clk.t), f, ErrMismatch},
		{"other time", strings.Replace(v, ".1800000000000.", ".1800000000001.", 1), f, ErrMismatch},
		{"truncated", v[:len(v)-1], f, ErrMalformed},
		{"version", "v2" + v[2:], f, ErrMalformed},
		{"sign", "v1.+1800000000000." + v[len(v)-64:], f, ErrMalformed},
		{"no mac", "v1.1800000000000", f, ErrMalformed},
		{"long", v + strings.Repeat("0", 200), f, ErrMalformed},
		{"stale", Sign(s, f, clk.t.Add(-MaxSkew-time.Millisecond)), f, ErrStale},
		{"future", Sign(s, f, clk.t.Add(MaxSkew+time.Millisecond)), f, ErrStale},
	} {
		t.Run(c2.name, func(t *testing.T) {
			if err := c.Check(c2.header, c2.f); !errors.Is(err, c2.want) {
				t.Fatalf("Check(%q, %+v) = %v, want %v", c2.header, c2.f, err, c2.want)
			}
		})
	}
	if err := c.Check(v, f); err != nil {
		t.Fatalf("valid voucher: %v", err)
	}
	if err := c.Check(v, f); !errors.Is(err, ErrReplayed) {
		t.Fatalf("replayed voucher: %v, want ErrReplayed", err)
	}
	// Within the skew, either way.
	for i, at := range []time.Duration{-MaxSkew, MaxSkew} {
		g := Fields{"h", 1, uint64(i)}
		if err := c.Check(Sign(s, g, clk.t.Add(at)), g); err != nil {
			t.Fatalf("voucher %v from now: %v", at, err)
		}
	}
	// The zero secret accepts nothing.
	if err := NewChecker(auth.Secret{}, 0).Check(v, f); !errors.Is(err, ErrMismatch) {
		t.Fatalf("zero secret: %v", err)
	}
}

// TestRemembered: rooms are remembered for 2*MaxSkew, at most max at once.
func TestRemembered(t *testing.T) {
	s := secret(t, "0123456789abcdef-cluster")
	c, clk := checker(t, s, 3)
	f := func(room uint64) Fields { return Fields{"h", 1, room} }
	for room := range uint64(3) {
		if err := c.Check(Sign(s, f(room), clk.t), f(room)); err != nil {
			t.Fatal(err)
		}
		clk.t = clk.t.Add(time.Second)
	}
	if err := c.Check(Sign(s, f(3), clk.t), f(3)); !errors.Is(err, ErrBusy) {
		t.Fatalf("fourth room: %v, want ErrBusy", err)
	}
	// Room 0 expires 2*MaxSkew after it was accepted: a new voucher for it
	// (fresh time) is accepted again; room 1 is still remembered.
	clk.t = clk.t.Add(2*MaxSkew - 3*time.Second)
	if err := c.Check(Sign(s, f(0), clk.t), f(0)); err != nil {
		t.Fatalf("room 0 after expiry: %v", err)
	}
	if err := c.Check(Sign(s, f(1), clk.t), f(1)); !errors.Is(err, ErrReplayed) {
		t.Fatalf("room 1 before expiry: %v, want ErrReplayed", err)
	}
	clk.t = clk.t.Add(time.Second) // room 1 expires: room 3 fits
	if err := c.Check(Sign(s, f(3), clk.t), f(3)); err != nil {
		t.Fatalf("room 3: %v", err)
	}
	if got := len(c.seen); got != 3 {
		t.Fatalf("%d rooms remembered, want 3", got)
	}
}

// FuzzCheck: whatever the header, Check never panics, and it accepts only
// a voucher made with the secret for exactly these fields; each at most
// once.
func FuzzCheck(f *testing.F) {
	s := secret(f, "0123456789abcdef-cluster")
	now := time.UnixMilli(1_800_000_000_000)
	good := Fields{"127.0.0.1", 8998, 42}
	f.Add(Sign(s, good, now), good.Host, good.Port, good.Room)
	f.Add(Sign(s, good, now.Add(-time.Second)), good.Host, good.Port, good.Room)
	f.Add(Sign(s, good, now), good.Host, good.Port, good.Room+1)
	f.Add("v1.1.", "", 0, uint64(0))
	f.Add("", "h", 1, uint64(1))
	f.Fuzz(func(t *testing.T, header, host string, port int, room uint64) {
		c, clk := checker(t, s, 0)
		clk.t = now
		fl := Fields{host, port, room}
		err := c.Check(header, fl)
		if err == nil {
			ts, _, _ := split(header)
			if want := "v1." + ts + "." + s.MACHex(domain, parts(ts, fl)...); !strings.EqualFold(header, want) {
				t.Fatalf("Check accepted %q for %+v; the secret signs %q", header, fl, want)
			}
			if err := c.Check(header, fl); !errors.Is(err, ErrReplayed) {
				t.Fatalf("second Check of %q: %v, want ErrReplayed", header, err)
			}
			return
		}
		for _, e := range []error{ErrMissing, ErrMalformed, ErrMismatch, ErrStale} {
			if errors.Is(err, e) {
				return
			}
		}
		t.Fatalf("Check(%q) = %v: not one of the sentinels", header, err)
	})
}
