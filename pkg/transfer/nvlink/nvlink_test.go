package nvlink

import (
	"errors"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
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

func TestWireRoundTrip(t *testing.T) {
	for _, p := range []packet{
		{Type: typeHello, Text: "incarnation"},
		{Type: typeWelcome, Status: 1, Text: "unknown ticket"},
		{Type: typeMapReq, Req: 7, Region: 3},
		{Type: typeMapReply, Kind: wireVMMFD, Flags: flagWritable, Req: 7, Region: 3, Offset: 4096, Size: 1 << 30, Gran: 2 << 20},
		{Type: typeMapReply, Kind: wireIPC, Req: 8, Region: 4, Size: 64 << 20, Key: [64]byte{1, 2, 3, 63: 9}},
		{Type: typeRevoke, Region: 3},
	} {
		b := p.appendTo(nil)
		q, err := decodePacket(b)
		if err != nil {
			t.Fatalf("%+v: %v", p, err)
		}
		if q != p {
			t.Fatalf("round trip: %+v != %+v", q, p)
		}
	}
	long := packet{Type: typeWelcome, Status: 1, Text: strings.Repeat("x", 300)}
	if q, err := decodePacket(long.appendTo(nil)); err != nil || len(q.Text) != maxText {
		t.Fatalf("long text: %v %d", err, len(q.Text))
	}
}

func TestWireRejects(t *testing.T) {
	good := (&packet{Type: typeMapReply, Kind: wireHost, Offset: 10, Size: 100}).appendTo(nil)
	for name, b := range map[string][]byte{
		"short":         good[:50],
		"trailing":      append(append([]byte{}, good...), 0),
		"type":          func() []byte { c := append([]byte{}, good...); c[0] = 9; return c }(),
		"kind":          func() []byte { c := append([]byte{}, good...); c[2] = 0; return c }(),
		"reserved":      func() []byte { c := append([]byte{}, good...); c[50] = 1; return c }(),
		"offset > size": (&packet{Type: typeMapReply, Kind: wireHost, Offset: 101, Size: 100}).appendTo(nil),
		"too long":      make([]byte, maxPacket+1),
	} {
		if _, err := decodePacket(b); !errors.Is(err, errBadPacket) {
			t.Errorf("%s: %v, want errBadPacket", name, err)
		}
	}
}

func FuzzDecodePacket(f *testing.F) {
	f.Add((&packet{Type: typeHello, Text: "x"}).appendTo(nil))
	f.Add((&packet{Type: typeMapReply, Kind: wireVMMFD, Size: 1 << 21, Gran: 1 << 21}).appendTo(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 4096 {
			return
		}
		p, err := decodePacket(b)
		if err != nil {
			return
		}
		q, err := decodePacket(p.appendTo(nil))
		if err != nil || q != p {
			t.Fatalf("re-encode: %v %+v %+v", err, p, q)
		}
	})
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
