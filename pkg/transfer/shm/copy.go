package shm

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// Submit copies the tasks between local memory and the peer's mapped
// regions. A small batch to a connected peer is copied right here, in the
// caller's goroutine; otherwise a goroutine connects, maps what is missing
// and copies, spreading big batches over Config.Copiers goroutines.
func (t *Transport) Submit(ctx context.Context, d *transfer.Descriptor, tasks []*transfer.Task) {
	var total uint64
	for _, k := range tasks {
		total += k.Bytes()
	}
	t.peers.Submit(d, tasks, func(p *peer) bool {
		if p.link.Connected() && (total < uint64(t.cfg.ParallelMin) || int(t.busy.Load()) >= t.cfg.Copiers) {
			t.run(ctx, p, tasks, total, false)
			return true
		}
		return false
	}, func(p *peer) { t.run(ctx, p, tasks, total, true) })
}

// job is one task's two byte ranges.
type job struct {
	k      *transfer.Task
	local  []byte
	remote []byte
}

func (j *job) copy(off, n int) {
	if j.k.Op == transfer.Write {
		copy(j.remote[off:off+n], j.local[off:off+n])
	} else {
		copy(j.local[off:off+n], j.remote[off:off+n])
	}
}

// run copies one batch; parallel allows spreading it over Config.Copiers
// goroutines.
func (t *Transport) run(ctx context.Context, p *peer, tasks []*transfer.Task, total uint64, parallel bool) {
	t.busy.Add(1)
	defer t.busy.Add(-1)
	if !p.link.Connected() {
		// Connecting blocks: give up when the batch or the transport ends.
		if err := t.peers.Bound(ctx, p.link.Connect); err != nil {
			if ctx.Err() != nil {
				err = fdshare.CtxError(ctx, Name)
			}
			fdshare.FailAll(tasks, fmt.Errorf("shm: connect to %s: %w", p.desc.Name, err))
			return
		}
	}
	if err := p.link.Alive(); err != nil {
		fdshare.FailAll(tasks, err)
		return
	}
	hs, err := handles(tasks)
	if err != nil {
		fdshare.FailAll(tasks, err)
		return
	}
	refused, err := p.mapRegions(ctx, uniqueIDs(hs))
	if err != nil {
		if ctx.Err() != nil {
			err = fdshare.CtxError(ctx, Name)
		}
		fdshare.FailAll(tasks, err)
		return
	}

	p.mu.RLock()
	if p.closed {
		p.mu.RUnlock()
		fdshare.FailAll(tasks, p.link.Err())
		return
	}
	jobs := make([]job, 0, len(tasks))
	for i, k := range tasks {
		j, err := p.job(k, hs[i], refused)
		if err != nil {
			k.Done(err)
			continue
		}
		if k.List == nil {
			jobs = append(jobs, j)
			continue
		}
		// One job per page, each ending the task when done (Done counts
		// once); the job check covered the remote extent.
		for _, pg := range k.List.Pages {
			jobs = append(jobs, job{k: k, local: bytesAt(k.Local+pg.Local, k.List.PageLen),
				remote: j.remote[pg.Remote : pg.Remote+k.List.PageLen : pg.Remote+k.List.PageLen]})
		}
	}
	if parallel && total >= uint64(t.cfg.ParallelMin) && t.cfg.Copiers > 1 {
		copyParallel(ctx, jobs, total, t.cfg.Copiers)
	} else {
		for i := range jobs {
			if ctx.Err() != nil {
				break
			}
			jobs[i].copy(0, len(jobs[i].local))
		}
	}
	p.mu.RUnlock()

	// The peer must still be alive after the copies: bytes written into the
	// memory of a process that died are lost.
	err = p.link.Alive()
	if err == nil && ctx.Err() != nil {
		err = fdshare.CtxError(ctx, Name)
	}
	for i := range jobs {
		jobs[i].k.Done(err)
	}
}

// handles reads each task's shm handle, parsing each distinct one once.
func handles(tasks []*transfer.Task) ([]Handle, error) {
	hs := make([]Handle, len(tasks))
	var prevRaw json.RawMessage
	var prev Handle
	for i, k := range tasks {
		raw := k.Region.Handles[Name]
		if i == 0 || !bytes.Equal(raw, prevRaw) {
			prev = Handle{}
			if err := json.Unmarshal(raw, &prev); err != nil {
				return nil, fmt.Errorf("shm: region [%#x, +%d) has a bad shm handle: %w", k.Region.Addr, k.Region.Len, err)
			}
			prevRaw = raw
		}
		hs[i] = prev
	}
	return hs, nil
}

func uniqueIDs(hs []Handle) []Handle {
	var out []Handle
next:
	for _, h := range hs {
		for _, o := range out {
			if o.ID == h.ID {
				continue next
			}
		}
		out = append(out, h)
	}
	return out
}

// job checks one task against its mapping (defense in depth: the engine
// already checked it against the published region table) and returns its
// byte ranges. p.mu is held shared.
func (p *peer) job(k *transfer.Task, h Handle, refused map[uint64]error) (job, error) {
	m := p.maps[h.ID]
	if m == nil {
		why := fmt.Sprintf("shm region %d of %s is not mapped (unregistered meanwhile)", h.ID, p.desc.Name)
		if err := refused[h.ID]; err != nil {
			why = err.Error()
		}
		return job{}, &transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrOutOfBounds, Detail: why}
	}
	limit := min(m.size, k.Region.Len)
	if k.Remote < k.Region.Addr || k.Remote-k.Region.Addr > limit || k.Len > limit-(k.Remote-k.Region.Addr) {
		return job{}, &transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrOutOfBounds,
			Detail: fmt.Sprintf("outside the %d bytes of shm region %d at %#x", limit, h.ID, k.Region.Addr)}
	}
	off := m.off + (k.Remote - k.Region.Addr)
	mem := m.mem.Bytes()
	if off+k.Len > uint64(len(mem)) {
		return job{}, &transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrOutOfBounds,
			Detail: fmt.Sprintf("outside the %d-byte mapping of shm region %d", len(mem), h.ID)}
	}
	if k.Op == transfer.Write && !m.writable {
		return job{}, &transfer.RangeError{Addr: k.Remote, Len: k.Len, Err: transfer.ErrAccessDenied,
			Detail: fmt.Sprintf("shm region %d was shared read-only", h.ID)}
	}
	j := job{k: k, remote: mem[off : off+k.Len : off+k.Len]}
	if k.List == nil {
		j.local = bytesAt(k.Local, k.Len)
	}
	return j, nil
}

// bytesAt is the registered local memory [addr, addr+n). The engine checked
// that it lies in a registered region, which the caller keeps alive (mapped
// or pinned) while it is registered.
func bytesAt(addr, n uint64) []byte {
	a := uintptr(addr)
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&a))), n)
}

// copyParallel spreads the jobs, cut into chunks, over workers goroutines
// (the caller's included). It stops early when ctx ends.
func copyParallel(ctx context.Context, jobs []job, total uint64, workers int) {
	const minChunk = 256 << 10
	chunk := max(total/uint64(workers*4), minChunk)
	type piece struct {
		j      *job
		off, n int
	}
	pieces := make([]piece, 0, int(total/chunk)+len(jobs))
	for i := range jobs {
		j := &jobs[i]
		for off := 0; off < len(j.local); off += int(chunk) {
			pieces = append(pieces, piece{j, off, min(int(chunk), len(j.local)-off)})
		}
	}
	workers = min(workers, len(pieces))
	var next atomic.Int64
	work := func() {
		for {
			i := next.Add(1) - 1
			if i >= int64(len(pieces)) || ctx.Err() != nil {
				return
			}
			pc := pieces[i]
			pc.j.copy(pc.off, pc.n)
		}
	}
	var wg sync.WaitGroup
	for range workers - 1 {
		wg.Go(work)
	}
	work()
	wg.Wait()
}
