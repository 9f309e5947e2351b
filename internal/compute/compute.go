// Package compute is the contract between the engine and a model backend
// (cpu or cuda): one batched forward pass over sequences whose KV cache lives
// in a paged pool.
package compute

import (
	"context"
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
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

// DeviceSampler is an optional Model capability (found by type assertion):
// a forward pass that also samples, where the logits are, the next token of
// every seq with Logits set, so that only the sampled ids and the logprobs
// asked for reach the host. It follows internal/sampling's rule exactly:
// for equal logits, accepted tokens, seed and step it picks the token
// sampling.Sampler picks, and its logprobs are sampling.Logprobs' (raw:
// log-softmax of the unpenalised logits at temperature 1) to within float32
// rounding, the top ids equal.
//
// A request's device state (SamplerState) holds its parameters and seed
// and, when logit_bias or a penalty is on, the bias and a per-token count of
// its accepted output tokens (with the prompt's tokens marked for the
// repetition penalty). The caller makes it once per request, passes it to
// every pass that samples the request, and closes it when the request ends.
// A pass counts the token it samples; tokens accepted otherwise (sampled on
// the host, or by another server) are passed in Sample.Accept of the next
// pass that samples the request, and counted before its draw.
type DeviceSampler interface {
	// NewSamplerState makes one request's device state. An error (no room,
	// or no device sampling on this backend) means: sample this request on
	// the host.
	NewSamplerState(p sampling.Params, seed uint64, prompt []int32) (SamplerState, error)
	// ForwardSample is Forward that, for every seq i with Logits set,
	// counts samp[i].Accept into samp[i].State, samples output step
	// samp[i].Step into res[i] and counts that token; samp[i] and res[i]
	// of the other seqs are ignored. Accept is read during the call only.
	// On error no token is counted for sure: the caller must end the
	// requests of the batch.
	ForwardSample(ctx context.Context, seqs []Seq, samp []Sample, res []Sampled) error
}

// AsyncSampler is an optional DeviceSampler capability (found by type
// assertion): a sampling pass queued on the device and returned from at
// once, so that the host builds and queues the next pass while the device
// computes this one, and the device does not wait for the host between
// decode steps. The next pass can read its tokens from this one's sampled
// ids where they are, before the host has seen them.
//
// At most two passes are pending (started, results not yet waited for);
// they are waited for in the order started. A backend may run a pass to
// its end inside StartSample (one it cannot queue ahead); Wait then only
// hands over the results.
type AsyncSampler interface {
	// StartSample queues ForwardSample(seqs, samp) and returns its handle.
	// A seq i with from[i] >= 0 (from may be nil: none) is a one-token
	// decode whose token is the one the pass started just before this one
	// sampled for its seq from[i] (which had Logits set); its Tokens[0] is
	// ignored. Accept is read during the call only. On error nothing of
	// this pass is counted for sure: the caller ends its requests, and
	// still waits for the passes started before it.
	StartSample(ctx context.Context, seqs []Seq, samp []Sample, from []int) (Pending, error)
}

// Pending is a started pass of an AsyncSampler.
type Pending interface {
	// Wait blocks until the pass is done and writes ForwardSample's
	// results into res (len >= the pass's seqs). It is called once.
	Wait(res []Sampled) error
}

// SamplerState is one request's sampling state on a DeviceSampler.
type SamplerState interface {
	// Close frees the state; it must not be used again.
	Close() error
}

// Sample is what a ForwardSample pass samples for one seq.
type Sample struct {
	State SamplerState
	Step  uint64 // output step: the draw is sampling.Uniform(seed, Step)
	// Accept are output tokens accepted since the state's last pass that
	// it did not sample itself, counted (in order) before this draw.
	Accept      []int32
	Logprob     bool // return the sampled token's raw logprob
	TopLogprobs int  // return the n most likely tokens (0..sampling.MaxTopLogprobs)
}

// Sampled is one seq's result of a ForwardSample pass.
type Sampled struct {
	Token   int
	Logprob float32               // when Sample.Logprob, else 0
	Top     []sampling.TopLogprob // when Sample.TopLogprobs > 0, else nil; a new slice
}

// RankError is a failed forward pass of a tensor-parallel model: the rank
// whose failure ended it (the others stopped waiting for it) and why.
type RankError struct {
	Rank int
	Err  error
}

func (e *RankError) Error() string { return fmt.Sprintf("tp rank %d: %v", e.Rank, e.Err) }

func (e *RankError) Unwrap() error { return e.Err }
