package server

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strconv"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	samp "github.com/mooncake-go/mooncake-go/internal/sampling"
)

// generateRequest is the body of SGLang's /generate.
type generateRequest struct {
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams samplingParams  `json:"sampling_params"`
	Stream         bool            `json:"stream"`
	ReturnLogprob  bool            `json:"return_logprob"`
	TopLogprobsNum int             `json:"top_logprobs_num"`
	// LogprobStartLen is where the prompt's logprobs start (with return_logprob);
	// -1: its last position.
	LogprobStartLen *int `json:"logprob_start_len"`
	// TextInLogprobs puts each token's text in the logprob triples.
	TextInLogprobs bool    `json:"return_text_in_logprobs"`
	RID            ridList `json:"rid"`
	bootstrapFields
}

// generateExtras are the fields of SGLang's GenerateReqInput we do not decode.
var generateExtras = fieldRules{
	"input_embeds": {why: "input embeddings"},
	"image_data":   {why: "multimodal input"}, "video_data": {why: "multimodal input"}, "audio_data": {why: "multimodal input"},
	"modalities": {why: "multimodal input"}, "mm_hashes": {why: "multimodal input"},
	"lora_path": {why: "LoRA adapters"}, "lora_id": {why: "LoRA adapters"},
	"custom_logit_processor": {why: "custom logit processors"},
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

// samplingParams is /generate's sampling_params: an object, or a list of them (one per
// prompt of a batch).
type samplingParams struct {
	generateSampling // the object form
	list             []generateSampling
	isList           bool
}

func (sp *samplingParams) decodeField(p string, raw json.RawMessage) *Error {
	switch k := jsonKind(raw); k {
	case "null":
		return nil
	case "object":
		return decodeStruct(p, raw, reflect.ValueOf(&sp.generateSampling).Elem())
	case "array":
		elems := elements(raw)
		sp.list, sp.isList = make([]generateSampling, len(elems)), true
		for i, el := range elems {
			if e := decodeStruct(p+"["+strconv.Itoa(i)+"]", el, reflect.ValueOf(&sp.list[i]).Elem()); e != nil {
				return e
			}
		}
		return nil
	default:
		return badRequest(p, "%s: wrong type: expected an object or a list of objects, got JSON %s", p, k)
	}
}

// sampling converts g with its field names prefixed (sampling_params. or
// sampling_params[i].).
func (g *generateSampling) toSampling(prefix string) sampling {
	if g.Seed == nil {
		g.Seed = g.SamplingSeed
	}
	s := g.sampling(g.MaxNewTokens, "max_new_tokens")
	s.prefix = prefix
	return s
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
	sp := &spec{stream: g.Stream, logprobs: g.ReturnLogprob, topLogprobs: g.TopLogprobsNum, textInLogprobs: g.TextInLogprobs,
		inputLogprobs: g.ReturnLogprob, logprobStart: -1, rids: g.RID, ridField: "rid", n: 1}
	if v := g.LogprobStartLen; v != nil {
		if *v < -1 {
			return nil, badRequest("logprob_start_len", "logprob_start_len must be -1 or a prompt position, got %d", *v)
		}
		sp.logprobStart = *v
	}
	var e *Error
	field := "text"
	if hasText {
		sp.prompts, sp.batch, e = decodePrompts("text", g.Text, promptText)
	} else {
		field = "input_ids"
		sp.prompts, sp.batch, e = decodePrompts("input_ids", g.InputIDs, promptIDs)
	}
	if e != nil {
		return nil, e
	}
	nField := "sampling_params.n"
	if ps := &g.SamplingParams; ps.isList {
		if !sp.batch || len(ps.list) != len(sp.prompts) {
			return nil, badRequest("sampling_params", "sampling_params is a list of %d for %d prompts: give one object, or one per prompt of a batch", len(ps.list), len(sp.prompts))
		}
		nField = "sampling_params[0].n"
		for i := range ps.list {
			prefix := "sampling_params[" + strconv.Itoa(i) + "]."
			sp.samplings = append(sp.samplings, ps.list[i].toSampling(prefix))
			n := 1
			if v := ps.list[i].N; v != nil {
				n = *v
			}
			if i == 0 {
				sp.n = n
			} else if n != sp.n {
				return nil, badRequest(prefix+"n", "%sn is %d, sampling_params[0].n %d: every prompt of a batch gets the same n", prefix, n, sp.n)
			}
		}
	} else {
		sp.samplings = []sampling{ps.toSampling("sampling_params.")}
		if v := ps.N; v != nil {
			sp.n = *v
		}
	}
	if sp.boot, e = g.bootstrap(); e != nil {
		return nil, e
	}
	sp.nField, sp.promptField = nField, field
	return sp, nil
}

// generateResponse is /generate's answer, and each event of its stream
// (text and output_ids cumulative). Index is the generation's place in a
// streamed batch (or n > 1).
type generateResponse struct {
	Text      string       `json:"text"`
	OutputIDs []int        `json:"output_ids"`
	MetaInfo  generateMeta `json:"meta_info"`
	Index     *int         `json:"index,omitempty"`
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
	// InputTokenLogprobs are the prompt's from logprob_start_len (its last
	// position: [null, id, text], as SGLang gives the first position it returns).
	InputTokenLogprobs [][3]any `json:"input_token_logprobs,omitempty"`
	InputTopLogprobs   []any    `json:"input_top_logprobs,omitempty"`
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

// generateObject is the answer so far.
func (rn *run) generateObject(sp *spec) generateResponse {
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
			if sp.textInLogprobs {
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
		if sp.inputLogprobs && len(rn.req.InputIDs) > 0 {
			last := rn.req.InputIDs[len(rn.req.InputIDs)-1]
			m.InputTokenLogprobs = [][3]any{{nil, last, text(last)}}
			if rn.req.TopLogprobs > 0 {
				m.InputTopLogprobs = []any{nil}
			}
		}
	}
	return generateResponse{Text: rn.text.String(), OutputIDs: ids, MetaInfo: m}
}

func (s *Server) handleGenerate(w http.ResponseWriter, r *http.Request) {
	rn := s.begin("generate")
	defer func() { rn.end(nil) }()
	sp, ok := accept(s, w, r, rn, decodeGenerate)
	if !ok {
		return
	}
	if e := s.submitAll(r, rn, sp); e != nil {
		rn.fail(w, e)
		return
	}
	if sp.stream {
		rn.streamAll(w, func(out *sse, k int, ev engine.Event) {
			o := rn.kids[k].generateObject(sp)
			if !sp.single() {
				o.Index = &k
			}
			out.event(o)
		}, nil)
		return
	}
	if err := rn.collectAll(); err != nil {
		rn.fail(w, asError(err))
		return
	}
	if sp.single() {
		writeJSON(w, http.StatusOK, rn.kids[0].generateObject(sp))
		return
	}
	all := make([]generateResponse, len(rn.kids))
	for k, kid := range rn.kids {
		all[k] = kid.generateObject(sp)
	}
	writeJSON(w, http.StatusOK, all)
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
