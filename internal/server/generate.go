package server

import (
	"encoding/json"
	"net/http"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	samp "github.com/mooncake-go/mooncake-go/internal/sampling"
)

// generateRequest is the body of SGLang's /generate.
type generateRequest struct {
	Text           json.RawMessage   `json:"text"`
	InputIDs       json.RawMessage   `json:"input_ids"`
	SamplingParams *generateSampling `json:"sampling_params"`
	Stream         bool              `json:"stream"`
	ReturnLogprob  bool              `json:"return_logprob"`
	TopLogprobsNum int               `json:"top_logprobs_num"`
	// TextInLogprobs puts each token's text in the logprob triples.
	TextInLogprobs bool    `json:"return_text_in_logprobs"`
	RID            *string `json:"rid"`
	bootstrapFields
}

// generateExtras are the fields of SGLang's GenerateReqInput we do not decode.
var generateExtras = fieldRules{
	"input_embeds": {why: "input embeddings"},
	"image_data":   {why: "multimodal input"}, "video_data": {why: "multimodal input"}, "audio_data": {why: "multimodal input"},
	"modalities": {why: "multimodal input"}, "mm_hashes": {why: "multimodal input"},
	"lora_path": {why: "LoRA adapters"}, "lora_id": {why: "LoRA adapters"},
	"custom_logit_processor": {why: "custom logit processors"},
	"logprob_start_len":      {accept: []string{"-1"}, why: "prompt logprobs"},
	"token_ids_logprob":      {why: "logprobs of given token ids"},
	"return_hidden_states":   {accept: []string{"false"}}, "return_routed_experts": {accept: []string{"false"}},
	"return_sampling_mask": {accept: []string{"false"}}, "return_entropy": {accept: []string{"false"}},
	"return_prompt_token_ids": {accept: []string{"false"}}, "return_flat_raw_top_logprobs": {accept: []string{"false"}},
	"session_params": {why: "sessions"},
	"priority":       {why: "request priorities"},
	"routed_dp_rank": {why: "data parallelism"}, "data_parallel_rank": {why: "data parallelism"},
	"log_metrics":       {accept: []string{"true"}, why: "every request is measured"},
	"no_logs":           {accept: []string{"false"}, why: "every request is logged, without its text"},
	"custom_labels":     {why: "custom metric labels"},
	"background":        {accept: []string{"false"}},
	"require_reasoning": {accept: []string{"false"}}, "max_thinking_tokens": {why: "thinking budgets"},
	// Labels and hints that change nothing here.
	"session_id": {info: true}, "conversation_id": {info: true}, "routing_key": {info: true},
	"extra_key": {info: true}, "cache_salt": {info: true}, "received_time": {info: true}, "external_trace_header": {info: true},
}

func (*generateRequest) extraFields() fieldRules { return generateExtras }

// generateSampling is SGLang's sampling_params.
type generateSampling struct {
	samplingFields
	MaxNewTokens *int   `json:"max_new_tokens"`
	SamplingSeed *int64 `json:"sampling_seed"` // SGLang's name for seed
}

// samplingExtras are the sampling fields of SGLang we do not decode (shared with its
// extensions of the OpenAI bodies).
var samplingExtras = fieldRules{
	"json_schema": {why: "constrained decoding"}, "regex": {why: "constrained decoding"},
	"ebnf": {why: "constrained decoding"}, "structural_tag": {why: "constrained decoding"},
	"stop_regex":                    {why: "stop regexes"},
	"min_new_tokens":                {accept: []string{"0"}},
	"skip_special_tokens":           {accept: []string{"true"}, why: "special tokens are always skipped"},
	"spaces_between_special_tokens": {info: true},
	"no_stop_trim":                  {accept: []string{"false"}, why: "a matched stop string is always trimmed"},
	"custom_params":                 {why: "custom logit processors"},
	"stream_interval":               {info: true}, // every token is streamed
}

func (*generateSampling) extraFields() fieldRules { return samplingExtras }

// decodeGenerate decodes and checks a /generate body (no tokenization).
func decodeGenerate(body []byte) (*spec, *Error) {
	var g generateRequest
	if e := unmarshalObject(body, &g); e != nil {
		return nil, e
	}
	hasText := jsonKind(g.Text) != "absent" && jsonKind(g.Text) != "null"
	hasIDs := jsonKind(g.InputIDs) != "absent" && jsonKind(g.InputIDs) != "null"
	switch {
	case hasText && hasIDs:
		return nil, badRequest("text", "give either text or input_ids, not both")
	case !hasText && !hasIDs:
		return nil, badRequest("text", "either text or input_ids is required")
	}
	if g.TopLogprobsNum < 0 || g.TopLogprobsNum > samp.MaxTopLogprobs {
		return nil, badRequest("top_logprobs_num", "top_logprobs_num must be in [0, %d], got %d", samp.MaxTopLogprobs, g.TopLogprobsNum)
	}
	sp := &spec{stream: g.Stream, logprobs: g.ReturnLogprob, topLogprobs: g.TopLogprobsNum, textInLogprobs: g.TextInLogprobs}
	var e *Error
	if hasText {
		sp.prompt, e = decodePrompt("text", g.Text, promptText)
	} else {
		sp.prompt, e = decodePrompt("input_ids", g.InputIDs, promptIDs)
	}
	if e != nil {
		return nil, e
	}
	if g.RID != nil {
		sp.rid = *g.RID
	}
	if p := g.SamplingParams; p != nil {
		if p.Seed == nil {
			p.Seed = p.SamplingSeed
		}
		sp.sampling = p.sampling(p.MaxNewTokens, "max_new_tokens")
	}
	sp.sampling.maxName = "max_new_tokens"
	sp.sampling.prefix = "sampling_params."
	if sp.boot, e = g.bootstrap(); e != nil {
		return nil, e
	}
	return sp, nil
}

// generateResponse is /generate's answer, and each event of its stream
// (text and output_ids cumulative).
type generateResponse struct {
	Text      string       `json:"text"`
	OutputIDs []int        `json:"output_ids"`
	MetaInfo  generateMeta `json:"meta_info"`
}

type generateMeta struct {
	ID                  string   `json:"id"`
	FinishReason        any      `json:"finish_reason"` // null while streaming
	PromptTokens        int      `json:"prompt_tokens"`
	CompletionTokens    int      `json:"completion_tokens"`
	CachedTokens        int      `json:"cached_tokens"`
	E2ELatency          float64  `json:"e2e_latency"`
	OutputTokenLogprobs [][3]any `json:"output_token_logprobs,omitempty"`
	// OutputTopLogprobs: per output token, its position's most likely
	// tokens as [logprob, token id, null] (with top_logprobs_num).
	OutputTopLogprobs [][][3]any `json:"output_top_logprobs,omitempty"`
}

// sglangFinish is SGLang's finish_reason object.
func sglangFinish(f *engine.Finish, completion int) map[string]any {
	out := map[string]any{"type": f.Type}
	switch f.Type {
	case "stop":
		if f.Matched != nil {
			out["matched"] = f.Matched
		}
	case "length":
		out["length"] = completion
	case "abort":
		msg := "aborted"
		if f.Err != nil {
			msg = f.Err.Error()
		}
		out["message"] = msg
	}
	return out
}

// generateObject is the answer so far; textInLogprobs puts each token's text in its
// logprob triples.
func (rn *run) generateObject(textInLogprobs bool) generateResponse {
	ids := rn.ids
	if ids == nil {
		ids = []int{}
	}
	m := generateMeta{
		ID:               rn.req.ID,
		PromptTokens:     rn.promptTokens(),
		CompletionTokens: rn.completionTokens(),
		CachedTokens:     rn.cachedTokens(),
		E2ELatency:       rn.elapsed(),
	}
	if rn.finish != nil {
		m.FinishReason = sglangFinish(rn.finish, len(rn.ids))
	}
	if rn.req.Logprobs {
		text := func(id int) any {
			if textInLogprobs {
				return rn.s.tokenText(id)
			}
			return nil
		}
		m.OutputTokenLogprobs = make([][3]any, len(rn.ids))
		for i, id := range rn.ids {
			m.OutputTokenLogprobs[i] = [3]any{rn.logprobs[i], id, text(id)}
		}
		if rn.req.TopLogprobs > 0 {
			m.OutputTopLogprobs = make([][][3]any, len(rn.ids))
			for i := range rn.ids {
				m.OutputTopLogprobs[i] = make([][3]any, len(rn.tops[i]))
				for j, tp := range rn.tops[i] {
					m.OutputTopLogprobs[i][j] = [3]any{tp.Logprob, tp.Token, text(tp.Token)}
				}
			}
		}
	}
	return generateResponse{Text: rn.text.String(), OutputIDs: ids, MetaInfo: m}
}

func (s *Server) handleGenerate(w http.ResponseWriter, r *http.Request) {
	rn := s.begin("generate")
	var err error
	defer func() { rn.end(err) }()
	sp, ok := accept(s, w, r, rn, decodeGenerate)
	if !ok {
		return
	}
	req, maxZero, e := s.build(sp)
	if e != nil {
		rn.fail(w, e)
		return
	}
	if e := rn.submit(r.Context(), r.Header, req, sp.boot, maxZero); e != nil {
		rn.fail(w, e)
		return
	}
	if sp.stream {
		rn.stream(w, func(out *sse, ev engine.Event) { out.event(rn.generateObject(sp.textInLogprobs)) }, nil)
		return
	}
	rn.collect()
	if ferr := rn.failure(); ferr != nil {
		err = ferr
		rn.fail(w, asError(ferr))
		return
	}
	writeJSON(w, http.StatusOK, rn.generateObject(sp.textInLogprobs))
}

// stream is the streaming flow shared by every API. It waits for the first
// event, so that a request failing before any output gets a plain HTTP
// error; then it starts the SSE stream and calls emit for every event. A
// failure after the start sends an error event and no [DONE]; otherwise
// final (if set) writes its last events and [DONE] ends the stream.
func (rn *run) stream(w http.ResponseWriter, emit func(out *sse, ev engine.Event), final func(out *sse)) {
	ev, ok := rn.next()
	if !ok {
		rn.fail(w, errorf(http.StatusInternalServerError, "no events"))
		return
	}
	if ev.Finish != nil && rn.failure() != nil && len(rn.ids) == 0 && rn.text.Len() == 0 {
		rn.fail(w, asError(rn.failure()))
		return
	}
	out := startSSE(w)
	for {
		if ev.Finish != nil && rn.failure() != nil {
			break
		}
		emit(out, ev)
		if ev, ok = rn.next(); !ok {
			break
		}
	}
	if ferr := rn.failure(); ferr != nil {
		e := asError(ferr)
		rn.status = e.Status
		if e.Status != statusClientClosed {
			out.fail(e)
		}
		return
	}
	if final != nil {
		final(out)
	}
	out.done()
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		writeError(w, errorf(http.StatusInternalServerError, "encoding response: %v", err))
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}
