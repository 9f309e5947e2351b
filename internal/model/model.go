package model

import (
	"fmt"
	"os"
)

// Model is a loaded model: its configuration and float32 host weights.
type Model struct {
	Config Config
	W      *Weights
	Path   string // where it was loaded from ("" for built-in or in-memory models)
	Random bool   // weights are seeded random, not trained
}

// Weights are a model's tensors in float32, row-major [out][in] as HF stores
// them. Projections map Dim to Heads*HeadDim (q), KVHeads*HeadDim (k, v) and
// back (o); the feed-forward maps Dim to HiddenDim (W1 gate, W3 up) and back
// (W2 down).
type Weights struct {
	Embed  []float32 // [Vocab][Dim]
	Layers []Layer
	Norm   []float32 // final RMSNorm [Dim]
	LMHead []float32 // [Vocab][Dim]; the same slice as Embed when tied
}

// Layer holds one transformer block's weights.
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

// Validate checks that the configuration is usable.
func (c *Config) Validate() error {
	switch {
	case c.Dim <= 0, c.HiddenDim <= 0, c.Layers <= 0, c.Heads <= 0, c.KVHeads <= 0, c.HeadDim <= 0, c.Vocab <= 0:
		return fmt.Errorf("model: bad shape: dim %d hidden %d layers %d heads %d kv heads %d head dim %d vocab %d",
			c.Dim, c.HiddenDim, c.Layers, c.Heads, c.KVHeads, c.HeadDim, c.Vocab)
	case c.Heads%c.KVHeads != 0:
		return fmt.Errorf("model: %d heads not a multiple of %d kv heads", c.Heads, c.KVHeads)
	case c.HeadDim%2 != 0:
		return fmt.Errorf("model: odd head dim %d", c.HeadDim)
	case c.Layers > 1<<12, c.Dim > 1<<17, c.HiddenDim > 1<<19, c.Vocab > 1<<22, c.Heads > 1<<10, c.HeadDim > 1<<12:
		return fmt.Errorf("model: implausible shape %+v", *c)
	}
	return nil
}

// tensorShapes lists every weight of cfg with its HF name and shape, in the
// order HF checkpoints usually hold them.
type tensorShape struct {
	name  string
	shape []int
	dst   *[]float32
}

func (c *Config) qDim() int  { return c.Heads * c.HeadDim }
func (c *Config) kvDim() int { return c.KVHeads * c.HeadDim }

// shapes returns the tensors of w (allocating nothing) named as in HF.
func (w *Weights) shapes(c *Config) []tensorShape {
	if len(w.Layers) != c.Layers {
		w.Layers = make([]Layer, c.Layers)
	}
	out := []tensorShape{{"model.embed_tokens.weight", []int{c.Vocab, c.Dim}, &w.Embed}}
	for i := range w.Layers {
		l := &w.Layers[i]
		p := fmt.Sprintf("model.layers.%d.", i)
		out = append(out,
			tensorShape{p + "input_layernorm.weight", []int{c.Dim}, &l.AttnNorm},
			tensorShape{p + "self_attn.q_proj.weight", []int{c.qDim(), c.Dim}, &l.WQ},
			tensorShape{p + "self_attn.k_proj.weight", []int{c.kvDim(), c.Dim}, &l.WK},
			tensorShape{p + "self_attn.v_proj.weight", []int{c.kvDim(), c.Dim}, &l.WV},
			tensorShape{p + "self_attn.o_proj.weight", []int{c.Dim, c.qDim()}, &l.WO},
		)
		if c.QKVBias {
			out = append(out,
				tensorShape{p + "self_attn.q_proj.bias", []int{c.qDim()}, &l.BQ},
				tensorShape{p + "self_attn.k_proj.bias", []int{c.kvDim()}, &l.BK},
				tensorShape{p + "self_attn.v_proj.bias", []int{c.kvDim()}, &l.BV},
			)
		}
		out = append(out,
			tensorShape{p + "post_attention_layernorm.weight", []int{c.Dim}, &l.FFNNorm},
			tensorShape{p + "mlp.gate_proj.weight", []int{c.HiddenDim, c.Dim}, &l.W1},
			tensorShape{p + "mlp.up_proj.weight", []int{c.HiddenDim, c.Dim}, &l.W3},
			tensorShape{p + "mlp.down_proj.weight", []int{c.Dim, c.HiddenDim}, &l.W2},
		)
	}
	out = append(out, tensorShape{"model.norm.weight", []int{c.Dim}, &w.Norm})
	if !c.TiedEmbedding {
		out = append(out, tensorShape{"lm_head.weight", []int{c.Vocab, c.Dim}, &w.LMHead})
	}
	return out
}

// check verifies that every tensor of w has the size cfg implies.
func (w *Weights) check(c *Config) error {
	if w == nil {
		return fmt.Errorf("model: no weights")
	}
	for _, t := range w.shapes(c) {
		if len(*t.dst) != numel(t.shape) {
			return fmt.Errorf("model: tensor %s has %d elements, want %v", t.name, len(*t.dst), t.shape)
		}
	}
	if c.TiedEmbedding {
		w.LMHead = w.Embed
	}
	return nil
}

func numel(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
