package transfer

import (
	"context"
	"fmt"
	"sync"

	"go.uber.org/zap"
)

// segment is an opened peer segment: its last known descriptor.
type segment struct {
	name  string
	mu    sync.Mutex
	desc  *Descriptor
	table *regionTable
	stale bool // a transport saw the peer fail: refetch before the next use
}

func (s *segment) setDesc(d *Descriptor) {
	t, err := newRegionTable(d.Regions)
	if err != nil {
		t = &regionTable{} // ReadDescriptor validated peers; our own is valid
	}
	s.mu.Lock()
	s.desc, s.table, s.stale = d, t, false
	s.mu.Unlock()
}

func (s *segment) snapshot() (*Descriptor, *regionTable, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.desc, s.table, s.stale
}

func (s *segment) markStale() {
	s.mu.Lock()
	s.stale = true
	s.mu.Unlock()
}

// OpenSegment finds a peer segment by name (in the registry, or in P2P mode
// by connecting to the name as an address) and returns its id for requests.
// Opening a segment again refreshes its descriptor.
func (e *Engine) OpenSegment(ctx context.Context, name string) (SegmentID, error) {
	e.mu.RLock()
	id, ok := e.byName[name]
	closed := e.closed
	e.mu.RUnlock()
	if closed {
		return 0, ErrClosed
	}
	if ok && id == LocalSegment {
		return id, nil
	}
	if ok {
		return id, e.refresh(ctx, e.segAt(id))
	}
	d, err := e.fetch(ctx, name)
	if err != nil {
		return 0, &OpError{Op: "open", Segment: name, Err: err}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if id, ok := e.byName[name]; ok { // raced with another open
		return id, nil
	}
	s := &segment{name: name}
	s.setDesc(d)
	e.segs = append(e.segs, s)
	id = SegmentID(len(e.segs) - 1)
	e.byName[name] = id
	e.lg.Info("segment opened", zap.String("segment", name), zap.String("peer", d.Addr),
		zap.String("incarnation", d.Incarnation), zap.Bool("same_machine", d.Host.SameMachine(e.self.Host)))
	return id, nil
}

func (e *Engine) segAt(id SegmentID) *segment {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if id < 0 || int(id) >= len(e.segs) {
		return nil
	}
	return e.segs[id]
}

// SegmentDescriptor returns the last known descriptor of an opened segment.
func (e *Engine) SegmentDescriptor(id SegmentID) (*Descriptor, error) {
	s := e.segAt(id)
	if s == nil {
		return nil, fmt.Errorf("%w: id %d", ErrSegmentNotFound, id)
	}
	d, _, _ := s.snapshot()
	return d.Clone(), nil
}

// fetch gets a descriptor from the registry or, in P2P mode, from the peer.
// Whatever the registry is, the descriptor must be of name and sealed with
// this engine's secret: nothing else is ever cached.
func (e *Engine) fetch(ctx context.Context, name string) (*Descriptor, error) {
	if e.cfg.Registry != nil {
		d, err := e.cfg.Registry.Get(ctx, name)
		if err != nil {
			return nil, err
		}
		if d.Name != name {
			err = fmt.Errorf("it describes segment %q, not %q", d.Name, name)
		} else {
			err = d.CheckSeal(e.cfg.Secret)
		}
		if err != nil {
			return nil, &DescriptorError{Key: "the registry entry of " + name, Err: err}
		}
		return d, nil
	}
	ctx, cancel := context.WithTimeout(ctx, e.cfg.Timeout)
	defer cancel()
	conn, d, err := e.dialHandshake(ctx, name, "ctl", "", true)
	if err != nil {
		return nil, err
	}
	e.adoptCtl(d, conn)
	return d, nil
}

// refresh refetches a segment's descriptor; a new incarnation drops every
// transport's state for the old one.
func (e *Engine) refresh(ctx context.Context, s *segment) error {
	if s == nil {
		return ErrSegmentNotFound
	}
	if s.name == e.cfg.Name {
		return nil
	}
	old, _, _ := s.snapshot()
	d, err := e.fetch(ctx, s.name)
	if err != nil {
		s.markStale()
		return &OpError{Op: "open", Segment: s.name, Err: err}
	}
	if old != nil && old.Incarnation != d.Incarnation {
		e.lg.Warn("peer restarted: dropping its connections and mappings", zap.String("segment", s.name),
			zap.String("old", old.Incarnation), zap.String("new", d.Incarnation))
		e.dropPeer(old)
	}
	s.setDesc(d)
	return nil
}

func (e *Engine) dropPeer(d *Descriptor) {
	for _, t := range e.cfg.Transports {
		t.DropPeer(d)
	}
	e.mu.Lock()
	c := e.ctl[d.Name]
	if c != nil && c.inc == d.Incarnation {
		delete(e.ctl, d.Name)
	} else {
		c = nil
	}
	e.mu.Unlock()
	if c != nil {
		c.close(ErrPeerRestarted)
	}
}
