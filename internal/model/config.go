// Package model defines a Llama-family model: its configuration and weights,
// and loads them from llama2.c checkpoints and HF directories.
package model

// Config is the architecture of a Llama-family model (Llama 2/3, Mistral,
// Qwen2). Field names follow HF config.json where one exists.
type Config struct {
	Arch          string  // "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"
	Dim           int     // hidden_size
	HiddenDim     int     // intermediate_size
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
	QKVBias       bool    // attention bias on q, k, v (Qwen2)
	// RopeInterleaved selects the RoPE pairing: true rotates (x[2i], x[2i+1])
	// as llama2.c does; false rotates (x[i], x[i+d/2]) as HF does.
	RopeInterleaved bool
	BOS             int    // -1 if none
	EOS             []int  // stop ids from the model config
	DType           string // dtype of the stored weights: "float32", "float16", "bfloat16"
}

// RopeScaling is HF's rope_scaling (only the "llama3" type changes anything).
type RopeScaling struct {
	Type                          string  `json:"rope_type"`
	Factor                        float64 `json:"factor"`
	LowFreqFactor                 float64 `json:"low_freq_factor"`
	HighFreqFactor                float64 `json:"high_freq_factor"`
	OriginalMaxPositionEmbeddings int     `json:"original_max_position_embeddings"`
}
