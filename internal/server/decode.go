package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strconv"
	"unicode/utf8"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// readBody reads a request body of at most limit bytes: 413 beyond it.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *Error) {
	// Start at the announced size, up to 64 KiB: a client that announces more and
	// sends nothing holds no more than that.
	size := min(max(r.ContentLength, 0), limit, 64<<10)
	buf := bytes.NewBuffer(make([]byte, 0, size+1))
	_, err := buf.ReadFrom(http.MaxBytesReader(w, r.Body, limit))
	body := buf.Bytes()
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, errorf(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", mbe.Limit)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return nil, &Error{Status: http.StatusRequestTimeout, Message: "the request body did not arrive within the read timeout", Err: err}
		}
		return nil, badRequest("", "reading request body: %v", err)
	}
	return body, nil
}

// unmarshalObject decodes a request body, a JSON object, into v (a pointer to a struct)
// with decodeObject.
func unmarshalObject(body []byte, v any) *Error {
	b := bytes.TrimSpace(body)
	if len(b) == 0 {
		return badRequest("", "empty request body: expected a JSON object")
	}
	if b[0] != '{' {
		return badRequest("", "request body must be a JSON object")
	}
	if !json.Valid(b) {
		var probe any
		return jsonError(json.Unmarshal(b, &probe))
	}
	return decodeObject("", b, v)
}

// jsonError describes malformed JSON.
func jsonError(err error) *Error {
	var se *json.SyntaxError
	switch {
	case errors.As(err, &se):
		return badRequest("", "malformed JSON at byte %d: %v", se.Offset, se)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("", "malformed JSON: unexpected end of input")
	default:
		return badRequest("", "malformed JSON: %v", err)
	}
}

// unquote decodes a JSON string value (from a parsed body: valid JSON). One without
// escapes, in valid UTF-8, is its bytes: no second scan of a long prompt.
func unquote(raw json.RawMessage) (string, error) {
	b := bytes.TrimSpace(raw)
	if len(b) >= 2 && b[0] == '"' && b[len(b)-1] == '"' {
		if in := b[1 : len(b)-1]; bytes.IndexByte(in, '\\') < 0 && utf8.Valid(in) {
			return string(in), nil
		}
	}
	var s string
	err := json.Unmarshal(raw, &s)
	return s, err
}

// jsonKind is the kind of a raw JSON value by its first byte.
func jsonKind(raw json.RawMessage) string {
	b := bytes.TrimSpace(raw)
	if len(b) == 0 {
		return "absent"
	}
	switch b[0] {
	case 'n':
		return "null"
	case '"':
		return "string"
	case '[':
		return "array"
	case '{':
		return "object"
	case 't', 'f':
		return "boolean"
	default:
		return "number"
	}
}

// stopList is OpenAI's and SGLang's "stop": a string or a list of strings.
type stopList []string

func (s *stopList) UnmarshalJSON(b []byte) error {
	switch jsonKind(b) {
	case "null":
		*s = nil
		return nil
	case "string":
		var one string
		if err := json.Unmarshal(b, &one); err != nil {
			return err
		}
		if one == "" {
			*s = nil
		} else {
			*s = stopList{one}
		}
		return nil
	case "array":
		var many []string
		if err := json.Unmarshal(b, &many); err != nil {
			return errStopType
		}
		out := many[:0]
		for _, m := range many {
			if m != "" {
				out = append(out, m)
			}
		}
		*s = stopList(out)
		return nil
	default:
		return errStopType
	}
}

var errStopType = errors.New("expected a string or a list of strings")

// sampling is the sampling fields common to every API, as pointers so that
// absent and zero differ.
type sampling struct {
	MaxNewTokens      *int
	Temperature       *float64
	TopP              *float64
	TopK              *int
	MinP              *float64
	FrequencyPenalty  *float64
	PresencePenalty   *float64
	RepetitionPenalty *float64
	Stop              stopList
	StopTokenIDs      []int
	IgnoreEOS         bool
	Seed              *int64
	N                 *int // read by the decoders into spec.n
	LogitBias         json.RawMessage

	maxName string // the field that carried MaxNewTokens: "max_new_tokens" or "max_tokens"
	prefix  string // "sampling_params." for /generate
}

// params checks the fields and converts them; maxZero reports an explicit
// request for zero new tokens.
func (p *sampling) params(vocab int) (sp engine.SamplingParams, maxZero bool, e *Error) {
	f := func(name string) string { return p.prefix + name }
	finite := func(name string, v *float64) *Error {
		if v != nil && (math.IsNaN(*v) || math.IsInf(*v, 0)) {
			return badRequest(f(name), "%s must be a finite number", f(name))
		}
		return nil
	}
	for _, c := range []struct {
		name string
		v    *float64
	}{{"temperature", p.Temperature}, {"top_p", p.TopP}, {"min_p", p.MinP},
		{"frequency_penalty", p.FrequencyPenalty}, {"presence_penalty", p.PresencePenalty}, {"repetition_penalty", p.RepetitionPenalty}} {
		if e := finite(c.name, c.v); e != nil {
			return sp, false, e
		}
	}
	if v := p.MaxNewTokens; v != nil {
		if *v < 0 {
			return sp, false, badRequest(f(p.maxName), "%s must be >= 0, got %d", f(p.maxName), *v)
		}
		sp.MaxNewTokens = *v
		maxZero = *v == 0
	}
	if v := p.Temperature; v != nil {
		if *v < 0 {
			return sp, false, badRequest(f("temperature"), "%s must be >= 0, got %g", f("temperature"), *v)
		}
		sp.Temperature = *v
	}
	if v := p.TopP; v != nil {
		if *v <= 0 || *v > 1 {
			return sp, false, badRequest(f("top_p"), "%s must be in (0, 1], got %g", f("top_p"), *v)
		}
		sp.TopP = *v
	}
	if v := p.TopK; v != nil {
		if *v < -1 {
			return sp, false, badRequest(f("top_k"), "%s must be -1 (off) or >= 1, got %d", f("top_k"), *v)
		}
		sp.TopK = *v
	}
	if v := p.MinP; v != nil {
		if *v < 0 || *v > 1 {
			return sp, false, badRequest(f("min_p"), "%s must be in [0, 1], got %g", f("min_p"), *v)
		}
		sp.MinP = *v
	}
	if v := p.FrequencyPenalty; v != nil {
		if *v < -2 || *v > 2 {
			return sp, false, badRequest(f("frequency_penalty"), "%s must be in [-2, 2], got %g", f("frequency_penalty"), *v)
		}
		sp.FrequencyPenalty = *v
	}
	if v := p.PresencePenalty; v != nil {
		if *v < -2 || *v > 2 {
			return sp, false, badRequest(f("presence_penalty"), "%s must be in [-2, 2], got %g", f("presence_penalty"), *v)
		}
		sp.PresencePenalty = *v
	}
	if v := p.RepetitionPenalty; v != nil {
		if *v <= 0 || *v > 2 {
			return sp, false, badRequest(f("repetition_penalty"), "%s must be in (0, 2], got %g", f("repetition_penalty"), *v)
		}
		sp.RepetitionPenalty = *v
	}
	for _, id := range p.StopTokenIDs {
		if id < 0 || (vocab > 0 && id >= vocab) {
			return sp, false, badRequest(f("stop_token_ids"), "%s: token id %d is outside the vocabulary [0, %d)", f("stop_token_ids"), id, vocab)
		}
	}
	if sp.LogitBias, e = logitBias(f("logit_bias"), p.LogitBias, vocab); e != nil {
		return sp, false, e
	}
	sp.Stop = []string(p.Stop)
	sp.StopTokenIDs = p.StopTokenIDs
	sp.IgnoreEOS = p.IgnoreEOS
	sp.Seed = p.Seed
	return sp, maxZero, nil
}

// prompt is a request's input before tokenization: text or token ids.
type prompt struct {
	text   string
	ids    []int
	isText bool
	addBOS bool // for text
	field  string
}

// Prompt forms decodePrompt accepts.
const (
	promptText = 1 << iota // a string (or a list of one)
	promptIDs              // a list of integer token ids (or a list of one)
)

// decodePrompts reads a request's prompt field: one prompt in one of the forms allowed,
// or a batch (a list of strings, or a list of lists of token ids), each element its own
// request. batch reports a list (answered with a list, as SGLang answers it).
func decodePrompts(field string, raw json.RawMessage, forms int) (ps []prompt, batch bool, e *Error) {
	if jsonKind(raw) == "array" {
		elems := elements(raw)
		if len(elems) > 0 {
			switch k := jsonKind(elems[0]); {
			case k == "string" && forms&promptText != 0, k == "array" && forms&promptIDs != 0:
				ps = make([]prompt, len(elems))
				for i, el := range elems {
					at := field + "[" + strconv.Itoa(i) + "]"
					want := promptText
					if k == "array" {
						want = promptIDs
					}
					if ek := jsonKind(el); ek != k {
						return nil, false, badRequest(field, "%s: expected %s like %s[0], got JSON %s", at, map[string]string{"string": "a string", "array": "a list of token ids"}[k], field, ek)
					}
					if ps[i], e = decodePromptAt(field, at, el, want); e != nil {
						return nil, false, e
					}
				}
				return ps, true, nil
			}
		}
	}
	p, e := decodePromptAt(field, field, raw, forms)
	if e != nil {
		return nil, false, e
	}
	return []prompt{p}, false, nil
}

// decodePromptAt reads one prompt at path at (field, or an element of it): a string,
// or a flat list of integer token ids.
func decodePromptAt(field, at string, raw json.RawMessage, forms int) (prompt, *Error) {
	want := "a string or a list of integer token ids"
	switch forms {
	case promptText:
		want = "a string"
	case promptIDs:
		want = "a list of integer token ids"
	}
	switch k := jsonKind(raw); k {
	case "absent", "null":
		return prompt{}, badRequest(field, "%s is required", at)
	case "string":
		if forms&promptText == 0 {
			return prompt{}, badRequest(field, "%s: expected %s, got JSON string", at, want)
		}
		s, err := unquote(raw)
		if err != nil {
			return prompt{}, jsonError(err)
		}
		return prompt{text: s, isText: true, addBOS: true, field: field}, nil
	case "array":
	default:
		return prompt{}, badRequest(field, "%s: expected %s, got JSON %s", at, want, k)
	}
	if forms&promptIDs == 0 {
		return prompt{}, badRequest(field, "%s: expected %s, got a list", at, want)
	}
	elems := elements(raw)
	ids := make([]int, len(elems))
	for i, el := range elems {
		if k := jsonKind(el); k != "number" {
			return prompt{}, badRequest(field, "%s[%d]: expected an integer token id, got JSON %s", at, i, k)
		}
		id, err := strconv.Atoi(string(el)) // JSON's integers, as encoding/json takes them
		if err != nil {
			return prompt{}, badRequest(field, "%s[%d]: expected an integer token id, got JSON number %s", at, i, el)
		}
		ids[i] = id
	}
	return prompt{ids: ids, field: field}, nil
}

// bootstrapFields are the disaggregation fields the load balancer adds.
type bootstrapFields struct {
	BootstrapHost *string `json:"bootstrap_host"`
	BootstrapPort *int    `json:"bootstrap_port"`
	BootstrapRoom *uint64 `json:"bootstrap_room"`
}

func (b *bootstrapFields) bootstrap() (*Bootstrap, *Error) {
	if b.BootstrapHost == nil && b.BootstrapPort == nil && b.BootstrapRoom == nil {
		return nil, nil
	}
	out := &Bootstrap{}
	if b.BootstrapHost != nil {
		out.Host = *b.BootstrapHost
	}
	if b.BootstrapPort != nil {
		if *b.BootstrapPort < 0 || *b.BootstrapPort > 65535 {
			return nil, badRequest("bootstrap_port", "bootstrap_port %d is not a port", *b.BootstrapPort)
		}
		out.Port = *b.BootstrapPort
	}
	if b.BootstrapRoom != nil {
		out.Room = *b.BootstrapRoom
	}
	return out, nil
}

// defaultMaxNewTokens is the engine's default for SamplingParams.MaxNewTokens 0.
const defaultMaxNewTokens = 128

// spec is a decoded request of any API, ready to be tokenized and submitted: one
// prompt or a batch of them, each generated n times.
type spec struct {
	prompts []prompt
	// batch: the prompt was a list (answered with a list).
	batch bool
	// samplings are the sampling fields: one for every prompt, or one per prompt.
	samplings []sampling
	// n is how many completions each prompt gets (1 if not set).
	n        int
	logprobs bool
	// topLogprobs: how many most likely tokens to return with each output
	// token (with logprobs; completions: logprobs, chat: top_logprobs,
	// /generate: top_logprobs_num).
	topLogprobs int
	// textInLogprobs: /generate's return_text_in_logprobs.
	textInLogprobs bool
	// inputLogprobs: /generate's logprob_start_len asks for the prompt's logprobs
	// (only its last position: logprob_start_len -1 or len(prompt)-1).
	inputLogprobs bool
	// logprobStart is logprob_start_len as given (-1: the last prompt position).
	logprobStart int
	stream       bool
	rids         ridList // rid: one (a prefix for a batch's elements) or one per prompt
	ridField     string
	// nField and promptField name the fields that carried n and the prompt.
	nField, promptField string
	boot                *Bootstrap
}

// samplingOf is prompt i's sampling fields.
func (sp *spec) samplingOf(i int) *sampling {
	if len(sp.samplings) == 1 {
		return &sp.samplings[0]
	}
	return &sp.samplings[i]
}

// single reports a request of one prompt, generated once: answered with an object.
func (sp *spec) single() bool { return !sp.batch && sp.n <= 1 }

// count is how many generations the request makes.
func (sp *spec) count() int { return len(sp.prompts) * max(sp.n, 1) }

// MaxN is the largest n (completions per prompt) a request may ask for.
const MaxN = 128

// DefaultMaxBatch bounds the generations of one request (prompts times n) when
// Config.MaxBatch is 0.
const DefaultMaxBatch = 256

// checkCount checks n and the batch's size, naming the field that carried the count.
func (s *Server) checkCount(sp *spec) *Error {
	nField, promptField := sp.nField, sp.promptField
	if sp.n < 1 || sp.n > MaxN {
		return badRequest(nField, "%s must be in [1, %d], got %d", nField, MaxN, sp.n)
	}
	if len(sp.prompts) == 0 {
		return badRequest(promptField, "%s is an empty list", promptField)
	}
	if c := sp.count(); c > s.cfg.MaxBatch {
		f := promptField
		if len(sp.prompts) == 1 {
			f = nField
		}
		return badRequest(f, "%d prompts times n=%d is %d generations, more than this server takes in one request (%d)", len(sp.prompts), sp.n, c, s.cfg.MaxBatch)
	}
	if sp.boot != nil && sp.count() > 1 {
		f := promptField
		if !sp.batch {
			f = nField
		}
		return badRequest(f, "batches and n > 1 are not supported on disaggregated requests yet: send one prompt with n=1 per request")
	}
	switch r := sp.rids; {
	case r.list && !sp.batch:
		return badRequest(sp.ridField, "%s is a list but the prompt is not", sp.ridField)
	case r.list && len(r.ids) != len(sp.prompts):
		return badRequest(sp.ridField, "%s has %d ids for %d prompts", sp.ridField, len(r.ids), len(sp.prompts))
	}
	return nil
}

// rid is the request id of prompt i's sample j ("": generated).
func (sp *spec) rid(i, j int) string {
	r := sp.rids
	switch {
	case len(r.ids) == 0:
		return ""
	case r.list && sp.n <= 1:
		return r.ids[i]
	case r.list:
		return r.ids[i] + "_" + strconv.Itoa(j)
	case r.ids[0] == "":
		return ""
	case sp.single():
		return r.ids[0]
	default:
		return r.ids[0] + "_" + strconv.Itoa(i*max(sp.n, 1)+j)
	}
}

// ridList is SGLang's rid: a string, or a list of strings (one per prompt of a batch).
type ridList struct {
	ids  []string
	list bool
}

func (r *ridList) UnmarshalJSON(b []byte) error {
	switch jsonKind(b) {
	case "null":
		*r = ridList{}
		return nil
	case "string":
		var one string
		if err := json.Unmarshal(b, &one); err != nil {
			return err
		}
		*r = ridList{ids: []string{one}}
		return nil
	case "array":
		var many []string
		if err := json.Unmarshal(b, &many); err != nil {
			return errRidType
		}
		*r = ridList{ids: many, list: true}
		return nil
	}
	return errRidType
}

var errRidType = errors.New("expected a string or a list of strings")

// tooLong is the error for a prompt the tokenizer stopped at the context's length.
func (s *Server) tooLong(field string, tl *tokenizer.TooLongError) *Error {
	n := s.cfg.ContextLen
	msg := fmt.Sprintf("the prompt (at least %d tokens) is longer than the model's context length (%d tokens)", tl.Tokens, n)
	if tl.Length {
		msg = fmt.Sprintf("the prompt (%d bytes: at least %d tokens) is longer than the model's context length (%d tokens)", tl.Bytes, tl.Tokens, n)
	}
	return &Error{Status: http.StatusBadRequest, Param: field, Message: msg, Err: fmt.Errorf("%w: %w", engine.ErrPromptTooLong, tl)}
}

// build tokenizes and checks prompt i of sp and makes its engine request. maxZero
// reports a request for zero new tokens, which is answered without the engine.
func (s *Server) build(sp *spec, i int) (req *engine.Request, maxZero bool, e *Error) {
	vocab := s.cfg.Tokenizer.VocabSize()
	params, maxZero, e := sp.samplingOf(i).params(vocab)
	if e != nil {
		return nil, false, e
	}
	p := sp.prompts[i]
	ids := p.ids
	if p.isText {
		if p.text == "" {
			return nil, false, badRequest(p.field, "%s is empty", p.field)
		}
		limit := -1 // the context's length: longer prompts stop the tokenizer there
		if s.cfg.ContextLen > 0 {
			limit = s.cfg.ContextLen - 1
		}
		var err error
		ids, err = s.cfg.Tokenizer.EncodeLimit(p.text, p.addBOS, limit)
		var tl *tokenizer.TooLongError
		switch {
		case errors.As(err, &tl):
			return nil, false, s.tooLong(p.field, tl)
		case err != nil:
			return nil, false, badRequest(p.field, "%s: tokenizing: %v", p.field, err)
		}
	}
	if len(ids) == 0 {
		return nil, false, badRequest(p.field, "%s is empty", p.field)
	}
	for _, id := range ids {
		if id < 0 || (vocab > 0 && id >= vocab) {
			return nil, false, badRequest(p.field, "%s: token id %d is outside the vocabulary [0, %d)", p.field, id, vocab)
		}
	}
	if n := s.cfg.ContextLen; n > 0 {
		if len(ids) >= n {
			return nil, false, &Error{Status: http.StatusBadRequest, Param: p.field, Err: engine.ErrPromptTooLong,
				Message: fmt.Sprintf("the prompt (%d tokens) is longer than the model's context length (%d tokens)", len(ids), n)}
		}
		want := params.MaxNewTokens
		if want == 0 {
			want = defaultMaxNewTokens
		}
		if room := n - len(ids); want > room {
			params.MaxNewTokens = room // finishes with "length" at the end of the context
		}
	}
	if sp.inputLogprobs && sp.logprobStart >= 0 && sp.logprobStart != len(ids)-1 {
		if sp.logprobStart >= len(ids) {
			return nil, false, badRequest("logprob_start_len", "logprob_start_len %d is not below the prompt's %d tokens", sp.logprobStart, len(ids))
		}
		return nil, false, badRequest("logprob_start_len", "logprob_start_len %d is not supported: the backends compute logits for a prompt's last position only, so its logprobs start there (-1, or %d for this prompt)",
			sp.logprobStart, len(ids)-1)
	}
	er := &engine.Request{ID: sp.rid(i, 0), InputIDs: ids, Params: params, Logprobs: sp.logprobs}
	if sp.logprobs {
		er.TopLogprobs = sp.topLogprobs
	}
	return er, maxZero, nil
}
