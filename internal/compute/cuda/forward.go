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
	if err := ctx.Err(); err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return err
	}
	err := b.forward(ctx, seqs, out, copyLogits)
	if err != nil {
		// Leave the GPU idle whatever happened, so scratch can be reused.
		if serr := b.cx.Synchronize(); serr != nil {
			err = errors.Join(err, serr)
		}
	}
	return err
}

// check validates seqs and returns the token count and logits rows.
func (b *Backend) check(seqs []compute.Seq, out [][]float32) (n, m int, err error) {
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
			if i >= len(out) || len(out[i]) < c.Vocab {
				return 0, 0, fmt.Errorf("cuda backend: seq %d: no room for %d logits", i, c.Vocab)
			}
			m++
		}
		n += len(s.Tokens)
	}
	return n, m, nil
}

// plan is one forward pass's metadata, laid out in one buffer (int32
// sections, then the int64 slots) that is copied to the GPU at once.
type plan struct {
	n, m       int
	ng, np     int // split-K queries; flash prefill sequences
	nsplit     int // splits of the longest split-K query
	maxPrefill int // longest flash prefill chunk
	// section offsets in int32 units
	tok, pos, gRow, gPos, gPtoff, pStart, pLen, pPos0, pPtoff, pages, lrows int
	slot                                                                    int // in int64 units
	size                                                                    int // bytes
}

func (b *Backend) makePlan(seqs []compute.Seq, n, m int) (*plan, []int32, []int64) {
	ps := b.layout.PageSize
	p := &plan{n: n, m: m}
	npages := 0
	for _, s := range seqs {
		if len(s.Tokens) == 0 {
			continue
		}
		end := s.Pos + len(s.Tokens)
		npages += (end + ps - 1) / ps
		if b.flash && !b.opts.NoFlashPrefill && len(s.Tokens) > 1 {
			p.np++
			p.maxPrefill = max(p.maxPrefill, len(s.Tokens))
		} else {
			p.ng += len(s.Tokens)
			p.nsplit = max(p.nsplit, (end+b.fn.split-1)/b.fn.split)
		}
	}
	o := 0
	sec := func(k int) int { r := o; o += k; return r }
	p.tok, p.pos = sec(n), sec(n)
	p.gRow, p.gPos, p.gPtoff = sec(p.ng), sec(p.ng), sec(p.ng)
	p.pStart, p.pLen, p.pPos0, p.pPtoff = sec(p.np), sec(p.np), sec(p.np), sec(p.np)
	p.pages, p.lrows = sec(npages), sec(m)
	o = (o + 1) &^ 1
	p.slot = o / 2
	p.size = o*4 + n*8
	i32 := make([]int32, o)
	i64 := make([]int64, n)
	kvd := int64(b.cfg.KVHeads * b.cfg.HeadDim)
	t, g, q, pg, lr := 0, 0, 0, 0, 0
	for _, s := range seqs {
		if len(s.Tokens) == 0 {
			continue
		}
		end := s.Pos + len(s.Tokens)
		ptoff := pg
		for _, x := range s.Pages[:(end+ps-1)/ps] {
			i32[p.pages+pg] = x
			pg++
		}
		flash := b.flash && !b.opts.NoFlashPrefill && len(s.Tokens) > 1
		if flash {
			i32[p.pStart+q], i32[p.pLen+q], i32[p.pPos0+q], i32[p.pPtoff+q] = int32(t), int32(len(s.Tokens)), int32(s.Pos), int32(ptoff)
			q++
		}
		for j, tok := range s.Tokens {
			pos := s.Pos + j
			i32[p.tok+t], i32[p.pos+t] = tok, int32(pos)
			i64[t] = int64(s.Pages[pos/ps])*int64(ps)*kvd + int64(pos%ps)*kvd
			if !flash {
				i32[p.gRow+g], i32[p.gPos+g], i32[p.gPtoff+g] = int32(t), int32(pos), int32(ptoff)
				g++
			}
			t++
		}
		if s.Logits {
			i32[p.lrows+lr] = int32(t - 1)
			lr++
		}
	}
	return p, i32, i64
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

// gemm computes y[n][out] = x[n][in] . w[out][in]^T + beta*y; y is f32 when
// yF32, else T.
func (r *run) gemm(y cu.DevicePtr, yF32 bool, x, w cu.DevicePtr, n, out, in int, beta float32) {
	if r.err != nil {
		return
	}
	b := r.b
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

// partBudget bounds the split-K attention's partial results per launch.
const partBudget = 256 << 20

func (b *Backend) forward(ctx context.Context, seqs []compute.Seq, out [][]float32, copyLogits bool) error {
	n, m, err := b.check(seqs, out)
	if err != nil || n == 0 {
		return err
	}
	c := &b.cfg
	s := &b.s
	eb := uint64(b.eb)
	dim, qd, kvd, hid := c.Dim, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HiddenDim
	un := uint64(n)
	p, i32, i64 := b.makePlan(seqs, n, m)
	for _, e := range []struct {
		d  *dbuf
		sz uint64
	}{
		{&s.x, un * uint64(dim) * 4}, {&s.xb, un * uint64(dim) * eb}, {&s.qkv, un * uint64(qd+2*kvd) * 4},
		{&s.q, un * uint64(qd) * eb}, {&s.att, un * uint64(qd) * eb}, {&s.gu, un * uint64(2*hid) * eb},
		{&s.h, un * uint64(hid) * eb}, {&s.lx, uint64(max(m, 1)) * uint64(dim) * eb},
		{&s.logits, uint64(max(m, 1)) * uint64(c.Vocab) * 4}, {&s.meta, uint64(p.size)},
	} {
		if err := b.ensure(e.d, e.sz); err != nil {
			return fmt.Errorf("cuda backend: scratch: %w", err)
		}
	}
	perQuery := uint64(c.Heads) * uint64(max(p.nsplit, 1)) * uint64(c.HeadDim+2) * 4
	qchunk := max(1, min(p.ng, int(partBudget/perQuery)))
	if err := b.ensure(&s.part, uint64(qchunk)*perQuery); err != nil {
		return fmt.Errorf("cuda backend: scratch: %w", err)
	}
	if err := b.ensureHost(&s.hostMeta, uint64(p.size)); err != nil {
		return err
	}
	hm := s.hostMeta.Bytes()
	copy(hm, unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(i32))), len(i32)*4))
	if n > 0 {
		copy(hm[p.slot*8:], unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(i64))), n*8))
	}
	st := b.cx.DefaultStream()
	r := &run{b: b, s: st}
	if err := st.MemcpyHtoD(s.meta.p, s.hostMeta.Ptr(), uint64(p.size)); err != nil {
		return err
	}
	meta := func(off int) cu.DevicePtr { return s.meta.p + cu.DevicePtr(off*4) }
	null := cu.DevicePtr(0)
	nb := uint32(n)
	hd := c.HeadDim
	interleaved := int32(0)
	if c.RopeInterleaved {
		interleaved = 1
	}
	scaleLog2 := float32(1 / math.Sqrt(float64(hd)) * math.Log2E)
	div := float32(math.Sqrt(float64(hd)))
	layerBytes := cu.DevicePtr(int64(b.layout.Pages) * int64(b.layout.PageBytes()))
	rmsT := rmsThreads(dim)
	ropeY := ropeBlocks(c.Heads, c.KVHeads, hd)
	siluY := siluBlocks(hid)

	hooked := false
	for i := range seqs {
		hooked = hooked || seqs[i].Layer != nil
	}
	r.launch(b.fn.embed, cu.D1(nb), cu.D1(256), 0, s.x.p, b.w.embed, meta(p.tok), int32(dim))
	for li := range b.w.layers {
		if err := ctx.Err(); err != nil {
			return err
		}
		w := &b.w.layers[li]
		kc := b.kvBase + cu.DevicePtr(2*li)*layerBytes
		vc := kc + layerBytes
		r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, s.xb.p, s.x.p, w.attnNorm, null, int32(dim), c.NormEps)
		r.gemm(s.qkv.p, true, s.xb.p, w.wqkv, n, qd+2*kvd, dim, 0)
		r.launch(b.fn.ropeKV, cu.Dim3{X: nb, Y: ropeY, Z: 1}, cu.D1(ropeThreads), 0, s.q.p, kc, vc, s.qkv.p, w.bqkv,
			meta(p.pos), s.meta.p+cu.DevicePtr(p.slot*8), b.ropeTab, b.rope, int32(b.ropeN), int32(c.Heads),
			int32(c.KVHeads), interleaved)
		if hooked && r.err == nil {
			if err := b.reportLayer(st, seqs, li); err != nil {
				return fmt.Errorf("cuda backend: layer %d: %w", li, err)
			}
		}
		if p.np > 0 && b.fn.attnFlash2 != nil {
			bq := 16 * b.fn.flash2Warps
			r.launch(b.fn.attnFlash2, cu.Dim3{X: uint32((p.maxPrefill + bq - 1) / bq), Y: uint32(c.Heads), Z: uint32(p.np)},
				cu.D1(uint32(32*b.fn.flash2Warps)), uint32(b.fn.flash2Smem), s.att.p, s.q.p, kc, vc, meta(p.pStart), meta(p.pLen),
				meta(p.pPos0), meta(p.pPtoff), meta(p.pages), int32(b.layout.PageSize), int32(c.Heads), int32(c.KVHeads), scaleLog2)
		} else if p.np > 0 {
			r.launch(b.fn.attnFlash, cu.Dim3{X: uint32((p.maxPrefill + 63) / 64), Y: uint32(c.Heads), Z: uint32(p.np)},
				cu.D1(128), 0, s.att.p, s.q.p, kc, vc, meta(p.pStart), meta(p.pLen), meta(p.pPos0), meta(p.pPtoff),
				meta(p.pages), int32(b.layout.PageSize), int32(c.Heads), int32(c.KVHeads), scaleLog2)
		}
		partML := s.part.p + cu.DevicePtr(uint64(qchunk)*uint64(c.Heads)*uint64(p.nsplit)*uint64(hd)*4)
		for q0 := 0; q0 < p.ng; q0 += qchunk {
			cnt := uint32(min(qchunk, p.ng-q0))
			af, at := b.fn.attnSplit, uint32(b.fn.attThreads)
			if b.fn.attnDecode != nil {
				af, at = b.fn.attnDecode, 128
			}
			r.launch(af, cu.Dim3{X: uint32(p.nsplit), Y: uint32(c.KVHeads), Z: cnt}, cu.D1(at), 0,
				s.part.p, partML, s.q.p, kc, vc, meta(p.gRow), meta(p.gPos), meta(p.gPtoff), meta(p.pages),
				int32(b.layout.PageSize), int32(p.nsplit), int32(c.Heads), int32(c.KVHeads), int32(q0), div)
			r.launch(b.fn.attnCombine, cu.Dim3{X: uint32(c.Heads), Y: cnt, Z: 1}, cu.D1(uint32(b.fn.combineThreads)), 0,
				s.att.p, s.part.p, partML, meta(p.gRow), meta(p.gPos), int32(p.nsplit), int32(c.Heads), int32(q0))
		}
		r.gemm(s.x.p, true, s.att.p, w.wo, n, dim, qd, 1)
		r.launch(b.fn.rmsnorm, cu.D1(nb), cu.D1(rmsT), 0, s.xb.p, s.x.p, w.ffnNorm, null, int32(dim), c.NormEps)
		r.gemm(s.gu.p, false, s.xb.p, w.w13, n, 2*hid, dim, 0)
		r.launch(b.fn.siluMul, cu.Dim3{X: nb, Y: siluY, Z: 1}, cu.D1(siluThreads), 0, s.h.p, s.gu.p, int32(hid))
		r.gemm(s.x.p, true, s.h.p, w.w2, n, dim, hid, 1)
		if r.err != nil {
			return fmt.Errorf("cuda backend: layer %d: %w", li, r.err)
		}
	}
	if m > 0 {
		r.launch(b.fn.rmsnorm, cu.D1(uint32(m)), cu.D1(rmsT), 0, s.lx.p, s.x.p, b.w.norm, meta(p.lrows), int32(dim), c.NormEps)
		r.gemm(s.logits.p, true, s.lx.p, b.w.lmHead, m, c.Vocab, dim, 0)
		if r.err != nil {
			return fmt.Errorf("cuda backend: logits: %w", r.err)
		}
		if copyLogits {
			lb := uint64(m) * uint64(c.Vocab) * 4
			if err := b.ensureHostLogits(lb); err != nil {
				return err
			}
			if err := st.MemcpyDtoH(s.hostLogits.Ptr(), s.logits.p, lb); err != nil {
				return err
			}
		}
	}
	if err := st.Synchronize(); err != nil {
		return fmt.Errorf("cuda backend: forward: %w", err)
	}
	if m > 0 && copyLogits {
		all := unsafe.Slice((*float32)(s.hostLogits.Ptr()), m*c.Vocab)
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
	if err := b.cx.DefaultStream().Synchronize(); err != nil {
		return err
	}
	return b.ensureHost(&b.s.hostLogits, n)
}
