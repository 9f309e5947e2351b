package server_test

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/server"
	"github.com/mooncake-go/mooncake-go/internal/server/servertest"
)

// TestLogitBiasParsed: logit_bias reaches the engine from all three APIs.
func TestLogitBiasParsed(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen})
	bias := `{"72": -100, "105": 2.5, "0": 100}`
	for _, c := range []struct{ path, body string }{
		{"/generate", `{"text": "Hi", "sampling_params": {"max_new_tokens": 2, "logit_bias": ` + bias + `}}`},
		{"/v1/completions", `{"prompt": "Hi", "max_tokens": 2, "logit_bias": ` + bias + `}`},
		{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logit_bias": ` + bias + `}`},
	} {
		if status, body := post(t, ts.URL+c.path, c.body); status != 200 {
			t.Fatalf("%s: status %d: %s", c.path, status, body)
		}
		reqs := gen.Requests()
		got := reqs[len(reqs)-1].Params.LogitBias
		if want := map[int]float64{72: -100, 105: 2.5, 0: 100}; !maps.Equal(got, want) {
			t.Fatalf("%s: LogitBias %v, want %v", c.path, got, want)
		}
	}
	// Absent, null and {} mean none.
	for _, b := range []string{``, `, "logit_bias": null`, `, "logit_bias": {}`} {
		if status, body := post(t, ts.URL+"/v1/completions", `{"prompt": "Hi", "max_tokens": 1`+b+`}`); status != 200 {
			t.Fatalf("%q: status %d: %s", b, status, body)
		}
		reqs := gen.Requests()
		if got := reqs[len(reqs)-1].Params.LogitBias; len(got) != 0 {
			t.Fatalf("%q: LogitBias %v", b, got)
		}
	}
}

// TestLogitBiasRefused: every bad logit_bias is a 400 naming the field as
// the API spells it.
func TestLogitBiasRefused(t *testing.T) {
	gen := &servertest.Generator{}
	ts, _ := newServer(t, server.Config{Generator: gen})
	var many strings.Builder
	many.WriteString("{")
	for id := range 4097 {
		if id > 0 {
			many.WriteString(",")
		}
		fmt.Fprintf(&many, `"%d": 1`, id)
	}
	many.WriteString("}")
	for _, c := range []struct{ bias, msg string }{
		{`[1, 2]`, "expected an object"},
		{`5`, "expected an object"},
		{`{"abc": 1}`, `key "abc" is not a token id`},
		{`{"1.5": 1}`, `key "1.5" is not a token id`},
		{`{"07": 1}`, `key "07" is not a token id`},
		{`{"-1": 1}`, "outside the vocabulary"},
		{`{"258": 1}`, "outside the vocabulary [0, 258)"},
		{`{"99999999999999999999": 1}`, "is not a token id"},
		{`{"5": 100.5}`, "must be in [-100, 100], got 100.5"},
		{`{"5": -101}`, "must be in [-100, 100], got -101"},
		{`{"5": 1e400}`, "must be in [-100, 100]"},
		{`{"5": "1"}`, "must be a number, got JSON string"},
		{`{"5": null}`, "must be a number, got JSON null"},
		{`{"5": [1]}`, "must be a number, got JSON array"},
		{many.String(), "has 4097 entries, at most 4096"},
	} {
		for _, api := range []struct{ path, body, param string }{
			{"/generate", `{"text": "Hi", "sampling_params": {"logit_bias": %s}}`, "sampling_params.logit_bias"},
			{"/v1/completions", `{"prompt": "Hi", "logit_bias": %s}`, "logit_bias"},
			{"/v1/chat/completions", `{"messages": [{"role": "user", "content": "Hi"}], "logit_bias": %s}`, "logit_bias"},
		} {
			n := len(gen.Requests())
			status, body := post(t, ts.URL+api.path, fmt.Sprintf(api.body, c.bias))
			checkError(t, status, body, 400, c.msg)
			var e struct {
				Error struct {
					Message string `json:"message"`
					Param   string `json:"param"`
				} `json:"error"`
			}
			_ = json.Unmarshal(body, &e)
			if e.Error.Param != api.param || !strings.HasPrefix(e.Error.Message, api.param) {
				t.Fatalf("%s %s: error %+v, want param %q", api.path, trunc(c.bias), e.Error, api.param)
			}
			if len(gen.Requests()) != n {
				t.Fatalf("%s %s: a refused request reached the engine", api.path, trunc(c.bias))
			}
		}
	}
}

func trunc(s string) string {
	if len(s) > 40 {
		return s[:40] + "..."
	}
	return s
}

// TestLogitBiasRealEngine: through the HTTP API and the real engine, -100
// on the greedy token changes the answer and keeps the token out of it,
// banning all but one token yields only that token, and the logprobs are
// the raw model's either way.
func TestLogitBiasRealEngine(t *testing.T) {
	e := newEngine(t, 256)
	ts, _ := newServer(t, server.Config{Generator: e, Tokenizer: e.Tokenizer(), RandomWeights: true, ContextLen: 256})
	type genTop struct {
		OutputIDs []int `json:"output_ids"`
		MetaInfo  struct {
			OutputTokenLogprobs [][3]any   `json:"output_token_logprobs"`
			OutputTopLogprobs   [][][3]any `json:"output_top_logprobs"`
		} `json:"meta_info"`
	}
	run := func(sp string) genTop {
		t.Helper()
		status, b := post(t, ts.URL+"/generate", `{"text": "Once upon a time", "return_logprob": true, "top_logprobs_num": 5,
			"sampling_params": {"max_new_tokens": 8, "ignore_eos": true`+sp+`}}`)
		var g genTop
		if err := json.Unmarshal(b, &g); status != 200 || err != nil || len(g.OutputIDs) != 8 {
			t.Fatalf("status %d (%v): %s", status, err, b)
		}
		return g
	}
	plain := run(`, "temperature": 0`)
	banned := plain.OutputIDs[0]
	g := run(fmt.Sprintf(`, "temperature": 0, "logit_bias": {"%d": -100}`, banned))
	if slices.Contains(g.OutputIDs, banned) {
		t.Fatalf("token %d banned, output %v (unbiased %v)", banned, g.OutputIDs, plain.OutputIDs)
	}
	// Position 0 has the same prompt in both runs: the same raw top list.
	if fmt.Sprint(g.MetaInfo.OutputTopLogprobs[0]) != fmt.Sprint(plain.MetaInfo.OutputTopLogprobs[0]) {
		t.Fatalf("top logprobs at position 0 moved with the bias:\n%v\n%v", g.MetaInfo.OutputTopLogprobs[0], plain.MetaInfo.OutputTopLogprobs[0])
	}

	only := (plain.OutputIDs[1] + 1) % e.Tokenizer().VocabSize()
	var all []string
	for id := range e.Tokenizer().VocabSize() {
		if id != only {
			all = append(all, fmt.Sprintf(`"%d": -100`, id))
		}
	}
	g = run(`, "temperature": 1.5, "seed": 3, "logit_bias": {` + strings.Join(all, ", ") + `}`)
	for i, id := range g.OutputIDs {
		if id != only {
			t.Fatalf("all but %d banned: output %v", only, g.OutputIDs)
		}
		if lp := g.MetaInfo.OutputTokenLogprobs[i][0].(float64); lp > -0.01 {
			t.Fatalf("logprob %v of the only allowed token: the bias leaked into the logprobs", lp)
		}
	}
	if fmt.Sprint(g.MetaInfo.OutputTopLogprobs[0]) != fmt.Sprint(plain.MetaInfo.OutputTopLogprobs[0]) {
		t.Fatalf("top logprobs at position 0 moved with the bias:\n%v\n%v", g.MetaInfo.OutputTopLogprobs[0], plain.MetaInfo.OutputTopLogprobs[0])
	}
}
