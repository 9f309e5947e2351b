package shm

import (
	"encoding/json"
	"unsafe"
)

func bytesAddr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))) }

func jsonUnmarshal(b []byte, v any) error { return json.Unmarshal(b, v) }

// peerState is the initiator state of a peer incarnation (nil if none).
func (t *Transport) peerState(inc string) *peer {
	p, _ := t.peers.Lookup(inc)
	return p
}

func (p *peer) mapCount() int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return len(p.maps)
}

func (p *peer) anyWritable() bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, m := range p.maps {
		if m.writable {
			return true
		}
	}
	return false
}
