package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

// readBody reads a request body of at most limit bytes: 413 beyond it.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *Error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, errorf(http.StatusRequestEntityTooLarge, "request body is larger than %d bytes", mbe.Limit)
		}
		return nil, badRequest("", "reading request body: %v", err)
	}
	return body, nil
}

// unmarshalObject decodes a JSON object into v (a pointer to a struct) and
// turns decoding errors into 400s that name the field.
func unmarshalObject(body []byte, v any) *Error {
	b := bytes.TrimSpace(body)
	if len(b) == 0 {
		return badRequest("", "empty request body: expected a JSON object")
	}
	if b[0] != '{' {
		return badRequest("", "request body must be a JSON object")
	}
	if err := json.Unmarshal(b, v); err != nil {
		return jsonError(err)
	}
	return nil
}

func jsonError(err error) *Error {
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	var fe *fieldError
	switch {
	case errors.As(err, &se):
		return badRequest("", "malformed JSON at byte %d: %v", se.Offset, se)
	case errors.As(err, &te):
		if te.Field == "" {
			return badRequest("", "wrong type: expected %s, got JSON %s", goTypeName(te.Type.String()), te.Value)
		}
		return badRequest(te.Field, "%s: wrong type: expected %s, got JSON %s", te.Field, goTypeName(te.Type.String()), te.Value)
	case errors.As(err, &fe):
		return badRequest(fe.field, "%s: %s", fe.field, fe.msg)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return badRequest("", "malformed JSON: unexpected end of input")
	default:
		return badRequest("", "malformed JSON: %v", err)
	}
}

// goTypeName names a Go type the way a JSON user thinks of it.
func goTypeName(t string) string {
	switch {
	case strings.HasPrefix(t, "[]"), strings.HasPrefix(t, "server.stopList"):
		return "array"
	case strings.Contains(t, "int"):
		return "integer"
	case strings.Contains(t, "float"):
		return "number"
	case t == "string" || t == "*string":
		return "string"
	case strings.Contains(t, "bool"):
		return "boolean"
	case strings.HasPrefix(t, "server."), strings.HasPrefix(t, "*server."), strings.HasPrefix(t, "map"):
		return "object"
	}
	return t
}

// fieldError is a decoding error of a custom JSON type, with its field name.
type fieldError struct{ field, msg string }

func (e *fieldError) Error() string { return e.field + ": " + e.msg }

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

// firstElemKind is the kind of the first element of a JSON array ("" for []).
func firstElemKind(raw json.RawMessage) string {
	b := bytes.TrimSpace(raw)
	if len(b) < 2 || b[0] != '[' {
		return ""
	}
	inner := bytes.TrimSpace(b[1:])
	if len(inner) == 0 || inner[0] == ']' {
		return ""
	}
	return jsonKind(inner[:1])
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
			return &fieldError{"stop", "expected a string or a list of strings"}
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
		return &fieldError{"stop", "expected a string or a list of strings"}
	}
}

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

// decodeTextOrIDs reads a single prompt given as a JSON string or a list of
// token ids; batches (a list of strings or of lists) get 400.
func decodeTextOrIDs(field string, raw json.RawMessage) (prompt, *Error) {
	switch jsonKind(raw) {
	case "string":
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return prompt{}, jsonError(err)
		}
		return prompt{text: s, isText: true, addBOS: true, field: field}, nil
	case "array":
		switch firstElemKind(raw) {
		case "string", "array":
			var one []json.RawMessage
			if err := json.Unmarshal(raw, &one); err == nil && len(one) == 1 {
				return decodeTextOrIDs(field, one[0])
			}
			return prompt{}, badRequest(field, "%s: batches are not supported: send one prompt per request", field)
		}
		var ids []int
		if err := json.Unmarshal(raw, &ids); err != nil {
			return prompt{}, badRequest(field, "%s: expected a string or a list of integer token ids", field)
		}
		return prompt{ids: ids, field: field}, nil
	case "absent", "null":
		return prompt{}, badRequest(field, "%s is required", field)
	default:
		return prompt{}, badRequest(field, "%s: expected a string or a list of integer token ids, got JSON %s", field, jsonKind(raw))
	}
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
	stream      bool
	rid         string
	boot        *Bootstrap
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
		var err error
		ids, err = s.cfg.Tokenizer.Encode(sp.prompt.text, sp.prompt.addBOS)
		if err != nil {
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
