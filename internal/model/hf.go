package model

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"sync"
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
	BOS            json.RawMessage `json:"bos_token_id"`
	EOS            json.RawMessage `json:"eos_token_id"`
	TorchDType     string          `json:"torch_dtype"`
	DType          string          `json:"dtype"`
	HiddenAct      string          `json:"hidden_act"`
}

// ropeParams covers rope_scaling and transformers 5's rope_parameters.
type ropeParams struct {
	RopeTheta *float64 `json:"rope_theta"`
	RopeType  string   `json:"rope_type"`
	Type      string   `json:"type"`
	RopeScaling
}

// ParseHFConfig converts an HF config.json into a Config.
func ParseHFConfig(b []byte) (Config, error) {
	var h hfConfig
	if err := json.Unmarshal(b, &h); err != nil {
		return Config{}, fmt.Errorf("model: config.json: %w", err)
	}
	arch := ""
	if len(h.Architectures) > 0 {
		arch = h.Architectures[0]
	} else {
		arch = map[string]string{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[h.ModelType]
	}
	switch arch {
	case "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM":
	default:
		return Config{}, fmt.Errorf("model: architecture %q (model_type %q) not supported; want LlamaForCausalLM, MistralForCausalLM or Qwen2ForCausalLM", arch, h.ModelType)
	}
	if h.HiddenAct != "" && h.HiddenAct != "silu" {
		return Config{}, fmt.Errorf("model: hidden_act %q not supported", h.HiddenAct)
	}
	c := Config{
		Arch: arch, Dim: h.HiddenSize, HiddenDim: h.Intermediate, Layers: h.Layers, Heads: h.Heads,
		KVHeads: h.Heads, Vocab: h.Vocab, MaxSeqLen: h.MaxPos, RopeTheta: 10000, NormEps: 1e-6,
		QKVBias: arch == "Qwen2ForCausalLM", BOS: -1, DType: h.TorchDType,
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
	if h.AttentionBias && !c.QKVBias {
		return Config{}, fmt.Errorf("model: attention_bias (with an o_proj bias) not supported for %s", arch)
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
		case "llama3":
			s := rp.RopeScaling
			s.Type = "llama3"
			if s.Factor <= 0 || s.OriginalMaxPositionEmbeddings <= 0 || s.HighFreqFactor <= s.LowFreqFactor {
				return Config{}, fmt.Errorf("model: bad llama3 rope_scaling %+v", s)
			}
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

// LoadHF reads an HF model directory: config.json and model.safetensors, or
// shards listed in model.safetensors.index.json. F32, F16 and BF16 tensors
// are converted to float32.
func LoadHF(dir string) (*Model, error) {
	b, err := os.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	c, err := ParseHFConfig(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", dir, err)
	}
	files, err := safetensorsFiles(dir)
	if err != nil {
		return nil, err
	}
	var opened []*stFile
	defer func() {
		for _, f := range opened {
			f.Close()
		}
	}()
	where := map[string]*stFile{}
	for _, p := range files {
		f, err := openSafetensors(p)
		if err != nil {
			return nil, err
		}
		opened = append(opened, f)
		for name := range f.tensors {
			where[name] = f
		}
	}
	if _, ok := where["lm_head.weight"]; !ok && !c.TiedEmbedding {
		c.TiedEmbedding = true // no classifier stored: it is the embedding
	}
	w := &Weights{}
	shapes := w.shapes(&c)
	var total int64
	for _, s := range shapes {
		f, ok := where[s.name]
		if !ok {
			return nil, fmt.Errorf("model: %s: tensor %s missing", dir, s.name)
		}
		t := f.tensors[s.name]
		if numel(t.Shape) != numel(s.shape) || len(t.Shape) != len(s.shape) {
			return nil, fmt.Errorf("model: %s: tensor %s has shape %v, want %v", dir, s.name, t.Shape, s.shape)
		}
		for i := range t.Shape {
			if t.Shape[i] != s.shape[i] {
				return nil, fmt.Errorf("model: %s: tensor %s has shape %v, want %v", dir, s.name, t.Shape, s.shape)
			}
		}
		total += t.End - t.Begin
	}
	prog := newProgress("loading "+filepath.Base(dir), total)
	defer prog.Finish()
	jobs := make(chan tensorShape)
	errs := make([]error, len(shapes))
	idx := map[string]int{}
	for i, s := range shapes {
		idx[s.name] = i
	}
	var wg sync.WaitGroup
	for k := 0; k < min(runtime.GOMAXPROCS(0), 4); k++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for s := range jobs {
				f := where[s.name]
				*s.dst = make([]float32, numel(s.shape))
				errs[idx[s.name]] = f.readF32(f.tensors[s.name], *s.dst, prog)
			}
		}()
	}
	for _, s := range shapes {
		jobs <- s
	}
	close(jobs)
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return nil, e
		}
	}
	if err := w.check(&c); err != nil {
		return nil, err
	}
	return &Model{Config: c, W: w, Path: dir}, nil
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
