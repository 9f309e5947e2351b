package fdshare

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
)

// Packet types. Every transport that uses this package speaks the same
// five; only the header layout differs (see Layout).
const (
	TypeHello    = 1 // initiator -> server: ticket
	TypeWelcome  = 2 // server -> initiator: proof or refusal
	TypeMapReq   = 3 // initiator -> server: send me an item (its fd)
	TypeMapReply = 4 // server -> initiator: the item (fd with SCM_RIGHTS) or refusal
	TypeRevoke   = 5 // server -> initiator: the item was removed
)

const (
	// FlagWritable (mapReply flags bit 0): the peer may write the item.
	FlagWritable = 1
	// MaxText is the longest text a packet carries; longer text is cut.
	MaxText = 255
	// MaxPacket is the longest packet of any layout (Wide), for buffers.
	MaxPacket = wideHeader + MaxText

	compactHeader = 72
	wideHeader    = 128
)

// ErrBadPacket is wrapped by every decoding error ("<name>: malformed
// packet: ...").
var ErrBadPacket = errors.New("malformed packet")

// Layout is a packet header layout. Each transport keeps the layout it
// always had, so its wire format (docs/format/shm.md, docs/format/nvlink.md)
// does not change.
type Layout uint8

const (
	// Compact is the 72-byte header of shm:
	//
	//	 0 type     u8
	//	 1 status   u8    0 = ok, else an error (text says why)
	//	 2 flags    u8    mapReply: bit 0 = the fd is writable
	//	 3 textLen  u8
	//	 4 reserved u32   zero
	//	 8 req      u64   request id (mapRequest, mapReply)
	//	16 region   u64   item id
	//	24 offset   u64   mapReply
	//	32 size     u64   mapReply
	//	40 key      [32]  hello: ticket; welcome: proof
	//	72 text     [textLen]
	//
	// Packet.Kind, Packet.Gran and Key[32:] are not on the wire.
	Compact Layout = iota + 1
	// Wide is the 128-byte header of nvlink:
	//
	//	  0 type     u8
	//	  1 status   u8
	//	  2 kind     u8    mapReply: handle kind
	//	  3 textLen  u8
	//	  4 flags    u32   mapReply: bit 0 = writable
	//	  8 req      u64
	//	 16 region   u64
	//	 24 offset   u64
	//	 32 size     u64
	//	 40 gran     u64
	//	 48 reserved u64   zero
	//	 56 reserved u64   zero
	//	 64 key      [64]  hello: ticket (0..31); welcome: proof (0..31);
	//	                   mapReply: the transport's key (IPC or fabric handle)
	//	128 text     [textLen]
	Wide
)

// Packet is one message on the unix socket (SOCK_SEQPACKET, one packet per
// message). Fields a type does not use are zero. Integers are
// little-endian on the wire.
type Packet struct {
	Type   byte
	Status byte
	Kind   byte   // Wide only
	Flags  uint32 // Compact: the low 8 bits
	Req    uint64
	Region uint64
	Offset uint64
	Size   uint64
	Gran   uint64   // Wide only
	Key    [64]byte // Compact: the first 32 bytes
	Text   string
}

// Wire is a transport's packet codec.
type Wire struct {
	// Name prefixes errors ("shm: malformed packet: ...").
	Name   string
	Layout Layout
	// CheckReply, if set, checks an ok mapReply after the common checks
	// (the transport's own fields); its error is wrapped in ErrBadPacket.
	CheckReply func(p *Packet) error
}

// HeaderLen is the fixed header's length.
func (w *Wire) HeaderLen() int {
	if w.Layout == Wide {
		return wideHeader
	}
	return compactHeader
}

// MaxPacket is the longest packet of this layout.
func (w *Wire) MaxPacket() int { return w.HeaderLen() + MaxText }

// Append encodes p after b.
func (w *Wire) Append(b []byte, p *Packet) []byte {
	text := p.Text
	if len(text) > MaxText {
		text = text[:MaxText]
	}
	var h [wideHeader]byte
	h[0], h[1], h[3] = p.Type, p.Status, byte(len(text))
	binary.LittleEndian.PutUint64(h[8:], p.Req)
	binary.LittleEndian.PutUint64(h[16:], p.Region)
	binary.LittleEndian.PutUint64(h[24:], p.Offset)
	binary.LittleEndian.PutUint64(h[32:], p.Size)
	if w.Layout == Wide {
		h[2] = p.Kind
		binary.LittleEndian.PutUint32(h[4:], p.Flags)
		binary.LittleEndian.PutUint64(h[40:], p.Gran)
		copy(h[64:128], p.Key[:])
	} else {
		h[2] = byte(p.Flags)
		copy(h[40:72], p.Key[:32])
	}
	b = append(b, h[:w.HeaderLen()]...)
	return append(b, text...)
}

// decbuf reads fixed-size fields with a sticky error: once a read fails,
// every later read returns zero; the caller checks err once at the end.
type decbuf struct {
	name string
	b    []byte
	err  error
}

func (d *decbuf) next(n int) []byte {
	if d.err != nil {
		return nil
	}
	if len(d.b) < n {
		d.err = fmt.Errorf("%s: %w: need %d more bytes, have %d", d.name, ErrBadPacket, n, len(d.b))
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

// Decode parses one packet. It refuses packets longer than MaxPacket(),
// short or trailing bytes, non-zero reserved fields, unknown types, and
// whatever CheckReply refuses in an ok mapReply.
func (w *Wire) Decode(b []byte) (Packet, error) {
	var p Packet
	if len(b) > w.MaxPacket() {
		return p, fmt.Errorf("%s: %w: %d bytes exceed %d", w.Name, ErrBadPacket, len(b), w.MaxPacket())
	}
	d := decbuf{name: w.Name, b: b}
	p.Type, p.Status = d.u8(), d.u8()
	var text []byte
	if w.Layout == Wide {
		p.Kind = d.u8()
		n := int(d.u8())
		p.Flags = d.u32()
		p.Req, p.Region, p.Offset, p.Size, p.Gran = d.u64(), d.u64(), d.u64(), d.u64(), d.u64()
		r1, r2 := d.u64(), d.u64()
		copy(p.Key[:], d.next(64))
		text = d.next(n)
		if err := d.end(); err != nil {
			return Packet{}, err
		}
		if r1 != 0 || r2 != 0 {
			return Packet{}, fmt.Errorf("%s: %w: reserved fields are not zero", w.Name, ErrBadPacket)
		}
	} else {
		p.Flags = uint32(d.u8())
		n := int(d.u8())
		reserved := d.u32()
		p.Req, p.Region, p.Offset, p.Size = d.u64(), d.u64(), d.u64(), d.u64()
		copy(p.Key[:32], d.next(32))
		text = d.next(n)
		if err := d.end(); err != nil {
			return Packet{}, err
		}
		if reserved != 0 {
			return Packet{}, fmt.Errorf("%s: %w: reserved field is %#x", w.Name, ErrBadPacket, reserved)
		}
	}
	if p.Type < TypeHello || p.Type > TypeRevoke {
		return Packet{}, fmt.Errorf("%s: %w: unknown type %d", w.Name, ErrBadPacket, p.Type)
	}
	if p.Type == TypeMapReply && p.Status == 0 && w.CheckReply != nil {
		if err := w.CheckReply(&p); err != nil {
			return Packet{}, fmt.Errorf("%s: %w: %v", w.Name, ErrBadPacket, err)
		}
	}
	p.Text = string(text)
	return p, nil
}

// end is the decoder's final check: the sticky error, then trailing bytes.
func (d *decbuf) end() error {
	if d.err != nil {
		return d.err
	}
	if len(d.b) != 0 {
		return fmt.Errorf("%s: %w: %d trailing bytes", d.name, ErrBadPacket, len(d.b))
	}
	return nil
}

// Read reads one packet that must carry no fds (any it carries are
// closed). buf must hold MaxPacket()+1 bytes.
func (w *Wire) Read(c *net.UnixConn, buf []byte) (Packet, error) {
	var oob [64]byte
	n, oobn, _, _, err := c.ReadMsgUnix(buf, oob[:])
	if err != nil {
		return Packet{}, err
	}
	if n == 0 {
		return Packet{}, io.EOF
	}
	if oobn > 0 {
		CloseRights(oob[:oobn])
		return Packet{}, fmt.Errorf("%s: unexpected fds", w.Name)
	}
	return w.Decode(buf[:n])
}
