package nvlink

// peerState is the initiator state of the peer named seg (nil if none).
func (t *Transport) peerState(seg string) *peer {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range t.peers {
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
