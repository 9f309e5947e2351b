package model

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/sharedtest"
)

func sharedDir(tb testing.TB) string { return sharedtest.Dir(tb) }

func TestLoadLlama2C(t *testing.T) {
	p := filepath.Join(sharedDir(t), "models", "stories260K", "stories260K.bin")
	if _, err := os.Stat(p); err != nil {
		t.Skipf("stories260K not found (set MOONCAKE_SHARED): %v", err)
	}
	m, err := Load(p)
	if err != nil {
		t.Fatal(err)
	}
	c := m.Config
	if c.Dim != 64 || c.HiddenDim != 172 || c.Layers != 5 || c.Heads != 8 || c.KVHeads != 4 || c.Vocab != 512 ||
		c.MaxSeqLen != 512 || !c.TiedEmbedding || !c.RopeInterleaved || c.BOS != 1 || len(c.EOS) != 2 {
		t.Fatalf("config %+v", c)
	}
	if &m.W.LMHead[0] != &m.W.Embed[0] {
		t.Error("classifier not shared with the embedding")
	}
	b, _ := os.ReadFile(p)
	short := filepath.Join(t.TempDir(), "short.bin")
	os.WriteFile(short, b[:len(b)/2], 0o644)
	if _, err := LoadLlama2C(short); err == nil {
		t.Error("truncated checkpoint accepted")
	}

	dir := t.TempDir()
	if err := ConvertLlama2CToHF(p, dir, []byte("{}"), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Error(err)
	}
	h, err := Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	hd := c.HeadDim
	// Row 1 of head 0 in HF order is row 2 in llama2.c order.
	for i := 0; i < c.Dim; i++ {
		if h.W.Layers[0].WQ[1*c.Dim+i] != m.W.Layers[0].WQ[2*c.Dim+i] || h.W.Layers[0].WK[hd/2*c.Dim+i] != m.W.Layers[0].WK[1*c.Dim+i] {
			t.Fatal("q/k rows not permuted to the half-split convention")
		}
	}
	if h.Config.RopeInterleaved || !h.Config.TiedEmbedding || h.Config.Dim != 64 {
		t.Fatalf("hf config %+v", h.Config)
	}
}

// TestWriteRandom writes each tiny shape (sharded into small files) and
// loads it back: the weights equal NewRandom's, rounded to the dtype.
func TestWriteRandom(t *testing.T) {
	for _, name := range []string{"tiny", "tiny-qwen2", "tiny-llama3"} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if err := writeRandom(name, dir, 5, "", 64<<10); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(filepath.Join(dir, "model.safetensors.index.json")); err != nil {
				t.Fatalf("not sharded: %v", err)
			}
			got, err := Load(dir)
			if err != nil {
				t.Fatal(err)
			}
			want, err := NewRandom(name, 5)
			if err != nil {
				t.Fatal(err)
			}
			cfg, _ := RandomConfig(name)
			if got.Config.QKVBias != cfg.QKVBias || got.Config.TiedEmbedding != cfg.TiedEmbedding ||
				(cfg.RopeScaling != nil) != (got.Config.RopeScaling != nil) || got.Config.RopeTheta != cfg.RopeTheta {
				t.Fatalf("config %+v, want %+v", got.Config, cfg)
			}
			gs, ws := got.W.shapes(&got.Config), want.W.shapes(&want.Config)
			if len(gs) != len(ws) {
				t.Fatalf("%d tensors, want %d", len(gs), len(ws))
			}
			for i := range gs {
				g, w := *gs[i].dst, *ws[i].dst
				for j := range w {
					r := w[j]
					switch cfg.DType {
					case "bfloat16":
						r = math.Float32frombits(uint32(f32ToBF16(r)) << 16)
					case "float16":
						r = f16ToF32(f32ToF16(r))
					}
					if g[j] != r {
						t.Fatalf("%s[%d] = %v, want %v", gs[i].name, j, g[j], r)
					}
				}
			}
		})
	}
	if err := WriteRandom("nope", t.TempDir(), 1, ""); err == nil {
		t.Error("unknown shape accepted")
	}
}

func TestBuiltin(t *testing.T) {
	a, b := Builtin(), Builtin()
	if !a.Random || a.Config.Vocab < 258 || a.Config.BOS != 256 || a.Config.EOS[0] != 257 {
		t.Fatalf("builtin %+v", a.Config)
	}
	for i, v := range a.W.Layers[3].W2 {
		if b.W.Layers[3].W2[i] != v {
			t.Fatal("built-in weights differ between calls")
		}
	}
}

func TestParseHFConfig(t *testing.T) {
	for _, tc := range []struct {
		name, json string
		ok         bool
		check      func(Config) bool
	}{
		{"qwen2", `{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"rope_theta":1000000,"tie_word_embeddings":true,
			"eos_token_id":[1,2],"bos_token_id":null}`, true,
			func(c Config) bool {
				return c.QKVBias && c.HeadDim == 16 && c.BOS == -1 && len(c.EOS) == 2 && c.RopeTheta == 1e6
			}},
		{"llama3", `{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"head_dim":32,"vocab_size":100,"rope_scaling":{"rope_type":"llama3","factor":8,
			"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":8192},"eos_token_id":5}`, true,
			func(c Config) bool {
				return c.RopeScaling != nil && c.RopeScaling.Factor == 8 && c.HeadDim == 32 && c.KVHeads == 4
			}},
		{"rope_parameters", `{"model_type":"mistral","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"vocab_size":100,"rope_parameters":{"rope_type":"default","rope_theta":5000}}`, true,
			func(c Config) bool { return c.Arch == "MistralForCausalLM" && c.RopeTheta == 5000 }},
		{"unknown arch", `{"architectures":["GPT2LMHeadModel"],"hidden_size":64}`, false, nil},
		{"yarn", `{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"vocab_size":100,"rope_scaling":{"type":"yarn","factor":4}}`, false, nil},
		{"bad heads", `{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"num_key_value_heads":3,"vocab_size":100}`, false, nil},
	} {
		c, err := ParseHFConfig([]byte(tc.json))
		if (err == nil) != tc.ok {
			t.Errorf("%s: err %v", tc.name, err)
			continue
		}
		if tc.ok && !tc.check(c) {
			t.Errorf("%s: %+v", tc.name, c)
		}
	}
}
