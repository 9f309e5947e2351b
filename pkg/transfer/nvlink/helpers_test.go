package nvlink

// peerState is the initiator state of the peer named seg (nil if none).
func (t *Transport) peerState(seg string) *peer {
	for _, p := range t.peers.All() {
		if p.desc.Name == seg {
			return p
		}
	}
	return nil
}

func (p *peer) mapCount() int {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return len(p.maps)
}
