package model

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
)

// hfConfig is the part of an HF config.json we read.
type hfConfig struct {
	Architectures  []string        `json:"architectures"`
	ModelType      string          `json:"model_type"`
	HiddenSize     int             `json:"hidden_size"`
	Intermediate   int             `json:"intermediate_size"`
	Layers         int             `json:"num_hidden_layers"`
	Heads          int             `json:"num_attention_heads"`
	KVHeads        *int            `json:"num_key_value_heads"`
	HeadDim        *int            `json:"head_dim"`
	Vocab          int             `json:"vocab_size"`
	MaxPos         int             `json:"max_position_embeddings"`
	RopeTheta      *float64        `json:"rope_theta"`
	RopeScaling    json.RawMessage `json:"rope_scaling"`
	RopeParameters json.RawMessage `json:"rope_parameters"`
	RMSNormEps     *float64        `json:"rms_norm_eps"`
	Tie            *bool           `json:"tie_word_embeddings"`
	AttentionBias  bool            `json:"attention_bias"`
	MLPBias        bool            `json:"mlp_bias"`
	BOS            json.RawMessage `json:"bos_token_id"`
	EOS            json.RawMessage `json:"eos_token_id"`
	TorchDType     string          `json:"torch_dtype"`
	DType          string          `json:"dtype"`
	HiddenAct      string          `json:"hidden_act"`

	SlidingWindow    *int  `json:"sliding_window"`
	UseSlidingWindow *bool `json:"use_sliding_window"`
	MaxWindowLayers  *int  `json:"max_window_layers"`

	NumExperts      int   `json:"num_experts"`
	NumLocalExperts int   `json:"num_local_experts"`
	ExpertsPerTok   int   `json:"num_experts_per_tok"`
	MoEIntermediate int   `json:"moe_intermediate_size"`
	NormTopKProb    *bool `json:"norm_topk_prob"`
	SharedExpertDim int   `json:"shared_expert_intermediate_size"`
	SparseStep      int   `json:"decoder_sparse_step"`
	MLPOnlyLayers   []int `json:"mlp_only_layers"`
}

// ropeParams covers rope_scaling and transformers 5's rope_parameters.
type ropeParams struct {
	RopeTheta *float64 `json:"rope_theta"`
	RopeType  string   `json:"rope_type"`
	Type      string   `json:"type"`
	RopeScaling
}

// ParseHFConfig converts an HF config.json into a Config, selecting the
// architecture from the built-in registry.
func ParseHFConfig(b []byte) (Config, error) { return Architectures().ParseHFConfig(b) }

// ParseHFConfig converts an HF config.json into a Config of one of r's
// architectures.
func (r *Registry) ParseHFConfig(b []byte) (Config, error) {
	var h hfConfig
	if err := json.Unmarshal(b, &h); err != nil {
		return Config{}, fmt.Errorf("model: config.json: %w", err)
	}
	spec, err := r.Select(h.Architectures, h.ModelType)
	if err != nil {
		return Config{}, err
	}
	if h.HiddenAct != "" && h.HiddenAct != "silu" {
		return Config{}, fmt.Errorf("model: hidden_act %q not supported", h.HiddenAct)
	}
	c := Config{
		Spec: spec, Dim: h.HiddenSize, HiddenDim: h.Intermediate, Layers: h.Layers, Heads: h.Heads,
		KVHeads: h.Heads, Vocab: h.Vocab, MaxSeqLen: h.MaxPos, RopeTheta: 10000, NormEps: 1e-6,
		BOS: -1, DType: h.TorchDType,
	}
	if h.DType != "" {
		c.DType = h.DType
	}
	if h.KVHeads != nil {
		c.KVHeads = *h.KVHeads
	}
	if h.HeadDim != nil && *h.HeadDim > 0 {
		c.HeadDim = *h.HeadDim
	} else if c.Heads > 0 {
		c.HeadDim = c.Dim / c.Heads
	}
	if h.RMSNormEps != nil {
		c.NormEps = float32(*h.RMSNormEps)
	}
	if h.Tie != nil {
		c.TiedEmbedding = *h.Tie
	}
	if h.MLPBias {
		return Config{}, fmt.Errorf("model: mlp_bias not supported for %s", spec.Name)
	}
	if h.AttentionBias && !spec.Attention.QKVBias {
		return Config{}, fmt.Errorf("model: attention_bias (with an o_proj bias) not supported for %s", spec.Name)
	}
	if spec.Attention.SlidingWindow && h.SlidingWindow != nil && *h.SlidingWindow > 0 {
		// Mistral and Mixtral apply sliding_window when set; the Qwens only
		// with use_sliding_window, from layer max_window_layers on.
		switch {
		case h.UseSlidingWindow == nil:
			c.SlidingWindow = *h.SlidingWindow
		case *h.UseSlidingWindow:
			c.SlidingWindow = *h.SlidingWindow
			if h.MaxWindowLayers != nil {
				c.WindowFrom = *h.MaxWindowLayers
			}
		}
	}
	if spec.MLP.MoE {
		c.Experts = max(h.NumExperts, h.NumLocalExperts)
		c.TopK = h.ExpertsPerTok
		c.ExpertDim = h.MoEIntermediate
		if c.ExpertDim == 0 {
			c.ExpertDim = h.Intermediate // Mixtral's experts are intermediate_size wide
		}
		c.NormTopKProb = spec.MLP.NormTopK == NormTopKAlways || (h.NormTopKProb != nil && *h.NormTopKProb)
		c.SharedExpertDim = h.SharedExpertDim
		c.DenseLayers = h.MLPOnlyLayers
		c.SparseStep = h.SparseStep
	}
	if h.RopeTheta != nil {
		c.RopeTheta = *h.RopeTheta
	}
	for _, raw := range []json.RawMessage{h.RopeParameters, h.RopeScaling} {
		if len(raw) == 0 || string(raw) == "null" {
			continue
		}
		var rp ropeParams
		if err := json.Unmarshal(raw, &rp); err != nil {
			return Config{}, fmt.Errorf("model: rope_scaling: %w", err)
		}
		if rp.RopeTheta != nil {
			c.RopeTheta = *rp.RopeTheta
		}
		t := rp.RopeType
		if t == "" {
			t = rp.Type
		}
		switch t {
		case "", "default":
		case "llama3", "linear":
			s := rp.RopeScaling
			s.Type = t
			c.RopeScaling = &s
		default:
			return Config{}, fmt.Errorf("model: rope_scaling type %q not supported", t)
		}
	}
	var bos int
	if len(h.BOS) > 0 && string(h.BOS) != "null" && json.Unmarshal(h.BOS, &bos) == nil {
		c.BOS = bos
	}
	var eos int
	var eosList []int
	if len(h.EOS) > 0 && string(h.EOS) != "null" {
		if json.Unmarshal(h.EOS, &eos) == nil {
			c.EOS = []int{eos}
		} else if json.Unmarshal(h.EOS, &eosList) == nil {
			c.EOS = eosList
		}
	}
	if c.MaxSeqLen <= 0 {
		c.MaxSeqLen = 2048
	}
	if err := c.Validate(); err != nil {
		return Config{}, err
	}
	return c, nil
}

// LoadHF reads an HF model directory (config.json and model.safetensors, or
// the shards model.safetensors.index.json lists) with the built-in
// architectures.
func LoadHF(dir string) (*Model, error) { return Architectures().LoadHF(dir) }

// LoadHF reads an HF model directory. The safetensors files are
// memory-mapped and every tensor is a view of its file in the stored dtype
// (F32, F16 or BF16): nothing is converted or copied. The mapping is read
// ahead in parallel, so the model is resident when LoadHF returns. Close
// unmaps it.
func (r *Registry) LoadHF(dir string) (*Model, error) {
	b, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	c, err := r.ParseHFConfig(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	files, err := safetensorsFiles(dir)
	if err != nil {
		return nil, err
	}
	m := &Model{Path: dir}
	loaded := false
	defer func() {
		if !loaded {
			m.Close()
		}
	}()
	where := map[string]*stFile{}
	for _, p := range files {
		f, err := mapSafetensors(p)
		if err != nil {
			return nil, err
		}
		m.maps = append(m.maps, f.data)
		for name := range f.tensors {
			where[name] = f
		}
	}
	if _, has := where["lm_head.weight"]; !has && !c.TiedEmbedding {
		c.TiedEmbedding = true // no classifier stored: it is the embedding
	}
	m.Config = c
	m.Layers = make([]LayerTensors, c.Layers)
	dt, _ := ParseDType(c.DType)
	if dt == 0 {
		dt = F32
	}
	specs := c.Spec.Tensors(&c, dt)
	for i := range specs {
		s := &specs[i]
		f, found := where[s.Name]
		if !found {
			return nil, fmt.Errorf("model: %s: tensor %s missing", dir, s.Name)
		}
		t := f.tensors[s.Name]
		if !slices.Equal(t.Shape, s.Shape) {
			return nil, fmt.Errorf("model: %s: tensor %s has shape %v, want %v", dir, s.Name, t.Shape, s.Shape)
		}
		d, err := ParseDType(t.DType)
		if err != nil {
			return nil, fmt.Errorf("model: %s: tensor %s: %w", dir, s.Name, err)
		}
		data := f.data[t.Begin:t.End]
		if !littleEndian {
			data = swapped(data, d.Size())
		}
		*m.slot(s) = &Tensor{Name: s.Name, DType: d, Shape: s.Shape, Data: data}
	}
	if c.TiedEmbedding {
		m.LMHead = m.Embed
	}
	prefault(m.maps, "loading "+filepath.Base(dir))
	loaded = true
	return m, nil
}

// safetensorsFiles lists the weight files of an HF directory.
func safetensorsFiles(dir string) ([]string, error) {
	if b, err := os.ReadFile(filepath.Join(dir, "model.safetensors.index.json")); err == nil {
		var idx struct {
			WeightMap map[string]string `json:"weight_map"`
		}
		if err := json.Unmarshal(b, &idx); err != nil {
			return nil, fmt.Errorf("model: %s: index: %w", dir, err)
		}
		seen := map[string]bool{}
		var out []string
		for _, f := range idx.WeightMap {
			if filepath.Base(f) != f {
				return nil, fmt.Errorf("model: %s: index names a file outside the directory: %q", dir, f)
			}
			if !seen[f] {
				seen[f] = true
				out = append(out, filepath.Join(dir, f))
			}
		}
		sort.Strings(out)
		if len(out) == 0 {
			return nil, fmt.Errorf("model: %s: empty safetensors index", dir)
		}
		return out, nil
	}
	if _, err := os.Stat(filepath.Join(dir, "model.safetensors")); err == nil {
		return []string{filepath.Join(dir, "model.safetensors")}, nil
	}
	out, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
	if len(out) == 0 {
		return nil, fmt.Errorf("model: %s: no config.json with *.safetensors weights", dir)
	}
	return out, nil
}
