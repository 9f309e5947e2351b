package shm

import (
	"bytes"
	"errors"
	"testing"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// The codec itself is tested and fuzzed in fdshare; these pin shm's
// layout (docs/format/shm.md) and its own check.

func TestPacketLayout(t *testing.T) {
	p := fdshare.Packet{Type: fdshare.TypeMapReply, Status: 0, Flags: fdshare.FlagWritable, Req: 7, Region: 3,
		Offset: 4096, Size: 1 << 34, Text: "ok"}
	copy(p.Key[:32], bytes.Repeat([]byte{0xab}, 32))
	b := wire.Append(nil, &p)
	if len(b) != 72+2 {
		t.Fatalf("packet of %d bytes, want 74", len(b))
	}
	want := []struct {
		off int
		b   byte
	}{{0, 4}, {1, 0}, {2, 1}, {3, 2}, {8, 7}, {16, 3}, {25, 0x10}, {36, 4}, {40, 0xab}, {71, 0xab}, {72, 'o'}}
	for _, w := range want {
		if b[w.off] != w.b {
			t.Errorf("byte %d = %#x, want %#x", w.off, b[w.off], w.b)
		}
	}
	got, err := wire.Decode(b)
	if err != nil || got != p {
		t.Fatalf("round trip: %+v, %v; want %+v", got, err, p)
	}
}

func TestDecodeRefusesWrap(t *testing.T) {
	b := wire.Append(nil, &fdshare.Packet{Type: fdshare.TypeMapReply, Offset: 1 << 63, Size: 1 << 63})
	if _, err := wire.Decode(b); !errors.Is(err, fdshare.ErrBadPacket) {
		t.Fatalf("wrapping region: %v, want ErrBadPacket", err)
	}
	b = wire.Append(nil, &fdshare.Packet{Type: fdshare.TypeMapReply, Status: 1, Offset: 1 << 63, Size: 1 << 63})
	if _, err := wire.Decode(b); err != nil {
		t.Fatalf("a refusal is not checked: %v", err)
	}
	if len(wire.Append(nil, &fdshare.Packet{Type: fdshare.TypeHello, Text: string(make([]byte, 300))})) != 72+255 {
		t.Fatal("text not cut at 255 bytes")
	}
}
