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
	N                 *int
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
	if p.N != nil && *p.N != 1 {
		return sp, false, badRequest(f("n"), "%s=%d is not supported: only n=1", f("n"), *p.N)
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

// decodePrompt reads a single prompt, given as one of the forms allowed; batches (lists
// of several) get 400, and so does anything else, naming field.
func decodePrompt(field string, raw json.RawMessage, forms int) (prompt, *Error) {
	return decodePromptAt(field, field, raw, forms)
}

// decodePromptAt is decodePrompt for the value at path at (field, or an element of it).
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
	elems := elements(raw)
	kind := ""
	for i, el := range elems {
		k := jsonKind(el)
		if kind == "" {
			kind = k
		}
		if k != kind || (k != "number" && k != "string" && k != "array") {
			return prompt{}, badRequest(field, "%s[%d]: expected %s, got JSON %s", at, i, want, k)
		}
	}
	switch kind {
	case "", "number":
		if forms&promptIDs == 0 {
			return prompt{}, badRequest(field, "%s: expected %s, got a list of numbers", at, want)
		}
		ids := make([]int, len(elems))
		for i, el := range elems {
			id, err := strconv.Atoi(string(el)) // JSON's integers, as encoding/json takes them
			if err != nil {
				return prompt{}, badRequest(field, "%s[%d]: expected an integer token id, got JSON number %s", at, i, el)
			}
			ids[i] = id
		}
		return prompt{ids: ids, field: field}, nil
	case "string":
		if forms&promptText == 0 {
			return prompt{}, badRequest(field, "%s: expected %s, got a list of strings", at, want)
		}
	case "array":
		if forms&promptIDs == 0 || at != field {
			return prompt{}, badRequest(field, "%s: expected %s, got a list of lists", at, want)
		}
		forms = promptIDs // a list of lists of ids
	}
	if len(elems) != 1 {
		return prompt{}, badRequest(field, "%s: batches are not supported: send one prompt per request", at)
	}
	return decodePromptAt(field, at+"[0]", elems[0], forms)
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

// spec is a decoded request of any API, ready to be tokenized and submitted.
type spec struct {
	prompt   prompt
	sampling sampling
	logprobs bool
	// topLogprobs: how many most likely tokens to return with each output
	// token (with logprobs; completions: logprobs, chat: top_logprobs,
	// /generate: top_logprobs_num).
	topLogprobs int
	// textInLogprobs: /generate's return_text_in_logprobs.
	textInLogprobs bool
	stream         bool
	rid            string
	boot           *Bootstrap
}

// tooLong is the error for a prompt the tokenizer stopped at the context's length.
func (s *Server) tooLong(field string, tl *tokenizer.TooLongError) *Error {
	n := s.cfg.ContextLen
	msg := fmt.Sprintf("the prompt (at least %d tokens) is longer than the model's context length (%d tokens)", tl.Tokens, n)
	if tl.Length {
		msg = fmt.Sprintf("the prompt (%d bytes: at least %d tokens) is longer than the model's context length (%d tokens)", tl.Bytes, tl.Tokens, n)
	}
	return &Error{Status: http.StatusBadRequest, Param: field, Message: msg, Err: fmt.Errorf("%w: %w", engine.ErrPromptTooLong, tl)}
}

// build tokenizes and checks a spec and makes the engine request. maxZero
// reports a request for zero new tokens, which is answered without the
// engine.
func (s *Server) build(sp *spec) (req *engine.Request, maxZero bool, e *Error) {
	vocab := s.cfg.Tokenizer.VocabSize()
	params, maxZero, e := sp.sampling.params(vocab)
	if e != nil {
		return nil, false, e
	}
	ids := sp.prompt.ids
	if sp.prompt.isText {
		if sp.prompt.text == "" {
			return nil, false, badRequest(sp.prompt.field, "%s is empty", sp.prompt.field)
		}
		limit := -1 // the context's length: longer prompts stop the tokenizer there
		if s.cfg.ContextLen > 0 {
			limit = s.cfg.ContextLen - 1
		}
		var err error
		ids, err = s.cfg.Tokenizer.EncodeLimit(sp.prompt.text, sp.prompt.addBOS, limit)
		var tl *tokenizer.TooLongError
		switch {
		case errors.As(err, &tl):
			return nil, false, s.tooLong(sp.prompt.field, tl)
		case err != nil:
			return nil, false, badRequest(sp.prompt.field, "%s: tokenizing: %v", sp.prompt.field, err)
		}
	}
	if len(ids) == 0 {
		return nil, false, badRequest(sp.prompt.field, "%s is empty", sp.prompt.field)
	}
	for _, id := range ids {
		if id < 0 || (vocab > 0 && id >= vocab) {
			return nil, false, badRequest(sp.prompt.field, "%s: token id %d is outside the vocabulary [0, %d)", sp.prompt.field, id, vocab)
		}
	}
	if n := s.cfg.ContextLen; n > 0 {
		if len(ids) >= n {
			return nil, false, &Error{Status: http.StatusBadRequest, Param: sp.prompt.field, Err: engine.ErrPromptTooLong,
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
	er := &engine.Request{ID: sp.rid, InputIDs: ids, Params: params, Logprobs: sp.logprobs}
	if sp.logprobs {
		er.TopLogprobs = sp.topLogprobs
	}
	return er, maxZero, nil
}
