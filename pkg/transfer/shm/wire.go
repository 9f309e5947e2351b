package shm

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Packets on the unix socket (SOCK_SEQPACKET, one packet per message). Every
// packet has the same fixed 72-byte header followed by textLen bytes of text;
// fields a type does not use are zero. Byte layout in docs/format/shm.md.
//
//	 0 type     u8
//	 1 status   u8    0 = ok, else an error (text says why)
//	 2 flags    u8    mapReply: bit 0 = the fd is writable
//	 3 textLen  u8
//	 4 reserved u32   zero
//	 8 req      u64   request id (mapRequest, mapReply)
//	16 region   u64   region id
//	24 offset   u64   mapReply: offset of the region in the memfd
//	32 size     u64   mapReply: the region's length
//	40 key      [32]  hello: ticket; welcome: server proof
//	72 text     [textLen]  hello: initiator incarnation; errors: reason
//
// Integers are little-endian.
const (
	typeHello    = 1 // initiator -> server: ticket
	typeWelcome  = 2 // server -> initiator: proof or refusal
	typeMapReq   = 3 // initiator -> server: send me region's memfd
	typeMapReply = 4 // server -> initiator: region's memfd (SCM_RIGHTS) or refusal
	typeRevoke   = 5 // server -> initiator: region was unregistered

	headerLen = 72
	maxText   = 255
	maxPacket = headerLen + maxText

	flagWritable = 1
)

var errBadPacket = errors.New("shm: malformed packet")

// packet is one message on the unix socket.
type packet struct {
	Type   byte
	Status byte
	Flags  byte
	Req    uint64
	Region uint64
	Offset uint64
	Size   uint64
	Key    [32]byte
	Text   string
}

// appendTo encodes p after b.
func (p *packet) appendTo(b []byte) []byte {
	text := p.Text
	if len(text) > maxText {
		text = text[:maxText]
	}
	var h [headerLen]byte
	h[0], h[1], h[2], h[3] = p.Type, p.Status, p.Flags, byte(len(text))
	binary.LittleEndian.PutUint64(h[8:], p.Req)
	binary.LittleEndian.PutUint64(h[16:], p.Region)
	binary.LittleEndian.PutUint64(h[24:], p.Offset)
	binary.LittleEndian.PutUint64(h[32:], p.Size)
	copy(h[40:72], p.Key[:])
	b = append(b, h[:]...)
	return append(b, text...)
}

// decbuf reads fixed-size fields with a sticky error: once a read fails,
// every later read returns zero; the caller checks err once at the end.
type decbuf struct {
	b   []byte
	err error
}

func (d *decbuf) next(n int) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.err = fmt.Errorf("%w: need %d more bytes, have %d", errBadPacket, n, len(d.b))
		return nil
	}
	s := d.b[:n]
	d.b = d.b[n:]
	return s
}

func (d *decbuf) u8() byte {
	if s := d.next(1); s != nil {
		return s[0]
	}
	return 0
}

func (d *decbuf) u32() uint32 {
	if s := d.next(4); s != nil {
		return binary.LittleEndian.Uint32(s)
	}
	return 0
}

func (d *decbuf) u64() uint64 {
	if s := d.next(8); s != nil {
		return binary.LittleEndian.Uint64(s)
	}
	return 0
}

// decodePacket parses one packet.
func decodePacket(b []byte) (packet, error) {
	var p packet
	if len(b) > maxPacket {
		return p, fmt.Errorf("%w: %d bytes exceed %d", errBadPacket, len(b), maxPacket)
	}
	d := decbuf{b: b}
	p.Type, p.Status, p.Flags = d.u8(), d.u8(), d.u8()
	n := int(d.u8())
	reserved := d.u32()
	p.Req, p.Region, p.Offset, p.Size = d.u64(), d.u64(), d.u64(), d.u64()
	copy(p.Key[:], d.next(32))
	text := d.next(n)
	if d.err != nil {
		return packet{}, d.err
	}
	if len(d.b) != 0 {
		return packet{}, fmt.Errorf("%w: %d trailing bytes", errBadPacket, len(d.b))
	}
	if reserved != 0 {
		return packet{}, fmt.Errorf("%w: reserved field is %#x", errBadPacket, reserved)
	}
	if p.Type < typeHello || p.Type > typeRevoke {
		return packet{}, fmt.Errorf("%w: unknown type %d", errBadPacket, p.Type)
	}
	if p.Type == typeMapReply && p.Status == 0 && p.Offset+p.Size < p.Offset {
		return packet{}, fmt.Errorf("%w: region [%d, +%d) wraps", errBadPacket, p.Offset, p.Size)
	}
	p.Text = string(text)
	return p, nil
}
