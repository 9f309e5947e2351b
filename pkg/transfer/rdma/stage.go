package rdma

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/staging"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

// Staging of GPU memory the NICs cannot reach (docs/RDMA.md, "Staging").
//
// A task with staged memory on either side is cut into pieces. Each piece
// takes a span of the initiator's staging (per peer: pinned host memory from
// the region's transfer.DeviceMemory, registered once on every NIC) when its
// local memory is staged, and a span of the target's staging (per control
// connection: the target allocates and registers it on the first "stage"
// request, the initiator hands out its spans) when the remote memory is.
// The pieces of a batch flow through its pipeline:
//
//	feed:   take spans (bounded wait), start device->host copies (write),
//	        ask the target to copy device->staging ("copy", read), in groups
//	post:   wait each piece's device copy in order, hand its RDMA to the batch
//	finish: after the RDMA, start host->device copies (read) and ask the
//	        target to copy staging->device ("copy", write), in groups
//
// so the device copies of later pieces overlap the RDMA of earlier ones.
// Spans are given back once nothing (HCA, device copy) uses them; a copy
// that outlives its wait is settled in the background, keeping its span
// until it ends (if it never does, that staging is never freed).

const (
	maxPieces = 256 // pieces of one batch in flight
	copyGroup = 32  // device copies per control exchange
	maxCopies = 256 // device copies one "copy" request may ask
)

// pieceSize is the largest piece: a slice, at most a quarter of the
// staging, so several pieces are in flight.
func (t *Transport) pieceSize() int { return max(1, min(t.cfg.SliceSize, t.cfg.StagingSize/4)) }

// copyReq is one device copy a "copy" request asks of the target: N bytes
// between device address Dev and offset Off of the connection's staging, to
// the device (In) or from it.
type copyReq struct {
	In  bool   `json:"in,omitempty"`
	Dev uint64 `json:"dev"`
	Off uint64 `json:"off"`
	N   uint64 `json:"n"`
}

// ---- initiator ----

// peerStaging is an initiator's staging toward one peer: local (its own
// pinned memory) and remote (the target's area for this connection).
type peerStaging struct {
	mu     sync.Mutex
	local  *localStaging
	remote *remoteStaging
}

type localStaging struct {
	mem    transfer.Staging
	buf    []byte
	base   uint64
	mrs    []verbs.MR
	lkeys  []uint32 // per NIC
	ring   *staging.Ring
	busy   sync.WaitGroup // settling copies
	leaked atomic.Bool    // a copy never ended: never free the memory
}

type remoteStaging struct {
	keys *remoteKeys // the area: address, size, rkeys
	ring *staging.Ring
}

// localFor returns the peer's local staging, allocating it from dev and
// registering it on every NIC the first time.
func (ps *peerStaging) localFor(t *Transport, dev transfer.DeviceMemory) (*localStaging, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.local != nil {
		return ps.local, nil
	}
	n := t.cfg.StagingSize
	mem, err := dev.AllocStaging(n)
	if err != nil {
		return nil, fmt.Errorf("%w: rdma: %d bytes of local staging: %w", transfer.ErrDeviceCopy, n, err)
	}
	buf := mem.Bytes()
	if len(buf) < n {
		mem.Close()
		return nil, fmt.Errorf("%w: rdma: local staging of %d bytes, asked for %d", transfer.ErrDeviceCopy, len(buf), n)
	}
	buf = buf[:n:n]
	ls := &localStaging{mem: mem, buf: buf, base: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(buf)))), ring: staging.NewRing(uint64(n))}
	for _, nc := range t.nics {
		m, err := nc.pd.RegMR(uintptr(ls.base), uint64(n), verbs.AccessLocalWrite)
		if err != nil {
			ls.free()
			return nil, fmt.Errorf("%w: rdma: %s: ibv_reg_mr of %d bytes of local staging: %w", transfer.ErrDeviceCopy, nc.name, n, err)
		}
		ls.mrs = append(ls.mrs, m)
		ls.lkeys = append(ls.lkeys, m.LKey())
	}
	ps.local = ls
	return ls, nil
}

func (ls *localStaging) free() {
	for _, m := range ls.mrs {
		m.Close()
	}
	ls.mrs = nil
	ls.mem.Close()
}

// remoteFor returns the target's staging area for this connection, asking
// for it (naming the staged region at addr) the first time.
func (ps *peerStaging) remoteFor(ctx context.Context, t *Transport, p *peer, addr uint64) (*remoteStaging, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if ps.remote != nil {
		return ps.remote, nil
	}
	resp, err := p.exchange(ctx, &message{Op: "stage", Addr: addr}, t.h.Timeout())
	if err != nil {
		return nil, fmt.Errorf("rdma: asking %s for staging: %w", p.name, err)
	}
	if resp.Err != "" || resp.Len == 0 || len(resp.RKeys) == 0 {
		return nil, fmt.Errorf("%w: rdma: %s has no staging for its GPU region [%#x, ...): %s", transfer.ErrDeviceCopy, p.name, addr, resp.Err)
	}
	ps.remote = &remoteStaging{keys: &remoteKeys{addr: resp.Addr, n: resp.Len, access: transfer.AccessReadWrite, rkeys: resp.RKeys},
		ring: staging.NewRing(resp.Len)}
	return ps.remote, nil
}

// close frees the local staging once no copy settles on it; the peer's
// QPs are closed.
func (ps *peerStaging) close() {
	ps.mu.Lock()
	ls := ps.local
	ps.local, ps.remote = nil, nil
	ps.mu.Unlock()
	if ls == nil {
		return
	}
	ls.busy.Wait()
	if !ls.leaked.Load() {
		ls.free()
	}
}

// piece is a staged task's part of at most pieceSize bytes.
type piece struct {
	j             *job
	op            verbs.Opcode
	local, remote uint64
	n             int
	lr            *transfer.Region
	ldev          transfer.DeviceMemory // the local memory is staged
	keys          *remoteKeys           // the remote region (keys.staged: it is staged)
	lkeys         []uint32              // the local region's, when not staged
	pref          []bool

	ls       *localStaging
	rs       *remoteStaging
	lsp, rsp *staging.Span
	rspLost  bool                // the target's copy is in an unknown state: the span is not reused
	c        transfer.Completion // the local device copy in flight
	err      error
}

// pipe moves one batch's pieces.
type pipe struct {
	t    *Transport
	b    *batch
	p    *peer
	pre  chan *piece   // spans taken, copies started: in order
	post chan *piece   // transferred: to be copied in
	room chan struct{} // one per piece in flight
	left atomic.Int32  // pieces not ended
	fin  chan struct{} // every piece ended

	lsErr, rsErr error // the first staging setup failure (feeder only)
}

// startPipe runs the batch's pipeline on goroutines of its own, holding a
// reference on p until they end.
func (t *Transport) startPipe(b *batch, p *peer, pcs []*piece) {
	pp := &pipe{t: t, b: b, p: p, pre: make(chan *piece, maxPieces), post: make(chan *piece, maxPieces),
		room: make(chan struct{}, maxPieces), fin: make(chan struct{})}
	pp.left.Store(int32(len(pcs)))
	p.ref()
	var wg sync.WaitGroup
	wg.Add(3)
	t.wg.Add(1)
	go func() { defer wg.Done(); pp.feed(pcs) }()
	go func() { defer wg.Done(); pp.postLoop() }()
	go func() { defer wg.Done(); pp.finishLoop() }()
	go func() {
		defer t.wg.Done()
		wg.Wait()
		p.release()
	}()
}

func (pp *pipe) ctx() context.Context { return pp.b.ctx }

// end reports a piece: its spans go back (unless the target's copy state
// is unknown), its room is freed, its job counts it.
func (pp *pipe) end(pc *piece, roomHeld bool) {
	if pc.lsp != nil {
		pc.ls.ring.Release(pc.lsp)
		pc.lsp = nil
	}
	if pc.rsp != nil && !pc.rspLost {
		pc.rs.ring.Release(pc.rsp)
	}
	pc.rsp = nil
	if pc.err == nil {
		side := "remote"
		if pc.ldev != nil {
			side = "local"
		}
		pp.t.m.staged.WithLabelValues(side, opLabel(pc.op)).Add(float64(pc.n))
	}
	if roomHeld {
		<-pp.room
	}
	pc.j.finish(pc.err)
	if pp.left.Add(-1) == 0 {
		close(pp.fin)
	}
}

// what names a piece in errors.
func (pc *piece) what(peer string) string {
	return fmt.Sprintf("%v of %d bytes, local %#x (%v region [%#x, +%d)), remote %#x at %s", pc.op, pc.n, pc.local, pc.lr.Location, pc.lr.Addr, pc.lr.Len, pc.remote, peer)
}

// feed takes the pieces' spans in order, starts their device->host copies
// and has the target stage the remote reads, in groups.
func (pp *pipe) feed(pcs []*piece) {
	defer close(pp.pre)
	var group []*piece
	flush := func() {
		pp.copies(group, false)
		for _, pc := range group {
			pp.pre <- pc // room bounds the pieces in flight: never blocks
		}
		group = group[:0]
	}
	for i, pc := range pcs {
		ended := pp.ctx().Err() != nil
		if !ended {
			select {
			case pp.room <- struct{}{}:
			default:
				flush()
				select {
				case pp.room <- struct{}{}:
				case <-pp.ctx().Done():
					ended = true
				}
			}
		}
		if ended {
			flush()
			for _, pc := range pcs[i:] {
				pc.err = fmt.Errorf("rdma: %s: %w", pc.what(pp.p.name), pp.ctx().Err())
				pp.end(pc, false)
			}
			return
		}
		if err := pp.spans(pc, flush); err != nil {
			pc.err = err
			pp.end(pc, true)
			continue
		}
		if pc.op == verbs.OpWrite && pc.ldev != nil {
			c, err := pc.ldev.CopyToHost(pc.lsp.Of(pc.ls.buf), pc.local)
			if err != nil {
				pc.err = fmt.Errorf("rdma: staging copy to host for %s: %w", pc.what(pp.p.name), err)
			}
			pc.c = c
		}
		group = append(group, pc)
		if len(group) >= copyGroup {
			flush()
		}
	}
	flush()
}

// spans takes the piece's staging spans, waiting (after flush, so the
// pieces taken so far go on) at most the engine's Timeout.
func (pp *pipe) spans(pc *piece, flush func()) error {
	t := pp.t
	if pc.ldev != nil {
		if pp.lsErr == nil {
			pc.ls, pp.lsErr = pp.p.stg.localFor(t, pc.ldev)
		}
		if pp.lsErr != nil {
			return fmt.Errorf("%s: %w", pc.what(pp.p.name), pp.lsErr)
		}
		sp, err := pp.span(pc.ls.ring, pc.n, flush, "local")
		if err != nil {
			return fmt.Errorf("%s: %w", pc.what(pp.p.name), err)
		}
		pc.lsp = sp
	}
	if pc.keys.staged {
		if pp.rsErr == nil {
			pc.rs, pp.rsErr = pp.p.stg.remoteFor(pp.ctx(), t, pp.p, pc.keys.addr)
		}
		if pp.rsErr != nil {
			return fmt.Errorf("%s: %w", pc.what(pp.p.name), pp.rsErr)
		}
		sp, err := pp.span(pc.rs.ring, pc.n, flush, pp.p.name+"'s")
		if err != nil {
			return fmt.Errorf("%s: %w", pc.what(pp.p.name), err)
		}
		pc.rsp = sp
	}
	return nil
}

func (pp *pipe) span(r *staging.Ring, n int, flush func(), whose string) (*staging.Span, error) {
	if uint64(n) > r.Size() {
		return nil, fmt.Errorf("%w: rdma: a piece of %d bytes does not fit in %s staging of %d bytes", transfer.ErrDeviceCopy, n, whose, r.Size())
	}
	if sp, ok := r.TryAlloc(n); ok {
		return sp, nil
	}
	flush()
	tm := time.NewTimer(pp.t.h.Timeout())
	defer tm.Stop()
	for {
		if sp, ok := r.TryAlloc(n); ok {
			return sp, nil
		}
		select {
		case <-r.Freed():
		case <-tm.C:
			return nil, fmt.Errorf("%w: rdma: no %s staging came free in %v (%d bytes)", transfer.ErrDeviceCopy, whose, pp.t.h.Timeout(), r.Size())
		case <-pp.ctx().Done():
			return nil, fmt.Errorf("rdma: waiting for %s staging: %w", whose, pp.ctx().Err())
		}
	}
}

// copies asks the target for the device copies of the group's pieces that
// need one: staging->device after writes (in), device->staging before reads.
func (pp *pipe) copies(group []*piece, in bool) {
	op := verbs.OpRead
	if in {
		op = verbs.OpWrite
	}
	var ask []*piece
	m := &message{Op: "copy"}
	for _, pc := range group {
		if pc.err == nil && pc.op == op && pc.keys.staged {
			ask = append(ask, pc)
			m.Copies = append(m.Copies, copyReq{In: in, Dev: pc.remote, Off: pc.rsp.Off, N: uint64(pc.n)})
		}
	}
	if len(ask) == 0 {
		return
	}
	dir := "to its staging"
	if in {
		dir = "from its staging"
	}
	resp, err := pp.p.exchange(pp.ctx(), m, pp.t.h.Timeout())
	if err == nil && resp.Err != "" {
		err = errors.New(resp.Err)
	} else if err == nil && len(resp.Errs) != len(ask) {
		err = fmt.Errorf("%d results for %d copies", len(resp.Errs), len(ask))
	}
	// A request sent without its answer leaves the target's copies in an
	// unknown state; the connection is out of use then (a new one comes
	// with a new area), so those spans are never reused.
	lost := pp.p.connErr.Load() != nil
	for i, pc := range ask {
		switch {
		case err != nil:
			pc.rspLost = lost
			pc.err = fmt.Errorf("%w: rdma: %s's device copy %s for %s: %w", transfer.ErrDeviceCopy, pp.p.name, dir, pc.what(pp.p.name), err)
		case resp.Errs[i] != "":
			pc.err = fmt.Errorf("%w: rdma: %s's device copy %s for %s: %s", transfer.ErrDeviceCopy, pp.p.name, dir, pc.what(pp.p.name), resp.Errs[i])
		}
	}
}

// postLoop waits each piece's device copy in order and hands its RDMA to
// the batch.
func (pp *pipe) postLoop() {
	for pc := range pp.pre {
		if pc.err == nil && pc.c != nil && !pp.wait(pc, "to host") {
			continue // settling: it ends the piece
		}
		if pc.err != nil {
			pp.end(pc, true)
			continue
		}
		s := &slice{j: pc.j, p: pp.p, op: pc.op, local: pc.local, remote: pc.remote, n: uint32(pc.n), keys: pc.keys, lkeys: pc.lkeys, pref: pc.pref}
		if pc.lsp != nil {
			s.local, s.lkeys = pc.ls.base+pc.lsp.Off, pc.ls.lkeys
		}
		if pc.rsp != nil {
			s.remote, s.keys = pc.rs.keys.addr+pc.rsp.Off, pc.rs.keys
		}
		s.done = func(err error) { pp.transferred(pc, err) }
		select {
		case pp.b.staged <- s:
		case <-pp.b.loopDone:
			err := fmt.Errorf("rdma: %w", pp.ctx().Err())
			if e := pp.b.dead.Load(); e != nil {
				err = *e
			}
			s.finish(err)
		}
	}
}

// wait waits for the piece's local device copy within the batch's context.
// If the copy did not end by then it settles in the background (keeping
// the span until the copy ends, at most one more Timeout) and ends the
// piece from there: wait reports false.
func (pp *pipe) wait(pc *piece, dir string) bool {
	c := pc.c
	err := c.Wait(pp.ctx())
	if err == nil || errors.Is(err, transfer.ErrDeviceCopy) || pp.ctx().Err() == nil {
		pc.c = nil
		if err != nil {
			pc.err = fmt.Errorf("rdma: staging copy %s for %s: %w", dir, pc.what(pp.p.name), err)
		}
		return true
	}
	pc.err = fmt.Errorf("rdma: staging copy %s for %s: %w", dir, pc.what(pp.p.name), err)
	ls, sp := pc.ls, pc.lsp
	pc.lsp = nil
	ls.busy.Add(1)
	pp.t.wg.Add(1)
	go func() {
		defer pp.t.wg.Done()
		defer ls.busy.Done()
		ctx, cancel := context.WithTimeout(context.Background(), pp.t.h.Timeout())
		err := c.Wait(ctx)
		cancel()
		if err == nil || errors.Is(err, transfer.ErrDeviceCopy) || ctx.Err() == nil {
			ls.ring.Release(sp)
		} else {
			ls.leaked.Store(true)
			pp.t.lg.Error("a device copy never ended: its staging is left allocated", zap.String("peer", pp.p.name), zap.Uint64("addr", pc.local))
		}
		pp.end(pc, true)
	}()
	return false
}

// transferred is the piece's RDMA result (on a poller or the batch's
// goroutine: it does not block).
func (pp *pipe) transferred(pc *piece, err error) {
	if err != nil {
		pc.err = err
		pp.end(pc, true)
		return
	}
	if pc.op == verbs.OpWrite {
		if pc.lsp != nil {
			pc.ls.ring.Release(pc.lsp)
			pc.lsp = nil
		}
		if pc.keys.staged {
			pp.post <- pc // room bounds it: never blocks
			return
		}
	} else {
		if pc.rsp != nil {
			pc.rs.ring.Release(pc.rsp)
			pc.rsp = nil
		}
		if pc.ldev != nil {
			pp.post <- pc
			return
		}
	}
	pp.end(pc, true)
}

// finishLoop ends transferred pieces in groups: host->device copies of
// reads into local staged memory, and one request for the target's copies
// of writes into its staged memory.
func (pp *pipe) finishLoop() {
	for {
		var group []*piece
		select {
		case pc := <-pp.post:
			group = append(group, pc)
		case <-pp.fin:
			return
		}
	more:
		for len(group) < copyGroup {
			select {
			case pc := <-pp.post:
				group = append(group, pc)
			default:
				break more
			}
		}
		for _, pc := range group {
			if pc.op == verbs.OpRead && pc.ldev != nil {
				c, err := pc.ldev.CopyFromHost(pc.local, pc.lsp.Of(pc.ls.buf))
				if err != nil {
					pc.err = fmt.Errorf("rdma: staging copy from host for %s: %w", pc.what(pp.p.name), err)
				}
				pc.c = c
			}
		}
		pp.copies(group, true)
		for _, pc := range group {
			if pc.err == nil && pc.c != nil && !pp.wait(pc, "from host") {
				continue
			}
			pp.end(pc, true)
		}
	}
}

// ---- target ----

// servedStaging is a served connection's staging area: pinned host memory
// registered on every NIC for the peer's RDMA, and the device copies the
// peer asks between it and staged GPU regions.
type servedStaging struct {
	t      *Transport
	mem    transfer.Staging
	buf    []byte
	mrs    []verbs.MR
	busy   sync.WaitGroup // copies settling past their bound
	leaked atomic.Bool
}

// setup allocates the area (once per connection) from the memory of the
// staged region at addr.
func (st *servedStaging) setup(addr uint64) *message {
	t := st.t
	fail := func(f string, a ...any) *message { return &message{Op: "stage", Addr: addr, Err: fmt.Sprintf(f, a...)} }
	if st.mem == nil {
		var dev transfer.DeviceMemory
		t.mu.Lock()
		for r, e := range t.regions {
			if r.Addr == addr && e.staged != nil {
				dev = e.staged
			}
		}
		t.mu.Unlock()
		if dev == nil {
			return fail("no staged GPU region registered at %#x", addr)
		}
		n := t.cfg.StagingSize
		if !t.servedStaging.Take(int64(n)) {
			return fail("the staging of served connections is at its limit of %d bytes (Config.MaxServedStaging)", t.servedStaging.Max)
		}
		mem, err := dev.AllocStaging(n)
		if err != nil {
			t.servedStaging.Give(int64(n))
			return fail("%d bytes of staging: %v", n, err)
		}
		if len(mem.Bytes()) < n {
			mem.Close()
			t.servedStaging.Give(int64(n))
			return fail("staging of %d bytes, asked for %d", len(mem.Bytes()), n)
		}
		st.mem, st.buf = mem, mem.Bytes()[:n:n]
		base := uintptr(unsafe.Pointer(unsafe.SliceData(st.buf)))
		for _, nc := range t.nics {
			m, err := nc.pd.RegMR(base, uint64(n), verbs.AccessLocalWrite|verbs.AccessRemoteWrite|verbs.AccessRemoteRead)
			if err != nil {
				st.free()
				return fail("%s: ibv_reg_mr of %d bytes of staging: %v", nc.name, n, err)
			}
			st.mrs = append(st.mrs, m)
		}
	}
	m := &message{Op: "stage", Addr: uint64(uintptr(unsafe.Pointer(unsafe.SliceData(st.buf)))), Len: uint64(len(st.buf))}
	for _, x := range st.mrs {
		m.RKeys = append(m.RKeys, x.RKey())
	}
	return m
}

func (st *servedStaging) free() {
	for _, m := range st.mrs {
		m.Close()
	}
	st.mrs = nil
	st.mem.Close()
	st.mem, st.buf = nil, nil
	st.t.servedStaging.Give(int64(st.t.cfg.StagingSize))
}

// close frees the area once no copy uses it (the connection's QPs are
// closed).
func (st *servedStaging) close() {
	st.busy.Wait()
	if st.mem != nil && !st.leaked.Load() {
		st.free()
	}
}

// copy runs the device copies a "copy" request asks, each on a region the
// engine holds for it, and waits for them at most the engine's Timeout.
// broken: one did not end by then; it settles in the background and the
// connection must end (the peer cannot know when that span is free).
func (st *servedStaging) copy(m *message) (resp *message, broken bool) {
	t := st.t
	resp = &message{Op: "copy"}
	if st.mem == nil {
		resp.Err = "no staging set up on this connection"
		return resp, false
	}
	if len(m.Copies) == 0 || len(m.Copies) > maxCopies {
		resp.Err = fmt.Sprintf("%d copies asked (1..%d)", len(m.Copies), maxCopies)
		return resp, false
	}
	type run struct {
		c   transfer.Completion
		reg *transfer.Region
	}
	runs := make([]run, len(m.Copies))
	resp.Errs = make([]string, len(m.Copies))
	for i, c := range m.Copies {
		need, dir := transfer.AccessRead, "to host"
		if c.In {
			need, dir = transfer.AccessWrite, "from host"
		}
		if c.N == 0 || c.Off+c.N > uint64(len(st.buf)) || c.Off+c.N < c.Off {
			resp.Errs[i] = fmt.Sprintf("staging span [%d, +%d) outside the %d bytes of staging", c.Off, c.N, len(st.buf))
			continue
		}
		reg, err := t.h.HoldLocal(c.Dev, c.N, need)
		if err != nil {
			resp.Errs[i] = err.Error()
			continue
		}
		t.mu.Lock()
		e := t.regions[reg]
		t.mu.Unlock()
		if e == nil || e.staged == nil {
			reg.Release()
			resp.Errs[i] = fmt.Sprintf("[%#x, +%d) is not staged GPU memory", c.Dev, c.N)
			continue
		}
		b := st.buf[c.Off : c.Off+c.N : c.Off+c.N]
		var cp transfer.Completion
		if c.In {
			cp, err = e.staged.CopyFromHost(c.Dev, b)
		} else {
			cp, err = e.staged.CopyToHost(b, c.Dev)
		}
		if err != nil {
			reg.Release()
			resp.Errs[i] = fmt.Sprintf("copy %s of %d bytes at %#x: %v", dir, c.N, c.Dev, err)
			continue
		}
		runs[i] = run{c: cp, reg: reg}
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.h.Timeout())
	defer cancel()
	for i, r := range runs {
		if r.c == nil {
			continue
		}
		c := m.Copies[i]
		err := r.c.Wait(ctx)
		if err == nil || errors.Is(err, transfer.ErrDeviceCopy) || ctx.Err() == nil {
			r.reg.Release()
			if err != nil {
				resp.Errs[i] = fmt.Sprintf("copy of %d bytes at %#x: %v", c.N, c.Dev, err)
			}
			continue
		}
		broken = true
		resp.Errs[i] = fmt.Sprintf("copy of %d bytes at %#x did not end in %v", c.N, c.Dev, t.h.Timeout())
		st.busy.Add(1)
		t.wg.Add(1)
		go func() {
			defer t.wg.Done()
			defer st.busy.Done()
			ctx, cancel := context.WithTimeout(context.Background(), t.h.Timeout())
			err := r.c.Wait(ctx)
			cancel()
			if err == nil || errors.Is(err, transfer.ErrDeviceCopy) || ctx.Err() == nil {
				r.reg.Release()
				return
			}
			st.leaked.Store(true) // the region stays held: UnregisterMemory says so
			t.lg.Error("a served device copy never ended: its staging and region stay held", zap.Uint64("addr", c.Dev))
		}()
	}
	return resp, broken
}
