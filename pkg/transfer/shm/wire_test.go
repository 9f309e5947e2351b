package shm

import (
	"bytes"
	"testing"
)

func TestPacketRoundTrip(t *testing.T) {
	for _, p := range []packet{
		{Type: typeHello, Key: [32]byte{1, 2, 3}, Text: "0123456789abcdef"},
		{Type: typeWelcome, Status: 1, Text: "unknown or used ticket"},
		{Type: typeMapReq, Req: 7, Region: 3},
		{Type: typeMapReply, Flags: flagWritable, Req: 7, Region: 3, Offset: 4096, Size: 1 << 34},
		{Type: typeRevoke, Region: 9},
	} {
		b := p.appendTo(nil)
		got, err := decodePacket(b)
		if err != nil {
			t.Fatalf("%+v: %v", p, err)
		}
		if got != p {
			t.Fatalf("round trip: got %+v, want %+v", got, p)
		}
	}
}

func TestDecodeRefuses(t *testing.T) {
	good := (&packet{Type: typeMapReq, Req: 1, Region: 2}).appendTo(nil)
	for name, b := range map[string][]byte{
		"empty":     nil,
		"short":     good[:headerLen-1],
		"trailing":  append(append([]byte(nil), good...), 0),
		"type-zero": append([]byte{0}, good[1:]...),
		"type-big":  append([]byte{99}, good[1:]...),
		"reserved":  func() []byte { b := bytes.Clone(good); b[5] = 1; return b }(),
		"text-len":  func() []byte { b := bytes.Clone(good); b[3] = 10; return b }(),
		"wraps":     (&packet{Type: typeMapReply, Offset: 1 << 63, Size: 1 << 63}).appendTo(nil),
	} {
		if _, err := decodePacket(b); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func FuzzDecodePacket(f *testing.F) {
	f.Add((&packet{Type: typeHello, Text: "abc"}).appendTo(nil))
	f.Add((&packet{Type: typeMapReply, Req: 1, Region: 2, Offset: 3, Size: 4, Flags: 1}).appendTo(nil))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		if len(b) > 2*maxPacket {
			return
		}
		p, err := decodePacket(b)
		if err != nil {
			return
		}
		// What decodes encodes back to the same bytes.
		if again := p.appendTo(nil); !bytes.Equal(again, b) {
			t.Fatalf("re-encoding %+v: %x, want %x", p, again, b)
		}
	})
}
