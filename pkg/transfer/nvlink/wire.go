package nvlink

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// wire is the packet codec of the unix socket: fdshare's Wide layout, a
// fixed 128-byte header and textLen bytes of text; fields a type does not
// use are zero. Byte layout in docs/format/nvlink.md.
//
//	  0 type     u8
//	  1 status   u8    0 = ok, else an error (text says why)
//	  2 kind     u8    mapReply: handle kind (wire* below)
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
var wire = fdshare.Wire{Name: Name, Layout: fdshare.Wide, CheckReply: checkReply}

// Handle kinds on the wire.
const (
	wireVMMFD     = 1
	wireIPC       = 2
	wireHost      = 3
	wireVMMFabric = 4
)

// checkReply refuses an ok mapReply with an unknown kind or an offset
// beyond its object.
func checkReply(p *fdshare.Packet) error {
	if p.Kind < wireVMMFD || p.Kind > wireVMMFabric {
		return fmt.Errorf("unknown handle kind %d", p.Kind)
	}
	if p.Offset > p.Size {
		return fmt.Errorf("offset %d beyond size %d", p.Offset, p.Size)
	}
	return nil
}
