// Package model defines decoder-only transformer models as data: an
// architecture registry of Specs (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen2-MoE,
// Qwen3-MoE, Mixtral), their configurations, and their weights as named
// tensors in the stored dtype, loaded from llama2.c checkpoints and HF
// directories (safetensors, memory-mapped).
package model

import (
	"fmt"
	"math"
	"slices"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

// Config is the shape and hyperparameters of a model; Spec is its
// architecture. Field names follow HF config.json where one exists.
type Config struct {
	Spec          *Spec   // the architecture; nil only for configs that never run a model
	Dim           int     // hidden_size
	HiddenDim     int     // intermediate_size (dense MLP layers)
	Layers        int     // num_hidden_layers
	Heads         int     // num_attention_heads
	KVHeads       int     // num_key_value_heads
	HeadDim       int     // head_dim (Dim/Heads unless given)
	Vocab         int     // vocab_size
	MaxSeqLen     int     // max_position_embeddings
	RopeTheta     float64 // rope_theta
	RopeScaling   *RopeScaling
	NormEps       float32 // rms_norm_eps
	TiedEmbedding bool    // tie_word_embeddings

	// Sliding-window attention: a position attends to the last
	// SlidingWindow positions (itself included) in layers from
	// WindowFrom on (Qwen's max_window_layers); 0: every position.
	SlidingWindow int
	WindowFrom    int

	// Mixture of experts (Spec.MLP.MoE).
	Experts         int   // num_experts, num_local_experts
	TopK            int   // num_experts_per_tok
	ExpertDim       int   // moe_intermediate_size (Mixtral: intermediate_size)
	NormTopKProb    bool  // renormalise the TopK routing weights (norm_topk_prob; always for Mixtral)
	SharedExpertDim int   // shared_expert_intermediate_size
	DenseLayers     []int // mlp_only_layers: layers with a dense MLP
	SparseStep      int   // decoder_sparse_step: layer i is MoE when (i+1)%SparseStep == 0 (0 or 1: every layer)

	BOS   int    // -1 if none
	EOS   []int  // stop ids from the model config
	DType string // dtype of the stored weights: "float32", "float16", "bfloat16"
}

// RopeScaling is HF's rope_scaling: "llama3" or "linear".
type RopeScaling struct {
	Type                          string  `json:"rope_type"`
	Factor                        float64 `json:"factor"`
	LowFreqFactor                 float64 `json:"low_freq_factor,omitempty"`
	HighFreqFactor                float64 `json:"high_freq_factor,omitempty"`
	OriginalMaxPositionEmbeddings int     `json:"original_max_position_embeddings,omitempty"`
}

// ArchName is the architecture's name ("" without a Spec).
func (c *Config) ArchName() string {
	if c.Spec == nil {
		return ""
	}
	return c.Spec.Name
}

// MoELayer says whether layer i has a mixture-of-experts MLP.
func (c *Config) MoELayer(i int) bool {
	if c.Spec == nil || !c.Spec.MLP.MoE || c.Experts == 0 || slices.Contains(c.DenseLayers, i) {
		return false
	}
	return c.SparseStep <= 1 || (i+1)%c.SparseStep == 0
}

// Window is layer i's attention window in positions (0: unbounded).
func (c *Config) Window(i int) int {
	if i < c.WindowFrom {
		return 0
	}
	return c.SlidingWindow
}

// KVLayout is the paged KV pool of a model of c: per layer K and V of
// KVHeads x HeadDim elements of elemBytes per token.
func (c *Config) KVLayout(pageSize, pages, elemBytes int) kvcache.Layout {
	return kvcache.Layout{Layers: c.Layers, PageSize: pageSize, KVHeads: c.KVHeads, HeadDim: c.HeadDim,
		ElemBytes: elemBytes, Pages: pages}
}

// InvFreq is RoPE's inverse frequency of each of the HeadDim/2 pairs, with
// the configured scaling applied: the one definition every backend uses.
func (c *Config) InvFreq() []float64 {
	half := c.HeadDim / 2
	f := make([]float64, half)
	for i := range f {
		f[i] = 1 / math.Pow(c.RopeTheta, float64(2*i)/float64(c.HeadDim))
	}
	s := c.RopeScaling
	switch {
	case s == nil:
	case s.Type == "linear":
		for i := range f {
			f[i] /= s.Factor
		}
	case s.Type == "llama3":
		lowWavelen := float64(s.OriginalMaxPositionEmbeddings) / s.LowFreqFactor
		highWavelen := float64(s.OriginalMaxPositionEmbeddings) / s.HighFreqFactor
		for i, x := range f {
			wavelen := 2 * math.Pi / x
			switch {
			case wavelen < highWavelen:
			case wavelen > lowWavelen:
				f[i] = x / s.Factor
			default:
				smooth := (float64(s.OriginalMaxPositionEmbeddings)/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
				f[i] = (1-smooth)*x/s.Factor + smooth*x
			}
		}
	}
	return f
}

// Validate checks that the configuration is usable.
func (c *Config) Validate() error {
	switch {
	case c.Dim <= 0, c.HiddenDim < 0, c.Layers <= 0, c.Heads <= 0, c.KVHeads <= 0, c.HeadDim <= 0, c.Vocab <= 0:
		return fmt.Errorf("model: bad shape: dim %d hidden %d layers %d heads %d kv heads %d head dim %d vocab %d",
			c.Dim, c.HiddenDim, c.Layers, c.Heads, c.KVHeads, c.HeadDim, c.Vocab)
	case c.Heads%c.KVHeads != 0:
		return fmt.Errorf("model: %d heads not a multiple of %d kv heads", c.Heads, c.KVHeads)
	case c.HeadDim%2 != 0:
		return fmt.Errorf("model: odd head dim %d", c.HeadDim)
	case c.Layers > 1<<12, c.Dim > 1<<17, c.HiddenDim > 1<<19, c.Vocab > 1<<22, c.Heads > 1<<10, c.HeadDim > 1<<12,
		c.Experts > 1<<12, c.ExpertDim > 1<<19, c.SharedExpertDim > 1<<19:
		return fmt.Errorf("model: implausible shape %+v", *c)
	case c.SlidingWindow < 0, c.WindowFrom < 0:
		return fmt.Errorf("model: sliding window %d from layer %d", c.SlidingWindow, c.WindowFrom)
	case c.SlidingWindow > 0 && (c.Spec == nil || !c.Spec.Attention.SlidingWindow):
		return fmt.Errorf("model: %s has no sliding-window attention", c.ArchName())
	}
	moe := false
	for i := 0; i < c.Layers; i++ {
		if c.MoELayer(i) {
			moe = true
		} else if c.HiddenDim == 0 {
			return fmt.Errorf("model: layer %d has a dense MLP of intermediate_size 0", i)
		}
	}
	if moe {
		switch {
		case c.TopK <= 0 || c.TopK > c.Experts:
			return fmt.Errorf("model: %d experts per token of %d", c.TopK, c.Experts)
		case c.ExpertDim <= 0:
			return fmt.Errorf("model: expert intermediate size %d", c.ExpertDim)
		case c.Spec.MLP.SharedExpert && c.SharedExpertDim <= 0:
			return fmt.Errorf("model: shared expert intermediate size %d", c.SharedExpertDim)
		}
	}
	if s := c.RopeScaling; s != nil {
		switch {
		case s.Type == "linear" && s.Factor > 0:
		case s.Type == "llama3" && s.Factor > 0 && s.OriginalMaxPositionEmbeddings > 0 && s.HighFreqFactor > s.LowFreqFactor:
		default:
			return fmt.Errorf("model: bad rope_scaling %+v", *s)
		}
	}
	return nil
}

func (c *Config) qDim() int  { return c.Heads * c.HeadDim }
func (c *Config) kvDim() int { return c.KVHeads * c.HeadDim }

// clone returns c with its slices and pointers copied (the Spec is shared).
func (c Config) clone() Config {
	c.EOS = slices.Clone(c.EOS)
	c.DenseLayers = slices.Clone(c.DenseLayers)
	if c.RopeScaling != nil {
		r := *c.RopeScaling
		c.RopeScaling = &r
	}
	return c
}
