package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// defaultCompletionMaxTokens is OpenAI's default max_tokens for /v1/completions.
const defaultCompletionMaxTokens = 16

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

var streamOptionsExtras = fieldRules{
	"include_obfuscation":    {info: true}, // OpenAI's padding of stream events: none here
	"continuous_usage_stats": {accept: []string{"false"}, why: "usage is sent at the end"},
}

func (*streamOptions) extraFields() fieldRules { return streamOptionsExtras }

// samplingFields are the sampling fields /generate's sampling_params and
// both OpenAI bodies share (with SGLang's extensions: top_k, min_p,
// stop_token_ids, ignore_eos); each adds its own name for the token limit.
type samplingFields struct {
	Temperature       *float64 `json:"temperature"`
	TopP              *float64 `json:"top_p"`
	TopK              *int     `json:"top_k"`
	MinP              *float64 `json:"min_p"`
	FrequencyPenalty  *float64 `json:"frequency_penalty"`
	PresencePenalty   *float64 `json:"presence_penalty"`
	RepetitionPenalty *float64 `json:"repetition_penalty"`
	N                 *int     `json:"n"`
	Stop              stopList `json:"stop"`
	StopTokenIDs      []int    `json:"stop_token_ids"`
	IgnoreEOS         bool     `json:"ignore_eos"`
	Seed              *int64   `json:"seed"`

	LogitBias biasObject `json:"logit_bias"` // checked by logitBias
}

func (o *samplingFields) sampling(maxTokens *int, maxName string) sampling {
	return sampling{
		MaxNewTokens: maxTokens, Temperature: o.Temperature, TopP: o.TopP, TopK: o.TopK, MinP: o.MinP,
		FrequencyPenalty: o.FrequencyPenalty, PresencePenalty: o.PresencePenalty, RepetitionPenalty: o.RepetitionPenalty,
		Stop: o.Stop, StopTokenIDs: o.StopTokenIDs, IgnoreEOS: o.IgnoreEOS, Seed: o.Seed, N: o.N, maxName: maxName,
		LogitBias: json.RawMessage(o.LogitBias),
	}
}

// completionRequest is the body of /v1/completions.
type completionRequest struct {
	Model         string          `json:"model"`
	Prompt        json.RawMessage `json:"prompt"`
	MaxTokens     *int            `json:"max_tokens"`
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	Logprobs      *int            `json:"logprobs"`
	RID           ridList         `json:"rid"`
	samplingFields
	bootstrapFields
}

// openaiExtras are the fields of OpenAI's completion bodies and of SGLang's extensions
// of them we do not decode.
var openaiExtras = mergeRules(samplingExtras, fieldRules{
	"user":      {info: true},
	"lora_path": {why: "LoRA adapters"}, "session_params": {why: "sessions"}, "priority": {why: "request priorities"},
	"custom_logit_processor": {why: "custom logit processors"},
	"min_tokens":             {accept: []string{"0"}},
	"return_hidden_states":   {accept: []string{"false"}}, "return_routed_experts": {accept: []string{"false"}},
})

var completionExtras = mergeRules(openaiExtras, fieldRules{
	"best_of": {accept: []string{"1"}},
	"echo":    {accept: []string{"false"}},
	"suffix":  {accept: []string{`""`}, why: "insertion"},
})

func (*completionRequest) extraFields() fieldRules { return completionExtras }

// mergeRules merges rule tables.
func mergeRules(tables ...fieldRules) fieldRules {
	out := fieldRules{}
	for _, t := range tables {
		for k, v := range t {
			out[k] = v
		}
	}
	return out
}

// openaiSpec is a decoded OpenAI request.
type openaiSpec struct {
	spec
	model        string
	includeUsage bool
}

func decodeCompletion(body []byte) (*openaiSpec, *Error) {
	var c completionRequest
	if e := unmarshalObject(body, &c); e != nil {
		return nil, e
	}
	if c.Logprobs != nil && (*c.Logprobs < 0 || *c.Logprobs > 20) {
		return nil, badRequest("logprobs", "logprobs must be in [0, 20], got %d", *c.Logprobs)
	}
	ps, batch, e := decodePrompts("prompt", c.Prompt, promptText|promptIDs)
	if e != nil {
		return nil, e
	}
	maxTokens := c.MaxTokens
	if maxTokens == nil {
		d := defaultCompletionMaxTokens
		maxTokens = &d
	}
	o := &openaiSpec{model: c.Model}
	o.prompts, o.batch = ps, batch
	o.stream = c.Stream
	o.includeUsage = c.StreamOptions != nil && c.StreamOptions.IncludeUsage
	if c.Logprobs != nil {
		o.logprobs = true
		o.topLogprobs = *c.Logprobs
	}
	o.rids, o.ridField = c.RID, "rid"
	o.n, o.nField, o.promptField = openaiN(c.N), "n", "prompt"
	o.samplings = []sampling{c.samplingFields.sampling(maxTokens, "max_tokens")}
	if o.boot, e = c.bootstrap(); e != nil {
		return nil, e
	}
	return o, nil
}

// openaiN is OpenAI's n (1 when absent).
func openaiN(n *int) int {
	if n == nil {
		return 1
	}
	return *n
}

// chatRequest is the body of /v1/chat/completions.
type chatRequest struct {
	Model               string         `json:"model"`
	Messages            []chatMessage  `json:"messages"`
	MaxTokens           *int           `json:"max_tokens"`
	MaxCompletionTokens *int           `json:"max_completion_tokens"`
	Stream              bool           `json:"stream"`
	StreamOptions       *streamOptions `json:"stream_options"`
	Logprobs            bool           `json:"logprobs"`
	TopLogprobs         *int           `json:"top_logprobs"`
	RID                 ridList        `json:"rid"`
	// ChatTemplateKwargs are extra chat template variables, as SGLang and
	// vLLM take them ({"enable_thinking": false} for Qwen3).
	ChatTemplateKwargs map[string]any `json:"chat_template_kwargs"`
	samplingFields
	bootstrapFields
}

var chatExtras = mergeRules(openaiExtras, fieldRules{
	"tools": {accept: []string{"[]"}}, "tool_choice": {accept: []string{`"none"`, `"auto"`}, why: "tools"},
	"functions": {accept: []string{"[]"}, why: "tools"}, "function_call": {accept: []string{`"none"`, `"auto"`}, why: "tools"},
	"parallel_tool_calls": {info: true},
	"response_format":     {accept: []string{`{"type":"text"}`}, why: "structured output"},
	"audio":               {why: "audio output"}, "modalities": {accept: []string{`["text"]`}},
	"prediction":         {why: "predicted outputs"},
	"web_search_options": {why: "web search"},
	"reasoning_effort":   {why: "reasoning control"}, "verbosity": {why: "verbosity control"},
	"continue_final_message": {accept: []string{"false"}},
	"separate_reasoning":     {accept: []string{"false"}, why: "reasoning parsing"},
	"stream_reasoning":       {info: true},
	// Labels and storage hints that change nothing here.
	"metadata": {info: true}, "store": {info: true}, "service_tier": {info: true},
	"prompt_cache_key": {info: true}, "safety_identifier": {info: true},
})

func (*chatRequest) extraFields() fieldRules { return chatExtras }

type chatMessage struct {
	Role string `json:"role"`
	// Content is a string, null, or a list of content parts (decodeContent).
	Content json.RawMessage `json:"content"`
}

var messageExtras = fieldRules{
	"name": {info: true}, "tool_call_id": {info: true}, "refusal": {info: true},
	"tool_calls": {accept: []string{"[]"}, why: "tools"}, "function_call": {why: "tools"},
	"audio":             {why: "audio"},
	"reasoning_content": {accept: []string{`""`}, why: "reasoning content"},
}

func (*chatMessage) extraFields() fieldRules { return messageExtras }

// contentPart is one part of a message's content; only text parts are supported.
type contentPart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

var contentPartExtras = fieldRules{
	"image_url": {why: "only text content parts are supported"}, "input_audio": {why: "only text content parts are supported"},
	"file": {why: "only text content parts are supported"}, "video_url": {why: "only text content parts are supported"},
}

func (*contentPart) extraFields() fieldRules { return contentPartExtras }

// decodeContent reads a message's content at path p: a string, null, or a list of text
// parts (joined by newlines).
func decodeContent(p string, raw json.RawMessage) (string, *Error) {
	switch k := jsonKind(raw); k {
	case "absent", "null":
		return "", nil
	case "string":
		s, err := unquote(raw)
		if err != nil {
			return "", jsonError(err)
		}
		return s, nil
	case "array":
	default:
		return "", badRequest(p, "%s: expected a string or a list of content parts, got JSON %s", p, k)
	}
	var parts []contentPart
	if e := decodeValue(p, raw, reflect.ValueOf(&parts).Elem()); e != nil {
		return "", e
	}
	texts := make([]string, 0, len(parts))
	for i, part := range parts {
		at := fmt.Sprintf("%s[%d]", p, i)
		switch {
		case part.Type != "text":
			return "", badRequest(at+".type", "%s.type %s is not supported: only text content parts are", at, jsonQuote(part.Type))
		case part.Text == nil:
			return "", badRequest(at+".text", "%s.text is required", at)
		}
		texts = append(texts, *part.Text)
	}
	return strings.Join(texts, "\n"), nil
}

func jsonQuote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// chatSpec is a decoded chat request before its template is applied.
type chatSpec struct {
	openaiSpec
	messages []ChatMessage
	kwargs   map[string]any // chat_template_kwargs
}

func decodeChat(body []byte) (*chatSpec, *Error) {
	var c chatRequest
	if e := unmarshalObject(body, &c); e != nil {
		return nil, e
	}
	switch {
	case len(c.Messages) == 0:
		return nil, badRequest("messages", "messages is empty")
	case c.TopLogprobs != nil && (*c.TopLogprobs < 0 || *c.TopLogprobs > 20):
		return nil, badRequest("top_logprobs", "top_logprobs must be in [0, 20], got %d", *c.TopLogprobs)
	}
	if err := tokenizer.CheckChatKwargs(c.ChatTemplateKwargs); err != nil {
		var ke *tokenizer.ChatKwargError
		if errors.As(err, &ke) {
			return nil, badRequest("chat_template_kwargs."+ke.Name, "chat_template_kwargs.%s: %s", ke.Name, ke.Why)
		}
		return nil, badRequest("chat_template_kwargs", "chat_template_kwargs: %v", err)
	}
	msgs := make([]ChatMessage, 0, len(c.Messages))
	for i, m := range c.Messages {
		role := m.Role
		switch role {
		case "developer":
			role = "system"
		case "system", "user", "assistant", "tool":
		default:
			return nil, badRequest(fmt.Sprintf("messages[%d].role", i), "messages[%d].role %q is not one of system, developer, user, assistant, tool", i, m.Role)
		}
		content, e := decodeContent(fmt.Sprintf("messages[%d].content", i), m.Content)
		if e != nil {
			return nil, e
		}
		msgs = append(msgs, ChatMessage{Role: role, Content: content})
	}
	maxTokens, maxName := c.MaxCompletionTokens, "max_completion_tokens"
	if maxTokens == nil {
		maxTokens, maxName = c.MaxTokens, "max_tokens"
	}
	o := &chatSpec{messages: msgs, kwargs: c.ChatTemplateKwargs}
	o.model = c.Model
	o.stream = c.Stream
	o.includeUsage = c.StreamOptions != nil && c.StreamOptions.IncludeUsage
	o.logprobs = c.Logprobs
	if c.TopLogprobs != nil {
		o.topLogprobs = *c.TopLogprobs
	}
	o.rids, o.ridField = c.RID, "rid"
	o.n, o.nField, o.promptField = openaiN(c.N), "n", "messages"
	o.samplings = []sampling{c.samplingFields.sampling(maxTokens, maxName)}
	var e *Error
	if o.boot, e = c.bootstrap(); e != nil {
		return nil, e
	}
	return o, nil
}

// render applies the chat template. The template's text is encoded with a
// BOS only if it does not begin with the BOS token's text already.
func (s *Server) render(c *chatSpec) *Error {
	text, err := s.cfg.ChatTemplate(c.messages, c.kwargs)
	if err != nil {
		return badRequest("messages", "applying the chat template: %v", err)
	}
	addBOS := true
	if bos := s.cfg.Tokenizer.BOS(); bos >= 0 {
		if t := s.cfg.Tokenizer.TokenText(bos); t != "" && strings.HasPrefix(text, t) {
			addBOS = false
		}
	}
	c.prompts = []prompt{{text: text, isText: true, addBOS: addBOS, field: "messages"}}
	return nil
}

// PlainChatTemplate is the built-in template for models without one:
// "role: content" lines, then "assistant:" to prompt the reply.
func PlainChatTemplate(msgs []ChatMessage) (string, error) {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString(m.Role)
		b.WriteString(": ")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	b.WriteString("assistant:")
	return b.String(), nil
}

// Response objects.

type usage struct {
	PromptTokens        int           `json:"prompt_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	TotalTokens         int           `json:"total_tokens"`
	PromptTokensDetails *promptDetail `json:"prompt_tokens_details,omitempty"`
}

// promptDetail is OpenAI's usage.prompt_tokens_details.
type promptDetail struct {
	CachedTokens int `json:"cached_tokens"`
}

type completionChoice struct {
	Index        int                `json:"index"`
	Text         string             `json:"text"`
	Logprobs     *completionLogprob `json:"logprobs"`
	FinishReason *string            `json:"finish_reason"`
	MatchedStop  any                `json:"matched_stop,omitempty"`
}

type completionLogprob struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float32            `json:"token_logprobs"`
	TopLogprobs   []map[string]float32 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
}

type completionResponse struct {
	ID      string             `json:"id"`
	Object  string             `json:"object"`
	Created int64              `json:"created"`
	Model   string             `json:"model"`
	Choices []completionChoice `json:"choices"`
	Usage   *usage             `json:"usage,omitempty"`
}

type chatMessageOut struct {
	Role    string `json:"role,omitempty"`
	Content string `json:"content"`
}

type chatDelta struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

type chatTokenLogprob struct {
	Token       string           `json:"token"`
	Logprob     float32          `json:"logprob"`
	Bytes       []int            `json:"bytes"`
	TopLogprobs []chatTopLogprob `json:"top_logprobs"`
}

type chatTopLogprob struct {
	Token   string  `json:"token"`
	Logprob float32 `json:"logprob"`
	Bytes   []int   `json:"bytes"`
}

type chatLogprobs struct {
	Content []chatTokenLogprob `json:"content"`
}

type chatChoice struct {
	Index        int             `json:"index"`
	Message      *chatMessageOut `json:"message,omitempty"`
	Delta        *chatDelta      `json:"delta,omitempty"`
	Logprobs     *chatLogprobs   `json:"logprobs"`
	FinishReason *string         `json:"finish_reason"`
	MatchedStop  any             `json:"matched_stop,omitempty"`
}

type chatResponse struct {
	ID      string       `json:"id"`
	Object  string       `json:"object"`
	Created int64        `json:"created"`
	Model   string       `json:"model"`
	Choices []chatChoice `json:"choices"`
	Usage   *usage       `json:"usage,omitempty"`
}

// usage is the usage of rn's kids: each prompt's tokens once (its first sample's),
// every sample's completion.
func (rn *run) usage(n int) *usage {
	u := &usage{PromptTokensDetails: &promptDetail{}}
	for k, kid := range rn.kids {
		if k%max(n, 1) == 0 {
			u.PromptTokens += kid.promptTokens()
			u.PromptTokensDetails.CachedTokens += kid.cachedTokens()
		}
		u.CompletionTokens += kid.completionTokens()
	}
	u.TotalTokens = u.PromptTokens + u.CompletionTokens
	return u
}

// openaiFinish is the finish_reason string and matched_stop of a finish.
func openaiFinish(f *engine.Finish) (*string, any) {
	if f == nil {
		return nil, nil
	}
	t := f.Type
	if f.Type == "stop" {
		return &t, f.Matched
	}
	return &t, nil
}

func (s *Server) tokenText(id int) string { return s.cfg.Tokenizer.TokenText(id) }

// completionLogprobs is the logprobs object of output tokens [from, to).
func (rn *run) completionLogprobs(from, to, offset, top int) *completionLogprob {
	lp := &completionLogprob{Tokens: []string{}, TokenLogprobs: []float32{}, TextOffset: []int{}}
	if top > 0 {
		lp.TopLogprobs = []map[string]float32{}
	}
	for i := from; i < to; i++ {
		t := rn.s.tokenText(rn.ids[i])
		lp.Tokens = append(lp.Tokens, t)
		lp.TokenLogprobs = append(lp.TokenLogprobs, rn.logprobs[i])
		lp.TextOffset = append(lp.TextOffset, offset)
		offset += len(t)
		if top > 0 {
			m := map[string]float32{}
			for _, tp := range rn.tops[i] {
				// Tokens with the same text share an entry: the likeliest.
				tt := rn.s.tokenText(tp.Token)
				if _, seen := m[tt]; !seen {
					m[tt] = tp.Logprob
				}
			}
			lp.TopLogprobs = append(lp.TopLogprobs, m)
		}
	}
	return lp
}

func tokenBytes(t string) []int {
	out := make([]int, len(t))
	for i := 0; i < len(t); i++ {
		out[i] = int(t[i])
	}
	return out
}

func (rn *run) chatLogprobs(from, to int) *chatLogprobs {
	lp := &chatLogprobs{Content: []chatTokenLogprob{}}
	for i := from; i < to; i++ {
		t := rn.s.tokenText(rn.ids[i])
		c := chatTokenLogprob{Token: t, Logprob: rn.logprobs[i], Bytes: tokenBytes(t), TopLogprobs: []chatTopLogprob{}}
		for _, tp := range rn.tops[i] {
			tt := rn.s.tokenText(tp.Token)
			c.TopLogprobs = append(c.TopLogprobs, chatTopLogprob{Token: tt, Logprob: tp.Logprob, Bytes: tokenBytes(tt)})
		}
		lp.Content = append(lp.Content, c)
	}
	return lp
}

// openaiPrepare runs the steps both OpenAI endpoints share after decoding:
// the model check, tokenization and submission.
func (s *Server) openaiPrepare(r *http.Request, rn *run, o *openaiSpec) *Error {
	if e := s.checkModel(o.model); e != nil {
		return e
	}
	return s.submitAll(r, rn, &o.spec)
}

func (s *Server) modelOf(o *openaiSpec) string {
	if o.model != "" {
		return o.model
	}
	return s.cfg.ModelName
}

func (s *Server) handleCompletions(w http.ResponseWriter, r *http.Request) {
	rn := s.begin("completions")
	defer func() { rn.end(nil) }()
	o, ok := accept(s, w, r, rn, decodeCompletion)
	if !ok {
		return
	}
	if e := s.openaiPrepare(r, rn, o); e != nil {
		rn.fail(w, e)
		return
	}
	id, created, model := "cmpl-"+rn.kids[0].req.ID, time.Now().Unix(), s.modelOf(o)
	chunk := func(choices []completionChoice) completionResponse {
		return completionResponse{ID: id, Object: "text_completion", Created: created, Model: model, Choices: choices}
	}
	if o.stream {
		// Per choice: tokens and bytes of text already sent, and the text's offset.
		sent, sentText, offset := make([]int, len(rn.kids)), make([]int, len(rn.kids)), make([]int, len(rn.kids))
		emit := func(out *sse, k int, ev engine.Event) {
			kid := rn.kids[k]
			text := kid.text.String()[sentText[k]:]
			if text == "" && ev.Finish == nil && !o.logprobs {
				return
			}
			ch := completionChoice{Index: k, Text: text}
			if o.logprobs {
				ch.Logprobs = kid.completionLogprobs(sent[k], len(kid.ids), offset[k], o.topLogprobs)
				for _, t := range ch.Logprobs.Tokens {
					offset[k] += len(t)
				}
			}
			ch.FinishReason, ch.MatchedStop = openaiFinish(ev.Finish)
			sent[k], sentText[k] = len(kid.ids), kid.text.Len()
			out.event(chunk([]completionChoice{ch}))
		}
		final := func(out *sse) {
			if o.includeUsage {
				c := chunk([]completionChoice{})
				c.Usage = rn.usage(o.n)
				out.event(c)
			}
		}
		rn.streamAll(w, emit, final)
		return
	}
	if err := rn.collectAll(); err != nil {
		rn.fail(w, asError(err))
		return
	}
	choices := make([]completionChoice, len(rn.kids))
	for k, kid := range rn.kids {
		ch := completionChoice{Index: k, Text: kid.text.String()}
		ch.FinishReason, ch.MatchedStop = openaiFinish(kid.finish)
		if o.logprobs {
			ch.Logprobs = kid.completionLogprobs(0, len(kid.ids), 0, o.topLogprobs)
		}
		choices[k] = ch
	}
	resp := chunk(choices)
	resp.Usage = rn.usage(o.n)
	writeJSON(w, http.StatusOK, resp)
}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) {
	rn := s.begin("chat")
	defer func() { rn.end(nil) }()
	c, ok := accept(s, w, r, rn, decodeChat)
	if !ok {
		return
	}
	if e := s.render(c); e != nil {
		rn.fail(w, e)
		return
	}
	if e := s.openaiPrepare(r, rn, &c.openaiSpec); e != nil {
		rn.fail(w, e)
		return
	}
	id, created, model := "chatcmpl-"+rn.kids[0].req.ID, time.Now().Unix(), s.modelOf(&c.openaiSpec)
	chunk := func(ch chatChoice) chatResponse {
		return chatResponse{ID: id, Object: "chat.completion.chunk", Created: created, Model: model, Choices: []chatChoice{ch}}
	}
	if c.stream {
		started, sent, sentText := make([]bool, len(rn.kids)), make([]int, len(rn.kids)), make([]int, len(rn.kids))
		emit := func(out *sse, k int, ev engine.Event) {
			kid := rn.kids[k]
			if !started[k] {
				started[k] = true
				empty := ""
				out.event(chunk(chatChoice{Index: k, Delta: &chatDelta{Role: "assistant", Content: &empty}}))
			}
			text := kid.text.String()[sentText[k]:]
			if text != "" || (c.logprobs && len(kid.ids) > sent[k]) {
				ch := chatChoice{Index: k, Delta: &chatDelta{Content: &text}}
				if c.logprobs {
					ch.Logprobs = kid.chatLogprobs(sent[k], len(kid.ids))
				}
				sent[k], sentText[k] = len(kid.ids), kid.text.Len()
				out.event(chunk(ch))
			}
			if ev.Finish != nil {
				ch := chatChoice{Index: k, Delta: &chatDelta{}}
				ch.FinishReason, ch.MatchedStop = openaiFinish(ev.Finish)
				out.event(chunk(ch))
			}
		}
		final := func(out *sse) {
			if c.includeUsage {
				u := chatResponse{ID: id, Object: "chat.completion.chunk", Created: created, Model: model, Choices: []chatChoice{}, Usage: rn.usage(c.n)}
				out.event(u)
			}
		}
		rn.streamAll(w, emit, final)
		return
	}
	if err := rn.collectAll(); err != nil {
		rn.fail(w, asError(err))
		return
	}
	choices := make([]chatChoice, len(rn.kids))
	for k, kid := range rn.kids {
		ch := chatChoice{Index: k, Message: &chatMessageOut{Role: "assistant", Content: kid.text.String()}}
		ch.FinishReason, ch.MatchedStop = openaiFinish(kid.finish)
		if c.logprobs {
			ch.Logprobs = kid.chatLogprobs(0, len(kid.ids))
		}
		choices[k] = ch
	}
	resp := chatResponse{ID: id, Object: "chat.completion", Created: created, Model: model, Choices: choices, Usage: rn.usage(c.n)}
	writeJSON(w, http.StatusOK, resp)
}

type modelCard struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	Root        string `json:"root,omitempty"`
	MaxModelLen int    `json:"max_model_len,omitempty"`
}

func (s *Server) card() modelCard {
	return modelCard{ID: s.cfg.ModelName, Object: "model", Created: s.created, OwnedBy: "mooncake-go",
		Root: s.cfg.ModelPath, MaxModelLen: s.cfg.ContextLen}
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": []modelCard{s.card()}})
}

func (s *Server) handleModel(w http.ResponseWriter, r *http.Request) {
	name := r.PathValue("model")
	e := s.checkModel(name)
	if name == "" { // GET /v1/models/
		e = &Error{Status: http.StatusNotFound, Param: "model", Message: "no model named: GET /v1/models/{model}"}
	}
	if e != nil {
		writeError(w, e)
		return
	}
	writeJSON(w, http.StatusOK, s.card())
}
