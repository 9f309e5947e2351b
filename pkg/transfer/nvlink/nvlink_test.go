package nvlink

import (
	"errors"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

func TestNoGPU(t *testing.T) {
	err := Available()
	if err == nil {
		t.Skip("a GPU is present: the no-GPU path is not reachable")
	}
	if !errors.Is(err, cuda.ErrNoDriver) && !errors.Is(err, cuda.ErrNoDevice) {
		t.Fatalf("Available: %v, want ErrNoDriver or ErrNoDevice", err)
	}
	for name, f := range map[string]func(Config) (*Transport, error){"nvlink": New, "mnnvl": NewMNNVL} {
		tr, err := f(Config{})
		if tr != nil || err == nil || !strings.HasPrefix(err.Error(), name+": ") {
			t.Fatalf("%s without GPU: %v, %v", name, tr, err)
		}
		t.Logf("%s: %v", name, err)
	}
	fc := CheckFabric()
	if fc.Usable || fc.Reason == "" {
		t.Fatalf("CheckFabric without GPU: %+v", fc)
	}
}

// The codec itself is tested and fuzzed in fdshare; these pin nvlink's
// layout (docs/format/nvlink.md) and its own checks.
func TestWireRoundTrip(t *testing.T) {
	for _, p := range []fdshare.Packet{
		{Type: fdshare.TypeHello, Text: "incarnation"},
		{Type: fdshare.TypeWelcome, Status: 1, Text: "unknown ticket"},
		{Type: fdshare.TypeMapReq, Req: 7, Region: 3},
		{Type: fdshare.TypeMapReply, Kind: wireVMMFD, Flags: fdshare.FlagWritable, Req: 7, Region: 3, Offset: 4096, Size: 1 << 30, Gran: 2 << 20},
		{Type: fdshare.TypeMapReply, Kind: wireIPC, Req: 8, Region: 4, Size: 64 << 20, Key: [64]byte{1, 2, 3, 63: 9}},
		{Type: fdshare.TypeRevoke, Region: 3},
	} {
		b := wire.Append(nil, &p)
		if len(b) != 128+len(p.Text) {
			t.Fatalf("%+v: %d bytes", p, len(b))
		}
		q, err := wire.Decode(b)
		if err != nil {
			t.Fatalf("%+v: %v", p, err)
		}
		if q != p {
			t.Fatalf("round trip: %+v != %+v", q, p)
		}
	}
	b := wire.Append(nil, &fdshare.Packet{Type: fdshare.TypeMapReply, Kind: wireIPC, Flags: 1, Gran: 5, Key: [64]byte{63: 9}})
	for off, want := range map[int]byte{2: wireIPC, 4: 1, 40: 5, 127: 9} {
		if b[off] != want {
			t.Errorf("byte %d = %d, want %d", off, b[off], want)
		}
	}
	long := fdshare.Packet{Type: fdshare.TypeWelcome, Status: 1, Text: strings.Repeat("x", 300)}
	if q, err := wire.Decode(wire.Append(nil, &long)); err != nil || len(q.Text) != fdshare.MaxText {
		t.Fatalf("long text: %v %d", err, len(q.Text))
	}
}

func TestWireRejects(t *testing.T) {
	good := wire.Append(nil, &fdshare.Packet{Type: fdshare.TypeMapReply, Kind: wireHost, Offset: 10, Size: 100})
	for name, b := range map[string][]byte{
		"short":         good[:50],
		"trailing":      append(append([]byte{}, good...), 0),
		"type":          func() []byte { c := append([]byte{}, good...); c[0] = 9; return c }(),
		"kind":          func() []byte { c := append([]byte{}, good...); c[2] = 0; return c }(),
		"reserved":      func() []byte { c := append([]byte{}, good...); c[50] = 1; return c }(),
		"offset > size": wire.Append(nil, &fdshare.Packet{Type: fdshare.TypeMapReply, Kind: wireHost, Offset: 101, Size: 100}),
		"too long":      make([]byte, wire.MaxPacket()+1),
	} {
		if _, err := wire.Decode(b); !errors.Is(err, fdshare.ErrBadPacket) {
			t.Errorf("%s: %v, want ErrBadPacket", name, err)
		}
	}
}

func TestDecodeHandle(t *testing.T) {
	for raw, ok := range map[string]bool{
		`{"kind":"vmm-fd","id":1,"device":0,"size":4096,"offset":0}`: true,
		`{"kind":"host","id":2,"device":-1,"size":100,"offset":10}`:  true,
		`{"kind":"ipc","id":3,"size":10,"offset":11}`:                false,
		`{"kind":"bogus","id":3}`:                                    false,
		`{"kind":"vmm-fabric","id":1,"size":1,"fabric":"AAE="}`:      false,
		`not json`: false,
	} {
		if _, err := decodeHandle([]byte(raw)); (err == nil) != ok {
			t.Errorf("%s: %v", raw, err)
		}
	}
}

func TestNormBus(t *testing.T) {
	for in, want := range map[string]string{
		"00000000:19:00.0": "0000:19:00.0",
		"0000:1A:00.0":     "0000:1a:00.0",
		"":                 "",
	} {
		if got := normBus(in); got != want {
			t.Errorf("normBus(%q) = %q, want %q", in, got, want)
		}
	}
}
