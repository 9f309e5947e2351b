package model

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
)

// randomShape is a named configuration for seeded random weights.
type randomShape struct {
	arch string // registered architecture
	cfg  Config
	// scaled: std 1/sqrt(fan_in) for matrices and 1 for the embedding,
	// so a random model's greedy output varies (HF's 0.02 otherwise).
	scaled bool
	// noisyNorms: norm weights 1 + normal(0, 0.1) instead of 1, so a norm
	// applied with the wrong weights shows.
	noisyNorms bool
	// tiny: a CI shape, run by the conformance suite and the golden checks.
	tiny bool
}

func byteTokenizerIDs(c Config) Config { c.BOS, c.EOS = 256, []int{257}; return c }

// randomShapes are the named shapes. The tiny ones have byte-tokenizer ids
// (convert --random writes a byte tokenizer beside them).
func randomShapes() map[string]randomShape {
	llama3 := &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 8192}
	qwen3 := func(layers int) Config {
		return Config{Dim: 5120, HiddenDim: 25600, Layers: layers, Heads: 64, KVHeads: 8, HeadDim: 128, Vocab: 151936,
			MaxSeqLen: 40960, RopeTheta: 1000000, NormEps: 1e-6, BOS: 151643, EOS: []int{151645, 151643}, DType: "bfloat16"}
	}
	qwen3MoE := func(layers int) Config {
		return Config{Dim: 2048, HiddenDim: 6144, Layers: layers, Heads: 32, KVHeads: 4, HeadDim: 128, Vocab: 151936,
			MaxSeqLen: 40960, RopeTheta: 1000000, NormEps: 1e-6, Experts: 128, TopK: 8, ExpertDim: 768, NormTopKProb: true,
			SparseStep: 1, BOS: 151643, EOS: []int{151645, 151643}, DType: "bfloat16"}
	}
	return map[string]randomShape{
		"tiny": {arch: "LlamaForCausalLM", tiny: true, cfg: byteTokenizerIDs(Config{Dim: 64, HiddenDim: 172, Layers: 2, Heads: 4,
			KVHeads: 2, HeadDim: 16, Vocab: 320, MaxSeqLen: 512, RopeTheta: 10000, NormEps: 1e-5, DType: "float32"})},
		"tiny-qwen2": {arch: "Qwen2ForCausalLM", tiny: true, scaled: true, cfg: byteTokenizerIDs(Config{Dim: 64, HiddenDim: 160,
			Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16, Vocab: 320, MaxSeqLen: 512, RopeTheta: 1000000, NormEps: 1e-6,
			TiedEmbedding: true, DType: "bfloat16"})},
		"tiny-llama3": {arch: "LlamaForCausalLM", tiny: true, scaled: true, cfg: byteTokenizerIDs(Config{Dim: 64, HiddenDim: 192,
			Layers: 2, Heads: 4, KVHeads: 1, HeadDim: 32, Vocab: 320, MaxSeqLen: 8192, RopeTheta: 500000, NormEps: 1e-5,
			DType: "float16", RopeScaling: &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4,
				OriginalMaxPositionEmbeddings: 64}})},
		// Sliding window 24: prompts longer than it reach past the window.
		"tiny-mistral": {arch: "MistralForCausalLM", tiny: true, scaled: true, noisyNorms: true, cfg: byteTokenizerIDs(Config{
			Dim: 64, HiddenDim: 128, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16, Vocab: 320, MaxSeqLen: 1024,
			RopeTheta: 10000, NormEps: 1e-5, SlidingWindow: 24, DType: "bfloat16"})},
		// Head dim 32 x 4 heads: the attention width differs from Dim.
		"tiny-qwen3": {arch: "Qwen3ForCausalLM", tiny: true, scaled: true, noisyNorms: true, cfg: byteTokenizerIDs(Config{
			Dim: 64, HiddenDim: 128, Layers: 3, Heads: 4, KVHeads: 2, HeadDim: 32, Vocab: 320, MaxSeqLen: 2048,
			RopeTheta: 1000000, NormEps: 1e-6, TiedEmbedding: true, DType: "bfloat16"})},
		"tiny-qwen3-moe": {arch: "Qwen3MoeForCausalLM", tiny: true, scaled: true, noisyNorms: true, cfg: byteTokenizerIDs(Config{
			Dim: 64, HiddenDim: 128, Layers: 3, Heads: 4, KVHeads: 2, HeadDim: 32, Vocab: 320, MaxSeqLen: 2048,
			RopeTheta: 1000000, NormEps: 1e-6, Experts: 16, TopK: 4, ExpertDim: 32, NormTopKProb: true, SparseStep: 1,
			DType: "bfloat16"})},
		// Mixtral's experts renormalise always; sliding window 32.
		"tiny-mixtral": {arch: "MixtralForCausalLM", tiny: true, scaled: true, noisyNorms: true, cfg: byteTokenizerIDs(Config{
			Dim: 64, HiddenDim: 96, Layers: 2, Heads: 4, KVHeads: 2, HeadDim: 16, Vocab: 320, MaxSeqLen: 1024,
			RopeTheta: 1000000, NormEps: 1e-5, Experts: 8, TopK: 2, ExpertDim: 96, NormTopKProb: true, SlidingWindow: 32,
			DType: "bfloat16"})},
		// A shared expert; layer 1 dense (mlp_only_layers), no renormalisation.
		"tiny-qwen2-moe": {arch: "Qwen2MoeForCausalLM", tiny: true, scaled: true, noisyNorms: true, cfg: byteTokenizerIDs(Config{
			Dim: 64, HiddenDim: 96, Layers: 3, Heads: 4, KVHeads: 2, HeadDim: 16, Vocab: 320, MaxSeqLen: 2048,
			RopeTheta: 1000000, NormEps: 1e-6, Experts: 8, TopK: 2, ExpertDim: 32, SharedExpertDim: 64, SparseStep: 1,
			DenseLayers: []int{1}, DType: "bfloat16"})},
		"builtin": {arch: "LlamaForCausalLM", scaled: true, cfg: byteTokenizerIDs(Config{Dim: 256, HiddenDim: 688, Layers: 4,
			Heads: 8, KVHeads: 4, HeadDim: 32, Vocab: 320, MaxSeqLen: 4096, RopeTheta: 10000, NormEps: 1e-5, DType: "float32"})},
		"stories110m": {arch: "LlamaForCausalLM", cfg: Config{Dim: 768, HiddenDim: 2048, Layers: 12, Heads: 12, KVHeads: 12,
			HeadDim: 64, Vocab: 32000, MaxSeqLen: 1024, RopeTheta: 10000, NormEps: 1e-5, TiedEmbedding: true,
			BOS: 1, EOS: []int{2}, DType: "float32"}},
		"llama3-8b": {arch: "LlamaForCausalLM", cfg: Config{Dim: 4096, HiddenDim: 14336, Layers: 32, Heads: 32, KVHeads: 8,
			HeadDim: 128, Vocab: 128256, MaxSeqLen: 131072, RopeTheta: 500000, NormEps: 1e-5, RopeScaling: llama3,
			BOS: 128000, EOS: []int{128001, 128009}, DType: "bfloat16"}},
		"qwen3-32b":        {arch: "Qwen3ForCausalLM", cfg: qwen3(64)},
		"qwen3-32b-8l":     {arch: "Qwen3ForCausalLM", cfg: qwen3(8)},
		"qwen3-30b-a3b":    {arch: "Qwen3MoeForCausalLM", cfg: qwen3MoE(48)},
		"qwen3-30b-a3b-8l": {arch: "Qwen3MoeForCausalLM", cfg: qwen3MoE(8)},
	}
}

// RandomShapes lists the names WriteRandom and NewRandom accept.
func RandomShapes() []string { return sortedNames(randomShapes()) }

// TinyShapes maps every tiny CI shape to its architecture.
func TinyShapes() map[string]string {
	out := map[string]string{}
	for name, s := range randomShapes() {
		if s.tiny {
			out[name] = s.arch
		}
	}
	return out
}

// RandomConfig returns the configuration of a named random shape.
func RandomConfig(name string) (Config, error) {
	s, ok := randomShapes()[name]
	if !ok {
		return Config{}, fmt.Errorf("model: unknown random shape %q (have %s)", name, strings.Join(RandomShapes(), ", "))
	}
	c := s.cfg.clone()
	c.Spec = MustSpec(s.arch)
	if err := c.Validate(); err != nil {
		return Config{}, fmt.Errorf("model: random shape %s: %w", name, err)
	}
	return c, nil
}

// Builtin is the model used when no model path is given: a small Llama with
// seeded random weights for a byte tokenizer (ids 0..255 bytes, 256 BOS,
// 257 EOS).
func Builtin() *Model {
	m, err := NewRandom("builtin", 1)
	if err != nil {
		panic(err) // the built-in shape is valid
	}
	return m
}

// NewRandom builds a model of a named shape with seeded random weights in
// memory, as float32 tensors; the weights equal those WriteRandom writes
// (before dtype rounding).
func NewRandom(name string, seed int64) (*Model, error) {
	c, err := RandomConfig(name)
	if err != nil {
		return nil, err
	}
	c.DType = "float32"
	m := &Model{Config: c, Layers: make([]LayerTensors, c.Layers), Random: true}
	for _, t := range randomTensors(&c, seed, randomShapes()[name], F32) {
		dst := make([]float32, numel(t.shape))
		parallelChunks(int64(len(dst)), func(off, n int64) { t.gen(dst[off:off+n], off) })
		*m.slot(&t.spec) = f32Tensor(t.name, t.shape, dst)
	}
	if err := m.check(); err != nil {
		return nil, err
	}
	return m, nil
}

// parallelChunks calls f on chunkElems-sized pieces of [0, n) across cores.
func parallelChunks(n int64, f func(off, n int64)) {
	threads := runtime.GOMAXPROCS(0)
	next := make(chan int64)
	done := make(chan struct{})
	for k := 0; k < threads; k++ {
		go func() {
			for off := range next {
				f(off, min(chunkElems, n-off))
			}
			done <- struct{}{}
		}()
	}
	for off := int64(0); off < n; off += chunkElems {
		next <- off
	}
	close(next)
	for k := 0; k < threads; k++ {
		<-done
	}
}

// randomTensors describes every tensor of c with a seeded generator.
func randomTensors(c *Config, seed int64, shape randomShape, dt DType) []outTensor {
	var out []outTensor
	for _, s := range c.Spec.Tensors(c, dt) {
		std := 0.02
		norm := strings.HasSuffix(s.Name, "norm.weight")
		if shape.scaled && len(s.Shape) == 2 {
			std = 1 / math.Sqrt(float64(s.Shape[1]))
			if s.Role == RoleEmbed {
				std = 1
			}
		}
		h := fnv.New64a()
		h.Write([]byte(s.Name))
		tseed := uint64(seed)*0x9e3779b97f4a7c15 ^ h.Sum64()
		noisy := shape.noisyNorms
		out = append(out, outTensor{name: s.Name, dtype: dt.String(), shape: s.Shape, spec: s, gen: func(dst []float32, off int64) {
			if !norm {
				fillNormal(dst, tseed+uint64(off/chunkElems)*0xbf58476d1ce4e5b9, float32(std))
				return
			}
			if noisy {
				fillNormal(dst, tseed+uint64(off/chunkElems)*0xbf58476d1ce4e5b9, 0.1)
			} else {
				clear(dst)
			}
			for i := range dst {
				dst[i]++
			}
		}})
	}
	return out
}

// fillNormal fills dst with approximately normal(0, std) values from a
// splitmix64 stream: each value is an Irwin-Hall sum of four 16-bit
// uniforms, rescaled to unit variance.
func fillNormal(dst []float32, state uint64, std float32) {
	scale := std * float32(math.Sqrt(3)) / 65536
	for i := range dst {
		state += 0x9e3779b97f4a7c15
		z := state
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		z ^= z >> 31
		s := int32(z&0xffff) + int32(z>>16&0xffff) + int32(z>>32&0xffff) + int32(z>>48) - 2*65535
		dst[i] = float32(s) * scale
	}
}

// maxShardBytes bounds one safetensors shard.
const maxShardBytes = 4 << 30

// WriteRandom writes an HF directory (config.json and safetensors shards of
// at most 4 GiB with an index when there is more than one) holding seeded
// random weights of a named shape: normal(0, 0.02) (1/sqrt(fan_in) for the
// small test shapes other than "tiny"), norms 1. dtype is
// "" (the shape's own), "float32", "float16" or "bfloat16". No tokenizer
// files are written.
func WriteRandom(name string, outDir string, seed int64, dtype string) error {
	return writeRandom(name, outDir, seed, dtype, maxShardBytes)
}

func writeRandom(name string, outDir string, seed int64, dtype string, shardBytes int64) error {
	c, err := RandomConfig(name)
	if err != nil {
		return err
	}
	if dtype != "" {
		c.DType = dtype
	}
	dt, err := ParseDType(strings.ToLower(c.DType))
	if err != nil {
		return err
	}
	c.DType = dt.TorchName()
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if err := writeConfigJSON(filepath.Join(outDir, "config.json"), &c); err != nil {
		return err
	}
	ts := randomTensors(&c, seed, randomShapes()[name], dt)
	var shards [][]outTensor
	var total, cur int64
	for _, t := range ts {
		b := t.bytes()
		total += b
		if len(shards) == 0 || (cur+b > shardBytes && cur > 0) {
			shards = append(shards, nil)
			cur = 0
		}
		shards[len(shards)-1] = append(shards[len(shards)-1], t)
		cur += b
	}
	prog := newProgress("writing "+name, total)
	defer prog.Finish()
	threads := runtime.GOMAXPROCS(0)
	if len(shards) == 1 {
		return writeSafetensors(filepath.Join(outDir, "model.safetensors"), shards[0], threads, prog)
	}
	weightMap := map[string]string{}
	for i, sh := range shards {
		fn := fmt.Sprintf("model-%05d-of-%05d.safetensors", i+1, len(shards))
		if err := writeSafetensors(filepath.Join(outDir, fn), sh, threads, prog); err != nil {
			return err
		}
		for _, t := range sh {
			weightMap[t.name] = fn
		}
	}
	idx := map[string]any{"metadata": map[string]int64{"total_size": total}, "weight_map": weightMap}
	b, err := json.MarshalIndent(idx, "", "  ")
	if err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if err := os.WriteFile(filepath.Join(outDir, "model.safetensors.index.json"), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	return nil
}
