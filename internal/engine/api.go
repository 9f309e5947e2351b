// Package engine runs requests on a model backend: tokenized prompts in,
// sampled tokens and text out, with continuous batching, chunked prefill and
// a paged KV cache.
package engine

import (
	"errors"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
)

// Sentinel errors; wrap with %w and classify with errors.Is.
var (
	ErrClosed        = errors.New("engine: closed")
	ErrBadRequest    = errors.New("engine: bad request")     // HTTP 400
	ErrOverloaded    = errors.New("engine: overloaded")      // HTTP 503: queue full
	ErrPromptTooLong = errors.New("engine: prompt too long") // HTTP 400
	// ErrQueueTimeout: a request waited MaxQueueWait in the admission queue
	// without getting its pages (HTTP 503).
	ErrQueueTimeout = errors.New("engine: admission queue wait timed out")
)

// SamplingParams follows SGLang's sampling_params. Zero values mean the
// defaults noted on each field.
type SamplingParams struct {
	MaxNewTokens     int     // 0 means 128 (SGLang's default)
	Temperature      float64 // 0 means greedy
	TopP             float64 // 0 or 1 means off
	TopK             int     // 0 or -1 means off
	MinP             float64 // 0 means off
	Seed             *int64  // nil: from the engine's seed source
	FrequencyPenalty float64
	PresencePenalty  float64
	// RepetitionPenalty scales the logits of tokens already in the prompt
	// or the output (0 or 1: off; > 1 discourages repeats).
	RepetitionPenalty float64
	// LogitBias is added to the logits of its token ids (in the
	// vocabulary) before the penalties, for sampling only: at most
	// sampling.MaxLogitBias entries in [-100, 100] (OpenAI's logit_bias).
	LogitBias    map[int]float64
	Stop         []string // stop strings; the matched string is not part of the output text
	StopTokenIDs []int
	IgnoreEOS    bool
}

// Request is one generation request.
type Request struct {
	ID       string // rid; generated when empty
	InputIDs []int
	Params   SamplingParams
	Logprobs bool // return the logprob of every output token
	// TopLogprobs, when > 0, returns with every output token the most
	// likely tokens at its position (at most sampling.MaxTopLogprobs).
	TopLogprobs int

	// Room is the bootstrap room of a disaggregated request (0 when colocated);
	// it only labels logs here.
	Room uint64
	// Prefill, when set, makes this a prefill-only request (disaggregation,
	// prefill side): the prompt runs, the first token is sampled, the hooks are
	// called, and the request finishes without decoding.
	Prefill PrefillHook
	// Preloaded, when set, makes this a decode-side request whose prompt KV is
	// already in the pool (disaggregation, decode side): no prompt compute.
	// Submit takes its Table in every outcome: the engine releases it when
	// the request ends, or at once if Submit fails.
	Preloaded *Preloaded
}

// PrefillHook receives the progress of a prefill-only request. Calls come
// from the engine loop in order; they must not block for long.
type PrefillHook interface {
	// Pages is called once, before the first chunk runs, with the pages the
	// engine allocated for the prompt; the hook may keep them until Done.
	Pages(pages []int32)
	// Chunk is called after each prefill chunk with the number of prompt
	// tokens whose KV is now in the pool (cumulative).
	Chunk(tokensDone int)
	// Done is called once with the first sampled token and its logprob, or
	// with err set if the request failed or was aborted. The pages stay
	// allocated until release is called (exactly once), so the transfer can
	// finish.
	Done(first int, logprob float32, top []sampling.TopLogprob, err error, release func())
}

// PrefillLayerHook is an optional PrefillHook method: with a backend that
// reports layers, Layer is called during a chunk's forward pass once layer
// l's KV of the chunk is written (or queued: wait for ready, if not nil,
// before reading it). tokensDone is what Chunk will report after the pass.
// Calls for one request come in layer order, possibly from a backend
// goroutine, and must not block.
type PrefillLayerHook interface {
	Layer(l, tokensDone int, ready compute.Fence)
}

// PrefillGate is an optional PrefillHook method: until the channel is
// closed (for example until the decode side has said where the KV goes) the
// request does not block the queue and is admitted only if the pool keeps a
// quarter of its pages free after it, so requests whose gates are open never
// wait behind pages held for ones that may wait long. A gated request that
// the hook aborts (PrefillAborter) is finished as aborted.
type PrefillGate interface {
	Ready() <-chan struct{}
}

// PrefillCacheHook is an optional PrefillHook method: at admission, how
// many prompt tokens came from the prefix cache (their KV is in the first
// pages already; Chunk counts them as done).
type PrefillCacheHook interface {
	Cached(tokens int)
}

// PrefillAborter is an optional PrefillHook method: the engine checks it
// every step and aborts the request (calling Done with the error) once it
// returns non-nil, so the disaggregation layer can stop computing a prompt
// whose decode side is gone.
type PrefillAborter interface {
	Aborted() error
}

// Preloaded is a decode-side request whose prompt KV is already in Table's
// first pages and whose first token was sampled by the prefill server.
type Preloaded struct {
	// Table holds positions 0..len(InputIDs)-1 in its first pages, and may
	// hold every page the request needs (Engine.KVPages): the engine
	// reserves only what is missing. It passes to the engine with Submit.
	Table        *kvcache.Table
	FirstToken   int
	FirstLogprob float32
	FirstTop     []sampling.TopLogprob // when the request asked for TopLogprobs
	// CachedTokens is how many prompt tokens the prefill took from its
	// prefix cache (reported in Finish).
	CachedTokens int
}

// Event is one step of a request's output. Text is the new text since the
// previous event (never broken UTF-8, never a prefix of a stop string that
// may still match); Token is the new token (-1 when an event carries only a
// Finish).
type Event struct {
	Token   int
	Logprob float32
	Top     []sampling.TopLogprob // the most likely tokens here, when Request.TopLogprobs > 0
	Text    string
	Finish  *Finish // set on the last event
}

// Finish says why a request ended. Type is "stop", "length" or "abort";
// Matched is the stop string or stop token id that ended it (nil otherwise);
// Err is set for "abort" with the cause.
type Finish struct {
	Type         string
	Matched      any
	Err          error
	PromptTokens int
	OutputTokens int
	// CachedTokens is how many prompt tokens were not computed for this
	// request: taken from the prefix cache here, or by the prefill server.
	CachedTokens int
}
