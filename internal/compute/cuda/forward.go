package cuda

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/cublas"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// dbuf is a device buffer grown on demand.
type dbuf struct {
	p cu.DevicePtr
	n uint64
}

// scratch holds one forward pass's activations and metadata, grown on demand.
type scratch struct {
	x, xb, qkv, q, att, gu, h dbuf
	part, lx, logits, meta    dbuf
	hostMeta, hostLogits      *cu.HostMem
}

func (s *scratch) free(b *Backend) {
	for _, d := range []*dbuf{&s.x, &s.xb, &s.qkv, &s.q, &s.att, &s.gu, &s.h, &s.part, &s.lx, &s.logits, &s.meta} {
		if d.p != 0 {
			b.cx.MemFree(d.p)
		}
		*d = dbuf{}
	}
	s.hostMeta.Free()
	s.hostLogits.Free()
	b.moe.free(b)
	s.hostMeta, s.hostLogits = nil, nil
}

// ensure grows d to at least n bytes. Called only while the GPU is idle.
func (b *Backend) ensure(d *dbuf, n uint64) error {
	if d.n >= n {
		return nil
	}
	if d.p != 0 {
		if err := b.cx.MemFree(d.p); err != nil {
			return err
		}
		*d = dbuf{}
	}
	n = max(n, d.n+d.n/2, 1<<16)
	p, err := b.cx.MemAlloc(n)
	if err != nil {
		return err
	}
	*d = dbuf{p: p, n: n}
	return nil
}

func (b *Backend) ensureHost(h **cu.HostMem, n uint64) error {
	if *h != nil && (*h).Size() >= n {
		return nil
	}
	if *h != nil {
		if err := (*h).Free(); err != nil {
			return err
		}
		*h = nil
	}
	m, err := b.cx.MemHostAlloc(max(n, 1<<16), 0)
	if err != nil {
		return err
	}
	*h = m
	return nil
}

// Forward implements compute.Model.
func (b *Backend) Forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	return b.forwardOpt(ctx, seqs, out, true)
}

func (b *Backend) forwardOpt(ctx context.Context, seqs []compute.Seq, out [][]float32, copyLogits bool) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("cuda backend: closed")
	}
	return b.forwardLocked(ctx, seqs, out, copyLogits, nil)
}

// forwardLocked runs a pass (sampling it when job is set) under b.mu.
func (b *Backend) forwardLocked(ctx context.Context, seqs []compute.Seq, out [][]float32, copyLogits bool, job *sampleJob) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return err
	}
	err := b.forward(ctx, seqs, out, copyLogits, job)
	if err != nil {
		b.tm.broken()
		// Leave the GPU idle whatever happened, so scratch can be reused.
		if serr := b.stream.Synchronize(); serr != nil {
			err = errors.Join(err, serr)
		}
	}
	return err
}

// check validates seqs and returns the token count and logits rows;
// needOut: out must hold each logits row.
func (b *Backend) check(seqs []compute.Seq, out [][]float32, needOut bool) (n, m int, err error) {
	c := &b.cfg
	l := &b.layout
	for i, s := range seqs {
		if s.Logits && len(s.Tokens) == 0 {
			return 0, 0, fmt.Errorf("cuda backend: seq %d asks for logits but has no tokens", i)
		}
		if s.Pos < 0 {
			return 0, 0, fmt.Errorf("cuda backend: seq %d: negative position %d", i, s.Pos)
		}
		end := s.Pos + len(s.Tokens)
		if end > c.MaxSeqLen {
			return 0, 0, fmt.Errorf("cuda backend: seq %d: position %d beyond the context length %d", i, end-1, c.MaxSeqLen)
		}
		need := (end + l.PageSize - 1) / l.PageSize
		if len(s.Pages) < need {
			return 0, 0, fmt.Errorf("cuda backend: seq %d: %d pages for %d positions (page size %d)", i, len(s.Pages), end, l.PageSize)
		}
		for _, p := range s.Pages[:need] {
			if p < 0 || int(p) >= l.Pages {
				return 0, 0, fmt.Errorf("cuda backend: seq %d: page %d outside the pool of %d", i, p, l.Pages)
			}
		}
		for _, t := range s.Tokens {
			if t < 0 || int(t) >= c.Vocab {
				return 0, 0, fmt.Errorf("cuda backend: seq %d: token %d outside the vocabulary of %d", i, t, c.Vocab)
			}
		}
		if s.Logits {
			if needOut && (i >= len(out) || len(out[i]) < c.Vocab) {
				return 0, 0, fmt.Errorf("cuda backend: seq %d: no room for %d logits", i, c.Vocab)
			}
			m++
		}
		n += len(s.Tokens)
	}
	return n, m, nil
}

// passBufs are the device buffers a pass reads and writes.
type passBufs struct {
	x, xb, qkv, q, att, gu, h, part, lx, logits, meta cu.DevicePtr
	moe                                               *moeBufs
	arena                                             bool // the decode graphs' (captured: no host step)
}

// eagerBufs grows the eager scratch to what p needs (the stream is idle).
func (b *Backend) eagerBufs(p *passPlan) (*passBufs, error) {
	s := &b.s
	need := b.pc.scratchFor(p)
	for _, e := range []struct {
		d  *dbuf
		sz uint64
	}{
		{&s.x, need.x}, {&s.xb, need.xb}, {&s.qkv, need.qkv}, {&s.q, need.q}, {&s.att, need.att},
		{&s.gu, need.gu}, {&s.h, need.h}, {&s.lx, need.lx}, {&s.logits, need.logits}, {&s.meta, need.meta},
		{&s.part, need.part},
	} {
		if err := b.ensure(e.d, e.sz); err != nil {
			return nil, fmt.Errorf("cuda backend: scratch: %w", err)
		}
	}
	return &passBufs{x: s.x.p, xb: s.xb.p, qkv: s.qkv.p, q: s.q.p, att: s.att.p, gu: s.gu.p, h: s.h.p,
		part: s.part.p, lx: s.lx.p, logits: s.logits.p, meta: s.meta.p, moe: &b.moe}, nil
}

func (b *Backend) forward(ctx context.Context, seqs []compute.Seq, out [][]float32, copyLogits bool, job *sampleJob) error {
	n, _, err := b.check(seqs, out, job == nil && copyLogits)
	if err != nil || n == 0 {
		return err
	}
	if job != nil && len(job.states) == 0 {
		job = nil
	}
	if b.graphs != nil && b.gmode != graphsOff && isDecode(seqs) {
		if done, err := b.forwardDecode(ctx, seqs, out, copyLogits, job); done {
			return err
		}
	}
	// Eager scratch may move: the passes still queued end first.
	if err := b.q.settle(); err != nil {
		return err
	}
	p, err := buildPlan(&b.pc, seqs, nil)
	if err != nil {
		return err
	}
	d, err := b.eagerBufs(p)
	if err != nil {
		return err
	}
	if err := b.ensureMoE(&b.moe, p.n); err != nil {
		return err
	}
	var sb *sampleBufs
	if job != nil {
		if sb, err = b.eagerSampleBufs(p.m); err != nil {
			return err
		}
	}
	if err := b.begin(p, d.meta); err != nil {
		return err
	}
	if job != nil {
		if err := b.samplePrep(job, sb, p.m); err != nil {
			return err
		}
	}
	if err := b.enqueue(ctx, p, d, seqs); err != nil {
		return err
	}
	if job != nil {
		if err := errors.Join(b.sampleLaunch(sb, d.logits, p.m), b.sampleCopyOut(sb, job, p.m)); err != nil {
			return err
		}
	}
	return b.finish(seqs, out, p, d.logits, copyLogits)
}

// begin marks a step's start (Options.TimeSteps) and copies p's metadata
// to meta through the pinned staging buffer, async on the stream, once a
// queued pass before it is done with that buffer.
func (b *Backend) begin(p *passPlan, meta cu.DevicePtr) error {
	if err := b.q.waitInputs(); err != nil {
		return err
	}
	if err := b.ensureHost(&b.s.hostMeta, uint64(p.size)); err != nil {
		return err
	}
	copy(b.s.hostMeta.Bytes(), p.bytes())
	if err := b.tm.start(b.stream); err != nil {
		return err
	}
	return b.stream.MemcpyHtoD(meta, b.s.hostMeta.Ptr(), uint64(p.size))
}

// finish copies the logits rows of the seqs (the first rows of logits) to
// the host, async on the stream, waits for the pass and hands each seq its
// row.
func (b *Backend) finish(seqs []compute.Seq, out [][]float32, p *passPlan, logits cu.DevicePtr, copyLogits bool) error {
	c := &b.cfg
	m := 0
	for i := range seqs {
		if seqs[i].Logits {
			m++
		}
	}
	if m > 0 && copyLogits {
		lb := uint64(m) * uint64(c.Vocab) * 4
		if err := b.ensureHostLogits(lb); err != nil {
			return err
		}
		if err := b.stream.MemcpyDtoH(b.s.hostLogits.Ptr(), logits, lb); err != nil {
			return err
		}
	}
	if err := b.tm.stop(b.stream); err != nil {
		return err
	}
	if err := b.q.settle(); err != nil { // the queued passes before it, timed in order
		return err
	}
	if err := b.stream.Synchronize(); err != nil {
		return fmt.Errorf("cuda backend: forward: %w", err)
	}
	if err := b.tm.done(); err != nil {
		return err
	}
	if m > 0 && copyLogits {
		all := unsafe.Slice((*float32)(b.s.hostLogits.Ptr()), m*c.Vocab)
		var wg sync.WaitGroup
		r := 0
		for i, sq := range seqs {
			if sq.Logits {
				dst, src := out[i][:c.Vocab], all[r*c.Vocab:(r+1)*c.Vocab]
				if m*c.Vocab < 1<<20 {
					copy(dst, src)
				} else {
					wg.Go(func() { copy(dst, src) })
				}
				r++
			}
		}
		wg.Wait()
	}
	return nil
}

// run is a sticky-error launcher for one forward pass.
type run struct {
	b   *Backend
	s   *cu.Stream
	err error
}

func (r *run) launch(f *cu.Function, grid, block cu.Dim3, shmem uint32, args ...any) {
	if r.err == nil {
		r.err = r.s.Launch(f, grid, block, shmem, args...)
	}
}

// launchDep launches a kernel that waits for the ones ahead of it itself
// (pdl_wait: the gemv2 and gemm_sk sets), programmatically when the
// backend allows it.
func (r *run) launchDep(f *cu.Function, grid, block cu.Dim3, shmem uint32, args ...any) {
	if r.err == nil && r.b.fn.pdl {
		r.err = r.s.LaunchPDL(f, grid, block, shmem, args...)
		return
	}
	r.launch(f, grid, block, shmem, args...)
}

// gemm computes y[n][out] = x[n][in] . w[out][in]^T + beta*y; y is f32 when
// yF32, else T.
func (r *run) gemm(y cu.DevicePtr, yF32 bool, x, w cu.DevicePtr, n, out, in int, beta float32) {
	if r.err != nil {
		return
	}
	b := r.b
	if yF32 && b.skinny(n) && in%8 == 0 {
		f := &b.fn
		rb := ceilDiv(out, skRows)
		s, cps := skSplit(f.skCap, rb, in)
		r.launchDep(f.skPlain, cu.Dim3{X: uint32(rb), Y: uint32(s), Z: 1}, cu.D1(skThreads), 0, y, x, w, int32(n), int32(out),
			int32(in), beta, int32(cps), f.skPart, f.skCnt)
		return
	}
	if yF32 && b.fused(n) && in%8 == 0 {
		xb, stage := g2Stage(n, in)
		f, grid, ks := b.g2Split(b.fn.g2Plain, (out+1)/2, in)
		r.launchDep(f, grid, cu.D1(g2Threads), xb, y, x, w, int32(n), int32(out), int32(in), beta, stage, ks)
		return
	}
	if !b.opts.BatchInvariant && n <= b.fn.gemvMax && b.fn.gemvF32 != nil && in%8 == 0 {
		f := b.fn.gemvT
		if yF32 {
			f = b.fn.gemvF32
		}
		r.launch(f, cu.D1(uint32((out+7)/8)), cu.D1(256), 0, y, x, w, int32(n), int32(out), int32(in), beta)
		return
	}
	if b.opts.BatchInvariant {
		f := b.fn.gemmT
		if yF32 {
			f = b.fn.gemmF32
		}
		r.launch(f, cu.Dim3{X: uint32((out + 63) / 64), Y: uint32((n + 63) / 64), Z: 1}, cu.D1(256), 0,
			y, x, w, int32(n), int32(out), int32(in), beta)
		return
	}
	if r.gemmWG(y, yF32, x, w, n, out, in, beta) {
		return
	}
	tt, comp := cublas.R16BF, cublas.Compute32F
	if !b.bf16 {
		tt, comp = cublas.R32F, cublas.Compute32FPedantic
	}
	yt := tt
	if yF32 {
		yt = cublas.R32F
	}
	r.err = b.blas.GemmEx(&cublas.Gemm{TransA: cublas.OpT, TransB: cublas.OpN, M: out, N: n, K: in,
		Alpha: 1, Beta: beta, A: uint64(w), AType: tt, LDA: in, B: uint64(x), BType: tt, LDB: in,
		C: uint64(y), CType: yt, LDC: out, Compute: comp})
}

// gemmWG launches gemm's GEMM on gemm_wg when it is loaded and takes the
// shape (at most 128 rows, in % 64 == 0), and reports whether it did.
func (r *run) gemmWG(y cu.DevicePtr, yF32 bool, x, w cu.DevicePtr, n, out, in int, beta float32) bool {
	f := &r.b.fn
	if f.gw[0] == nil || n < 1 || n > gwNT[3] || in%64 != 0 || ceilDiv(out, 128) > gwRowBlocks {
		return false
	}
	i := 0
	for gwNT[i] < n {
		i++
	}
	yf := int32(0)
	if yF32 {
		yf = 1
	}
	g := min(f.gwGrid, ceilDiv(out, 128)*(in/64)) // every block a range of units
	r.launch(f.gw[i], cu.D1(uint32(g)), cu.D1(384), uint32(f.gwSmem[i]), y, x, w, int32(n), int32(out), int32(in), beta, yf,
		f.gwPart, f.gwCnt)
	return true
}

// fused reports whether a pass of n token rows runs the fused decode layer
// (gemv2_*: rmsnorm, RoPE with the KV write and SiLU-multiply inside the
// GEMVs).
func (b *Backend) fused(n int) bool {
	return b.fn.g2QKV != nil && !b.opts.BatchInvariant && n <= b.fn.gemvMax
}

// skinny reports whether the GEMMs of a pass of n token rows run gemm_sk_*.
func (b *Backend) skinny(n int) bool {
	return b.fn.skPlain != nil && !b.opts.BatchInvariant && n > b.fn.gemvMax && n <= b.fn.skMax
}

// partBudget bounds the split-K attention's partial results per launch of
// an eager pass (graphPartBudget: of a captured one).
const partBudget = 256 << 20

// enqueue launches pass p over buffers d on the backend's stream, the
// metadata already copied to d.meta. It only enqueues (no allocation, no
// synchronisation), so it can run under stream capture: then ctx is nil
// (no cancellation checks) and seqs nil (no layer calls).
func (b *Backend) enqueue(ctx context.Context, p *passPlan, d *passBufs, seqs []compute.Seq) error {
	c := &b.cfg
	dim, hd := c.Dim, c.HeadDim
	n, m := p.n, p.m
	r := &run{b: b, s: b.stream}
	lp := &layerPass{r: r, cctx: passCtx(ctx), p: p, d: d, slots: d.meta + cu.DevicePtr(p.slot*8), fused: b.fused(n), sk: b.skinny(n),
		xsmem: uint32(n * dim * 2), vt: rmsVT(dim), scaleLog2: float32(1 / math.Sqrt(float64(hd)) * math.Log2E),
		div:        float32(math.Sqrt(float64(hd))),
		layerBytes: cu.DevicePtr(int64(b.layout.Pages) * int64(b.layout.PageBytes())),
		partML:     d.part + cu.DevicePtr(uint64(p.qchunk)*uint64(c.Heads)*uint64(p.nsplit)*uint64(hd)*4),
		moe:        d.moe, grouped: d.arena || b.moeGroupedFor(n)}
	if c.Spec.Attention.Rope == model.RopeInterleaved {
		lp.interleaved = 1
	}
	hooked := false
	for i := range seqs {
		hooked = hooked || seqs[i].Layer != nil
	}
	r.launch(b.fn.embed, cu.D1(uint32(n)), cu.D1(256), 0, d.x, b.w.embed, lp.meta(p.tok), int32(dim))
	for li := range b.w.layers {
		if ctx != nil {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		w := &b.w.layers[li]
		if err := b.attention(lp, li, w, seqs, hooked); err != nil {
			return err
		}
		if w.moe != nil {
			b.moeMLP(lp, w)
		} else {
			b.denseMLP(lp, w)
		}
		if r.err != nil {
			return fmt.Errorf("cuda backend: layer %d: %w", li, r.err)
		}
	}
	if m == 0 {
		return nil
	}
	// The rank's vocabulary rows (all of them at tp 1), gathered after.
	lg, rows := d.logits, b.sh.vrows
	if b.sh.tp > 1 {
		lg = d.logits + cu.DevicePtr(m*c.Vocab*4)
	}
	if b.fused(m) {
		f, grid, ks := b.g2Split(b.fn.g2Norm, (rows+1)/2, dim)
		r.launchDep(f, grid, cu.D1(g2Threads), uint32(m*dim*2), lg, d.x, b.w.norm,
			lp.meta(p.lrows), b.w.lmHead, int32(m), int32(rows), int32(dim), lp.vt, c.NormEps, cu.DevicePtr(0), ks)
	} else {
		r.launch(b.fn.rmsnorm, cu.D1(uint32(m)), cu.D1(rmsThreads(dim)), 0, d.lx, d.x, b.w.norm, lp.meta(p.lrows), int32(dim),
			c.NormEps)
		r.gemm(lg, true, d.lx, b.w.lmHead, m, rows, dim, 0)
	}
	if b.sh.tp > 1 {
		b.gatherLogits(lp, d.logits, lg, m)
	}
	if r.err != nil {
		return fmt.Errorf("cuda backend: logits: %w", r.err)
	}
	return nil
}

// reportLayer records layer li's event after its KV writes and hands it to
// the seqs that asked, as the fence to wait for before reading the pages.
func (b *Backend) reportLayer(st *cu.Stream, seqs []compute.Seq, li int) error {
	for len(b.layerEv) <= li {
		ev, err := b.cx.NewEvent(cu.EventDisableTiming)
		if err != nil {
			return err
		}
		b.layerEv = append(b.layerEv, ev)
	}
	ev := b.layerEv[li]
	if err := ev.Record(st); err != nil {
		return err
	}
	for i := range seqs {
		if f := seqs[i].Layer; f != nil {
			f(li, eventFence{ev})
		}
	}
	return nil
}

// eventFence waits for a layer event. A later pass may re-record the event
// before the wait: the wait then ends later than needed, never earlier.
type eventFence struct{ ev *cu.Event }

func (f eventFence) Wait() error { return f.ev.Synchronize() }

// ensureHostLogits grows the pinned logits buffer; the GPU may be busy, so
// the old buffer is freed only after a synchronisation.
func (b *Backend) ensureHostLogits(n uint64) error {
	if b.s.hostLogits != nil && b.s.hostLogits.Size() >= n {
		return nil
	}
	if err := b.stream.Synchronize(); err != nil {
		return err
	}
	return b.ensureHost(&b.s.hostLogits, n)
}
