package tcp

import (
	"context"
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// piece is one request on the wire: a whole task or one chunk of it, or a
// vector of such pieces.
type piece struct {
	hdr    [reqSize]byte
	vec    []*piece // a vector request's pieces, in entry order
	ents   []byte   // their entries, sent after hdr
	op     uint8
	local  uint64
	remote uint64
	n      uint64
	task   *transfer.Task
	split  *split // for a task sent as several pieces
	ctx    context.Context

	// dev is the local device memory of a staged piece: a write is copied
	// into slot before it is sent, a read is received into slot and then
	// copied to dev.
	dev  transfer.DeviceMemory
	slot *slot
	wait transfer.Completion
}

// split counts the pieces of one task still out and keeps the first error.
type split struct {
	left  atomic.Int64
	mu    sync.Mutex
	first error
}

// finish ends the piece. A split task is done when its last piece is, with
// the first error: until then other pieces may still touch its memory.
func (pc *piece) finish(err error) {
	for _, m := range pc.vec {
		m.finish(err)
	}
	if pc.vec != nil {
		return
	}
	sp := pc.split
	if sp == nil {
		pc.task.Done(err)
		return
	}
	if err != nil {
		sp.mu.Lock()
		if sp.first == nil {
			sp.first = err
		}
		sp.mu.Unlock()
	}
	if sp.left.Add(-1) == 0 {
		sp.mu.Lock()
		err = sp.first
		sp.mu.Unlock()
		pc.task.Done(err)
	}
}

// entries are the piece's local ranges, in the order its bytes go on the
// wire.
func (pc *piece) entries() []entry {
	if pc.vec == nil {
		return []entry{{pc.local, pc.n}}
	}
	es := make([]entry, len(pc.vec))
	for i, m := range pc.vec {
		es[i] = entry{m.local, m.n}
	}
	return es
}

// appendMem appends the piece's local memory, in wire order, to bufs.
func (pc *piece) appendMem(bufs [][]byte) [][]byte {
	if pc.vec == nil {
		return append(bufs, mem(pc.local, pc.n))
	}
	for _, m := range pc.vec {
		bufs = append(bufs, mem(m.local, m.n))
	}
	return bufs
}

// what names a staged read's local memory in error text.
func (pc *piece) what() string {
	if pc.vec == nil {
		return fmt.Sprintf("%d bytes into %#x", pc.n, pc.local)
	}
	return fmt.Sprintf("%d bytes in %d pieces into %#x..", pc.n, len(pc.vec), pc.vec[0].local)
}

// dispatch splits tasks into pieces (a page-list task into its pages, and
// anything over the chunk size into chunks; pieces of device memory, on
// either side, at most one staging chunk), coalesces consecutive pieces of
// one op, local memory and remote region into vector requests of at most
// a chunk (if the peer takes them), and hands them to the least loaded
// lanes.
func (t *Transport) dispatch(ctx context.Context, p *peer, tasks []*transfer.Task) {
	if p.err != nil {
		failAll(tasks, p.err)
		return
	}
	type plan struct {
		tk    *transfer.Task
		dev   transfer.DeviceMemory
		chunk uint64
	}
	plans := make([]plan, 0, len(tasks))
	n := 0
	var total uint64
	for _, tk := range tasks {
		dev, err := deviceOf(tk.LocalRegion)
		if err != nil {
			tk.Done(err)
			continue
		}
		chunk := uint64(t.cfg.ChunkSize)
		if dev != nil {
			chunk = min(chunk, uint64(t.cfg.StagingChunk))
		}
		if tk.Region != nil && tk.Region.Location.Kind != transfer.CPU {
			chunk = min(chunk, p.stagingChunk)
		}
		plans = append(plans, plan{tk: tk, dev: dev, chunk: chunk})
		n += piecesOf(tk, chunk)
		total += tk.Bytes()
	}
	// A vector is at most a chunk, and small enough that the batch still
	// spreads over every lane.
	spread := max(total/uint64(len(p.lanes)), 1)
	pieces := make([]piece, n)
	perLane := make([][]*piece, len(p.lanes))
	load := make([]int64, len(p.lanes))
	for i, l := range p.lanes {
		load[i] = l.load.Load()
	}
	send := func(pc *piece) {
		best := 0
		for i := range load {
			if load[i] < load[best] {
				best = i
			}
		}
		load[best] += int64(pc.n) + reqSize
		perLane[best] = append(perLane[best], pc)
	}
	// The vector being built: grp[g:] of pieces of key, sum bytes.
	type key struct {
		op  uint8
		dev transfer.DeviceMemory
		rem *transfer.RegionInfo
	}
	var (
		grp  = make([]*piece, 0, n)
		g    int
		sum  uint64
		gk   key
		gmax uint64
	)
	flush := func() {
		switch vs := grp[g:len(grp):len(grp)]; len(vs) {
		case 0:
		case 1:
			send(vs[0])
		default:
			v := &piece{op: gk.op, n: sum, ctx: ctx, dev: gk.dev, vec: vs, ents: make([]byte, len(vs)*entrySize)}
			for i, m := range vs {
				binary.LittleEndian.PutUint64(v.ents[i*entrySize:], m.remote)
				binary.LittleEndian.PutUint64(v.ents[i*entrySize+8:], m.n)
			}
			send(v)
		}
		g, sum = len(grp), 0
	}
	k := 0
	add := func(pc *piece, pk key, chunk uint64) {
		if p.vector < 2 {
			send(pc)
			return
		}
		if pk != gk || len(grp)-g >= p.vector || sum+pc.n > gmax {
			flush()
		}
		gk, gmax = pk, min(chunk, spread)
		grp = append(grp, pc)
		sum += pc.n
	}
	for _, pl := range plans {
		tk, chunk := pl.tk, pl.chunk
		op := uint8(opWrite)
		if tk.Op == transfer.Read {
			op = opRead
		}
		var sp *split
		if np := piecesOf(tk, chunk); np > 1 {
			sp = new(split)
			sp.left.Store(int64(np))
		}
		if tk.List == nil {
			for off := uint64(0); off < tk.Len; off += chunk {
				pieces[k] = piece{op: op, local: tk.Local + off, remote: tk.Remote + off, n: min(chunk, tk.Len-off),
					task: tk, split: sp, ctx: ctx, dev: pl.dev}
				add(&pieces[k], key{op, pl.dev, tk.Region}, chunk)
				k++
			}
			continue
		}
		for _, pg := range tk.List.Pages {
			for off := uint64(0); off < tk.List.PageLen; off += chunk {
				pieces[k] = piece{op: op, local: tk.Local + pg.Local + off, remote: tk.Remote + pg.Remote + off,
					n: min(chunk, tk.List.PageLen-off), task: tk, split: sp, ctx: ctx, dev: pl.dev}
				add(&pieces[k], key{op, pl.dev, tk.Region}, chunk)
				k++
			}
		}
	}
	flush()
	for i, l := range p.lanes {
		if len(perLane[i]) > 0 {
			l.enqueue(perLane[i])
		}
	}
}

// piecesOf is how many pieces tk goes out as.
func piecesOf(tk *transfer.Task, chunk uint64) int {
	if tk.List == nil {
		return int((tk.Len + chunk - 1) / chunk)
	}
	return len(tk.List.Pages) * int((tk.List.PageLen+chunk-1)/chunk)
}
