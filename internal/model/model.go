package model

import (
	"errors"
	"fmt"
	"os"
	"unsafe"
)

// Model is a model: its configuration and its weights as named tensors in
// their stored dtype, by role (Config.Spec.Tensors lists them).
type Model struct {
	Config Config
	Embed  *Tensor // [Vocab][Dim]
	Layers []LayerTensors
	Norm   *Tensor // final RMSNorm [Dim]
	LMHead *Tensor // [Vocab][Dim]; Embed itself when tied
	Path   string  // where it was loaded from ("" for built-in or in-memory models)
	Random bool    // weights are seeded random, not trained
	maps   [][]byte
}

// Load reads a model from a llama2.c checkpoint file or an HF directory.
func Load(path string) (*Model, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	if st.IsDir() {
		return LoadHF(path)
	}
	return LoadLlama2C(path)
}

// HasWeights says whether m holds its weights (a model made for a backend
// that makes random weights itself has none).
func (m *Model) HasWeights() bool { return m.Embed != nil }

// Close releases the memory mappings of a loaded model. The tensors are
// unusable afterwards: close the backends that use them first.
func (m *Model) Close() error {
	var errs []error
	for _, b := range m.maps {
		errs = append(errs, unmap(b))
	}
	m.maps = nil
	return errors.Join(errs...)
}

// Tensors lists m's tensors in the Spec's order (the tied classifier once).
func (m *Model) Tensors() []*Tensor {
	c := m.Config
	if c.Spec == nil || len(m.Layers) != c.Layers {
		return nil
	}
	var out []*Tensor
	for _, ts := range c.Spec.Tensors(&c, F32) {
		out = append(out, *m.slot(&ts))
	}
	return out
}

// check verifies that m has every tensor of its Spec with the Spec's shape.
func (m *Model) check() error {
	c := &m.Config
	if c.Spec == nil {
		return fmt.Errorf("model: no architecture")
	}
	if err := c.Validate(); err != nil {
		return err
	}
	if len(m.Layers) != c.Layers {
		return fmt.Errorf("model: %d layers of weights, config says %d", len(m.Layers), c.Layers)
	}
	for _, ts := range c.Spec.Tensors(c, F32) {
		t := *m.slot(&ts)
		if t == nil {
			return fmt.Errorf("model: tensor %s missing", ts.Name)
		}
		if t.DType.Size() == 0 || len(t.Data) != numel(ts.Shape)*t.DType.Size() {
			return fmt.Errorf("model: tensor %s: %d bytes of %v, want shape %v", ts.Name, len(t.Data), t.DType, ts.Shape)
		}
	}
	if c.TiedEmbedding {
		m.LMHead = m.Embed
	}
	return nil
}

// AsFloat32 returns a model with m's configuration and weights as F32
// tensors: views of m's F32 tensors, widened copies of the others (exact).
// It shares m's mappings: close m, not the copy.
func (m *Model) AsFloat32() (*Model, error) {
	c := m.Config
	if c.Spec == nil || len(m.Layers) != c.Layers {
		return nil, fmt.Errorf("model: no architecture or layers")
	}
	out := &Model{Config: c, Layers: make([]LayerTensors, c.Layers), Path: m.Path, Random: m.Random}
	out.Config.DType = "float32"
	for _, ts := range c.Spec.Tensors(&c, F32) {
		t := *m.slot(&ts)
		if t == nil {
			return nil, fmt.Errorf("model: tensor %s missing", ts.Name)
		}
		*out.slot(&ts) = f32Tensor(t.Name, t.Shape, t.ToF32())
	}
	if err := out.check(); err != nil {
		return nil, err
	}
	return out, nil
}

// Weights are a dense model's tensors as float32 host slices, row-major
// [out][in] as HF stores them (FromWeights makes a model of them).
// Projections map Dim to Heads*HeadDim (q), KVHeads*HeadDim (k, v) and back
// (o); the feed-forward maps Dim to HiddenDim (W1 gate, W3 up) and back (W2
// down).
type Weights struct {
	Embed  []float32 // [Vocab][Dim]
	Layers []Layer
	Norm   []float32 // final RMSNorm [Dim]
	LMHead []float32 // [Vocab][Dim]; the same slice as Embed when tied
}

// Layer holds one dense transformer block's float32 weights.
type Layer struct {
	AttnNorm   []float32 // [Dim]
	WQ         []float32 // [Heads*HeadDim][Dim]
	WK, WV     []float32 // [KVHeads*HeadDim][Dim]
	WO         []float32 // [Dim][Heads*HeadDim]
	BQ, BK, BV []float32 // biases (Qwen2); nil when absent
	FFNNorm    []float32 // [Dim]
	W1, W3     []float32 // gate, up: [HiddenDim][Dim]
	W2         []float32 // down: [Dim][HiddenDim]
}

// FromWeights makes a model of c (a Llama-block architecture) from float32
// weights, sharing their memory.
func FromWeights(c Config, w *Weights) (*Model, error) {
	if c.Spec == nil {
		return nil, fmt.Errorf("model: no architecture")
	}
	if w == nil || len(w.Layers) != c.Layers {
		return nil, fmt.Errorf("model: weights for %d layers, config says %d", lenLayers(w), c.Layers)
	}
	m := &Model{Config: c, Layers: make([]LayerTensors, c.Layers)}
	for _, ts := range c.Spec.Tensors(&c, F32) {
		var v []float32
		if ts.Layer < 0 {
			v = map[Role][]float32{RoleEmbed: w.Embed, RoleNorm: w.Norm, RoleLMHead: w.LMHead}[ts.Role]
		} else {
			l := &w.Layers[ts.Layer]
			v = map[Role][]float32{RoleAttnNorm: l.AttnNorm, RoleQ: l.WQ, RoleK: l.WK, RoleV: l.WV, RoleO: l.WO,
				RoleQBias: l.BQ, RoleKBias: l.BK, RoleVBias: l.BV, RoleMLPNorm: l.FFNNorm,
				RoleGate: l.W1, RoleUp: l.W3, RoleDown: l.W2}[ts.Role]
		}
		if ts.Expert >= 0 || v == nil {
			return nil, fmt.Errorf("model: tensor %s missing from the float32 weights", ts.Name)
		}
		if len(v) != numel(ts.Shape) {
			return nil, fmt.Errorf("model: tensor %s has %d elements, want %v", ts.Name, len(v), ts.Shape)
		}
		*m.slot(&ts) = f32Tensor(ts.Name, ts.Shape, v)
	}
	if err := m.check(); err != nil {
		return nil, err
	}
	return m, nil
}

func lenLayers(w *Weights) int {
	if w == nil {
		return 0
	}
	return len(w.Layers)
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}

// f32Bytes views v's memory as bytes.
func f32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), len(v)*4)
}
