package model

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
)

// Tensor-parallel sharding, as SGLang and vLLM shard a model over tp ranks:
//   - attention by heads: rank r holds query heads QHeads(tp, r) and the
//     KV heads they read, KVHeads(tp, r): KVHeads/tp of them, or, when tp
//     exceeds the KV head count, the one its query heads read, replicated
//     on tp/KVHeads ranks; q/k/v projections column-parallel (their rows),
//     the output projection row-parallel (its columns), summed across ranks;
//   - the MLP column- then row-parallel: gate and up by rows, down by
//     columns, Split(intermediate, tp, r); every expert of a MoE layer the
//     same way (the router replicated), and the shared expert;
//   - the embedding and the LM head by vocabulary rows, VocabRows(tp, r):
//     each rank looks up its rows (zeros elsewhere) and the ranks sum; each
//     computes its logits and the ranks gather them.

// CheckTP reports whether c can be split over tp ranks.
func (c *Config) CheckTP(tp int) error {
	switch {
	case tp < 1:
		return fmt.Errorf("model: tensor parallel size %d", tp)
	case c.Heads%tp != 0:
		return fmt.Errorf("model: %d attention heads do not split over %d ranks", c.Heads, tp)
	case c.KVHeads%tp != 0 && tp%c.KVHeads != 0:
		return fmt.Errorf("model: %d KV heads neither split over %d ranks nor replicate onto them evenly", c.KVHeads, tp)
	}
	return nil
}

// QHeads is rank r's query heads [lo, hi) of tp ranks.
func (c *Config) QHeads(tp, r int) (lo, hi int) {
	n := c.Heads / tp
	return r * n, (r + 1) * n
}

// KVHeadsOf is rank r's KV heads [lo, hi) of tp ranks: those its query
// heads read.
func (c *Config) KVHeadsOf(tp, r int) (lo, hi int) {
	if tp <= c.KVHeads {
		n := c.KVHeads / tp
		return r * n, (r + 1) * n
	}
	h := r / (tp / c.KVHeads)
	return h, h + 1
}

// Split is rank r's part [lo, hi) of n rows split over tp ranks as evenly
// as whole rows allow.
func Split(n, tp, r int) (lo, hi int) { return n * r / tp, n * (r + 1) / tp }

// VocabShard is the rows of the vocabulary each rank's embedding and LM
// head hold: ceil(Vocab/tp) (the last rank may hold fewer).
func (c *Config) VocabShard(tp int) int { return (c.Vocab + tp - 1) / tp }

// VocabRows is rank r's vocabulary rows [lo, hi).
func (c *Config) VocabRows(tp, r int) (lo, hi int) {
	n := c.VocabShard(tp)
	return min(r*n, c.Vocab), min((r+1)*n, c.Vocab)
}

// KVShards are the KV pools of tp ranks: the rank's layout (KVLayout with
// its KV heads) and its first head.
func (c *Config) KVShards(tp, pageSize, pages, elemBytes int, order kvcache.Order) []kvcache.Shard {
	out := make([]kvcache.Shard, tp)
	for r := range out {
		lo, hi := c.KVHeadsOf(tp, r)
		l := c.KVLayout(pageSize, pages, elemBytes)
		l.KVHeads, l.Order = hi-lo, order
		out[r] = kvcache.Shard{Layout: l, FirstHead: lo}
	}
	return out
}
