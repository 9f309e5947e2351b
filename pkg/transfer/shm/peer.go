package shm

import (
	"context"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// peer is the initiator's state for one peer incarnation: the unix
// connection (fdshare.Client: ticket, fds, liveness) and the mapped
// regions.
type peer struct {
	t    *Transport
	desc *transfer.Descriptor
	link *fdshare.Client

	// mu is held shared by copies and exclusively to change or unmap
	// mappings, so no copy runs on memory being unmapped.
	mu     sync.RWMutex
	maps   map[uint64]*mapping
	closed bool // shut: mappings are gone
}

type mapping struct {
	mem      *transfer.HostMemory
	off      uint64 // the region's offset in the memfd (= in mem)
	size     uint64
	writable bool
}

// newPeer makes the state of a peer incarnation (no I/O).
func (t *Transport) newPeer(d *transfer.Descriptor) *peer {
	p := &peer{t: t, desc: d, maps: map[uint64]*mapping{}}
	p.link = fdshare.NewClient(fdshare.ClientConfig{
		Kind: Name, Version: protocolVersion, Wire: &wire, Host: t.h, Self: t.inc, Peer: d, Logger: t.lg,
		Go: t.peers.Go, OnRevoke: p.revoke, OnGone: p.shut,
	})
	return p
}

// revoke unmaps a region the peer unregistered.
func (p *peer) revoke(id uint64) {
	p.mu.Lock()
	m := p.maps[id]
	delete(p.maps, id)
	p.mu.Unlock()
	if m != nil {
		m.mem.Close()
	}
}

// shut closes the connection (if any), fails waiting requests and unmaps
// every region, after the copies in flight finish.
func (p *peer) shut(why error) {
	if why != nil {
		p.link.Die(why)
	}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	maps := p.maps
	p.maps = map[uint64]*mapping{}
	p.mu.Unlock()
	p.link.Close()
	for _, m := range maps {
		m.mem.Close()
	}
}

// mapRegions makes sure every region in hs is mapped: it asks the serving
// side for the memfds it lacks and maps each once. A region the peer
// refuses (or sends inconsistently) stays unmapped, with the reason in
// refused; err is for what fails the whole batch (connection, ctx).
func (p *peer) mapRegions(ctx context.Context, hs []Handle) (refused map[uint64]error, err error) {
	p.mu.RLock()
	var need []Handle
	var ids []uint64
	for _, h := range hs {
		if p.maps[h.ID] == nil {
			need = append(need, h)
			ids = append(ids, h.ID)
		}
	}
	p.mu.RUnlock()
	if len(need) == 0 {
		return nil, nil
	}
	return p.link.Fetch(ctx, ids, func(i int, r fdshare.Reply) error { return p.adopt(need[i], r) })
}

// adopt maps the memfd of one reply, after checking it against the handle
// the descriptor published.
func (p *peer) adopt(h Handle, r fdshare.Reply) error {
	if r.Status != 0 {
		if r.FD >= 0 {
			unix.Close(r.FD)
		}
		return fmt.Errorf("%s refused shm region %d: %s", p.desc.Name, h.ID, r.Text)
	}
	if r.FD < 0 {
		return fmt.Errorf("shm: %s sent region %d without its memfd", p.desc.Name, h.ID)
	}
	if r.Offset != h.Offset || r.Size != h.Size {
		unix.Close(r.FD)
		return fmt.Errorf("shm: %s sent region %d as [%d, +%d) of its memfd, descriptor says [%d, +%d)",
			p.desc.Name, h.ID, r.Offset, r.Size, h.Offset, h.Size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(r.FD, &st); err != nil || uint64(st.Size) < h.Offset+h.Size {
		unix.Close(r.FD)
		return fmt.Errorf("shm: memfd of region %d from %s is %d bytes, region needs %d (%v)", h.ID, p.desc.Name, st.Size, h.Offset+h.Size, err)
	}
	writable := r.Flags&fdshare.FlagWritable != 0
	mem, err := transfer.MapHost(r.FD, int64(h.Offset+h.Size), writable)
	if err != nil {
		unix.Close(r.FD)
		return err
	}
	m := &mapping{mem: mem, off: h.Offset, size: h.Size, writable: writable}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		mem.Close()
		return fdshare.ErrShut
	}
	if p.maps[h.ID] != nil { // another batch mapped it meanwhile
		p.mu.Unlock()
		mem.Close()
		return nil
	}
	p.maps[h.ID] = m
	p.mu.Unlock()
	return nil
}
