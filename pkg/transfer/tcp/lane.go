package tcp

import (
	"bufio"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// peer is the set of lanes to one incarnation of a segment.
type peer struct {
	t     *Transport
	name  string
	inc   string
	ready chan struct{} // closed when dialing ended: lanes or err is set
	err   error
	lanes []*lane
	// stagingChunk bounds requests to the peer's device regions.
	stagingChunk uint64
	// vector is the most pieces one request to the peer may carry (below
	// 2: the peer takes single requests only).
	vector int

	closing atomic.Bool
}

// peerFor returns the peer for d, starting to dial its lanes if there are
// none (or only lanes of another incarnation, which it closes).
func (t *Transport) peerFor(d *transfer.Descriptor) (*peer, error) {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil, fmt.Errorf("tcp: %w", transfer.ErrClosed)
	}
	p := t.peers[d.Name]
	if p != nil && p.inc == d.Incarnation {
		t.mu.Unlock()
		return p, nil
	}
	old := p
	p = &peer{t: t, name: d.Name, inc: d.Incarnation, ready: make(chan struct{}), stagingChunk: defaultStagingChunk}
	var inf info
	if json.Unmarshal(d.Transports[Name], &inf) == nil {
		if inf.StagingChunk > 0 {
			p.stagingChunk = uint64(min(inf.StagingChunk, MaxChunk))
		}
		if !t.cfg.NoVectors {
			p.vector = min(inf.Vector, maxVector)
		}
	}
	t.peers[d.Name] = p
	t.wg.Add(1)
	t.mu.Unlock()
	if old != nil {
		old.close(fmt.Errorf("%w: %s is now incarnation %s", transfer.ErrPeerRestarted, d.Name, d.Incarnation))
	}
	dd := d.Clone()
	go func() {
		defer t.wg.Done()
		t.dial(p, dd)
	}()
	return p, nil
}

// forget removes p from the peer table if it is still there.
func (t *Transport) forget(p *peer) {
	t.mu.Lock()
	if t.peers[p.name] == p {
		delete(t.peers, p.name)
	}
	t.mu.Unlock()
}

func (t *Transport) dial(p *peer, d *transfer.Descriptor) {
	ctx, cancel := context.WithTimeout(t.ctx, t.h.Timeout())
	defer cancel()
	conns := make([]net.Conn, t.cfg.Lanes)
	errs := make([]error, t.cfg.Lanes)
	var wg sync.WaitGroup
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conns[i], errs[i] = t.h.Dial(ctx, d, Name)
		}()
	}
	wg.Wait()
	err := errors.Join(errs...)
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	if err != nil {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
		// Keep the first error: errors.Join of identical refusals is noise.
		for _, e := range errs {
			if e != nil {
				err = e
				break
			}
		}
		p.err = fmt.Errorf("tcp: open lanes to %s: %w", p.name, err)
		t.forget(p)
		close(p.ready)
		return
	}
	t.mu.Lock()
	closed := t.closed || t.peers[p.name] != p
	if !closed {
		for _, c := range conns {
			l := newLane(p, c)
			p.lanes = append(p.lanes, l)
			l.lwg.Add(4)
			t.wg.Add(5)
			go func() { defer t.wg.Done(); defer l.lwg.Done(); l.writeLoop() }()
			go func() { defer t.wg.Done(); defer l.lwg.Done(); l.readLoop() }()
			go func() { defer t.wg.Done(); defer l.lwg.Done(); l.copyLoop() }()
			go func() { defer t.wg.Done(); defer l.lwg.Done(); l.finishLoop() }()
			go func() {
				defer t.wg.Done()
				l.lwg.Wait()
				if err := l.st.close(); err != nil {
					t.lg.Warn("freeing staging memory", zap.String("peer", p.name), zap.Error(err))
				}
				if l.st.leaked.Load() {
					t.lg.Error("a device copy never ended: its staging memory is left allocated", zap.String("peer", p.name))
				}
			}()
		}
	}
	t.mu.Unlock()
	if closed {
		for _, c := range conns {
			c.Close()
		}
		p.err = fmt.Errorf("tcp: lanes to %s: %w", p.name, transfer.ErrClosed)
	} else {
		t.lg.Debug("lanes open", zap.String("peer", p.name), zap.String("incarnation", p.inc), zap.Int("lanes", len(conns)))
	}
	close(p.ready)
}

// close fails every lane of the peer with err.
func (p *peer) close(err error) {
	if !p.closing.CompareAndSwap(false, true) {
		return
	}
	failLanes := func() {
		for _, l := range p.lanes {
			l.fail(err)
		}
	}
	select {
	case <-p.ready:
		failLanes()
	default: // still dialing: fail the lanes once they exist
		p.t.wg.Add(1)
		go func() {
			defer p.t.wg.Done()
			<-p.ready
			failLanes()
		}()
	}
}

// lane is one data connection to a peer: a writer goroutine sends queued
// pieces, a reader goroutine matches responses to them by id.
type lane struct {
	p    *peer
	conn net.Conn
	br   *bufio.Reader
	max  int
	tmo  time.Duration
	load atomic.Int64 // bytes queued or in flight

	mu       sync.Mutex
	cond     sync.Cond
	queue    []*piece
	inflight map[uint64]*piece
	next     uint64
	err      error
	lastDL   time.Time // when the read deadline was last pushed

	st    *stager
	rbufs [][]byte        // the reader's: a vector read's destinations
	done  context.Context // already done: polls completions
	stop  chan struct{}   // closed by fail
	cpq   chan *piece     // staged reads received into their slot, copy not started
	fin   chan *piece     // staged reads whose copy to the device runs
	lwg   sync.WaitGroup
}

func newLane(p *peer, c net.Conn) *lane {
	cfg := p.t.cfg
	l := &lane{p: p, conn: c, br: bufio.NewReaderSize(c, readBufSize), max: cfg.MaxInflight,
		tmo: p.t.h.Timeout(), inflight: map[uint64]*piece{}, st: newStager(cfg.StagingChunk, cfg.StagingSlots),
		stop: make(chan struct{}), cpq: make(chan *piece, finQueue), fin: make(chan *piece, finQueue),
		done: doneContext()}
	l.cond.L = &l.mu
	return l
}

func (l *lane) enqueue(ps []*piece) {
	var add int64
	for _, pc := range ps {
		add += int64(pc.n) + reqSize
	}
	l.mu.Lock()
	if l.err != nil {
		err := l.err
		l.mu.Unlock()
		for _, pc := range ps {
			pc.finish(err)
		}
		return
	}
	l.load.Add(add)
	l.queue = append(l.queue, ps...)
	l.mu.Unlock()
	l.cond.Signal()
}

// fail ends the lane: every queued or in-flight piece fails with err, and
// the peer's other lanes go too (a broken lane means a broken peer).
func (l *lane) fail(err error) {
	l.mu.Lock()
	if l.err != nil {
		l.mu.Unlock()
		return
	}
	l.err = err
	close(l.stop)
	q, inf := l.queue, l.inflight
	l.queue, l.inflight = nil, map[uint64]*piece{}
	l.mu.Unlock()
	l.cond.Broadcast()
	l.conn.Close()
	for _, pc := range q {
		pc.finish(err)
	}
	for _, pc := range inf {
		pc.finish(err)
	}
	l.p.t.forget(l.p)
	l.p.close(err)
}

func (l *lane) deadErr(what string, err error) error {
	if errors.Is(err, net.ErrClosed) {
		l.mu.Lock()
		e := l.err
		l.mu.Unlock()
		if e != nil {
			return e
		}
	}
	return fmt.Errorf("%w: tcp lane to %s: %s: %v", transfer.ErrPeerDead, l.p.name, what, err)
}

// pushDeadlineLocked moves the read deadline to now+timeout when it was
// last moved more than timeout/8 ago (or force). A lane with requests in
// flight and nothing received for about the timeout is dead.
func (l *lane) pushDeadlineLocked(force bool) {
	now := time.Now()
	if force || now.Sub(l.lastDL) > l.tmo/8 {
		l.conn.SetReadDeadline(now.Add(l.tmo))
		l.lastDL = now
	}
}

const maxSendBatch = 128

// finQueue bounds the staged reads waiting for the finisher.
const finQueue = 256

// skip is a piece the writer ends without sending it.
type skip struct {
	pc  *piece
	err error
}

func (l *lane) writeLoop() {
	var cur, next []*piece
	bufs := make(net.Buffers, 0, 2*maxSendBatch)
	for {
		if len(cur) == 0 {
			var ok bool
			if cur, ok = l.collect(cur[:0], true); !ok {
				return
			}
			if len(cur) == 0 {
				continue
			}
		}
		// Take and stage the next batch before sending this one, so its
		// copies run while this one is on the socket (each batch stages at
		// most half the ring).
		next, _ = l.collect(next[:0], false)
		if err := l.send(cur, bufs); err != nil {
			err = l.deadErr("send", err)
			l.abandon(next, err)
			l.fail(err)
			return
		}
		clear(cur)
		cur, next = next, cur
	}
}

// collect takes the next batch off the queue into batch and starts the
// copies of its staged writes; with wait, it first waits for work (and, if
// the staging is out, for some to come back). It reports false once the
// lane has failed.
func (l *lane) collect(batch []*piece, wait bool) ([]*piece, bool) {
	var skipped []skip
	l.mu.Lock()
	for wait && l.err == nil && (len(l.queue) == 0 || len(l.inflight) >= l.max) {
		l.cond.Wait()
	}
	if l.err != nil {
		l.mu.Unlock()
		return batch, false
	}
	idle := len(l.inflight) == 0
	var size, stagedBytes uint64
	staged, waitStaging := false, false
	half := uint64(l.st.slots*l.st.chunk) / 2
	i := 0
build:
	for ; i < len(l.queue) && len(l.inflight) < l.max && len(batch) < maxSendBatch && size < maxWriteBytes; i++ {
		pc := l.queue[i]
		if pc.ctx.Err() != nil {
			skipped = append(skipped, skip{pc, fmt.Errorf("tcp: not sent to %s: %w", l.p.name, pc.ctx.Err())})
			continue
		}
		if pc.dev != nil {
			if err := l.st.init(pc.dev); err != nil {
				skipped = append(skipped, skip{pc, err})
				continue
			}
			if pc.op == opWrite {
				if staged && stagedBytes+pc.n > half {
					break build // the rest goes with the next batch
				}
				var ok bool
				if pc.slot, ok = l.st.tryGet(toWire, int(pc.n)); !ok {
					waitStaging = len(batch) == 0
					break build // the next round, once staging is back
				}
				staged, stagedBytes = true, stagedBytes+pc.n
			}
		}
		l.next++
		h := reqHeader{op: pc.op, id: l.next, addr: pc.remote, len: pc.n}
		if pc.vec != nil {
			h.flags, h.addr = flagVector, uint64(len(pc.vec))
		}
		h.put(pc.hdr[:])
		if pc.slot == nil {
			// A staged write enters inflight once its bytes are staged.
			l.inflight[l.next] = pc
		}
		batch = append(batch, pc)
		if pc.op == opWrite {
			size += pc.n
		}
	}
	rest := copy(l.queue, l.queue[i:])
	clear(l.queue[rest:])
	l.queue = l.queue[:rest]
	if len(batch) > 0 {
		l.pushDeadlineLocked(idle)
	}
	l.mu.Unlock()
	for _, sk := range skipped {
		l.load.Add(-int64(sk.pc.n) - reqSize)
		sk.pc.finish(sk.err)
	}
	if len(batch) == 0 && wait && waitStaging {
		// The staging is out with copies that outlived their batch: wait
		// until some comes back.
		t := time.NewTimer(l.tmo)
		err := l.st.wait(toWire, l.stop, t.C)
		t.Stop()
		if err != nil && !errors.Is(err, errStopped) {
			l.fail(fmt.Errorf("tcp: lane to %s: %w", l.p.name, err))
			return batch, false
		}
	}
	if staged {
		l.stage(batch)
	}
	return batch, true
}

// stage starts the copies of the batch's staged writes into their slots.
func (l *lane) stage(batch []*piece) {
	for _, pc := range batch {
		if pc.slot == nil {
			continue
		}
		b := pc.slot.b
		pc.wait = copyRuns(pc.entries(), func(addr, off, n uint64) (transfer.Completion, error) {
			c, err := pc.dev.CopyToHost(b[off:off+n], addr)
			if err != nil {
				err = fmt.Errorf("tcp: staging %d bytes at %#x for %s: %w", n, addr, l.p.name, err)
			}
			return c, err
		})
	}
}

// send writes the batch with vectored writes; before a staged write it
// sends what came before and waits for the piece's copy. A piece whose copy
// failed is ended unsent.
func (l *lane) send(batch []*piece, bufs net.Buffers) error {
	bufs = bufs[:0]
	var slots []*slot // sent with bufs: free once written
	flush := func() error {
		if len(bufs) == 0 {
			return nil
		}
		l.conn.SetWriteDeadline(time.Now().Add(l.tmo))
		b := bufs
		_, err := b.WriteTo(l.conn)
		clear(bufs)
		bufs = bufs[:0]
		for _, s := range slots {
			l.st.put(toWire, s)
		}
		slots = slots[:0]
		return err
	}
	for k, pc := range batch {
		if pc.slot != nil {
			if ended(l.done, pc.wait) {
				pc.wait = doneCopy{} // staged already: no need to send what came before first
			} else if err := flush(); err != nil {
				l.abandon(batch[k:], l.deadErr("send", err))
				return err
			}
			if !l.staged(pc) {
				continue
			}
			slots = append(slots, pc.slot)
			bufs = append(bufs, pc.hdr[:])
			if pc.ents != nil {
				bufs = append(bufs, pc.ents)
			}
			bufs = append(bufs, pc.slot.b)
			pc.slot, pc.wait = nil, nil
			continue
		}
		bufs = append(bufs, pc.hdr[:])
		if pc.ents != nil {
			bufs = append(bufs, pc.ents)
		}
		if pc.op == opWrite {
			bufs = pc.appendMem(bufs)
		}
	}
	return flush()
}

// staged waits for a staged write's copy and, if its bytes are in the
// slot, puts the piece in flight. Otherwise it ends the piece (once the
// copy no longer touches its memory) and reports false.
func (l *lane) staged(pc *piece) bool {
	err := pc.wait.Wait(pc.ctx)
	if err != nil && pc.ctx.Err() != nil && !errors.Is(err, transfer.ErrDeviceCopy) {
		l.load.Add(-int64(pc.n) - reqSize)
		cerr := fmt.Errorf("tcp: not sent to %s: %w", l.p.name, pc.ctx.Err())
		l.st.settle(toWire, pc.slot, pc.wait, l.tmo, func(_ error, ended bool) {
			if ended {
				pc.finish(cerr)
			}
		})
		pc.slot, pc.wait = nil, nil
		return false
	}
	if err == nil {
		l.mu.Lock()
		if err = l.err; err == nil {
			l.inflight[l.hdrID(pc)] = pc
		}
		l.mu.Unlock()
	}
	if err != nil {
		l.load.Add(-int64(pc.n) - reqSize)
		l.st.put(toWire, pc.slot)
		pc.slot, pc.wait = nil, nil
		pc.finish(err)
		return false
	}
	return true
}

func (l *lane) hdrID(pc *piece) uint64 { return binary.LittleEndian.Uint64(pc.hdr[8:]) }

// abandon ends the staged writes of a batch that could not be sent, once
// their copies ended (the lane's failure ends the pieces in flight).
func (l *lane) abandon(rest []*piece, err error) {
	for _, pc := range rest {
		if pc.slot == nil {
			continue
		}
		l.load.Add(-int64(pc.n) - reqSize)
		slot, c := pc.slot, pc.wait
		pc.slot, pc.wait = nil, nil
		l.st.settle(toWire, slot, c, l.tmo, func(_ error, ended bool) {
			if ended {
				pc.finish(err)
			}
		})
	}
}

func (l *lane) readLoop() {
	defer close(l.cpq)
	var hb [respSize]byte
	for {
		n, err := io.ReadFull(l.br, hb[:])
		if err != nil {
			if n == 0 && errors.Is(err, os.ErrDeadlineExceeded) {
				l.mu.Lock()
				idle := len(l.inflight) == 0 && l.err == nil
				if idle {
					l.conn.SetReadDeadline(time.Time{})
				}
				l.mu.Unlock()
				if idle {
					continue
				}
				err = fmt.Errorf("nothing received for %v with requests in flight", l.tmo)
			}
			l.fail(l.deadErr("receive", err))
			return
		}
		h, err := parseResp(hb[:])
		if err != nil {
			l.fail(fmt.Errorf("%w: tcp lane to %s: %v", transfer.ErrPeerDead, l.p.name, err))
			return
		}
		l.mu.Lock()
		pc := l.inflight[h.id]
		full := len(l.inflight) >= l.max
		delete(l.inflight, h.id)
		if len(l.inflight) > 0 {
			l.pushDeadlineLocked(false)
		}
		l.mu.Unlock()
		if pc == nil {
			l.fail(fmt.Errorf("%w: tcp lane to %s: response to unknown request %d", transfer.ErrPeerDead, l.p.name, h.id))
			return
		}
		if full {
			l.cond.Signal()
		}
		l.load.Add(-int64(pc.n) - reqSize)
		if h.status != statusOK {
			text := make([]byte, h.len)
			if _, err := io.ReadFull(l.br, text); err != nil {
				err = l.deadErr("receive", err)
				pc.finish(err)
				l.fail(err)
				return
			}
			pc.finish(statusErr(l.p.name, h.status, string(text)))
			continue
		}
		want := uint64(0)
		if pc.op == opRead {
			want = pc.n
		}
		if h.len != want {
			err := fmt.Errorf("%w: tcp lane to %s: response %d carries %d bytes, want %d", transfer.ErrPeerDead, l.p.name, h.id, h.len, want)
			pc.finish(err)
			l.fail(err)
			return
		}
		if want > 0 && pc.dev != nil && pc.ctx.Err() == nil {
			if err := l.receiveStaged(pc); err != nil {
				pc.finish(err)
				l.fail(err)
				return
			}
			continue
		}
		if want > 0 {
			if pc.ctx.Err() != nil {
				// The batch ended (timed out or canceled): its memory may be
				// reused, so drop the data.
				_, err = l.br.Discard(int(want))
			} else {
				for _, b := range pc.appendMem(l.rbufs[:0]) {
					if err = readPayload(l.br, l.conn, b); err != nil {
						break
					}
				}
			}
			if err != nil {
				err = l.deadErr("receive", err)
				pc.finish(err)
				l.fail(err)
				return
			}
		}
		pc.finish(nil)
	}
}

// receiveStaged reads a staged read's data into a slot and hands it to the
// copier, which starts its copy to the device (off the socket's reader:
// the copy's enqueue costs as much as reading a piece); the finisher ends
// the piece once the copy ended. An error returned ends the lane.
func (l *lane) receiveStaged(pc *piece) error {
	slot, err := l.st.get(fromWire, int(pc.n), l.stop, l.tmo)
	if err != nil {
		return fmt.Errorf("%w: tcp lane to %s: %v", transfer.ErrPeerDead, l.p.name, err)
	}
	if err := readPayload(l.br, l.conn, slot.b); err != nil {
		l.st.put(fromWire, slot)
		return l.deadErr("receive", err)
	}
	pc.slot = slot
	l.cpq <- pc // blocks only while the copier catches up
	return nil
}

// copyLoop starts the device copies of received staged reads, in order.
func (l *lane) copyLoop() {
	defer close(l.fin)
	for pc := range l.cpq {
		b := pc.slot.b
		pc.wait = copyRuns(pc.entries(), func(addr, off, n uint64) (transfer.Completion, error) {
			return pc.dev.CopyFromHost(addr, b[off:off+n])
		})
		l.fin <- pc // blocks only while the finisher catches up
	}
}

// finishLoop ends staged reads in order, as their copies to the device end.
func (l *lane) finishLoop() {
	for pc := range l.fin {
		slot, c := pc.slot, pc.wait
		pc.slot, pc.wait = nil, nil
		err := c.Wait(pc.ctx)
		if err != nil && pc.ctx.Err() != nil && !errors.Is(err, transfer.ErrDeviceCopy) {
			cerr := fmt.Errorf("tcp: %s from %s: %w", pc.what(), l.p.name, err)
			l.st.settle(fromWire, slot, c, l.tmo, func(_ error, ended bool) {
				if ended {
					pc.finish(cerr)
				}
			})
			continue
		}
		l.st.put(fromWire, slot)
		if err != nil {
			err = fmt.Errorf("tcp: %s from %s: %w", pc.what(), l.p.name, err)
		}
		pc.finish(err)
	}
}
