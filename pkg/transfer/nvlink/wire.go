package nvlink

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// Packets on the unix socket (SOCK_SEQPACKET, one packet per message): a
// fixed 128-byte header and textLen bytes of text; fields a type does not
// use are zero. Byte layout in docs/format/nvlink.md.
//
//	  0 type     u8
//	  1 status   u8    0 = ok, else an error (text says why)
//	  2 kind     u8    mapReply: handle kind (kind* below)
//	  3 textLen  u8
//	  4 flags    u32   mapReply: bit 0 = writable
//	  8 req      u64   request id (mapRequest, mapReply)
//	 16 region   u64   region id
//	 24 offset   u64   mapReply: offset of the region in the exported object
//	 32 size     u64   mapReply: size of the exported object
//	 40 gran     u64   mapReply (vmm): allocation granularity
//	 48 reserved u64   zero
//	 56 reserved u64   zero
//	 64 key      [64]  hello: ticket (32) ; welcome: proof (32);
//	                   mapReply: IPC or fabric handle
//	128 text     [textLen]
//
// Integers are little-endian. A vmm-fd or host mapReply carries one fd
// (SCM_RIGHTS).
const (
	typeHello    = 1
	typeWelcome  = 2
	typeMapReq   = 3
	typeMapReply = 4
	typeRevoke   = 5

	headerLen = 128
	maxText   = 255
	maxPacket = headerLen + maxText

	flagWritable = 1
)

// Handle kinds on the wire.
const (
	wireVMMFD     = 1
	wireIPC       = 2
	wireHost      = 3
	wireVMMFabric = 4
)

var errBadPacket = errors.New("nvlink: malformed packet")

type packet struct {
	Type   byte
	Status byte
	Kind   byte
	Flags  uint32
	Req    uint64
	Region uint64
	Offset uint64
	Size   uint64
	Gran   uint64
	Key    [64]byte
	Text   string
}

func (p *packet) appendTo(b []byte) []byte {
	text := p.Text
	if len(text) > maxText {
		text = text[:maxText]
	}
	var h [headerLen]byte
	h[0], h[1], h[2], h[3] = p.Type, p.Status, p.Kind, byte(len(text))
	binary.LittleEndian.PutUint32(h[4:], p.Flags)
	binary.LittleEndian.PutUint64(h[8:], p.Req)
	binary.LittleEndian.PutUint64(h[16:], p.Region)
	binary.LittleEndian.PutUint64(h[24:], p.Offset)
	binary.LittleEndian.PutUint64(h[32:], p.Size)
	binary.LittleEndian.PutUint64(h[40:], p.Gran)
	copy(h[64:128], p.Key[:])
	b = append(b, h[:]...)
	return append(b, text...)
}

// decbuf reads fields with a sticky error, checked once at the end.
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

func decodePacket(b []byte) (packet, error) {
	var p packet
	if len(b) > maxPacket {
		return p, fmt.Errorf("%w: %d bytes exceed %d", errBadPacket, len(b), maxPacket)
	}
	d := decbuf{b: b}
	p.Type, p.Status, p.Kind = d.u8(), d.u8(), d.u8()
	n := int(d.u8())
	p.Flags = d.u32()
	p.Req, p.Region, p.Offset, p.Size, p.Gran = d.u64(), d.u64(), d.u64(), d.u64(), d.u64()
	r1, r2 := d.u64(), d.u64()
	copy(p.Key[:], d.next(64))
	text := d.next(n)
	if d.err != nil {
		return packet{}, d.err
	}
	if len(d.b) != 0 {
		return packet{}, fmt.Errorf("%w: %d trailing bytes", errBadPacket, len(d.b))
	}
	if r1 != 0 || r2 != 0 {
		return packet{}, fmt.Errorf("%w: reserved fields are not zero", errBadPacket)
	}
	if p.Type < typeHello || p.Type > typeRevoke {
		return packet{}, fmt.Errorf("%w: unknown type %d", errBadPacket, p.Type)
	}
	if p.Type == typeMapReply && p.Status == 0 {
		if p.Kind < wireVMMFD || p.Kind > wireVMMFabric {
			return packet{}, fmt.Errorf("%w: unknown handle kind %d", errBadPacket, p.Kind)
		}
		if p.Offset > p.Size {
			return packet{}, fmt.Errorf("%w: offset %d beyond size %d", errBadPacket, p.Offset, p.Size)
		}
	}
	p.Text = string(text)
	return p, nil
}
