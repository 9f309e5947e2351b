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
	cfg Config
	// scaled: std 1/sqrt(fan_in) for matrices and 1 for the embedding,
	// so a random model's greedy output varies (HF's 0.02 otherwise).
	scaled bool
}

func byteTokenizerIDs(c Config) Config { c.BOS, c.EOS = 256, []int{257}; return c }

var randomShapes = map[string]randomShape{
	"tiny": {cfg: byteTokenizerIDs(Config{Arch: "LlamaForCausalLM", Dim: 64, HiddenDim: 172, Layers: 2, Heads: 4, KVHeads: 2,
		HeadDim: 16, Vocab: 320, MaxSeqLen: 512, RopeTheta: 10000, NormEps: 1e-5, DType: "float32"})},
	"tiny-qwen2": {cfg: byteTokenizerIDs(Config{Arch: "Qwen2ForCausalLM", Dim: 64, HiddenDim: 160, Layers: 2, Heads: 4, KVHeads: 2,
		HeadDim: 16, Vocab: 320, MaxSeqLen: 512, RopeTheta: 1000000, NormEps: 1e-6, TiedEmbedding: true, QKVBias: true, DType: "bfloat16"}), scaled: true},
	"tiny-llama3": {cfg: byteTokenizerIDs(Config{Arch: "LlamaForCausalLM", Dim: 64, HiddenDim: 192, Layers: 2, Heads: 4, KVHeads: 1,
		HeadDim: 32, Vocab: 320, MaxSeqLen: 8192, RopeTheta: 500000, NormEps: 1e-5, DType: "float16",
		RopeScaling: &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 64}}), scaled: true},
	"builtin": {cfg: byteTokenizerIDs(Config{Arch: "LlamaForCausalLM", Dim: 256, HiddenDim: 688, Layers: 4, Heads: 8, KVHeads: 4,
		HeadDim: 32, Vocab: 320, MaxSeqLen: 4096, RopeTheta: 10000, NormEps: 1e-5, DType: "float32"}), scaled: true},
	"stories110m": {cfg: Config{Arch: "LlamaForCausalLM", Dim: 768, HiddenDim: 2048, Layers: 12, Heads: 12, KVHeads: 12,
		HeadDim: 64, Vocab: 32000, MaxSeqLen: 1024, RopeTheta: 10000, NormEps: 1e-5, TiedEmbedding: true,
		BOS: 1, EOS: []int{2}, DType: "float32"}},
	"llama3-8b": {cfg: Config{Arch: "LlamaForCausalLM", Dim: 4096, HiddenDim: 14336, Layers: 32, Heads: 32, KVHeads: 8,
		HeadDim: 128, Vocab: 128256, MaxSeqLen: 131072, RopeTheta: 500000, NormEps: 1e-5,
		RopeScaling: &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositionEmbeddings: 8192},
		BOS:         128000, EOS: []int{128001, 128009}, DType: "bfloat16"}},
}

// RandomShapes lists the names WriteRandom and NewRandom accept.
func RandomShapes() []string { return sortedNames(randomShapes) }

// RandomConfig returns the configuration of a named random shape.
func RandomConfig(name string) (Config, error) {
	s, ok := randomShapes[name]
	if !ok {
		return Config{}, fmt.Errorf("model: unknown random shape %q (have %s)", name, strings.Join(RandomShapes(), ", "))
	}
	c := s.cfg
	c.EOS = append([]int(nil), c.EOS...)
	if c.RopeScaling != nil {
		r := *c.RopeScaling
		c.RopeScaling = &r
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
// memory; the weights equal those WriteRandom writes (before dtype rounding).
func NewRandom(name string, seed int64) (*Model, error) {
	c, err := RandomConfig(name)
	if err != nil {
		return nil, err
	}
	c.DType = "float32"
	w := &Weights{}
	ts := randomTensors(&c, w, seed, randomShapes[name].scaled, "F32")
	for i := range ts {
		t := &ts[i]
		dst := make([]float32, numel(t.shape))
		parallelChunks(int64(len(dst)), func(off, n int64) { t.gen(dst[off:off+n], off) })
		*randomDst(&c, w, t.name) = dst
	}
	if err := w.check(&c); err != nil {
		return nil, err
	}
	return &Model{Config: c, W: w, Random: true}, nil
}

func randomDst(c *Config, w *Weights, name string) *[]float32 {
	for _, s := range w.shapes(c) {
		if s.name == name {
			return s.dst
		}
	}
	return nil
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
func randomTensors(c *Config, w *Weights, seed int64, scaled bool, dtype string) []outTensor {
	var out []outTensor
	for _, s := range w.shapes(c) {
		std := 0.02
		ones := strings.HasSuffix(s.name, "norm.weight")
		if scaled && len(s.shape) == 2 {
			std = 1 / math.Sqrt(float64(s.shape[1]))
			if s.name == "model.embed_tokens.weight" {
				std = 1
			}
		}
		h := fnv.New64a()
		h.Write([]byte(s.name))
		tseed := uint64(seed)*0x9e3779b97f4a7c15 ^ h.Sum64()
		out = append(out, outTensor{name: s.name, dtype: dtype, shape: s.shape, gen: func(dst []float32, off int64) {
			if ones {
				for i := range dst {
					dst[i] = 1
				}
				return
			}
			fillNormal(dst, tseed+uint64(off/chunkElems)*0xbf58476d1ce4e5b9, float32(std))
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
	st := map[string]string{"float32": "F32", "f32": "F32", "float16": "F16", "f16": "F16", "bfloat16": "BF16", "bf16": "BF16"}[strings.ToLower(c.DType)]
	if st == "" {
		return fmt.Errorf("model: dtype %q not supported (float32, float16, bfloat16)", c.DType)
	}
	c.DType = map[string]string{"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[st]
	if err := os.MkdirAll(outDir, 0o755); err != nil {
		return fmt.Errorf("model: %w", err)
	}
	if err := writeConfigJSON(filepath.Join(outDir, "config.json"), &c); err != nil {
		return err
	}
	ts := randomTensors(&c, &Weights{}, seed, randomShapes[name].scaled, st)
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
