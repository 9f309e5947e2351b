package model

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"unsafe"
)

// LoadLlama2C reads a checkpoint in llama2.c's legacy format: seven int32
// (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a
// negative vocab_size means an unshared classifier), then float32 tensors.
// RoPE pairs are interleaved; generation stops at EOS (2) or BOS (1), as in
// llama2.c. The tensors are views of the file read into memory.
func LoadLlama2C(path string) (*Model, error) {
	b, err := readAligned(path, 28)
	if err != nil {
		return nil, err
	}
	return parseLlama2C(path, b)
}

// readAligned reads the file at path into memory placed so that byte off of
// it is 32-byte aligned: llama2.c's tensors start at byte 28, and the
// kernels' loads are faster on aligned rows. (The files are small and
// float32: reading them beats mapping them misaligned.)
func readAligned(path string, off int) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	size := st.Size()
	if int64(int(size)) != size {
		return nil, fmt.Errorf("model: %s: %d bytes do not fit the address space", path, size)
	}
	buf := make([]byte, int(size)+32)
	shift := int((32 - (uintptr(unsafe.Pointer(&buf[0]))+uintptr(off))%32) % 32)
	b := buf[shift : shift+int(size)]
	if _, err := io.ReadFull(f, b); err != nil {
		return nil, fmt.Errorf("model: reading %s: %w", path, err)
	}
	return b, nil
}

func parseLlama2C(path string, b []byte) (*Model, error) {
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
		Spec: Llama2CSpec(), Dim: h[0], HiddenDim: h[1], Layers: h[2], Heads: h[3], KVHeads: h[4],
		Vocab: vocab, MaxSeqLen: h[6], RopeTheta: 10000, NormEps: 1e-5, TiedEmbedding: shared,
		BOS: 1, EOS: []int{2, 1}, DType: "float32",
	}
	if c.Heads > 0 {
		c.HeadDim = c.Dim / c.Heads
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if c.HeadDim*c.Heads != c.Dim || c.MaxSeqLen <= 0 || c.HiddenDim <= 0 {
		return nil, fmt.Errorf("model: %s: dim %d not divisible into %d heads, or seq_len %d", path, c.Dim, c.Heads, c.MaxSeqLen)
	}
	data := b[28:]
	if !littleEndian {
		data = swapped(data, 4)
	}
	nf := len(data) / 4
	pos := 0
	var short bool
	take := func(n int) []byte {
		if short || pos+n > nf {
			short = true
			return nil
		}
		out := data[4*pos : 4*(pos+n) : 4*(pos+n)]
		pos += n
		return out
	}
	L, d, kv, hd := c.Layers, c.Dim, c.kvDim(), c.HiddenDim
	m := &Model{Config: c, Layers: make([]LayerTensors, L), Path: path}
	t := func(name string, data []byte, shape ...int) *Tensor {
		return &Tensor{Name: name, DType: F32, Shape: shape, Data: data}
	}
	m.Embed = t("model.embed_tokens.weight", take(vocab*d), vocab, d)
	per := func(name string, n int, set func(*LayerTensors, *Tensor), shape ...int) {
		all := take(L * n)
		for i := range m.Layers {
			if all != nil {
				set(&m.Layers[i], t(fmt.Sprintf("model.layers.%d.%s", i, name), all[4*i*n:4*(i+1)*n:4*(i+1)*n], shape...))
			}
		}
	}
	per("input_layernorm.weight", d, func(l *LayerTensors, x *Tensor) { l.AttnNorm = x }, d)
	per("self_attn.q_proj.weight", d*c.qDim(), func(l *LayerTensors, x *Tensor) { l.Q = x }, c.qDim(), d)
	per("self_attn.k_proj.weight", d*kv, func(l *LayerTensors, x *Tensor) { l.K = x }, kv, d)
	per("self_attn.v_proj.weight", d*kv, func(l *LayerTensors, x *Tensor) { l.V = x }, kv, d)
	per("self_attn.o_proj.weight", c.qDim()*d, func(l *LayerTensors, x *Tensor) { l.O = x }, d, c.qDim())
	per("post_attention_layernorm.weight", d, func(l *LayerTensors, x *Tensor) { l.MLPNorm = x }, d)
	per("mlp.gate_proj.weight", hd*d, func(l *LayerTensors, x *Tensor) { l.Gate = x }, hd, d)
	per("mlp.down_proj.weight", d*hd, func(l *LayerTensors, x *Tensor) { l.Down = x }, d, hd)
	per("mlp.up_proj.weight", hd*d, func(l *LayerTensors, x *Tensor) { l.Up = x }, hd, d)
	m.Norm = t("model.norm.weight", take(d), d)
	pos += c.MaxSeqLen * c.HeadDim // freq_cis_real, freq_cis_imag
	if shared {
		m.LMHead = m.Embed
	} else {
		m.LMHead = t("lm_head.weight", take(vocab*d), vocab, d)
	}
	if short || pos > nf {
		return nil, fmt.Errorf("model: %s: file has %d bytes, too short for %+v", path, len(b), c)
	}
	if err := m.check(); err != nil {
		return nil, err
	}
	return m, nil
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
	defer m.Close()
	c := m.Config
	c.Spec = MustSpec("LlamaForCausalLM")
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if err := writeConfigJSON(filepath.Join(outDir, "config.json"), &c); err != nil {
		return err
	}
	var ts []outTensor
	for _, s := range c.Spec.Tensors(&c, F32) {
		v := (*m.slot(&s)).ToF32()
		switch s.Role {
		case RoleQ:
			v = permuteRoPE(v, c.Heads, c.HeadDim, c.Dim)
		case RoleK:
			v = permuteRoPE(v, c.KVHeads, c.HeadDim, c.Dim)
		}
		ts = append(ts, outTensor{name: s.Name, dtype: "F32", shape: s.Shape, src: v})
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
	s := c.Spec
	m := map[string]any{
		"architectures":           []string{s.Name},
		"model_type":              s.ModelType,
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
		"attention_bias":          s.Attention.QKVBias,
	}
	if s.Attention.SlidingWindow {
		switch {
		case c.SlidingWindow == 0:
			m["sliding_window"] = nil
			if s.ModelType != "mistral" && s.ModelType != "mixtral" {
				m["use_sliding_window"] = false
			}
		case s.ModelType == "mistral" || s.ModelType == "mixtral":
			m["sliding_window"] = c.SlidingWindow
		default:
			m["sliding_window"], m["use_sliding_window"], m["max_window_layers"] = c.SlidingWindow, true, c.WindowFrom
		}
	}
	if s.MLP.MoE {
		if s.ModelType == "mixtral" {
			m["num_local_experts"] = c.Experts
			m["intermediate_size"] = c.ExpertDim
		} else {
			m["num_experts"] = c.Experts
			m["moe_intermediate_size"] = c.ExpertDim
			m["norm_topk_prob"] = c.NormTopKProb
			m["decoder_sparse_step"] = max(c.SparseStep, 1)
			m["mlp_only_layers"] = append([]int{}, c.DenseLayers...)
		}
		m["num_experts_per_tok"] = c.TopK
		m["output_router_logits"] = false
		if s.MLP.SharedExpert {
			m["shared_expert_intermediate_size"] = c.SharedExpertDim
		}
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
