package model

import "fmt"

// Spec is an architecture as data: the blocks every layer is made of and the
// tensors they read. Every backend composes its layer from these blocks, so
// an architecture that is a new combination of them needs only a Spec (and
// its config.json fields). A Spec is read-only once registered.
type Spec struct {
	Name      string // config.json "architectures" entry, e.g. "Qwen3ForCausalLM"
	ModelType string // config.json "model_type", e.g. "qwen3"
	Attention AttentionSpec
	MLP       MLPSpec
}

// AttentionSpec is the attention block: RMSNorm, q/k/v projections, RoPE,
// attention over the KV cache (grouped-query), the output projection and the
// residual add.
type AttentionSpec struct {
	QKVBias bool // q, k and v projections have biases (Qwen2)
	QKNorm  bool // q and k get a per-head RMSNorm over the head dim before RoPE (Qwen3)
	Rope    RopeStyle
	// SlidingWindow: config.json's sliding_window applies (Mistral,
	// Mixtral; Qwen2 and Qwen3 when use_sliding_window is set).
	SlidingWindow bool
}

// RopeStyle is how RoPE pairs the elements of a head.
type RopeStyle uint8

const (
	// RopeHalf rotates (x[i], x[i+d/2]), as HF's rotate_half does.
	RopeHalf RopeStyle = iota
	// RopeInterleaved rotates (x[2i], x[2i+1]), as llama2.c does.
	RopeInterleaved
)

func (r RopeStyle) String() string {
	if r == RopeInterleaved {
		return "interleaved"
	}
	return "half"
}

// MLPSpec is the feed-forward block: RMSNorm, a SwiGLU MLP (dense, or a
// mixture of experts) and the residual add.
type MLPSpec struct {
	// MoE: layers have a router over Config.Experts SwiGLU experts of
	// Config.ExpertDim, of which each token uses Config.TopK (dense layers
	// remain where Config.DenseLayer says).
	MoE bool
	// Prefix is the MoE module's name in the layer ("mlp." or
	// "block_sparse_moe."); Router the router's ("gate"); Proj the names of
	// an expert's gate, up and down projections. (Dense MLPs are
	// "mlp.{gate,up,down}_proj" in every architecture.)
	Prefix string
	Router string
	Proj   [3]string
	// NormTopK: the TopK routing weights are renormalised to sum to 1:
	// always (Mixtral) or as config.json's norm_topk_prob says.
	NormTopK NormTopK
	// SharedExpert: beside the routed experts, every token goes through a
	// shared SwiGLU expert of Config.SharedExpertDim whose output is scaled
	// by sigmoid(shared_expert_gate . x) (Qwen2-MoE).
	SharedExpert bool
}

// NormTopK says when routing weights are renormalised over the chosen experts.
type NormTopK uint8

const (
	NormTopKConfig NormTopK = iota // as config.json's norm_topk_prob says
	NormTopKAlways
)

// Role is what a tensor is in its layer.
type Role uint8

// The roles of tensors.
const (
	RoleEmbed Role = iota + 1
	RoleNorm
	RoleLMHead
	RoleAttnNorm
	RoleQ
	RoleK
	RoleV
	RoleO
	RoleQBias
	RoleKBias
	RoleVBias
	RoleQNorm
	RoleKNorm
	RoleMLPNorm
	RoleGate // dense gate_proj, or expert Expert's gate
	RoleUp
	RoleDown
	RoleRouter
	RoleSharedGate
	RoleSharedUp
	RoleSharedDown
	RoleSharedExpertGate
)

// TensorSpec is one tensor a model of a Spec has: its HF name, shape and the
// dtype it is written in; Layer and Expert are -1 where they do not apply.
type TensorSpec struct {
	Name   string
	Shape  []int
	DType  DType
	Role   Role
	Layer  int
	Expert int
}

// Tensors lists every tensor of a model of Spec s and shape c, in the order
// HF checkpoints usually hold them. dt is their dtype (the norms' too, as HF
// writes them).
func (s *Spec) Tensors(c *Config, dt DType) []TensorSpec {
	t := func(name string, r Role, layer, expert int, shape ...int) TensorSpec {
		return TensorSpec{Name: name, Shape: shape, DType: dt, Role: r, Layer: layer, Expert: expert}
	}
	d, qd, kvd := c.Dim, c.qDim(), c.kvDim()
	out := []TensorSpec{t("model.embed_tokens.weight", RoleEmbed, -1, -1, c.Vocab, d)}
	for i := 0; i < c.Layers; i++ {
		p := fmt.Sprintf("model.layers.%d.", i)
		a := p + "self_attn."
		out = append(out,
			t(p+"input_layernorm.weight", RoleAttnNorm, i, -1, d),
			t(a+"q_proj.weight", RoleQ, i, -1, qd, d),
			t(a+"k_proj.weight", RoleK, i, -1, kvd, d),
			t(a+"v_proj.weight", RoleV, i, -1, kvd, d),
			t(a+"o_proj.weight", RoleO, i, -1, d, qd))
		if s.Attention.QKVBias {
			out = append(out,
				t(a+"q_proj.bias", RoleQBias, i, -1, qd),
				t(a+"k_proj.bias", RoleKBias, i, -1, kvd),
				t(a+"v_proj.bias", RoleVBias, i, -1, kvd))
		}
		if s.Attention.QKNorm {
			out = append(out,
				t(a+"q_norm.weight", RoleQNorm, i, -1, c.HeadDim),
				t(a+"k_norm.weight", RoleKNorm, i, -1, c.HeadDim))
		}
		out = append(out, t(p+"post_attention_layernorm.weight", RoleMLPNorm, i, -1, d))
		if !c.MoELayer(i) {
			out = append(out,
				t(p+"mlp.gate_proj.weight", RoleGate, i, -1, c.HiddenDim, d),
				t(p+"mlp.up_proj.weight", RoleUp, i, -1, c.HiddenDim, d),
				t(p+"mlp.down_proj.weight", RoleDown, i, -1, d, c.HiddenDim))
			continue
		}
		m := p + s.MLP.Prefix
		out = append(out, t(m+s.MLP.Router+".weight", RoleRouter, i, -1, c.Experts, d))
		for e := 0; e < c.Experts; e++ {
			x := fmt.Sprintf("%sexperts.%d.", m, e)
			out = append(out,
				t(x+s.MLP.Proj[0]+".weight", RoleGate, i, e, c.ExpertDim, d),
				t(x+s.MLP.Proj[1]+".weight", RoleUp, i, e, c.ExpertDim, d),
				t(x+s.MLP.Proj[2]+".weight", RoleDown, i, e, d, c.ExpertDim))
		}
		if s.MLP.SharedExpert {
			out = append(out,
				t(m+"shared_expert.gate_proj.weight", RoleSharedGate, i, -1, c.SharedExpertDim, d),
				t(m+"shared_expert.up_proj.weight", RoleSharedUp, i, -1, c.SharedExpertDim, d),
				t(m+"shared_expert.down_proj.weight", RoleSharedDown, i, -1, d, c.SharedExpertDim),
				t(m+"shared_expert_gate.weight", RoleSharedExpertGate, i, -1, 1, d))
		}
	}
	out = append(out, t("model.norm.weight", RoleNorm, -1, -1, d))
	if !c.TiedEmbedding {
		out = append(out, t("lm_head.weight", RoleLMHead, -1, -1, c.Vocab, d))
	}
	return out
}

// LayerTensors are one layer's weights by role, in their stored dtypes; nil
// where the layer has no such tensor.
type LayerTensors struct {
	AttnNorm, Q, K, V, O *Tensor
	QBias, KBias, VBias  *Tensor
	QNorm, KNorm         *Tensor
	MLPNorm              *Tensor
	// Dense MLP.
	Gate, Up, Down *Tensor
	// MoE: the router [Experts][Dim] and the experts.
	Router  *Tensor
	Experts []Expert
	// Shared expert and its gate [1][Dim] (Qwen2-MoE).
	Shared     Expert
	SharedGate *Tensor
}

// Expert is one SwiGLU expert: gate and up [n][Dim], down [Dim][n].
type Expert struct {
	Gate, Up, Down *Tensor
}

// slot is where a tensor of role r belongs in m.
func (m *Model) slot(ts *TensorSpec) **Tensor {
	switch ts.Role {
	case RoleEmbed:
		return &m.Embed
	case RoleNorm:
		return &m.Norm
	case RoleLMHead:
		return &m.LMHead
	}
	l := &m.Layers[ts.Layer]
	if ts.Expert >= 0 {
		if len(l.Experts) <= ts.Expert {
			l.Experts = append(l.Experts, make([]Expert, ts.Expert+1-len(l.Experts))...)
		}
		e := &l.Experts[ts.Expert]
		switch ts.Role {
		case RoleGate:
			return &e.Gate
		case RoleUp:
			return &e.Up
		case RoleDown:
			return &e.Down
		}
	}
	switch ts.Role {
	case RoleAttnNorm:
		return &l.AttnNorm
	case RoleQ:
		return &l.Q
	case RoleK:
		return &l.K
	case RoleV:
		return &l.V
	case RoleO:
		return &l.O
	case RoleQBias:
		return &l.QBias
	case RoleKBias:
		return &l.KBias
	case RoleVBias:
		return &l.VBias
	case RoleQNorm:
		return &l.QNorm
	case RoleKNorm:
		return &l.KNorm
	case RoleMLPNorm:
		return &l.MLPNorm
	case RoleGate:
		return &l.Gate
	case RoleUp:
		return &l.Up
	case RoleDown:
		return &l.Down
	case RoleRouter:
		return &l.Router
	case RoleSharedGate:
		return &l.Shared.Gate
	case RoleSharedUp:
		return &l.Shared.Up
	case RoleSharedDown:
		return &l.Shared.Down
	case RoleSharedExpertGate:
		return &l.SharedGate
	}
	panic(fmt.Sprintf("model: tensor %s has no role", ts.Name))
}
