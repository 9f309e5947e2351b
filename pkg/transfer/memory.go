package transfer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"go.uber.org/zap"
)

// Scope says which peers a region is registered for. Registration fails
// unless some installed transport can serve the region for that scope.
type Scope int

const (
	// ScopeAny: peers on any machine (the default).
	ScopeAny Scope = iota
	// ScopeSameMachine: only peers on this machine.
	ScopeSameMachine
)

type regOpts struct {
	host     *HostMemory
	off      int64
	scope    Scope
	scopeSet bool
	mem      Memory
}

// RegisterOption varies one RegisterMemory call.
type RegisterOption func(*regOpts)

// WithHostMemory says the region lies in m at offset off, so same-machine
// transports can share it.
func WithHostMemory(m *HostMemory, off int64) RegisterOption {
	return func(o *regOpts) { o.host, o.off = m, off }
}

// WithScope sets the peers a region is registered for. The default is
// every peer the installed transports can reach: ScopeAny when one of them
// crosses machines, else ScopeSameMachine.
func WithScope(s Scope) RegisterOption { return func(o *regOpts) { o.scope, o.scopeSet = s, true } }

// RegisterMemory registers [addr, addr+length) at loc with the given access
// rights for peers, and publishes it. Every transport that can serve the
// region prepares it now; if none can serve it for the scope, registration
// fails here with the reasons, never later on the peer.
func (e *Engine) RegisterMemory(ctx context.Context, addr uintptr, length uint64, loc Location, access Access, opts ...RegisterOption) error {
	var o regOpts
	for _, f := range opts {
		f(&o)
	}
	if !o.scopeSet {
		o.scope = ScopeSameMachine
		for _, t := range e.cfg.Transports {
			if t.Reach() == ReachNetwork {
				o.scope = ScopeAny
			}
		}
	}
	a := uint64(addr)
	if length == 0 || a+length < a {
		return &OpError{Op: "register", Err: fmt.Errorf("bad range [%#x, +%d)", a, length)}
	}
	if o.host != nil && (o.off < 0 || o.off+int64(length) > o.host.Size() || o.host.Addr()+uint64(o.off) != a) {
		return &OpError{Op: "register", Err: fmt.Errorf("range [%#x, +%d) is not at offset %d of the host memory given", a, length, o.off)}
	}
	if m := o.mem; m != nil && (a < m.Base() || a+length > m.Base()+m.Size() || m.Base()+m.Size() < m.Base()) {
		return &OpError{Op: "register", Err: fmt.Errorf("range [%#x, +%d) is not inside the memory given ([%#x, +%d))", a, length, m.Base(), m.Size())}
	}
	r := &Region{
		RegionInfo: RegionInfo{Addr: a, Len: length, Location: loc, Access: access, Handles: map[string]json.RawMessage{}},
		Host:       o.host, HostOffset: o.off, Memory: o.mem,
	}
	e.mu.Lock()
	if e.closed {
		e.mu.Unlock()
		return ErrClosed
	}
	for _, x := range e.local {
		if a < x.End() && x.Addr < a+length {
			e.mu.Unlock()
			return &OpError{Op: "register", Err: fmt.Errorf("range [%#x, %#x) overlaps registered [%#x, %#x)", a, a+length, x.Addr, x.End())}
		}
	}
	e.mu.Unlock()

	var served []Transport
	var reasons []string
	ok := false
	for _, t := range e.cfg.Transports {
		h, err := t.RegisterRegion(r)
		if err != nil {
			if !errors.Is(err, ErrCannotRegister) {
				e.unregisterFrom(served, r)
				return &OpError{Op: "register", Transport: t.Name(), Err: err}
			}
			reasons = append(reasons, t.Name()+": "+err.Error())
			continue
		}
		served = append(served, t)
		if h != nil {
			r.Handles[t.Name()] = h
		}
		if o.scope == ScopeSameMachine || t.Reach() == ReachNetwork {
			ok = true
		}
	}
	if !ok {
		e.unregisterFrom(served, r)
		return &OpError{Op: "register", Err: fmt.Errorf("%w: %v region [%#x, +%d) for %s peers: %s", ErrCannotRegister,
			loc, a, length, map[Scope]string{ScopeAny: "all", ScopeSameMachine: "same-machine"}[o.scope], strings.Join(reasons, "; "))}
	}
	e.mu.Lock()
	e.local = append(e.local, r)
	sort.Slice(e.local, func(i, j int) bool { return e.local[i].Addr < e.local[j].Addr })
	e.rebuildSelfLocked()
	e.mu.Unlock()
	if err := e.publish(ctx); err != nil {
		e.UnregisterMemory(context.Background(), addr)
		return err
	}
	var names []string
	for _, t := range served {
		names = append(names, t.Name())
	}
	e.lg.Info("memory registered", zap.String("location", loc.String()), zap.Uint64("addr", a),
		zap.Uint64("bytes", length), zap.Stringer("access", access), zap.Strings("transports", names))
	return nil
}

func (e *Engine) unregisterFrom(ts []Transport, r *Region) {
	for _, t := range ts {
		t.UnregisterRegion(r)
	}
}

// UnregisterMemory removes the region that starts at addr. It returns once
// no transfer touches the region any more (a local batch, or a peer's
// request being served), so the memory can be freed; if transfers still do
// after twice the engine's Timeout, it fails with ErrRegionInUse and the
// memory must not be freed.
func (e *Engine) UnregisterMemory(ctx context.Context, addr uintptr) error {
	e.mu.Lock()
	idx := -1
	for i, r := range e.local {
		if r.Addr == uint64(addr) {
			idx = i
		}
	}
	if idx < 0 {
		e.mu.Unlock()
		return &OpError{Op: "unregister", Err: fmt.Errorf("no region starts at %#x", addr)}
	}
	r := e.local[idx]
	e.local = append(e.local[:idx], e.local[idx+1:]...)
	e.rebuildSelfLocked()
	e.mu.Unlock()
	// No new transfer can reach the region now; wait for those that do
	// (every batch ends within the engine's Timeout, and a timed-out one
	// lets its memory go one Timeout later).
	if err := r.drain(ctx, 2*e.cfg.Timeout+time.Second, e.stopped); err != nil {
		e.publish(ctx)
		return &OpError{Op: "unregister", Err: err}
	}
	for _, t := range e.cfg.Transports {
		if _, ok := r.Handles[t.Name()]; ok || t.Reach() == ReachNetwork {
			t.UnregisterRegion(r)
		}
	}
	return e.publish(ctx)
}

// rebuildSelfLocked makes a new descriptor value (the old one may be in use
// by readers holding selfRef).
func (e *Engine) rebuildSelfLocked() {
	d := *e.self
	d.Regions = make([]RegionInfo, len(e.local))
	for i, r := range e.local {
		d.Regions[i] = r.RegionInfo
	}
	if err := d.Seal(e.cfg.Secret); err != nil {
		e.lg.Error("sealing the descriptor", zap.Error(err)) // cannot fail: it encoded before
	}
	e.self = &d
	e.segs[LocalSegment].setDesc(&d)
}

// AllocHost allocates size bytes of shareable (memfd-backed) host memory
// and registers it with the given access: what a KV-cache pool uses. Pages
// are not touched, so large pools register fast. opts apply to the
// registration (for example WithScope(ScopeSameMachine) when shm is the only
// transport).
func (e *Engine) AllocHost(ctx context.Context, size int64, numa int, access Access, opts ...RegisterOption) (*HostMemory, error) {
	m, err := AllocHost(size, e.cfg.Name)
	if err != nil {
		return nil, err
	}
	opts = append([]RegisterOption{WithHostMemory(m, 0)}, opts...)
	if err := e.RegisterMemory(ctx, uintptr(m.Addr()), uint64(size), Location{Kind: CPU, Index: numa}, access, opts...); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// FreeHost unregisters and releases memory from AllocHost.
func (e *Engine) FreeHost(ctx context.Context, m *HostMemory) error {
	err := e.UnregisterMemory(ctx, uintptr(m.Addr()))
	if errors.Is(err, ErrRegionInUse) {
		return err // unmapping it now could crash a transfer: leak it
	}
	if cerr := m.Close(); err == nil {
		err = cerr
	}
	return err
}
