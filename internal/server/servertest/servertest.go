// Package servertest has fakes of the server's dependencies, for tests of the
// server and of what talks to it (the load balancer, clients): a byte-level
// Tokenizer and a scripted Generator that behaves like the engine's contract
// (cancelling ctx aborts; the channel closes after the Finish event).
package servertest

import (
	"context"
	"fmt"
	"strings"
	"sync"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/sampling"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// Token ids of Tokenizer beyond the 256 bytes.
const (
	BOS   = 256
	EOS   = 257
	Vocab = 258
)

// Tokenizer is byte-level: ids 0..255 are bytes, then BOS and EOS.
type Tokenizer struct{}

// Encode returns the bytes of text, after BOS if addBOS.
func (Tokenizer) Encode(text string, addBOS bool) ([]int, error) {
	ids := make([]int, 0, len(text)+1)
	if addBOS {
		ids = append(ids, BOS)
	}
	for i := 0; i < len(text); i++ {
		ids = append(ids, int(text[i]))
	}
	return ids, nil
}

// EncodeLimit is Encode for at most limit ids (negative: no limit): one id per
// byte, so the length decides.
func (t Tokenizer) EncodeLimit(text string, addBOS bool, limit int) ([]int, error) {
	n := len(text)
	if addBOS {
		n++
	}
	if limit >= 0 && n > limit {
		return nil, &tokenizer.TooLongError{Limit: limit, Tokens: n, Bytes: len(text), Length: true}
	}
	return t.Encode(text, addBOS)
}

// Decode returns the bytes of ids; special tokens decode to nothing.
func (Tokenizer) Decode(ids []int) string {
	var b strings.Builder
	for _, id := range ids {
		if id >= 0 && id < 256 {
			b.WriteByte(byte(id))
		}
	}
	return b.String()
}

func (Tokenizer) VocabSize() int { return Vocab }
func (Tokenizer) BOS() int       { return BOS }
func (Tokenizer) EOS() []int     { return []int{EOS} }

// TokenText is the byte of id, or "<s>" and "</s>".
func (Tokenizer) TokenText(id int) string {
	switch {
	case id == BOS:
		return "<s>"
	case id == EOS:
		return "</s>"
	case id >= 0 && id < 256:
		return string([]byte{byte(id)})
	}
	return ""
}

// DefaultReply is what Generator generates when Reply is empty.
const DefaultReply = "Hello, world!"

// Generator is a scripted engine. With no Script it generates Reply (or
// DefaultReply) one byte per token, then EOS (finish "stop", matched EOS)
// unless ignore_eos, repeating Reply until max_new_tokens when ignore_eos;
// max_new_tokens ends it with "length". Logprobs are -0.5 per token.
type Generator struct {
	Reply string
	// Err, when set, is what Submit returns.
	Err error
	// Script, when set, makes the events of a request instead.
	Script func(r *engine.Request) []engine.Event
	// Hold, when set, is waited on (or the request's ctx) before the first event.
	Hold <-chan struct{}

	mu       sync.Mutex
	requests []*engine.Request
	aborted  int
}

// Requests returns the requests submitted so far.
func (g *Generator) Requests() []*engine.Request {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*engine.Request(nil), g.requests...)
}

// Aborted is how many requests ended because their ctx was cancelled.
func (g *Generator) Aborted() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.aborted
}

// Submit starts a request.
func (g *Generator) Submit(ctx context.Context, r *engine.Request) (<-chan engine.Event, error) {
	if g.Err != nil {
		return nil, g.Err
	}
	if len(r.InputIDs) == 0 {
		return nil, fmt.Errorf("%w: empty prompt", engine.ErrBadRequest)
	}
	g.mu.Lock()
	g.requests = append(g.requests, r)
	g.mu.Unlock()
	var events []engine.Event
	if g.Script != nil {
		events = g.Script(r)
	} else {
		events = g.reply(r)
	}
	ch := make(chan engine.Event)
	go func() {
		defer close(ch)
		abort := func() {
			g.mu.Lock()
			g.aborted++
			g.mu.Unlock()
			ch <- engine.Event{Token: -1, Finish: &engine.Finish{Type: "abort", Err: context.Cause(ctx), PromptTokens: len(r.InputIDs)}}
		}
		if g.Hold != nil {
			select {
			case <-g.Hold:
			case <-ctx.Done():
				abort()
				return
			}
		}
		for _, ev := range events {
			if ctx.Err() != nil {
				abort()
				return
			}
			select {
			case ch <- ev:
			case <-ctx.Done():
				abort()
				return
			}
		}
	}()
	return ch, nil
}

// top is the fake's most likely tokens when r asks: the chosen token at
// -0.5, then the next token ids at -1, -2, ...
func top(r *engine.Request, tok int) []sampling.TopLogprob {
	if r.TopLogprobs <= 0 {
		return nil
	}
	out := []sampling.TopLogprob{{Token: tok, Logprob: -0.5}}
	for k := 1; k < r.TopLogprobs; k++ {
		out = append(out, sampling.TopLogprob{Token: tok + k, Logprob: -float32(k)})
	}
	return out
}

func (g *Generator) reply(r *engine.Request) []engine.Event {
	reply := g.Reply
	if reply == "" {
		reply = DefaultReply
	}
	max := r.Params.MaxNewTokens
	if max == 0 {
		max = 128
	}
	var events []engine.Event
	for i := 0; ; i++ {
		if i == len(reply) && !r.Params.IgnoreEOS {
			events = append(events, engine.Event{Token: EOS, Logprob: -0.5, Top: top(r, EOS),
				Finish: &engine.Finish{Type: "stop", Matched: EOS, PromptTokens: len(r.InputIDs), OutputTokens: i + 1}})
			return events
		}
		c := reply[i%len(reply)]
		ev := engine.Event{Token: int(c), Logprob: -0.5, Top: top(r, int(c)), Text: string([]byte{c})}
		if i+1 == max {
			ev.Finish = &engine.Finish{Type: "length", PromptTokens: len(r.InputIDs), OutputTokens: i + 1}
			return append(events, ev)
		}
		events = append(events, ev)
	}
}
