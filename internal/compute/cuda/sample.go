package cuda

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"math"
	"runtime"
	"slices"
	"unsafe"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/csrc"
	"github.com/mooncake-go/mooncake-go/internal/compute"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// Sampling on the GPU (compute.DeviceSampler), kernels in
// csrc/llama/sample.cu (a module of its own, compiled with --fmad=false).
// A pass that samples adds, after the logits GEMM and on the same stream,
// three launches over its logits rows (sample_adjust, sample_weights,
// sample_finish) that read each row's parameters from a device buffer
// written before the pass (so a decode graph captures them too), and copies
// back one 176-byte result per row instead of the logits. Tokens accepted
// elsewhere are counted by one eager sample_accept launch before the pass.
//
// A request's device state is a slot: u32 state words [V] (count of the
// accepted output tokens, "in the prompt" and "has a bias" marks) and its
// logit_bias (ids ascending, float32 values). Only requests with a bias or
// a penalty get one; slots are allocated on demand, reused once closed, and
// freed with the backend.

var _ compute.DeviceSampler = (*Backend)(nil)

// Layout shared with sample.cu.
const (
	sampleRowBytes   = 104 // SampleRow
	sampleOutBytes   = 176 // SampleOut
	acceptEntryBytes = 16  // AcceptEntry
	sampleChunk      = 4096
	sampleBlock      = 256
	sampleMaxVocab   = 1024 * sampleBlock // MAX_RB rule blocks
	sampleFinish     = 1024               // sample_finish's threads
)

// SampleRow.flags
const (
	sfActive = 1 << iota
	sfGreedy
	sfLogprob
	sfPen
	sfRep
)

// sampleFns are the sampling module's kernels.
type sampleFns struct {
	mod                                         *cu.Module
	adjust, weights, finish, accept, init, take *cu.Function
	philox, exp                                 *cu.Function // tests
}

// sampleBufs are a pass's sampling buffers (rows rows).
type sampleBufs struct {
	params, out, work, cstat, rsum, bsum cu.DevicePtr
}

type sampleSizes struct{ params, out, work, cstat, rsum, bsum uint64 }

func sampleSizesFor(rows, vocab int) sampleSizes {
	r := uint64(rows)
	nch, nrb := uint64(ceilDiv(vocab, sampleChunk)), uint64(ceilDiv(vocab, sampleBlock))
	return sampleSizes{params: r * sampleRowBytes, out: r * sampleOutBytes, work: r * uint64(vocab) * 4,
		cstat: r * nch * 16, rsum: r * nch * 8, bsum: r * nrb * 8}
}

func (z *sampleSizes) total() uint64 { return z.params + z.out + z.work + z.cstat + z.rsum + z.bsum }

// sampler is a backend's sampling side (guarded by Backend.mu).
type sampler struct {
	fns       sampleFns
	err       error          // why device sampling is off (nil: on)
	slotBytes uint64         // words, then bias ids and values
	free      []cu.DevicePtr // closed states' slots
	open      int            // states not closed
	pass      uint64         // ForwardSample calls, to find a state twice in a batch
	graph     *sampleBufs    // the decode graphs' (fixed addresses; nil until first used)
	eager     struct{ params, out, work, cstat, rsum, bsum, accept, init dbuf }
	// pinned staging
	hostParams, hostAccept, hostInit *cu.HostMem
	hostOut                          [2]*cu.HostMem // results, alternating between passes (async.go)
}

// slot offsets: the words, then MaxLogitBias ids and values.
func (s *sampler) biasOff(vocab int) uint64 { return uint64(vocab*4+255) &^ 255 }

// loadSampler compiles and loads the sampling kernels; a failure leaves
// device sampling off (NewSamplerState refuses, the engine samples on the
// host) with a warning.
func (b *Backend) loadSampler() {
	s := &b.smp
	s.err = func() error {
		if b.cfg.Vocab > sampleMaxVocab {
			return fmt.Errorf("vocabulary %d above %d", b.cfg.Vocab, sampleMaxVocab)
		}
		src, err := csrc.LlamaKernel("sample")
		if err != nil {
			return err
		}
		kcfg := b.opts.KernelCache
		if kcfg.Logger == nil {
			kcfg.Logger = b.lg
		}
		k, err := cu.NewKernels(kcfg)
		if err != nil {
			return err
		}
		if s.fns.mod, err = k.LoadSource(b.cx, "sample", src, "--fmad=false"); err != nil {
			return err
		}
		f := &s.fns
		for _, e := range []struct {
			p    **cu.Function
			name string
		}{{&f.adjust, "sample_adjust"}, {&f.weights, "sample_weights"}, {&f.finish, "sample_finish"},
			{&f.accept, "sample_accept"}, {&f.init, "sample_init"}, {&f.take, "sample_take"}, {&f.philox, "sample_philox"}, {&f.exp, "sample_exp"}} {
			if *e.p, err = f.mod.Function(e.name); err != nil {
				return err
			}
		}
		return nil
	}()
	if s.err != nil {
		b.lg.Warn("device sampling off: requests sample on the host", zap.Error(s.err))
	}
	s.slotBytes = s.biasOff(b.cfg.Vocab) + sampling.MaxLogitBias*8
}

// release frees what the sampler holds besides b.allocs.
func (s *sampler) release(b *Backend) []error {
	var errs []error
	for _, d := range []*dbuf{&s.eager.params, &s.eager.out, &s.eager.work, &s.eager.cstat, &s.eager.rsum, &s.eager.bsum,
		&s.eager.accept, &s.eager.init} {
		if d.p != 0 {
			errs = append(errs, b.cx.MemFree(d.p))
		}
		*d = dbuf{}
	}
	for _, h := range []**cu.HostMem{&s.hostParams, &s.hostOut[0], &s.hostOut[1], &s.hostAccept, &s.hostInit} {
		errs = append(errs, (*h).Free())
		*h = nil
	}
	if s.fns.mod != nil {
		errs = append(errs, s.fns.mod.Unload())
		s.fns.mod = nil
	}
	s.free, s.graph = nil, nil
	return errs
}

// samplerState is one request's state (compute.SamplerState).
type samplerState struct {
	b      *Backend
	p      sampling.Params
	seed   uint64
	slot   cu.DevicePtr // 0: none needed
	nbias  int
	pass   uint64 // the last ForwardSample pass that sampled it
	closed bool
}

func penalised(p *sampling.Params) bool { return p.FrequencyPenalty != 0 || p.PresencePenalty != 0 }
func repeats(p *sampling.Params) bool   { return p.RepetitionPenalty != 0 && p.RepetitionPenalty != 1 }

// NewSamplerState implements compute.DeviceSampler.
func (b *Backend) NewSamplerState(p sampling.Params, seed uint64, prompt []int32) (compute.SamplerState, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	V := b.cfg.Vocab
	for id := range p.LogitBias {
		if id >= V {
			return nil, fmt.Errorf("cuda backend: logit_bias token %d outside the vocabulary of %d", id, V)
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.sampling(); err != nil {
		return nil, err
	}
	st := &samplerState{b: b, p: p, seed: seed}
	if len(p.LogitBias) == 0 && !penalised(&p) && !repeats(&p) {
		b.smp.open++
		return st, nil
	}
	var np []int32
	if repeats(&p) {
		np = prompt
		for _, t := range np {
			if t < 0 || int(t) >= V {
				return nil, fmt.Errorf("cuda backend: prompt token %d outside the vocabulary of %d", t, V)
			}
		}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := b.cx.SetCurrent(); err != nil {
		return nil, err
	}
	slot, err := b.smp.takeSlot(b)
	if err != nil {
		return nil, fmt.Errorf("cuda backend: sampler state: %w", err)
	}
	if err := b.initSlot(slot, np, p.LogitBias); err != nil {
		b.smp.free = append(b.smp.free, slot)
		return nil, fmt.Errorf("cuda backend: sampler state: %w", errors.Join(err, b.stream.Synchronize()))
	}
	st.slot, st.nbias = slot, len(p.LogitBias)
	b.smp.open++
	return st, nil
}

func (s *sampler) takeSlot(b *Backend) (cu.DevicePtr, error) {
	if n := len(s.free); n > 0 {
		p := s.free[n-1]
		s.free = s.free[:n-1]
		return p, nil
	}
	return b.alloc(s.slotBytes)
}

// initSlot zeroes slot's words, marks the prompt's and the biased tokens
// and writes the bias, then waits (the staging buffer is reused).
func (b *Backend) initSlot(slot cu.DevicePtr, prompt []int32, bias map[int]float64) error {
	s := &b.smp
	V := b.cfg.Vocab
	ids := slices.Sorted(maps.Keys(bias))
	np, nb := len(prompt), len(ids)
	n := uint64(np+2*nb) * 4
	if err := b.ensureHost(&s.hostInit, n); err != nil {
		return err
	}
	if err := b.ensure(&s.eager.init, uint64(np+nb)*4); err != nil {
		return err
	}
	h := s.hostInit.Bytes()
	for i, t := range prompt {
		binary.LittleEndian.PutUint32(h[4*i:], uint32(t))
	}
	for i, id := range ids {
		binary.LittleEndian.PutUint32(h[4*(np+i):], uint32(id))
		binary.LittleEndian.PutUint32(h[4*(np+nb+i):], math.Float32bits(float32(bias[id])))
	}
	st := b.stream
	off := s.biasOff(V)
	if err := st.MemsetD8(slot, 0, uint64(V)*4); err != nil {
		return err
	}
	if np+nb > 0 {
		if err := st.MemcpyHtoD(s.eager.init.p, s.hostInit.Ptr(), uint64(np+nb)*4); err != nil {
			return err
		}
	}
	if nb > 0 {
		hb := unsafe.Add(s.hostInit.Ptr(), 4*np)
		if err := st.MemcpyHtoD(slot+cu.DevicePtr(off), hb, uint64(nb)*4); err != nil {
			return err
		}
		if err := st.MemcpyHtoD(slot+cu.DevicePtr(off)+sampling.MaxLogitBias*4, unsafe.Add(hb, 4*nb), uint64(nb)*4); err != nil {
			return err
		}
	}
	if np+nb > 0 {
		blocks := uint32(min(ceilDiv(np+nb, 256), 1024))
		if err := st.Launch(s.fns.init, cu.D1(blocks), cu.D1(256), 0, slot, s.eager.init.p, int32(np),
			s.eager.init.p+cu.DevicePtr(4*np), int32(nb)); err != nil {
			return err
		}
	}
	return st.Synchronize()
}

// Close implements compute.SamplerState.
func (st *samplerState) Close() error {
	b := st.b
	b.mu.Lock()
	defer b.mu.Unlock()
	if st.closed {
		return errors.New("cuda backend: sampler state closed twice")
	}
	st.closed = true
	b.smp.open--
	if st.slot != 0 && !b.closed {
		b.smp.free = append(b.smp.free, st.slot)
	}
	return nil
}

// sampleJob is one ForwardSample pass's sampling: the logits rows' states
// and requests in row order, and the accepted tokens to count first.
type sampleJob struct {
	states []*samplerState
	reqs   []compute.Sample
	seqIdx []int // seq index of each row
	accept []acceptEntry
	slot   int // results staging buffer (sampler.hostOut)
	// Queued passes (async.go): prev is each seq's row in the last pass's
	// results whose token it takes (-1: its own), nil when none does;
	// async asks forwardDecode to leave the pass running, queued says it
	// did; graphOut says the pass sampled into the decode graphs' buffers.
	prev                    []int32
	async, queued, graphOut bool
}

type acceptEntry struct {
	words cu.DevicePtr
	token int32
}

// newSampleJob validates samp for seqs (called under b.mu).
func (b *Backend) newSampleJob(seqs []compute.Seq, samp []compute.Sample) (*sampleJob, error) {
	if len(samp) < len(seqs) {
		return nil, fmt.Errorf("cuda backend: %d samples for %d seqs", len(samp), len(seqs))
	}
	b.smp.pass++
	V := b.cfg.Vocab
	j := &sampleJob{}
	for i := range seqs {
		if !seqs[i].Logits {
			continue
		}
		sm := samp[i]
		st, ok := sm.State.(*samplerState)
		switch {
		case !ok || st == nil || st.b != b:
			return nil, fmt.Errorf("cuda backend: seq %d: no sampler state of this backend", i)
		case st.closed:
			return nil, fmt.Errorf("cuda backend: seq %d: sampler state closed", i)
		case st.pass == b.smp.pass:
			return nil, fmt.Errorf("cuda backend: seq %d: its sampler state is sampled twice in one pass", i)
		case sm.TopLogprobs < 0 || sm.TopLogprobs > sampling.MaxTopLogprobs:
			return nil, fmt.Errorf("cuda backend: seq %d: %d top logprobs, at most %d", i, sm.TopLogprobs, sampling.MaxTopLogprobs)
		}
		st.pass = b.smp.pass
		if st.slot != 0 {
			for _, t := range sm.Accept {
				if t < 0 || int(t) >= V {
					return nil, fmt.Errorf("cuda backend: seq %d: accepted token %d outside the vocabulary of %d", i, t, V)
				}
				j.accept = append(j.accept, acceptEntry{st.slot, t})
			}
		}
		j.states = append(j.states, st)
		j.reqs = append(j.reqs, sm)
		j.seqIdx = append(j.seqIdx, i)
	}
	return j, nil
}

// sampleParams writes the parameter image of rows rows (the job's first,
// the rest inactive padding) into dst (rows*sampleRowBytes bytes).
func sampleParams(dst []byte, j *sampleJob, rows, vocab int, biasOff uint64) {
	clear(dst[:rows*sampleRowBytes])
	le := binary.LittleEndian
	for r, st := range j.states {
		sm := j.reqs[r]
		p := &st.p
		d := dst[r*sampleRowBytes : (r+1)*sampleRowBytes]
		flags := sfActive
		if p.Greedy() {
			flags |= sfGreedy
		}
		if sm.Logprob {
			flags |= sfLogprob
		}
		if st.slot != 0 {
			le.PutUint64(d[0:], uint64(st.slot))
			le.PutUint64(d[8:], uint64(st.slot)+biasOff)
			le.PutUint64(d[16:], uint64(st.slot)+biasOff+sampling.MaxLogitBias*4)
			if penalised(p) {
				flags |= sfPen
			}
			if repeats(p) {
				flags |= sfRep
			}
		}
		le.PutUint64(d[24:], st.seed)
		le.PutUint64(d[32:], sm.Step)
		if p.TopP > 0 && p.TopP < 1 {
			le.PutUint64(d[40:], math.Float64bits(p.TopP))
		}
		if p.MinP > 0 {
			le.PutUint64(d[48:], math.Float64bits(p.MinP))
		}
		le.PutUint64(d[56:], math.Float64bits(p.FrequencyPenalty))
		le.PutUint64(d[64:], math.Float64bits(p.PresencePenalty))
		le.PutUint32(d[72:], uint32(flags))
		if p.TopK > 0 && p.TopK < vocab {
			le.PutUint32(d[76:], uint32(p.TopK))
		}
		le.PutUint32(d[80:], uint32(min(sm.TopLogprobs, vocab)))
		le.PutUint32(d[84:], uint32(st.nbias))
		le.PutUint32(d[88:], math.Float32bits(float32(1/p.Temperature)))
		le.PutUint32(d[92:], math.Float32bits(float32(p.RepetitionPenalty)))
	}
}

// ForwardSample implements compute.DeviceSampler: a started pass, waited
// for.
func (b *Backend) ForwardSample(ctx context.Context, seqs []compute.Seq, samp []compute.Sample, res []compute.Sampled) error {
	if len(res) < len(seqs) {
		return fmt.Errorf("cuda backend: %d results for %d seqs", len(res), len(seqs))
	}
	p, err := b.StartSample(ctx, seqs, samp, nil)
	if err != nil {
		return err
	}
	return p.Wait(res)
}

// sampling reports why the backend cannot sample now (b.mu held).
func (b *Backend) sampling() error {
	if b.closed {
		return errors.New("cuda backend: closed")
	}
	if b.smp.err != nil {
		return fmt.Errorf("cuda backend: no device sampling: %w", b.smp.err)
	}
	return nil
}

// results reads the rows' SampleOut records into res.
func (j *sampleJob) results(h []byte, vocab int, res []compute.Sampled) error {
	le := binary.LittleEndian
	for r, i := range j.seqIdx {
		o := h[r*sampleOutBytes : (r+1)*sampleOutBytes]
		tok := int32(le.Uint32(o[0:]))
		if tok < 0 || int(tok) >= vocab {
			return fmt.Errorf("cuda backend: device sampling gave token %d (vocabulary %d)", tok, vocab)
		}
		sm := j.reqs[r]
		out := compute.Sampled{Token: int(tok)}
		if sm.Logprob {
			out.Logprob = math.Float32frombits(le.Uint32(o[4:]))
		}
		if n := min(sm.TopLogprobs, vocab); n > 0 {
			out.Top = make([]sampling.TopLogprob, n)
			for k := range out.Top {
				out.Top[k] = sampling.TopLogprob{Token: int(int32(le.Uint32(o[16+4*k:]))),
					Logprob: math.Float32frombits(le.Uint32(o[96+4*k:]))}
			}
		}
		res[i] = out
	}
	return nil
}

// eagerSampleBufs grows the eager sampling buffers to rows rows (the GPU
// is idle).
func (b *Backend) eagerSampleBufs(rows int) (*sampleBufs, error) {
	e := &b.smp.eager
	z := sampleSizesFor(rows, b.cfg.Vocab)
	for _, x := range []struct {
		d *dbuf
		n uint64
	}{{&e.params, z.params}, {&e.out, z.out}, {&e.work, z.work}, {&e.cstat, z.cstat}, {&e.rsum, z.rsum}, {&e.bsum, z.bsum}} {
		if err := b.ensure(x.d, x.n); err != nil {
			return nil, fmt.Errorf("cuda backend: sampling buffers: %w", err)
		}
	}
	return &sampleBufs{params: e.params.p, out: e.out.p, work: e.work.p, cstat: e.cstat.p, rsum: e.rsum.p, bsum: e.bsum.p}, nil
}

// graphSampleBufs are the decode graphs' sampling buffers, sized for the
// largest bucket and allocated at the first sampled decode pass (the GPU
// is idle); their addresses never change after.
func (b *Backend) graphSampleBufs() (*sampleBufs, error) {
	if b.smp.graph != nil {
		return b.smp.graph, nil
	}
	g := b.graphs
	z := sampleSizesFor(g.buckets[len(g.buckets)-1], b.cfg.Vocab)
	sb := &sampleBufs{}
	for _, x := range []struct {
		p *cu.DevicePtr
		n uint64
	}{{&sb.params, z.params}, {&sb.out, z.out}, {&sb.work, z.work}, {&sb.cstat, z.cstat}, {&sb.rsum, z.rsum}, {&sb.bsum, z.bsum}} {
		var err error
		if *x.p, err = b.alloc(x.n); err != nil {
			return nil, fmt.Errorf("cuda backend: decode graph sampling buffers (%.1f MiB): %w", float64(z.total())/(1<<20), err)
		}
	}
	b.lg.Info("decode graph sampling buffers", zap.Uint64("bytes", z.total()))
	b.smp.graph = sb
	return sb, nil
}

// samplePrep copies the job's parameters (rows rows) to sb and counts its
// accepted tokens: async on the stream, before the pass's sampling
// launches (eager: never captured).
func (b *Backend) samplePrep(j *sampleJob, sb *sampleBufs, rows int) error {
	s := &b.smp
	st := b.stream
	n := uint64(rows) * sampleRowBytes
	if err := b.ensureHost(&s.hostParams, n); err != nil {
		return err
	}
	if err := b.ensureHost(&s.hostOut[j.slot], uint64(rows)*sampleOutBytes); err != nil {
		return err
	}
	sampleParams(s.hostParams.Bytes(), j, rows, b.cfg.Vocab, s.biasOff(b.cfg.Vocab))
	if err := st.MemcpyHtoD(sb.params, s.hostParams.Ptr(), n); err != nil {
		return err
	}
	na := len(j.accept)
	if na == 0 {
		return nil
	}
	an := uint64(na) * acceptEntryBytes
	if err := b.ensureHost(&s.hostAccept, an); err != nil {
		return err
	}
	if err := b.ensure(&s.eager.accept, an); err != nil {
		return err
	}
	h := s.hostAccept.Bytes()
	for i, a := range j.accept {
		binary.LittleEndian.PutUint64(h[16*i:], uint64(a.words))
		binary.LittleEndian.PutUint64(h[16*i+8:], uint64(uint32(a.token)))
	}
	if err := st.MemcpyHtoD(s.eager.accept.p, s.hostAccept.Ptr(), an); err != nil {
		return err
	}
	return st.Launch(s.fns.accept, cu.D1(uint32(min(ceilDiv(na, 256), 1024))), cu.D1(256), 0, s.eager.accept.p, int32(na))
}

// sampleLaunch enqueues the sampling kernels over rows logits rows. It only
// enqueues, so it can be captured.
func (b *Backend) sampleLaunch(sb *sampleBufs, logits cu.DevicePtr, rows int) error {
	f := &b.smp.fns
	st := b.stream
	V := b.cfg.Vocab
	nch, nrb := ceilDiv(V, sampleChunk), ceilDiv(V, sampleBlock)
	grid := cu.Dim3{X: uint32(nch), Y: uint32(rows), Z: 1}
	if err := st.Launch(f.adjust, grid, cu.D1(256), 0, sb.params, logits, sb.work, sb.cstat, int32(V), int32(nch)); err != nil {
		return err
	}
	if err := st.Launch(f.weights, grid, cu.D1(256), 0, sb.params, logits, sb.work, sb.cstat, sb.rsum, sb.bsum,
		int32(V), int32(nch), int32(nrb)); err != nil {
		return err
	}
	return st.Launch(f.finish, cu.D1(uint32(rows)), cu.D1(sampleFinish), 0, sb.params, logits, sb.work, sb.cstat,
		sb.rsum, sb.bsum, sb.out, int32(V), int32(nch), int32(nrb))
}

// sampleCopyOut copies the first n rows' results to the job's pinned
// staging buffer, async on the stream (read after the pass's end).
func (b *Backend) sampleCopyOut(sb *sampleBufs, j *sampleJob, n int) error {
	if n == 0 {
		return nil
	}
	return b.stream.MemcpyDtoH(b.smp.hostOut[j.slot].Ptr(), sb.out, uint64(n)*sampleOutBytes)
}

// SamplerStates counts the sampler states not closed (tests, logs).
func (b *Backend) SamplerStates() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.smp.open
}
