package model

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
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
	defer m.Close()
	c := m.Config
	if c.Dim != 64 || c.HiddenDim != 172 || c.Layers != 5 || c.Heads != 8 || c.KVHeads != 4 || c.Vocab != 512 ||
		c.MaxSeqLen != 512 || !c.TiedEmbedding || c.Spec.Attention.Rope != RopeInterleaved || c.BOS != 1 || len(c.EOS) != 2 {
		t.Fatalf("config %+v", c)
	}
	if m.LMHead != m.Embed {
		t.Error("classifier not shared with the embedding")
	}
	if m.Embed.DType != F32 || m.Embed.F32() == nil {
		t.Error("llama2.c tensors are not float32 views")
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
	defer h.Close()
	hd := c.HeadDim
	hq, mq := h.Layers[0].Q.F32(), m.Layers[0].Q.F32()
	hk, mk := h.Layers[0].K.F32(), m.Layers[0].K.F32()
	// Row 1 of head 0 in HF order is row 2 in llama2.c order.
	for i := 0; i < c.Dim; i++ {
		if hq[1*c.Dim+i] != mq[2*c.Dim+i] || hk[hd/2*c.Dim+i] != mk[1*c.Dim+i] {
			t.Fatal("q/k rows not permuted to the half-split convention")
		}
	}
	if h.Config.Spec.Attention.Rope != RopeHalf || h.Config.ArchName() != "LlamaForCausalLM" || !h.Config.TiedEmbedding || h.Config.Dim != 64 {
		t.Fatalf("hf config %+v", h.Config)
	}
}

// TestWriteRandom writes each tiny shape (sharded into small files) and
// loads it back: the weights equal NewRandom's, rounded to the dtype, and
// are views of the mapped files in that dtype.
func TestWriteRandom(t *testing.T) {
	for name := range TinyShapes() {
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
			defer got.Close()
			want, err := NewRandom(name, 5)
			if err != nil {
				t.Fatal(err)
			}
			cfg, _ := RandomConfig(name)
			g := got.Config
			if g.ArchName() != cfg.ArchName() || g.TiedEmbedding != cfg.TiedEmbedding ||
				(cfg.RopeScaling != nil) != (g.RopeScaling != nil) || g.RopeTheta != cfg.RopeTheta ||
				g.SlidingWindow != cfg.SlidingWindow || g.Experts != cfg.Experts || g.TopK != cfg.TopK ||
				g.ExpertDim != cfg.ExpertDim || g.NormTopKProb != cfg.NormTopKProb || g.SharedExpertDim != cfg.SharedExpertDim ||
				fmt.Sprint(g.DenseLayers) != fmt.Sprint(cfg.DenseLayers) || g.HeadDim != cfg.HeadDim {
				t.Fatalf("config %+v, want %+v", g, cfg)
			}
			dt, _ := ParseDType(cfg.DType)
			gs, ws := got.Tensors(), want.Tensors()
			if len(gs) != len(ws) || len(gs) == 0 {
				t.Fatalf("%d tensors, want %d", len(gs), len(ws))
			}
			for i := range gs {
				if gs[i].Name != ws[i].Name || gs[i].DType != dt {
					t.Fatalf("tensor %d: %s %v, want %s %v", i, gs[i].Name, gs[i].DType, ws[i].Name, dt)
				}
				g, w := gs[i].ToF32(), ws[i].F32()
				for j := range w {
					if r := RoundTo(dt, w[j]); g[j] != r {
						t.Fatalf("%s[%d] = %v, want %v", gs[i].Name, j, g[j], r)
					}
				}
			}
		})
	}
	if err := WriteRandom("nope", t.TempDir(), 1, ""); err == nil {
		t.Error("unknown shape accepted")
	}
}

// TestRandomShapes: every shape is a valid config of a registered
// architecture, and every registered architecture has a tiny shape.
func TestRandomShapes(t *testing.T) {
	archs := map[string]bool{}
	for name, arch := range TinyShapes() {
		archs[arch] = true
		if c, err := RandomConfig(name); err != nil || c.ArchName() != arch {
			t.Errorf("%s: %v %s", name, err, c.ArchName())
		}
	}
	for _, name := range Architectures().Names() {
		if !archs[name] {
			t.Errorf("architecture %s has no tiny shape", name)
		}
	}
	for _, name := range RandomShapes() {
		if _, err := RandomConfig(name); err != nil {
			t.Error(err)
		}
	}
	c, _ := RandomConfig("qwen3-30b-a3b")
	if !c.MoELayer(0) || !c.MoELayer(47) || c.Experts != 128 || c.TopK != 8 || !c.NormTopKProb {
		t.Errorf("qwen3-30b-a3b: %+v", c)
	}
	c, _ = RandomConfig("tiny-qwen2-moe")
	if !c.MoELayer(0) || c.MoELayer(1) || !c.MoELayer(2) {
		t.Errorf("tiny-qwen2-moe: layer 1 is dense (mlp_only_layers), the others MoE")
	}
}

func TestBuiltin(t *testing.T) {
	a, b := Builtin(), Builtin()
	if !a.Random || a.Config.Vocab < 258 || a.Config.BOS != 256 || a.Config.EOS[0] != 257 {
		t.Fatalf("builtin %+v", a.Config)
	}
	aw, bw := a.Layers[3].Down.F32(), b.Layers[3].Down.F32()
	for i, v := range aw {
		if bw[i] != v {
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
				return c.Spec.Attention.QKVBias && c.HeadDim == 16 && c.BOS == -1 && len(c.EOS) == 2 && c.RopeTheta == 1e6
			}},
		{"llama3", `{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"head_dim":32,"vocab_size":100,"rope_scaling":{"rope_type":"llama3","factor":8,
			"low_freq_factor":1,"high_freq_factor":4,"original_max_position_embeddings":8192},"eos_token_id":5}`, true,
			func(c Config) bool {
				return c.RopeScaling != nil && c.RopeScaling.Factor == 8 && c.HeadDim == 32 && c.KVHeads == 4
			}},
		{"rope_parameters", `{"model_type":"mistral","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"vocab_size":100,"rope_parameters":{"rope_type":"default","rope_theta":5000}}`, true,
			func(c Config) bool {
				return c.ArchName() == "MistralForCausalLM" && c.RopeTheta == 5000 && c.SlidingWindow == 0
			}},
		{"qwen3", `{"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":100,"attention_bias":false,
			"use_sliding_window":false,"sliding_window":4096,"max_window_layers":28}`, true,
			func(c Config) bool {
				return c.Spec.Attention.QKNorm && !c.Spec.Attention.QKVBias && c.HeadDim == 32 && c.SlidingWindow == 0
			}},
		{"qwen3 moe", `{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,
			"num_attention_heads":4,"vocab_size":100,"num_experts":16,"num_experts_per_tok":4,"moe_intermediate_size":32,
			"norm_topk_prob":true,"decoder_sparse_step":2,"mlp_only_layers":[3]}`, true,
			func(c Config) bool {
				return c.Experts == 16 && c.TopK == 4 && c.ExpertDim == 32 && c.NormTopKProb &&
					!c.MoELayer(0) && c.MoELayer(1) && !c.MoELayer(2) && !c.MoELayer(3)
			}},
		{"mixtral", `{"model_type":"mixtral","hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,
			"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"num_local_experts":8,"num_experts_per_tok":2,
			"sliding_window":4096}`, true,
			func(c Config) bool {
				return c.ArchName() == "MixtralForCausalLM" && c.Experts == 8 && c.TopK == 2 && c.ExpertDim == 96 &&
					c.NormTopKProb && c.SlidingWindow == 4096 && c.Window(1) == 4096
			}},
		{"qwen2 windows", `{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":4,
			"num_attention_heads":4,"vocab_size":100,"use_sliding_window":true,"sliding_window":64,"max_window_layers":2}`, true,
			func(c Config) bool { return c.Window(1) == 0 && c.Window(2) == 64 }},
		{"moe top-k beyond experts", `{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":64,"intermediate_size":128,
			"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100,"num_experts":4,"num_experts_per_tok":5,
			"moe_intermediate_size":32}`, false, nil},
		{"unknown arch", `{"architectures":["GPT2LMHeadModel"],"hidden_size":64}`, false, nil},
		{"mlp bias", `{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"vocab_size":100,"mlp_bias":true}`, false, nil},
		{"qwen3 attention bias", `{"architectures":["Qwen3ForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
			"num_attention_heads":4,"vocab_size":100,"attention_bias":true}`, false, nil},
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

// TestFromWeights: a model made from float32 slices shares them, and
// weights for another layer count are refused.
func TestFromWeights(t *testing.T) {
	ref, err := NewRandom("tiny-qwen2", 2)
	if err != nil {
		t.Fatal(err)
	}
	w := &Weights{Embed: ref.Embed.F32(), Norm: ref.Norm.F32(), LMHead: ref.LMHead.F32()}
	for _, l := range ref.Layers {
		w.Layers = append(w.Layers, Layer{AttnNorm: l.AttnNorm.F32(), WQ: l.Q.F32(), WK: l.K.F32(), WV: l.V.F32(), WO: l.O.F32(),
			BQ: l.QBias.F32(), BK: l.KBias.F32(), BV: l.VBias.F32(), FFNNorm: l.MLPNorm.F32(), W1: l.Gate.F32(), W3: l.Up.F32(), W2: l.Down.F32()})
	}
	m, err := FromWeights(ref.Config, w)
	if err != nil {
		t.Fatal(err)
	}
	if &m.Layers[1].V.F32()[0] != &w.Layers[1].WV[0] || len(m.Layers[0].QBias.F32()) != ref.Config.Heads*ref.Config.HeadDim {
		t.Fatal("the model does not share the weights, or lost the q bias")
	}
	w.Layers = w.Layers[:1]
	if _, err := FromWeights(ref.Config, w); err == nil || !strings.Contains(err.Error(), "weights for 1 layers") {
		t.Fatalf("one layer's weights for %d layers: %v", ref.Config.Layers, err)
	}
}
