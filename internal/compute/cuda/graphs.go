package cuda

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
)

// Decode graphs. A pure-decode step (every seq one token with logits, no
// layer calls) of at most the largest bucket's seqs runs as the replay of a
// graph captured for its shape (decodeShape): the batch padded to its
// bucket, the split count rounded up to a split bucket. All such passes use
// one arena of device buffers sized for the largest bucket (buckets run one
// at a time on the stream), so the addresses a capture baked in never move;
// the step's inputs (token ids, positions, KV slots, page tables) are
// copied into the arena's metadata buffer before the launch, outside the
// graph. The first step of a shape runs eagerly on the arena (warming
// cuBLAS and the kernels at that shape) and is then captured; a capture
// failure leaves that shape eager, with a warning.

const (
	defaultGraphMaxBS = 256 // SGLang's --cuda-graph-max-bs default
	// graphsPerBucket bounds the execs kept per batch bucket (one per split
	// bucket in use): a new split bucket beyond it re-captures and updates
	// the least recently used exec in place.
	graphsPerBucket = 4
	// graphPartBudget bounds the split-K partials of a captured pass (the
	// arena holds them for every shape): longer contexts launch their
	// queries in more chunks.
	graphPartBudget = 64 << 20
	// cublasWorkspace is the cuBLAS workspace set on the handle, so that
	// captured GEMMs never allocate (32 MiB: what cuBLAS asks for on Hopper).
	cublasWorkspace = 32 << 20
)

// Graph modes (tests and benchmarks switch them between passes).
const (
	graphsOn     = iota
	graphsOff    // every pass eager and packed, as with DisableCUDAGraph
	graphsPadded // decode passes padded to their shape on the arena, eager, never captured
)

// graphKey is a captured decode shape; sample: the pass samples on the
// GPU (sample.go) instead of leaving the logits to the host.
type graphKey struct {
	bs, splits int
	sample     bool
}

type graphSlot struct {
	key  graphKey
	exec *cu.GraphExec
	used uint64
}

// graphSet holds a backend's decode graphs and their arena.
type graphSet struct {
	pc        planConfig // the backend's, with graphPartBudget
	buckets   []int
	maxSplits int
	bufs      passBufs
	moe       moeBufs // for MoE models: sized for the largest bucket
	sizes     scratchSizes
	slots     map[int][]*graphSlot // by batch bucket
	failed    map[graphKey]bool
	planBuf   []int32 // the last decode plan's image, reused by the next
	clock     uint64
	// counters for logs and tests
	captures, updates, replays, eager int
	// breakCapture makes every capture fail (a synchronisation inside
	// it): tests of the fallback.
	breakCapture bool
}

// newGraphs allocates the arena for batches up to maxBS (owned by b.alloc).
func (b *Backend) newGraphs(maxBS int) (*graphSet, error) {
	g := &graphSet{pc: b.pc, slots: map[int][]*graphSlot{}, failed: map[graphKey]bool{}}
	g.pc.partBudget = graphPartBudget
	g.buckets = decodeBuckets(maxBS)
	g.maxSplits = g.pc.maxSplits()
	g.sizes = g.pc.arenaFor(g.buckets[len(g.buckets)-1])
	z := &g.sizes
	var err error
	for _, e := range []struct {
		p *cu.DevicePtr
		n uint64
	}{
		{&g.bufs.x, z.x}, {&g.bufs.xb, z.xb}, {&g.bufs.qkv, z.qkv}, {&g.bufs.q, z.q}, {&g.bufs.att, z.att},
		{&g.bufs.gu, z.gu}, {&g.bufs.h, z.h}, {&g.bufs.lx, z.lx}, {&g.bufs.logits, z.logits},
		{&g.bufs.part, z.part}, {&g.bufs.meta, z.meta},
	} {
		if *e.p, err = b.alloc(e.n); err != nil {
			return nil, fmt.Errorf("cuda backend: decode graph buffers (%.1f MiB): %w", float64(z.total())/(1<<20), err)
		}
	}
	g.bufs.moe, g.bufs.arena = &g.moe, true
	if err := b.ensureMoE(&g.moe, g.buckets[len(g.buckets)-1]); err != nil {
		g.moe.free(b)
		return nil, err
	}
	return g, nil
}

// lookup returns the exec captured for k, if any.
func (g *graphSet) lookup(k graphKey) *cu.GraphExec {
	for _, s := range g.slots[k.bs] {
		if s.key == k {
			g.clock++
			s.used = g.clock
			return s.exec
		}
	}
	return nil
}

// install makes gr the exec of k: a new slot while the bucket has room,
// else the least recently used slot's exec updated in place (or, when the
// driver refuses the update, destroyed and instantiated anew).
func (g *graphSet) install(k graphKey, gr *cu.Graph) (*cu.GraphExec, error) {
	g.clock++
	slots := g.slots[k.bs]
	if len(slots) < graphsPerBucket {
		ex, err := gr.Instantiate()
		if err != nil {
			return nil, err
		}
		g.slots[k.bs] = append(slots, &graphSlot{key: k, exec: ex, used: g.clock})
		return ex, nil
	}
	lru := slots[0]
	for _, s := range slots[1:] {
		if s.used < lru.used {
			lru = s
		}
	}
	lru.key, lru.used = k, g.clock
	if err := lru.exec.Update(gr); err == nil {
		g.updates++
		return lru.exec, nil
	}
	derr := lru.exec.Destroy()
	ex, err := gr.Instantiate()
	if err != nil {
		g.slots[k.bs] = removeSlot(slots, lru)
		return nil, errors.Join(err, derr)
	}
	lru.exec = ex
	return ex, derr
}

// drop destroys k's exec.
func (g *graphSet) drop(k graphKey) {
	for _, s := range g.slots[k.bs] {
		if s.key == k {
			s.exec.Destroy()
			g.slots[k.bs] = removeSlot(g.slots[k.bs], s)
			return
		}
	}
}

func removeSlot(slots []*graphSlot, s *graphSlot) []*graphSlot {
	for i, x := range slots {
		if x == s {
			return append(slots[:i], slots[i+1:]...)
		}
	}
	return slots
}

// destroy frees every exec (the arena belongs to b.allocs).
func (g *graphSet) destroy() error {
	var errs []error
	for _, slots := range g.slots {
		for _, s := range slots {
			errs = append(errs, s.exec.Destroy())
		}
	}
	g.slots = nil
	return errors.Join(errs...)
}

// execs counts the instantiated graphs.
func (g *graphSet) execs() int {
	n := 0
	for _, s := range g.slots {
		n += len(s)
	}
	return n
}

// forwardDecode runs a pure-decode pass padded to its shape: the replay of
// the shape's graph, or eagerly on the arena (then captured for the next
// steps). done is false when the batch exceeds the largest bucket (the
// caller runs it eager and packed).
func (b *Backend) forwardDecode(ctx context.Context, seqs []compute.Seq, out [][]float32, copyLogits bool, job *sampleJob) (done bool, err error) {
	g := b.graphs
	k, ok := b.decodeKey(seqs, job != nil)
	if !ok {
		return false, nil
	}
	var sb *sampleBufs
	if job != nil {
		if sb, err = b.graphSampleBufs(); err != nil {
			return true, err
		}
		job.graphOut = true
	}
	p, err := buildPlanIn(&g.pc, seqs, &decodeShape{bs: k.bs, splits: k.splits}, g.planBuf)
	if err != nil {
		return true, err
	}
	g.planBuf = p.img // reused by the next step's plan (this one is done with it by then)
	if job != nil && job.prev != nil {
		// Rows whose token the last pass sampled: -1 - its row, for sample_take.
		for i, r := range job.prev {
			if r >= 0 {
				p.img[p.tok+i] = -1 - r
			}
		}
	}
	if err := b.begin(p, g.bufs.meta); err != nil {
		return true, err
	}
	if job != nil {
		if err := b.samplePrep(job, sb, k.bs); err != nil {
			return true, err
		}
		if job.prev != nil {
			if err := b.stream.Launch(b.smp.fns.take, cu.D1(uint32(ceilDiv(p.n, 256))), cu.D1(256), 0,
				g.bufs.meta+cu.DevicePtr(4*p.tok), sb.out, int32(p.n)); err != nil {
				return true, err
			}
		}
		if job.async {
			if err := b.q.markInputs(b.stream); err != nil {
				return true, err
			}
		}
	}
	var ex *cu.GraphExec
	if b.gmode == graphsOn {
		ex = g.lookup(k)
	}
	if ex != nil {
		if err := ex.Launch(b.stream); err != nil {
			// Never fail the step for the graph: drop it and run eager.
			b.lg.Warn("CUDA graph launch failed; this decode shape stays eager", zap.Int("batch", k.bs),
				zap.Int("splits", k.splits), zap.Error(err))
			g.failed[k] = true
			g.drop(k)
			ex = nil
		} else {
			g.replays++
		}
	}
	if ex == nil {
		if err := b.enqueueDecode(ctx, k, p); err != nil {
			return true, err
		}
		g.eager++
	}
	if job != nil {
		if err := b.sampleCopyOut(sb, job, len(job.states)); err != nil {
			return true, err
		}
		if job.async && ex != nil {
			// Left running: StartSample records its end, Wait times it.
			job.queued = true
			return true, b.tm.stop(b.stream)
		}
	}
	if err := b.finish(seqs, out, p, g.bufs.logits, copyLogits); err != nil {
		return true, err
	}
	if ex == nil && b.gmode == graphsOn && !g.failed[k] {
		b.capture(k, p)
	}
	return true, nil
}

// decodeKey is the graph shape of pure-decode pass seqs (sample: it
// samples), false when the batch exceeds the largest bucket.
func (b *Backend) decodeKey(seqs []compute.Seq, sample bool) (graphKey, bool) {
	g := b.graphs
	bs, ok := bucketFor(g.buckets, len(seqs))
	if !ok {
		return graphKey{}, false
	}
	need := 1
	for i := range seqs {
		need = max(need, g.pc.splitsFor(seqs[i].Pos))
	}
	return graphKey{bs: bs, splits: splitBucket(need, g.maxSplits), sample: sample}, true
}

// enqueueDecode enqueues decode pass p of shape k on the arena, with the
// sampling launches when k samples (ctx nil: under capture).
func (b *Backend) enqueueDecode(ctx context.Context, k graphKey, p *passPlan) error {
	g := b.graphs
	if err := b.enqueue(ctx, p, &g.bufs, nil); err != nil {
		return err
	}
	if k.sample {
		return b.sampleLaunch(b.smp.graph, g.bufs.logits, k.bs)
	}
	return nil
}

// capture records pass p (shape k) into a graph and installs it; a failure
// marks k eager for good, with a warning. The stream is idle.
func (b *Backend) capture(k graphKey, p *passPlan) {
	g := b.graphs
	t0 := time.Now()
	free0, _, _ := b.cx.MemGetInfo()
	nodes := 0
	var gr *cu.Graph
	err := b.stream.BeginCapture(cu.CaptureThreadLocal)
	if err == nil {
		err = b.enqueueDecode(nil, k, p)
		if g.breakCapture && err == nil {
			err = b.stream.Synchronize()
		}
		var eerr error
		gr, eerr = b.stream.EndCapture() // always: it ends the capture
		err = errors.Join(err, eerr)
	}
	if err == nil {
		nodes, _ = gr.NodeCount()
		var ex *cu.GraphExec
		if ex, err = g.install(k, gr); err == nil {
			err = ex.Upload(b.stream)
		}
		if err == nil {
			err = b.stream.Synchronize()
		}
	}
	err = errors.Join(err, gr.Destroy())
	if err != nil {
		g.failed[k] = true
		g.drop(k)
		b.lg.Warn("CUDA graph capture failed; this decode shape stays eager", zap.Int("batch", k.bs),
			zap.Int("splits", k.splits), zap.Error(err))
		return
	}
	g.captures++
	free1, _, _ := b.cx.MemGetInfo()
	b.lg.Info("CUDA graph captured", zap.Int("batch", k.bs), zap.Int("splits", k.splits), zap.Bool("sample", k.sample),
		zap.Int("max_context", k.splits*g.pc.split), zap.Int("nodes", nodes), zap.Duration("took", time.Since(t0)),
		zap.Int64("device_bytes", int64(free0)-int64(free1)), zap.Int("graphs", g.execs()), zap.Int("updates", g.updates))
}

// setGraphMode switches graph use between passes (tests, benchmarks).
func (b *Backend) setGraphMode(mode int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.gmode = mode
}

// GraphStats counts decode passes by how they ran.
type GraphStats struct {
	Captures, Updates, Replays, Eager, Graphs int
}

// GraphStats reports the decode graphs' counters (zero with graphs off).
func (b *Backend) GraphStats() GraphStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	g := b.graphs
	if g == nil {
		return GraphStats{}
	}
	return GraphStats{Captures: g.captures, Updates: g.updates, Replays: g.replays, Eager: g.eager, Graphs: g.execs()}
}

// StepTimes sums the GPU time of passes and the GPU idle gaps between
// consecutive passes (Options.TimeSteps), from events on the stream: a pass
// spans its first input copy to its logits copy; a gap, one pass's end to
// the next one's start (host work between Forward calls included).
type StepTimes struct {
	Passes                 int
	Busy                   time.Duration
	Gaps                   int
	GapSum, GapMin, GapMax time.Duration
}

// GapMean is the mean gap.
func (s StepTimes) GapMean() time.Duration {
	if s.Gaps == 0 {
		return 0
	}
	return s.GapSum / time.Duration(s.Gaps)
}

// StepTimes returns the sums since the last ResetStepTimes (zero without
// Options.TimeSteps).
func (b *Backend) StepTimes() StepTimes {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tm == nil {
		return StepTimes{}
	}
	return b.tm.t
}

// ResetStepTimes zeroes the sums; the next pass starts no gap.
func (b *Backend) ResetStepTimes() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tm != nil {
		b.tm.t, b.tm.prev = StepTimes{}, false
	}
}

// stepTimer records a start and an end event per pass in a ring of three
// pairs: two passes may be queued while the one before them still holds
// the end the gap is measured from. Passes are done (timed) in the order
// started. Nil: timing off (every method a no-op).
type stepTimer struct {
	ev   [3][2]*cu.Event // [pass % 3][start, end]
	n    int             // passes timed
	q    int             // passes stopped (recorded to their end)
	prev bool            // the pair before n's holds the previous pass's end
	t    StepTimes
}

func newStepTimer(c *cu.Context) (*stepTimer, error) {
	tm := &stepTimer{}
	for i := range tm.ev {
		for j := range tm.ev[i] {
			ev, err := c.NewEvent(cu.EventDefault)
			if err != nil {
				tm.destroy()
				return nil, err
			}
			tm.ev[i][j] = ev
		}
	}
	return tm, nil
}

func (tm *stepTimer) start(s *cu.Stream) error {
	if tm == nil {
		return nil
	}
	return tm.ev[tm.q%3][0].Record(s)
}

func (tm *stepTimer) stop(s *cu.Stream) error {
	if tm == nil {
		return nil
	}
	err := tm.ev[tm.q%3][1].Record(s)
	tm.q++
	return err
}

// done reads the events of the oldest pass not yet timed (its end was
// waited for).
func (tm *stepTimer) done() error {
	if tm == nil {
		return nil
	}
	if tm.n >= tm.q {
		return nil // forgotten by broken
	}
	cur := tm.n % 3
	tm.n++
	ms, err := cu.ElapsedMs(tm.ev[cur][0], tm.ev[cur][1])
	if err != nil {
		tm.prev = false
		return err
	}
	tm.t.Passes++
	tm.t.Busy += msDur(ms)
	if tm.prev {
		gms, err := cu.ElapsedMs(tm.ev[(cur+2)%3][1], tm.ev[cur][0])
		if err != nil {
			tm.prev = false
			return err
		}
		gap := msDur(gms)
		if tm.t.Gaps == 0 || gap < tm.t.GapMin {
			tm.t.GapMin = gap
		}
		tm.t.GapMax = max(tm.t.GapMax, gap)
		tm.t.GapSum += gap
		tm.t.Gaps++
	}
	tm.prev = true
	return nil
}

// broken forgets the passes not yet timed (a pass failed: no gap to it).
func (tm *stepTimer) broken() {
	if tm != nil {
		tm.prev, tm.n = false, tm.q
	}
}

func (tm *stepTimer) destroy() error {
	if tm == nil {
		return nil
	}
	var errs []error
	for i := range tm.ev {
		for j := range tm.ev[i] {
			errs = append(errs, tm.ev[i][j].Destroy())
		}
	}
	return errors.Join(errs...)
}

func msDur(ms float32) time.Duration { return time.Duration(float64(ms) * 1e6) }
