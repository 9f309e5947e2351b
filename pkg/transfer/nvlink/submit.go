package nvlink

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// Submit moves the tasks with one scatter-kernel launch per local GPU
// (normally one): on the caller's goroutine when the peer is connected and
// every region is imported, else on a goroutine that connects and imports
// first. Completion is waited for off the caller's path; each task's Done
// follows its kernel's event.
func (t *Transport) Submit(ctx context.Context, d *transfer.Descriptor, tasks []*transfer.Task) {
	t.peers.Submit(d, tasks, func(p *peer) bool {
		return p.connected() && t.launch(ctx, p, tasks, false)
	}, func(p *peer) { t.run(ctx, p, tasks) })
}

// run is the slow path: connect, import what is missing, launch.
func (t *Transport) run(ctx context.Context, p *peer, tasks []*transfer.Task) {
	if !p.connected() {
		// Connecting blocks: give up when the batch or the transport ends.
		if err := t.peers.Bound(ctx, p.connect); err != nil {
			if ctx.Err() != nil {
				err = fdshare.CtxError(ctx, Name)
			}
			fdshare.FailAll(tasks, err)
			return
		}
	}
	t.launch(ctx, p, tasks, true)
}

// wants lists the regions of tasks that are not imported yet.
func (t *Transport) wants(p *peer, tasks []*transfer.Task) ([]want, error) {
	seen := map[uint64]bool{}
	var ws []want
	p.mu.RLock()
	defer p.mu.RUnlock()
	for _, k := range tasks {
		if seen[k.Region.Addr] {
			continue
		}
		seen[k.Region.Addr] = true
		raw := k.Region.Handles[t.name]
		if m := p.byAddr[k.Region.Addr]; m != nil && string(m.raw) == string(raw) {
			continue
		}
		h, err := decodeHandle(raw)
		if err != nil {
			return nil, fmt.Errorf("%s: region [%#x, +%d) of %s: %w", t.name, k.Region.Addr, k.Region.Len, p.desc.Name, err)
		}
		dev := t.busIndex(h.PCIBusID)
		if lr := k.LocalRegion; lr.Location.Kind == transfer.CUDA {
			dev = lr.Location.Index
		} else if dev < 0 {
			dev = 0
		}
		ws = append(ws, want{Handle: h, raw: raw, addr: k.Region.Addr, dev: dev})
	}
	return ws, nil
}

// importAll imports the regions of ws; refused ones are returned with why.
func (t *Transport) importAll(ctx context.Context, p *peer, ws []want) (map[uint64]error, error) {
	if !t.fabric {
		return p.mapRegions(ctx, ws)
	}
	var refused map[uint64]error
	for _, w := range ws {
		var key [64]byte
		copy(key[:], w.Fabric)
		m, err := t.importRegion(w, key, -1, true, w.Granularity)
		if err == nil {
			err = p.install(m)
		}
		if errors.Is(err, errClosedPeer) {
			return refused, p.err()
		}
		if err != nil {
			if refused == nil {
				refused = map[uint64]error{}
			}
			refused[w.ID] = err
		}
	}
	return refused, nil
}

// group is the part of a batch one local GPU copies.
type group struct {
	dev   *device
	tasks []*transfer.Task
	descs []cuda.CopyDesc
	ev    *cuda.Event
	err   error
}

var descPool = sync.Pool{New: func() any { return new([]cuda.CopyDesc) }}

// launch resolves every task to a (src, dst) pair under the peer's read
// lock and enqueues the kernels. With mayImport false it returns false,
// touching no task, when some region still has to be imported.
func (t *Transport) launch(ctx context.Context, p *peer, tasks []*transfer.Task, mayImport bool) bool {
	if mayImport {
		ws, err := t.wants(p, tasks)
		if err != nil {
			fdshare.FailAll(tasks, err)
			return true
		}
		refused, err := t.importAll(ctx, p, ws)
		if err != nil {
			if ctx.Err() != nil {
				err = fdshare.CtxError(ctx, Name)
			}
			fdshare.FailAll(tasks, err)
			return true
		}
		if len(refused) > 0 {
			bad := map[uint64]error{}
			for _, w := range ws {
				if why, ok := refused[w.ID]; ok {
					bad[w.addr] = why
				}
			}
			var rest []*transfer.Task
			for _, k := range tasks {
				if why, ok := bad[k.Region.Addr]; ok {
					if errors.Is(why, transfer.ErrOutOfBounds) {
						k.Done(&transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrOutOfBounds, Detail: t.name + ": " + why.Error()})
					} else {
						k.Done(fmt.Errorf("%w: %s: %v", transfer.ErrAccessDenied, t.name, why))
					}
				} else {
					rest = append(rest, k)
				}
			}
			tasks = rest
		}
	}
	if err := ctx.Err(); err != nil {
		fdshare.FailAll(tasks, fdshare.CtxError(ctx, Name))
		return true
	}
	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		fdshare.FailAll(tasks, p.err())
		return true
	}
	if err := p.alive(); err != nil {
		p.mu.RUnlock()
		fdshare.FailAll(tasks, err)
		return true
	}
	var groups []*group
	var last *mapping
	var lastRaw []byte
	var lastAddr uint64
	type failed struct {
		k   *transfer.Task
		err error
	}
	var fails []failed
	for _, k := range tasks {
		raw := k.Region.Handles[t.name]
		m := last
		if m == nil || k.Region.Addr != lastAddr || !sameBytes(raw, lastRaw) {
			m = p.byAddr[k.Region.Addr]
			if m != nil && string(m.raw) != string(raw) {
				m = nil
			}
			if m == nil {
				if !mayImport {
					p.mu.RUnlock()
					releaseGroups(groups)
					return false
				}
				fails = append(fails, failed{k, fmt.Errorf("%w: %s: region [%#x, +%d) of %s was released meanwhile",
					transfer.ErrPeerRestarted, t.name, k.Region.Addr, k.Region.Len, p.desc.Name)})
				continue
			}
			last, lastRaw, lastAddr = m, raw, k.Region.Addr
		}
		// The engine checked the peer's region table; check the import too.
		if k.Remote < m.addr || m.h.Offset+(k.Remote-m.addr)+k.Len > m.h.Size || k.Remote-m.addr+k.Len < k.Len {
			fails = append(fails, failed{k, &transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrOutOfBounds,
				Detail: fmt.Sprintf("%s: outside the imported object of %d bytes", t.name, m.h.Size)}})
			continue
		}
		if k.Op == transfer.Write && !m.writable {
			fails = append(fails, failed{k, &transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrAccessDenied,
				Detail: t.name + ": the peer shared this region read-only"}})
			continue
		}
		lr := k.LocalRegion
		var local cuda.DevicePtr
		di := m.owner
		if lr.Location.Kind == transfer.CUDA {
			di = lr.Location.Index
			local = cuda.DevicePtr(k.Local)
		}
		g := findGroup(groups, di)
		if g == nil {
			d, err := t.copier(di)
			if err != nil {
				fails = append(fails, failed{k, err})
				continue
			}
			dp := descPool.Get().(*[]cuda.CopyDesc)
			g = &group{dev: d, descs: (*dp)[:0]}
			groups = append(groups, g)
		}
		if lr.Location.Kind != transfer.CUDA {
			pn, err := t.pinLocal(lr, g.dev)
			if err != nil {
				fails = append(fails, failed{k, err})
				continue
			}
			local = pn.dev + cuda.DevicePtr(k.Local-lr.Addr)
		}
		if m.ipc != nil && m.owner != di {
			fails = append(fails, failed{k, fmt.Errorf("%w: %s: legacy IPC region [%#x, +%d) of %s is opened for GPU %d, not GPU %d "+
				"(cuIpcOpenMemHandle maps for one context; register a cuda.Pool to reach memory from several GPUs)",
				transfer.ErrAccessDenied, t.name, k.Region.Addr, k.Region.Len, p.desc.Name, m.owner, di)})
			continue
		}
		src, dst := local, m.ptr(k.Remote)
		if k.Op == transfer.Read {
			src, dst = dst, src
		}
		if k.List == nil {
			g.descs = append(g.descs, cuda.CopyDesc{Src: src, Dst: dst, Len: k.Len})
		} else {
			g.descs = slices.Grow(g.descs, len(k.List.Pages))
			for _, pg := range k.List.Pages {
				so, do := pg.Local, pg.Remote
				if k.Op == transfer.Read {
					so, do = do, so
				}
				g.descs = append(g.descs, cuda.CopyDesc{Src: src + cuda.DevicePtr(so), Dst: dst + cuda.DevicePtr(do), Len: k.List.PageLen})
			}
		}
		g.tasks = append(g.tasks, k)
	}
	for _, f := range fails {
		f.k.Done(f.err)
	}
	for _, g := range groups {
		if g.err = g.dev.cp.Copy(g.dev.stream, g.descs); g.err == nil {
			if g.ev, g.err = g.dev.event(); g.err == nil {
				if g.err = g.ev.Record(g.dev.stream); g.err != nil {
					g.dev.putEvent(g.ev)
					g.ev = nil
				}
			}
		}
	}
	// Wait off the caller's path; the read lock keeps the imports mapped
	// until the kernels are done.
	if !t.peers.Go(func() { t.complete(p, groups) }) {
		t.complete(p, groups)
	}
	return true
}

func sameBytes(a, b []byte) bool {
	if len(a) != len(b) {
		return false
	}
	return len(a) == 0 || unsafe.SliceData(a) == unsafe.SliceData(b) || string(a) == string(b)
}

func findGroup(gs []*group, dev int) *group {
	for _, g := range gs {
		if g.dev.idx == dev {
			return g
		}
	}
	return nil
}

func releaseGroups(gs []*group) {
	for _, g := range gs {
		d := g.descs[:0]
		descPool.Put(&d)
	}
}

// complete waits for each group's kernel, releases the peer's read lock and
// reports the tasks.
func (t *Transport) complete(p *peer, groups []*group) {
	for _, g := range groups {
		if g.ev != nil {
			g.err = g.ev.Synchronize()
			g.dev.putEvent(g.ev)
		}
	}
	p.mu.RUnlock()
	alive := p.alive()
	for _, g := range groups {
		err := g.err
		if err != nil {
			err = fmt.Errorf("%s: GPU %d: %w", t.name, g.dev.idx, err)
		} else if alive != nil {
			err = alive
		}
		for _, k := range g.tasks {
			k.Done(err)
		}
	}
	releaseGroups(groups)
}
