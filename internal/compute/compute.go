// Package compute is the contract between the engine and a model backend
// (cpu or cuda): one batched forward pass over sequences whose KV cache lives
// in a paged pool.
package compute

import (
	"context"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// Seq is one sequence's share of a forward pass.
type Seq struct {
	Tokens []int32 // tokens to process now (a prefill chunk, or one decode token)
	Pos    int     // position of Tokens[0]; positions 0..Pos-1 are already in the KV cache
	Pages  []int32 // page table covering positions 0..Pos+len(Tokens)-1
	Logits bool    // compute logits for the last token of Tokens
	// Layer, if set, is told during the pass, layer by layer, that this
	// seq's KV of layer l for Tokens is written: at once (ready nil), or,
	// on a device that runs asynchronously, once ready.Wait returns. A
	// backend may skip the calls (the pass's end covers every layer); it
	// makes them in layer order, possibly from one of its own goroutines.
	Layer func(l int, ready Fence)
}

// Fence is a point in a backend's queued work.
type Fence interface {
	// Wait blocks until the work before the fence is done.
	Wait() error
}

// Model runs forward passes. The KV of every processed token is written into
// the pool at its position's page. A backend's result for a sequence must not
// depend on what else is in the batch or on how its prompt was chunked.
type Model interface {
	Config() model.Config
	// Layout is the KV pool's layout.
	Layout() kvcache.Layout
	// Forward processes seqs and writes, for each seq with Logits set, the
	// vocabulary logits of its last token into out[i] (len Config().Vocab);
	// out[i] is untouched for the others.
	Forward(ctx context.Context, seqs []Seq, out [][]float32) error
	Close() error
}
