package cuda

import (
	"errors"
	"fmt"
	"math"
	"runtime"
	"sync"
	"unsafe"

	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// devWeights are the model's tensors on the GPU. Matrices are in T (bf16 or
// f32), row-major [out][in]; q, k, v are one matrix [q+2kv][Dim] and gate, up
// one [2*Hidden][Dim]. Norm weights and biases stay f32.
type devWeights struct {
	embed, norm, lmHead cu.DevicePtr
	layers              []devLayer
	bytes               int64
}

type devLayer struct {
	attnNorm, ffnNorm cu.DevicePtr // f32 [Dim]
	bqkv              cu.DevicePtr // f32 [q+2kv], 0 without bias
	qNorm, kNorm      cu.DevicePtr // f32 [HeadDim], 0 without q/k norms
	wqkv, wo, w13, w2 cu.DevicePtr // w13, w2: the dense MLP (0 in MoE layers)
	moe               *devMoE      // nil in dense layers
}

// devMoE is a mixture-of-experts layer's weights.
type devMoE struct {
	router    cu.DevicePtr // T [Experts (+1: the shared expert's gate)][Dim]
	w13, w2   cu.DevicePtr // T [Experts][2*ExpertDim][Dim] (gate, up), [Experts][Dim][ExpertDim]
	sw13, sw2 cu.DevicePtr // the shared expert's [2*S][Dim], [Dim][S]; 0 without
}

// uploadWeights copies m's tensors to the GPU from their stored dtype: bf16
// tensors into a bf16 backend (and f32 into an f32 one) as they are, from
// the memory mapping, with no host copy; others converted in bounded
// chunks. With RandomWeights they are made on the GPU instead.
func (b *Backend) uploadWeights(m *model.Model) error {
	c := &b.cfg
	eb := uint64(b.eb)
	w := &b.w
	random := b.opts.RandomWeights
	if !random && len(m.Layers) != c.Layers {
		return fmt.Errorf("cuda backend: %d layers of weights, config says %d", len(m.Layers), c.Layers)
	}
	var seed uint64 = uint64(b.opts.Seed)*0x9E3779B97F4A7C15 + 1
	nextSeed := func() uint64 { seed += 0xBF58476D1CE4E5B9; return seed }
	const std = 0.02
	uni := float32(std * math.Sqrt(3))

	// mat uploads (or fills) one T matrix [rows][cols] made of parts
	// stacked by rows.
	mat := func(rows, cols int, parts ...*model.Tensor) (cu.DevicePtr, error) {
		n := uint64(rows) * uint64(cols)
		p, err := b.alloc(n * eb)
		if err != nil {
			return 0, err
		}
		w.bytes += int64(n * eb)
		if random {
			return p, b.fill(b.fn.fillT, p, n, nextSeed(), uni, 0)
		}
		off := uint64(0)
		for _, t := range parts {
			if t == nil {
				return 0, errors.New("cuda backend: a tensor of the architecture is missing")
			}
			if err := b.uploadTensor(p+cu.DevicePtr(off*eb), t); err != nil {
				return 0, fmt.Errorf("cuda backend: %s: %w", t.Name, err)
			}
			off += uint64(t.Numel())
		}
		if off != n {
			return 0, fmt.Errorf("cuda backend: tensors of %d elements, want %dx%d", off, rows, cols)
		}
		return p, nil
	}
	// vec uploads one f32 vector made of parts; random weights: norms 1,
	// biases small.
	vec := func(n int, one bool, parts ...*model.Tensor) (cu.DevicePtr, error) {
		p, err := b.alloc(uint64(n) * 4)
		if err != nil {
			return 0, err
		}
		w.bytes += int64(n) * 4
		if random {
			if one {
				return p, b.fill(b.fn.fillF, p, uint64(n), nextSeed(), 0, 1)
			}
			return p, b.fill(b.fn.fillF, p, uint64(n), nextSeed(), uni, 0)
		}
		v := make([]float32, 0, n)
		for _, t := range parts {
			if t == nil {
				return 0, errors.New("cuda backend: a tensor of the architecture is missing")
			}
			v = append(v, t.ToF32()...)
		}
		if len(v) != n {
			return 0, fmt.Errorf("cuda backend: vector of %d elements, want %d", len(v), n)
		}
		return p, b.upload(p, v, false)
	}
	lt := func(i int) *model.LayerTensors {
		if random {
			return &model.LayerTensors{}
		}
		return &m.Layers[i]
	}
	var err error
	if w.embed, err = mat(c.Vocab, c.Dim, m.Embed); err != nil {
		return err
	}
	sp := c.Spec
	qd, kvd := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	// The rank's slices of the full tensors (model/shard.go): q, k, v and
	// their biases by heads, o by their columns; gate and up by rows, down
	// by columns.
	sh := &b.sh
	q0, k0 := sh.qlo*c.HeadDim, sh.klo*c.HeadDim
	q1, k1 := q0+qd, k0+kvd
	hlo, hhi := model.Split(sh.full.HiddenDim, sh.tp, sh.rank)
	w.layers = make([]devLayer, c.Layers)
	for i := range w.layers {
		l, h := &w.layers[i], lt(i)
		if l.attnNorm, err = vec(c.Dim, true, h.AttnNorm); err != nil {
			return err
		}
		if l.ffnNorm, err = vec(c.Dim, true, h.MLPNorm); err != nil {
			return err
		}
		if sp.Attention.QKVBias {
			if l.bqkv, err = vec(qd+2*kvd, false, rowsOf(h.QBias, q0, q1), rowsOf(h.KBias, k0, k1), rowsOf(h.VBias, k0, k1)); err != nil {
				return err
			}
		}
		if sp.Attention.QKNorm {
			if l.qNorm, err = vec(c.HeadDim, true, h.QNorm); err != nil {
				return err
			}
			if l.kNorm, err = vec(c.HeadDim, true, h.KNorm); err != nil {
				return err
			}
		}
		if l.wqkv, err = mat(qd+2*kvd, c.Dim, rowsOf(h.Q, q0, q1), rowsOf(h.K, k0, k1), rowsOf(h.V, k0, k1)); err != nil {
			return err
		}
		if l.wo, err = mat(c.Dim, qd, colsOf(h.O, q0, q1)); err != nil {
			return err
		}
		if !c.MoELayer(i) {
			if l.w13, err = mat(2*c.HiddenDim, c.Dim, rowsOf(h.Gate, hlo, hhi), rowsOf(h.Up, hlo, hhi)); err != nil {
				return err
			}
			if l.w2, err = mat(c.Dim, c.HiddenDim, colsOf(h.Down, hlo, hhi)); err != nil {
				return err
			}
			continue
		}
		if l.moe, err = b.uploadMoE(c, h, mat); err != nil {
			return err
		}
	}
	if w.norm, err = vec(c.Dim, true, m.Norm); err != nil {
		return err
	}
	if c.TiedEmbedding {
		w.lmHead = w.embed + cu.DevicePtr(uint64(sh.vlo)*uint64(c.Dim)*eb)
	} else if w.lmHead, err = mat(sh.vrows, c.Dim, rowsOf(m.LMHead, sh.vlo, sh.vlo+sh.vrows)); err != nil {
		return err
	}
	inv := c.InvFreq()
	if b.rope, err = b.alloc(uint64(len(inv)) * 8); err != nil {
		return err
	}
	if err = b.cx.MemcpyHtoD(b.rope, unsafe.Slice((*byte)(unsafe.Pointer(&inv[0])), len(inv)*8)); err != nil {
		return err
	}
	// The f32 cos/sin table of rope_kv, made on the GPU in double precision
	// (the values the kernel used to compute per token).
	b.ropeN = min(c.MaxSeqLen, ropeTabMax)
	pairs := uint64(b.ropeN) * uint64(len(inv))
	if b.ropeTab, err = b.alloc(pairs * 8); err != nil {
		return err
	}
	blocks := uint32(min((pairs+255)/256, 4096))
	// The copies above ran on the legacy stream, which the backend's stream
	// does not wait for; a pageable copy may return before its DMA ends.
	if err = b.cx.Synchronize(); err != nil {
		return err
	}
	return b.stream.Launch(b.fn.ropeTable, cu.D1(blocks), cu.D1(256), 0, b.ropeTab, b.rope, int32(b.ropeN))
}

// uploadMoE uploads one MoE layer's router, experts and shared expert
// through mat; h has no tensors with random weights.
func (b *Backend) uploadMoE(c *model.Config, h *model.LayerTensors,
	mat func(rows, cols int, parts ...*model.Tensor) (cu.DevicePtr, error)) (*devMoE, error) {
	E, I, S := c.Experts, c.ExpertDim, c.SharedExpertDim
	shared := c.Spec.MLP.SharedExpert
	sh := &b.sh
	elo, ehi := model.Split(sh.full.ExpertDim, sh.tp, sh.rank)
	slo, shi := model.Split(sh.full.SharedExpertDim, sh.tp, sh.rank)
	ex := func(i int) model.Expert {
		if i < len(h.Experts) {
			return h.Experts[i]
		}
		return model.Expert{}
	}
	var gu, down []*model.Tensor
	for e := 0; e < E; e++ {
		x := ex(e)
		gu = append(gu, rowsOf(x.Gate, elo, ehi), rowsOf(x.Up, elo, ehi))
		down = append(down, colsOf(x.Down, elo, ehi))
	}
	rows := E
	router := []*model.Tensor{h.Router}
	if shared {
		rows++
		router = append(router, h.SharedGate)
	}
	mw := &devMoE{}
	var err error
	if mw.router, err = mat(rows, c.Dim, router...); err != nil {
		return nil, err
	}
	if mw.w13, err = mat(E*2*I, c.Dim, gu...); err != nil {
		return nil, err
	}
	if mw.w2, err = mat(E*c.Dim, I, down...); err != nil {
		return nil, err
	}
	if shared {
		if mw.sw13, err = mat(2*S, c.Dim, rowsOf(h.Shared.Gate, slo, shi), rowsOf(h.Shared.Up, slo, shi)); err != nil {
			return nil, err
		}
		if mw.sw2, err = mat(c.Dim, S, colsOf(h.Shared.Down, slo, shi)); err != nil {
			return nil, err
		}
	}
	return mw, nil
}

// uploadTensor copies t's elements to p in T: as stored when t is already
// in T, else converted through a bounded host buffer.
func (b *Backend) uploadTensor(p cu.DevicePtr, t *model.Tensor) error {
	if (b.bf16 && t.DType == model.BF16) || (!b.bf16 && t.DType == model.F32) {
		if len(t.Data) != t.Numel()*t.DType.Size() {
			return fmt.Errorf("%d bytes for %d elements of %v", len(t.Data), t.Numel(), t.DType)
		}
		return b.cx.MemcpyHtoD(p, t.Data)
	}
	const chunk = 1 << 22
	n := t.Numel()
	f := make([]float32, min(n, chunk))
	var h []uint16
	if b.bf16 {
		h = make([]uint16, len(f))
	}
	for off := 0; off < n; off += chunk {
		part := f[:min(chunk, n-off)]
		t.ReadF32(part, off)
		var err error
		if b.bf16 {
			toBF16(h[:len(part)], part)
			err = b.cx.MemcpyHtoD(p+cu.DevicePtr(off*2), unsafe.Slice((*byte)(unsafe.Pointer(&h[0])), len(part)*2))
		} else {
			err = b.cx.MemcpyHtoD(p+cu.DevicePtr(off*4), unsafe.Slice((*byte)(unsafe.Pointer(&part[0])), len(part)*4))
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// fill runs a fill_random kernel over n elements at p.
func (b *Backend) fill(f *cu.Function, p cu.DevicePtr, n, seed uint64, scale, offset float32) error {
	return b.stream.Launch(f, cu.D1(4096), cu.D1(256), 0, p, int64(n), seed, scale, offset)
}

// upload copies v to the GPU at p as bf16 (rounded to nearest even) or f32.
func (b *Backend) upload(p cu.DevicePtr, v []float32, bf16 bool) error {
	if len(v) == 0 {
		return nil
	}
	if !bf16 {
		return b.cx.MemcpyHtoD(p, unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), len(v)*4))
	}
	const chunk = 1 << 24
	buf := make([]uint16, min(len(v), chunk))
	for off := 0; off < len(v); off += chunk {
		part := v[off:min(off+chunk, len(v))]
		toBF16(buf[:len(part)], part)
		if err := b.cx.MemcpyHtoD(p+cu.DevicePtr(off*2), unsafe.Slice((*byte)(unsafe.Pointer(&buf[0])), len(part)*2)); err != nil {
			return err
		}
	}
	return nil
}

// toBF16 rounds f32 to bf16 (nearest even), in parallel for large inputs.
func toBF16(dst []uint16, src []float32) {
	parts := max(1, min(runtime.GOMAXPROCS(0), len(src)>>16))
	var wg sync.WaitGroup
	for k := 0; k < parts; k++ {
		lo, hi := len(src)*k/parts, len(src)*(k+1)/parts
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := lo; i < hi; i++ {
				dst[i] = BF16(src[i])
			}
		}()
	}
	wg.Wait()
}

// BF16 rounds f to bfloat16 bits (nearest even; NaN stays NaN).
func BF16(f float32) uint16 {
	u := math.Float32bits(f)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}
