package model

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"unsafe"
)

// LoadLlama2C reads a checkpoint in llama2.c's legacy format: seven int32
// (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a
// negative vocab_size means an unshared classifier), then float32 tensors.
// RoPE pairs are interleaved; generation stops at EOS (2) or BOS (1), as in
// llama2.c.
func LoadLlama2C(path string) (*Model, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	if len(b) < 28 {
		return nil, fmt.Errorf("model: %s: too short for a llama2.c header", path)
	}
	var h [7]int
	for i := range h {
		h[i] = int(int32(binary.LittleEndian.Uint32(b[4*i:])))
	}
	shared := h[5] > 0
	vocab := h[5]
	if vocab < 0 {
		vocab = -vocab
	}
	c := Config{
		Arch: "LlamaForCausalLM", Dim: h[0], HiddenDim: h[1], Layers: h[2], Heads: h[3], KVHeads: h[4],
		Vocab: vocab, MaxSeqLen: h[6], RopeTheta: 10000, NormEps: 1e-5, TiedEmbedding: shared,
		RopeInterleaved: true, BOS: 1, EOS: []int{2, 1}, DType: "float32",
	}
	if c.Heads > 0 {
		c.HeadDim = c.Dim / c.Heads
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if c.HeadDim*c.Heads != c.Dim || c.MaxSeqLen <= 0 {
		return nil, fmt.Errorf("model: %s: dim %d not divisible into %d heads, or seq_len %d", path, c.Dim, c.Heads, c.MaxSeqLen)
	}
	floats := b[28:]
	nf := len(floats) / 4
	pos := 0
	var short bool
	take := func(n int) []float32 {
		if short || pos+n > nf {
			short = true
			return nil
		}
		out := make([]float32, n)
		src := floats[4*pos : 4*(pos+n)]
		if littleEndian {
			copy(out, unsafe.Slice((*float32)(unsafe.Pointer(&src[0])), n))
		} else {
			for i := range out {
				out[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
			}
		}
		pos += n
		return out
	}
	L, d, kv, hd := c.Layers, c.Dim, c.kvDim(), c.HiddenDim
	w := &Weights{Layers: make([]Layer, L)}
	w.Embed = take(vocab * d)
	per := func(n int, set func(*Layer, []float32)) {
		all := take(L * n)
		for i := range w.Layers {
			if all != nil {
				set(&w.Layers[i], all[i*n:(i+1)*n:(i+1)*n])
			}
		}
	}
	per(d, func(l *Layer, s []float32) { l.AttnNorm = s })
	per(d*c.qDim(), func(l *Layer, s []float32) { l.WQ = s })
	per(d*kv, func(l *Layer, s []float32) { l.WK = s })
	per(d*kv, func(l *Layer, s []float32) { l.WV = s })
	per(c.qDim()*d, func(l *Layer, s []float32) { l.WO = s })
	per(d, func(l *Layer, s []float32) { l.FFNNorm = s })
	per(hd*d, func(l *Layer, s []float32) { l.W1 = s })
	per(d*hd, func(l *Layer, s []float32) { l.W2 = s })
	per(hd*d, func(l *Layer, s []float32) { l.W3 = s })
	w.Norm = take(d)
	pos += c.MaxSeqLen * c.HeadDim // freq_cis_real, freq_cis_imag
	if shared {
		w.LMHead = w.Embed
	} else {
		w.LMHead = take(vocab * d)
	}
	if short || pos > nf {
		return nil, fmt.Errorf("model: %s: file has %d bytes, too short for %+v", path, len(b), c)
	}
	if err := w.check(&c); err != nil {
		return nil, err
	}
	return &Model{Config: c, W: w, Path: path}, nil
}

// permuteRoPE reorders the rows of each head of w ([heads*hd][in]) from the
// interleaved RoPE pairing to the half-split one: rows 0,2,4,...,1,3,5,...
func permuteRoPE(w []float32, heads, hd, in int) []float32 {
	out := make([]float32, len(w))
	for h := 0; h < heads; h++ {
		for half := 0; half < 2; half++ {
			for i := 0; i < hd/2; i++ {
				dst := h*hd + half*hd/2 + i
				src := h*hd + 2*i + half
				copy(out[dst*in:(dst+1)*in], w[src*in:(src+1)*in])
			}
		}
	}
	return out
}

// ConvertLlama2CToHF writes an HF directory (config.json for
// LlamaForCausalLM, model.safetensors in F32) from a llama2.c checkpoint,
// permuting q and k rows to HF's half-split RoPE convention, plus the
// tokenizer files given (skipped when nil).
func ConvertLlama2CToHF(binPath, outDir string, tokenizerJSON, tokenizerConfigJSON []byte) error {
	m, err := LoadLlama2C(binPath)
	if err != nil {
		return err
	}
	c := m.Config
	hw := *m.W
	hw.Layers = make([]Layer, len(m.W.Layers))
	for i, l := range m.W.Layers {
		l.WQ = permuteRoPE(l.WQ, c.Heads, c.HeadDim, c.Dim)
		l.WK = permuteRoPE(l.WK, c.KVHeads, c.HeadDim, c.Dim)
		hw.Layers[i] = l
	}
	c.RopeInterleaved = false
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if err := writeConfigJSON(filepath.Join(outDir, "config.json"), &c); err != nil {
		return err
	}
	var ts []outTensor
	for _, t := range hw.shapes(&c) {
		ts = append(ts, outTensor{name: t.name, dtype: "F32", shape: t.shape, src: *t.dst})
	}
	if err := writeSafetensors(filepath.Join(outDir, "model.safetensors"), ts, 1, nil); err != nil {
		return err
	}
	for name, b := range map[string][]byte{"tokenizer.json": tokenizerJSON, "tokenizer_config.json": tokenizerConfigJSON} {
		if b != nil {
			if err := os.WriteFile(filepath.Join(outDir, name), b, 0o644); err != nil {
				return fmt.Errorf("model: %w", err)
			}
		}
	}
	return nil
}

// writeConfigJSON writes c as an HF config.json.
func writeConfigJSON(path string, c *Config) error {
	dtype := c.DType
	if dtype == "" {
		dtype = "float32"
	}
	mt := map[string]string{"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[c.Arch]
	m := map[string]any{
		"architectures":           []string{c.Arch},
		"model_type":              mt,
		"hidden_size":             c.Dim,
		"intermediate_size":       c.HiddenDim,
		"num_hidden_layers":       c.Layers,
		"num_attention_heads":     c.Heads,
		"num_key_value_heads":     c.KVHeads,
		"head_dim":                c.HeadDim,
		"vocab_size":              c.Vocab,
		"max_position_embeddings": c.MaxSeqLen,
		"rope_theta":              c.RopeTheta,
		"rms_norm_eps":            c.NormEps,
		"tie_word_embeddings":     c.TiedEmbedding,
		"hidden_act":              "silu",
		"torch_dtype":             dtype,
	}
	if c.Arch != "Qwen2ForCausalLM" {
		m["attention_bias"] = false
	}
	if c.RopeScaling != nil {
		m["rope_scaling"] = c.RopeScaling
	}
	if c.BOS >= 0 {
		m["bos_token_id"] = c.BOS
	}
	switch len(c.EOS) {
	case 0:
	case 1:
		m["eos_token_id"] = c.EOS[0]
	default:
		m["eos_token_id"] = c.EOS
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if err := os.WriteFile(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	return nil
}
