package cuda

import (
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
	wqkv, wo, w13, w2 cu.DevicePtr
}

func (b *Backend) uploadWeights(m *model.Model) error {
	c := &b.cfg
	qd, kvd := c.Heads*c.HeadDim, c.KVHeads*c.HeadDim
	eb := uint64(b.eb)
	w := &b.w
	var seed uint64 = uint64(b.opts.Seed)*0x9E3779B97F4A7C15 + 1
	nextSeed := func() uint64 { seed += 0xBF58476D1CE4E5B9; return seed }
	const std = 0.02
	uni := float32(std * math.Sqrt(3))

	// mat uploads (or fills) one T matrix made of the given host parts.
	mat := func(rows, cols int, parts ...[]float32) (cu.DevicePtr, error) {
		n := uint64(rows) * uint64(cols)
		p, err := b.alloc(n * eb)
		if err != nil {
			return 0, err
		}
		w.bytes += int64(n * eb)
		if b.opts.RandomWeights {
			return p, b.fill(b.fn.fillT, p, n, nextSeed(), uni, 0)
		}
		off := uint64(0)
		for _, part := range parts {
			if err := b.upload(p+cu.DevicePtr(off*eb), part, b.bf16); err != nil {
				return 0, err
			}
			off += uint64(len(part))
		}
		if off != n {
			return 0, fmt.Errorf("cuda backend: tensor of %d elements, want %dx%d", off, rows, cols)
		}
		return p, nil
	}
	// vec uploads one f32 vector; random weights: norms 1, biases small.
	vec := func(n int, v []float32, one bool) (cu.DevicePtr, error) {
		p, err := b.alloc(uint64(n) * 4)
		if err != nil {
			return 0, err
		}
		w.bytes += int64(n) * 4
		if b.opts.RandomWeights {
			if one {
				return p, b.fill(b.fn.fillF, p, uint64(n), nextSeed(), 0, 1)
			}
			return p, b.fill(b.fn.fillF, p, uint64(n), nextSeed(), uni, 0)
		}
		if len(v) != n {
			return 0, fmt.Errorf("cuda backend: vector of %d elements, want %d", len(v), n)
		}
		return p, b.upload(p, v, false)
	}
	var hw *model.Weights
	if !b.opts.RandomWeights {
		var err error
		if hw, err = m.Float32Weights(); err != nil {
			return fmt.Errorf("cuda backend: %w", err)
		}
		if len(hw.Layers) != c.Layers {
			return fmt.Errorf("cuda backend: %d layers of weights, config says %d", len(hw.Layers), c.Layers)
		}
	}
	hl := func(i int) *model.Layer {
		if hw == nil {
			return &model.Layer{}
		}
		return &hw.Layers[i]
	}
	var err error
	embed := func() []float32 {
		if hw == nil {
			return nil
		}
		return hw.Embed
	}
	if w.embed, err = mat(c.Vocab, c.Dim, embed()); err != nil {
		return err
	}
	w.layers = make([]devLayer, c.Layers)
	for i := range w.layers {
		l, h := &w.layers[i], hl(i)
		if l.attnNorm, err = vec(c.Dim, h.AttnNorm, true); err != nil {
			return err
		}
		if l.ffnNorm, err = vec(c.Dim, h.FFNNorm, true); err != nil {
			return err
		}
		if c.Spec.Attention.QKVBias {
			var bias []float32
			if hw != nil {
				bias = append(append(append(make([]float32, 0, qd+2*kvd), h.BQ...), h.BK...), h.BV...)
			}
			if l.bqkv, err = vec(qd+2*kvd, bias, false); err != nil {
				return err
			}
		}
		if l.wqkv, err = mat(qd+2*kvd, c.Dim, h.WQ, h.WK, h.WV); err != nil {
			return err
		}
		if l.wo, err = mat(c.Dim, qd, h.WO); err != nil {
			return err
		}
		if l.w13, err = mat(2*c.HiddenDim, c.Dim, h.W1, h.W3); err != nil {
			return err
		}
		if l.w2, err = mat(c.Dim, c.HiddenDim, h.W2); err != nil {
			return err
		}
	}
	var norm []float32
	if hw != nil {
		norm = hw.Norm
	}
	if w.norm, err = vec(c.Dim, norm, true); err != nil {
		return err
	}
	if c.TiedEmbedding {
		w.lmHead = w.embed
	} else {
		var lm []float32
		if hw != nil {
			lm = hw.LMHead
		}
		if w.lmHead, err = mat(c.Vocab, c.Dim, lm); err != nil {
			return err
		}
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
