package model

import (
	"errors"
	"fmt"
	"strings"
)

// ErrArchitecture marks a config.json whose architecture no registered Spec
// implements.
var ErrArchitecture = errors.New("model: architecture not supported")

// Registry maps architecture names (config.json's "architectures") to
// Specs; config.json's model_type selects one when architectures is absent.
type Registry struct {
	specs  map[string]*Spec
	byType map[string]*Spec
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry {
	return &Registry{specs: map[string]*Spec{}, byType: map[string]*Spec{}}
}

// Register adds s under name (which becomes s.Name). A name or model_type
// registered twice is an error.
func (r *Registry) Register(name string, s Spec) error {
	if name == "" {
		return errors.New("model: Register: empty name")
	}
	if _, dup := r.specs[name]; dup {
		return fmt.Errorf("model: architecture %q registered twice", name)
	}
	if s.MLP.MoE && (s.MLP.Router == "" || s.MLP.Proj[0] == "" || s.MLP.Proj[1] == "" || s.MLP.Proj[2] == "") {
		return fmt.Errorf("model: architecture %q: MoE without router or expert names", name)
	}
	s.Name = name
	if s.ModelType != "" {
		if _, dup := r.byType[s.ModelType]; dup {
			return fmt.Errorf("model: model_type %q registered twice", s.ModelType)
		}
		r.byType[s.ModelType] = &s
	}
	r.specs[name] = &s
	return nil
}

// Lookup returns the Spec registered under name.
func (r *Registry) Lookup(name string) (*Spec, bool) {
	s, ok := r.specs[name]
	return s, ok
}

// Names lists the registered architectures in order.
func (r *Registry) Names() []string { return sortedNames(r.specs) }

// Select picks the Spec for a config.json: the first of architectures that
// is registered, else the one registered for modelType.
func (r *Registry) Select(architectures []string, modelType string) (*Spec, error) {
	for _, a := range architectures {
		if s, ok := r.specs[a]; ok {
			return s, nil
		}
	}
	if len(architectures) == 0 {
		if s, ok := r.byType[modelType]; ok {
			return s, nil
		}
	}
	return nil, fmt.Errorf("%w: architectures %q (model_type %q); have %s", ErrArchitecture, architectures, modelType,
		strings.Join(r.Names(), ", "))
}

// Architectures returns a registry holding every architecture this package
// implements.
func Architectures() *Registry {
	r := NewRegistry()
	dense := MLPSpec{}
	qwenMoE := MLPSpec{MoE: true, Prefix: "mlp.", Router: "gate", Proj: [3]string{"gate_proj", "up_proj", "down_proj"}}
	for _, e := range []struct {
		name string
		spec Spec
	}{
		{"LlamaForCausalLM", Spec{ModelType: "llama", MLP: dense}},
		{"MistralForCausalLM", Spec{ModelType: "mistral", Attention: AttentionSpec{SlidingWindow: true}, MLP: dense}},
		{"Qwen2ForCausalLM", Spec{ModelType: "qwen2", Attention: AttentionSpec{QKVBias: true, SlidingWindow: true}, MLP: dense}},
		{"Qwen3ForCausalLM", Spec{ModelType: "qwen3", Attention: AttentionSpec{QKNorm: true, SlidingWindow: true}, MLP: dense}},
		{"Qwen2MoeForCausalLM", Spec{ModelType: "qwen2_moe", Attention: AttentionSpec{QKVBias: true, SlidingWindow: true},
			MLP: MLPSpec{MoE: true, Prefix: "mlp.", Router: "gate", Proj: qwenMoE.Proj, SharedExpert: true}}},
		{"Qwen3MoeForCausalLM", Spec{ModelType: "qwen3_moe", Attention: AttentionSpec{QKNorm: true, SlidingWindow: true}, MLP: qwenMoE}},
		{"MixtralForCausalLM", Spec{ModelType: "mixtral", Attention: AttentionSpec{SlidingWindow: true},
			MLP: MLPSpec{MoE: true, Prefix: "block_sparse_moe.", Router: "gate", Proj: [3]string{"w1", "w3", "w2"}, NormTopK: NormTopKAlways}}},
	} {
		if err := r.Register(e.name, e.spec); err != nil {
			panic(err) // the built-in table is consistent
		}
	}
	return r
}

// Llama2CSpec is the architecture of llama2.c checkpoints: Llama with
// interleaved RoPE pairs.
func Llama2CSpec() *Spec {
	return &Spec{Name: "LlamaForCausalLM", ModelType: "llama", Attention: AttentionSpec{Rope: RopeInterleaved}}
}

// MustSpec returns the built-in Spec registered under name, for tests and
// tables that name a built-in architecture; it panics on unknown names.
func MustSpec(name string) *Spec {
	s, ok := Architectures().Lookup(name)
	if !ok {
		panic(fmt.Sprintf("model: no built-in architecture %q", name))
	}
	return s
}
