package shm

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// wire is the packet codec of the unix socket: fdshare's Compact layout,
// a fixed 72-byte header followed by textLen bytes of text. Byte layout in
// docs/format/shm.md.
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
var wire = fdshare.Wire{Name: Name, Layout: fdshare.Compact, CheckReply: checkReply}

// checkReply refuses an ok mapReply whose region wraps.
func checkReply(p *fdshare.Packet) error {
	if p.Offset+p.Size < p.Offset {
		return fmt.Errorf("region [%d, +%d) wraps", p.Offset, p.Size)
	}
	return nil
}
