package cuda

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"slices"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

// Queued sampling passes (compute.AsyncSampler). A decode pass whose shape
// has a graph is queued and left running: its plan and sampling parameters
// are copied in before it, its tokens that come from the previous pass are
// written into the plan's token rows on the device (sample_take, outside
// the graph), its sampled rows are copied to one of two pinned staging
// buffers and an event marks its end. The next pass may be queued before
// the host reads them, so the GPU runs decode steps back to back. Every
// other pass (eager shapes, the first pass of a shape, which is then
// captured) runs to its end inside StartSample as ForwardSample always
// did, after the passes before it.
//
// Host staging reuse: the plan, parameter and accept images are written
// for a pass only after the previous pass's copies of them are done (the
// inputs event); the results alternate between two buffers, and a pass
// starts only while at most one is unread, so the buffer it writes was
// read (waited) before.

var _ compute.AsyncSampler = (*Backend)(nil)

// queue is a backend's passes in flight (guarded by Backend.mu).
type queue struct {
	n      uint64     // sampling passes started
	last   *pending   // the pass started last (waited or not)
	unread []*pending // started, not waited, in order
	inputs *cu.Event  // after the last queued pass consumed its host inputs
	inUse  bool       // inputs is recorded and not yet waited for
	done   [2]*cu.Event
	seqs   []compute.Seq // seqs with tokens resolved on the host
	toks   []int32
}

// pending is a started sampling pass (compute.Pending).
type pending struct {
	b      *Backend
	job    *sampleJob
	ev     *cu.Event // its end when it was left queued; nil: it ran to its end
	graph  bool      // it sampled into the decode graphs' buffers
	rowOf  []int     // each seq's row in the results (-1: none)
	timed  bool      // its device work is over (err says how)
	waited bool
	err    error
}

// StartSample implements compute.AsyncSampler.
func (b *Backend) StartSample(ctx context.Context, seqs []compute.Seq, samp []compute.Sample, from []int) (compute.Pending, error) {
	if len(from) != 0 && len(from) != len(seqs) {
		return nil, fmt.Errorf("cuda backend: %d token sources for %d seqs", len(from), len(seqs))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.sampling(); err != nil {
		return nil, err
	}
	if len(b.q.unread) >= 2 {
		return nil, errors.New("cuda backend: two sampling passes are pending: wait for one first")
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	prev, err := b.q.sources(seqs, from)
	if err != nil {
		return nil, err
	}
	j, err := b.newSampleJob(seqs, samp)
	if err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return nil, err
	}
	if err := b.q.events(b.cx); err != nil {
		return nil, err
	}
	j.slot = int(b.q.n % 2)
	b.q.n++
	p := &pending{b: b, job: j, rowOf: make([]int, len(seqs))}
	for i := range p.rowOf {
		p.rowOf[i] = -1
	}
	for r, i := range j.seqIdx {
		p.rowOf[i] = r
	}
	if b.queueable(seqs, j, prev) {
		j.prev, j.async = prev, true
		seqs, _ = b.q.resolve(seqs, prev, false)
	} else {
		// Run it to its end after the passes before it, with the tokens
		// they sampled read here.
		if err := b.q.settle(); err != nil {
			return nil, err
		}
		if seqs, err = b.q.resolve(seqs, prev, true); err != nil {
			return nil, err
		}
	}
	err = b.forward(ctx, seqs, nil, false, j)
	if err != nil {
		// The passes before it stay to be waited for; none may take
		// tokens from this one.
		err = errors.Join(err, b.stream.Synchronize(), b.q.settle())
		b.tm.broken()
		b.q.last = nil
		return nil, err
	}
	if j.queued {
		p.ev = b.q.done[j.slot]
		if err := p.ev.Record(b.stream); err != nil {
			return nil, errors.Join(err, b.stream.Synchronize())
		}
	} else {
		p.timed = true // forward synchronised and timed it
	}
	p.graph = j.graphOut
	b.q.last = p
	b.q.unread = append(b.q.unread, p)
	return p, nil
}

// queueable reports whether the pass can be left running: a sampling
// decode pass whose shape has a graph, with its tokens from the previous
// pass readable on the device.
func (b *Backend) queueable(seqs []compute.Seq, j *sampleJob, prev []int32) bool {
	if b.graphs == nil || b.gmode != graphsOn || len(j.states) == 0 || !isDecode(seqs) {
		return false
	}
	k, ok := b.decodeKey(seqs, true)
	if !ok || b.graphs.lookup(k) == nil || b.graphs.failed[k] {
		return false
	}
	if prev != nil && (b.q.last == nil || !b.q.last.graph || b.smp.graph == nil) {
		return false
	}
	return true
}

// sources maps from onto the rows of the last pass's results (nil when
// no seq takes a token from it).
func (q *queue) sources(seqs []compute.Seq, from []int) ([]int32, error) {
	var prev []int32
	for i, f := range from {
		if f < 0 {
			continue
		}
		switch {
		case q.last == nil:
			return nil, fmt.Errorf("cuda backend: seq %d takes its token from a pass, but none was started before", i)
		case q.last.err != nil:
			return nil, fmt.Errorf("cuda backend: seq %d takes its token from a failed pass: %w", i, q.last.err)
		case f >= len(q.last.rowOf) || q.last.rowOf[f] < 0:
			return nil, fmt.Errorf("cuda backend: seq %d takes its token from seq %d of the last pass, which sampled none", i, f)
		case len(seqs[i].Tokens) != 1:
			return nil, fmt.Errorf("cuda backend: seq %d takes its token from the last pass but has %d tokens", i, len(seqs[i].Tokens))
		}
		if prev == nil {
			prev = make([]int32, len(seqs))
			for k := range prev {
				prev[k] = -1
			}
		}
		prev[i] = int32(q.last.rowOf[f])
	}
	return prev, nil
}

// resolve returns seqs with the tokens taken from the last pass written
// in: read from its staged results (onHost: it is done), or 0 for the
// plan, whose rows sample_take then rewrites on the device.
func (q *queue) resolve(seqs []compute.Seq, prev []int32, onHost bool) ([]compute.Seq, error) {
	if prev == nil {
		return seqs, nil
	}
	if onHost && q.last.err != nil {
		return nil, q.last.err
	}
	h := q.last.b.smp.hostOut[q.last.job.slot].Bytes()
	q.seqs = append(q.seqs[:0], seqs...)
	q.toks = slices.Grow(q.toks[:0], len(seqs))[:len(seqs)] // no allocation a step
	clear(q.toks)
	for i, r := range prev {
		if r < 0 {
			continue
		}
		if onHost {
			q.toks[i] = int32(binary.LittleEndian.Uint32(h[int(r)*sampleOutBytes:]))
		}
		q.seqs[i].Tokens = q.toks[i : i+1 : i+1]
	}
	return q.seqs, nil
}

// events makes the queue's events once.
func (q *queue) events(cx *cu.Context) error {
	if q.inputs != nil {
		return nil
	}
	for _, e := range []**cu.Event{&q.inputs, &q.done[0], &q.done[1]} {
		ev, err := cx.NewEvent(cu.EventDisableTiming)
		if err != nil {
			return err
		}
		*e = ev
	}
	return nil
}

// waitInputs blocks until the last queued pass's host inputs are copied
// (its start on the GPU: normally long done), so they can be rewritten.
func (q *queue) waitInputs() error {
	if !q.inUse {
		return nil
	}
	q.inUse = false
	return q.inputs.Synchronize()
}

// markInputs records that the pass queued so far has consumed its host
// inputs.
func (q *queue) markInputs(st *cu.Stream) error {
	if err := q.inputs.Record(st); err != nil {
		return err
	}
	q.inUse = true
	return nil
}

// settle waits for every unread pass's device work (in order), so that the
// stream is idle; their results stay staged for Wait.
func (q *queue) settle() error {
	var errs []error
	for _, p := range q.unread {
		errs = append(errs, p.finish())
	}
	q.inUse = false
	return errors.Join(errs...)
}

// finish waits for p's device work once and times it (b.mu held).
func (p *pending) finish() error {
	if p.timed {
		return p.err
	}
	p.timed = true
	if err := p.ev.Synchronize(); err != nil {
		p.err = fmt.Errorf("cuda backend: forward: %w", err)
		p.b.tm.broken()
		return p.err
	}
	p.err = p.b.tm.done()
	return p.err
}

// Wait implements compute.Pending.
func (p *pending) Wait(res []compute.Sampled) error {
	b := p.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if p.waited {
		return errors.New("cuda backend: sampling pass waited for twice")
	}
	if b.closed {
		return errors.New("cuda backend: closed with the sampling pass pending")
	}
	if len(b.q.unread) == 0 || b.q.unread[0] != p {
		return errors.New("cuda backend: sampling passes waited for out of order")
	}
	if len(res) < len(p.rowOf) {
		return fmt.Errorf("cuda backend: %d results for %d seqs", len(res), len(p.rowOf))
	}
	p.waited = true
	b.q.unread = b.q.unread[1:]
	if !p.timed {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := b.cx.SetCurrent(); err != nil {
			p.timed, p.err = true, err
		}
	}
	if err := p.finish(); err != nil {
		return err
	}
	if len(p.job.states) == 0 {
		return nil
	}
	return p.job.results(b.smp.hostOut[p.job.slot].Bytes(), b.cfg.Vocab, res)
}

// destroy frees the events (the GPU is idle).
func (q *queue) destroy() error {
	var errs []error
	for _, e := range []**cu.Event{&q.inputs, &q.done[0], &q.done[1]} {
		errs = append(errs, (*e).Destroy())
		*e = nil
	}
	q.last, q.unread = nil, nil
	return errors.Join(errs...)
}
