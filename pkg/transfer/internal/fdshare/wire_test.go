package fdshare

import (
	"bytes"
	"errors"
	"fmt"
	"testing"
)

var (
	compact = &Wire{Name: "shm", Layout: Compact}
	wide    = &Wire{Name: "nvlink", Layout: Wide, CheckReply: func(p *Packet) error {
		if p.Offset > p.Size {
			return fmt.Errorf("offset %d beyond size %d", p.Offset, p.Size)
		}
		return nil
	}}
)

func TestPacketRoundTrip(t *testing.T) {
	var key [64]byte
	for i := range key {
		key[i] = byte(i + 1)
	}
	var key32 [64]byte
	copy(key32[:32], key[:32])
	for _, tc := range []struct {
		w *Wire
		p Packet
	}{
		{compact, Packet{Type: TypeHello, Key: key32, Text: "0123456789abcdef"}},
		{compact, Packet{Type: TypeWelcome, Status: 1, Text: "unknown or used ticket"}},
		{compact, Packet{Type: TypeMapReq, Req: 7, Region: 3}},
		{compact, Packet{Type: TypeMapReply, Flags: FlagWritable, Req: 7, Region: 3, Offset: 4096, Size: 1 << 34}},
		{compact, Packet{Type: TypeRevoke, Region: 9}},
		{wide, Packet{Type: TypeHello, Key: key32, Text: "inc"}},
		{wide, Packet{Type: TypeMapReply, Kind: 2, Flags: 1 << 20, Req: 1, Region: 2, Offset: 3, Size: 4, Gran: 5, Key: key}},
		{wide, Packet{Type: TypeRevoke, Region: 9}},
	} {
		b := tc.w.Append(nil, &tc.p)
		if len(b) != tc.w.HeaderLen()+len(tc.p.Text) {
			t.Fatalf("%s %+v: %d bytes", tc.w.Name, tc.p, len(b))
		}
		got, err := tc.w.Decode(b)
		if err != nil {
			t.Fatalf("%s %+v: %v", tc.w.Name, tc.p, err)
		}
		if got != tc.p {
			t.Fatalf("%s round trip: got %+v, want %+v", tc.w.Name, got, tc.p)
		}
	}
}

// TestCompactDropsWideFields: what the compact layout has no room for is
// not on its wire.
func TestCompactDropsWideFields(t *testing.T) {
	p := Packet{Type: TypeMapReply, Kind: 3, Gran: 9, Flags: 0x101}
	p.Key[40] = 1
	got, err := compact.Decode(compact.Append(nil, &p))
	if err != nil {
		t.Fatal(err)
	}
	if got.Kind != 0 || got.Gran != 0 || got.Key != [64]byte{} || got.Flags != 1 {
		t.Fatalf("compact kept %+v", got)
	}
}

func TestDecodeRefuses(t *testing.T) {
	for _, w := range []*Wire{compact, wide} {
		good := w.Append(nil, &Packet{Type: TypeMapReq, Req: 1, Region: 2})
		reserved := 5
		if w.Layout == Wide {
			reserved = 50
		}
		cases := map[string][]byte{
			"empty":     nil,
			"short":     good[:w.HeaderLen()-1],
			"trailing":  append(bytes.Clone(good), 0),
			"too long":  make([]byte, w.MaxPacket()+1),
			"type-zero": append([]byte{0}, good[1:]...),
			"type-big":  append([]byte{99}, good[1:]...),
			"reserved":  func() []byte { b := bytes.Clone(good); b[reserved] = 1; return b }(),
			"text-len":  func() []byte { b := bytes.Clone(good); b[3] = 10; return b }(),
		}
		if w.CheckReply != nil {
			cases["check"] = w.Append(nil, &Packet{Type: TypeMapReply, Offset: 2, Size: 1})
		}
		for name, b := range cases {
			if _, err := w.Decode(b); !errors.Is(err, ErrBadPacket) {
				t.Errorf("%s %s: %v, want ErrBadPacket", w.Name, name, err)
			}
		}
	}
	// A refusal is not checked as a reply.
	if _, err := wide.Decode(wide.Append(nil, &Packet{Type: TypeMapReply, Status: 1, Offset: 2, Size: 1})); err != nil {
		t.Fatal(err)
	}
}

// FuzzDecodePacket decodes b with both layouts: what decodes encodes back
// to the same bytes.
func FuzzDecodePacket(f *testing.F) {
	f.Add(compact.Append(nil, &Packet{Type: TypeHello, Text: "abc"}))
	f.Add(compact.Append(nil, &Packet{Type: TypeMapReply, Req: 1, Region: 2, Offset: 3, Size: 4, Flags: 1}))
	f.Add(wide.Append(nil, &Packet{Type: TypeMapReply, Kind: 1, Size: 1 << 21, Gran: 1 << 21}))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 2*MaxPacket {
			return
		}
		for _, w := range []*Wire{compact, wide} {
			p, err := w.Decode(b)
			if err != nil {
				if !errors.Is(err, ErrBadPacket) {
					t.Fatalf("%s: error %v does not wrap ErrBadPacket", w.Name, err)
				}
				continue
			}
			if again := w.Append(nil, &p); !bytes.Equal(again, b) {
				t.Fatalf("%s: re-encoding %+v: %x, want %x", w.Name, p, again, b)
			}
		}
	})
}
