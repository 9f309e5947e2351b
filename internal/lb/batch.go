package lb

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
)

// A request of several generations (a /generate with a list of texts or of
// input_ids, a /v1/completions with a list of prompts, or n > 1 on any of
// the three) cannot go to a pair whole: a prefill and a decode share one
// room per generation. The LB splits it into one request per generation,
// prompt i's sample j at k = i*n + j, with the fields the colocated server
// would give that generation (its prompt, its sampling_params, its rid,
// seed + j for sample j > 0, n removed), sends each to a pair (the n
// samples of a prompt to the same pair) and answers as the colocated server
// does (internal/server/batch.go): a list, prompt-major, streamed events
// with index k. What it cannot split as the server would read it (a
// malformed list, n out of range, a sampling_params list of another
// length), it sends whole, for the server's own error.

// MaxN is the largest n a request may ask for, as the servers take.
const MaxN = 128

// endpoint is a generation endpoint.
type endpoint int

const (
	epGenerate endpoint = iota
	epCompletions
	epChat
)

func endpointOf(path string) endpoint {
	switch path {
	case "/v1/completions":
		return epCompletions
	case "/v1/chat/completions":
		return epChat
	}
	return epGenerate
}

// splitReq is a request split into one request per generation.
type splitReq struct {
	ep      endpoint
	batch   bool // the prompt was a list
	prompts int
	n       int
	subs    []*request // generation k is prompt k/n's sample k%n
	field   string     // the prompt's field
	nField  string     // n's field
	spList  bool       // sampling_params was a list (one per prompt)
	stream  bool
	usage   bool // stream_options.include_usage
	rids    []string
	ridList bool
}

// split returns the request's generations as requests of their own, nil
// when it is one generation or goes whole, or the client's error.
func (l *LB) split(path string, req *request) (*splitReq, *failure) {
	sp := &splitReq{ep: endpointOf(path), stream: req.stream, n: 1, prompts: 1}
	b, ms := req.body, req.members
	var prompt []byte
	var wants []string
	switch sp.ep {
	case epGenerate:
		text, ids := lastMember(b, ms, "text"), lastMember(b, ms, "input_ids")
		if given(text) && given(ids) {
			return nil, nil
		}
		prompt, sp.field, wants = text, "text", []string{"string"}
		if given(ids) {
			prompt, sp.field, wants = ids, "input_ids", []string{"array"}
		}
	case epCompletions:
		prompt, sp.field, wants = lastMember(b, ms, "prompt"), "prompt", []string{"string", "array"}
	case epChat:
		sp.field = "messages"
	}
	elems, batch, ok := promptList(prompt, wants)
	if !ok {
		return nil, nil
	}
	sp.batch = batch
	if batch {
		sp.prompts = len(elems)
	}

	// n, and for /generate each prompt's sampling_params.
	var sampling [][]byte // one for all prompts, one per prompt, or none
	sp.nField = "n"
	if sp.ep == epGenerate {
		sp.nField = "sampling_params.n"
		switch raw := lastMember(b, ms, "sampling_params"); kindOf(raw) {
		case "absent", "null":
		case "object":
			sampling = [][]byte{raw}
		case "array":
			list, err := arrayElems(raw)
			if err != nil || !batch || len(list) != len(elems) {
				return nil, nil
			}
			for _, o := range list {
				if kindOf(o) != "object" {
					return nil, nil
				}
			}
			sampling, sp.spList, sp.nField = list, true, "sampling_params[0].n"
		default:
			return nil, nil
		}
		for i, o := range sampling {
			oms, err := objectMembers(o)
			if err != nil {
				return nil, nil
			}
			n, ok := intOf(lastMember(o, oms, "n"))
			if !ok || i > 0 && n != sp.n {
				return nil, nil
			}
			sp.n = n
		}
	} else {
		n, ok := intOf(lastMember(b, ms, "n"))
		if !ok {
			return nil, nil
		}
		sp.n = n
	}
	if sp.n < 1 || sp.n > MaxN || !batch && sp.n == 1 {
		return nil, nil
	}
	if c := sp.prompts * sp.n; c > l.cfg.MaxBatch {
		f := sp.field
		if !batch {
			f = sp.nField
		}
		return nil, &failure{code: http.StatusBadRequest, param: f,
			msg: fmt.Sprintf("%d prompts times n=%d is %d generations, more than the load balancer takes in one request (%d)", sp.prompts, sp.n, c, l.cfg.MaxBatch)}
	}

	// rid: one (a prefix for the generations' ids) or one per prompt.
	switch raw := lastMember(b, ms, "rid"); kindOf(raw) {
	case "absent", "null":
	case "string":
		var s string
		if json.Unmarshal(raw, &s) != nil {
			return nil, nil
		}
		sp.rids = []string{s}
	case "array":
		if json.Unmarshal(raw, &sp.rids) != nil {
			return nil, nil
		}
		sp.ridList = true
		switch {
		case !batch:
			return nil, &failure{code: http.StatusBadRequest, param: "rid", msg: "rid is a list but the prompt is not"}
		case len(sp.rids) != sp.prompts:
			return nil, &failure{code: http.StatusBadRequest, param: "rid", msg: fmt.Sprintf("rid has %d ids for %d prompts", len(sp.rids), sp.prompts)}
		}
	default:
		return nil, nil
	}
	if sp.ep != epGenerate && sp.stream {
		if so := lastMember(b, ms, "stream_options"); kindOf(so) == "object" {
			if sms, err := objectMembers(so); err == nil {
				sp.usage = string(lastMember(so, sms, "include_usage")) == "true"
			}
		}
	}

	for i := range sp.prompts {
		for j := range sp.n {
			var edits []edit
			if batch {
				edits = append(edits, edit{sp.field, elems[i]})
			}
			if sp.ep == epGenerate {
				if len(sampling) > 0 {
					o := sampling[min(i, len(sampling)-1)]
					edits = append(edits, edit{"sampling_params", sample(o, j, "seed", "sampling_seed")})
				}
			} else {
				edits = append(edits, edit{"n", nil})
				if j > 0 {
					if v, ok := seedPlus(lastMember(b, ms, "seed"), j); ok {
						edits = append(edits, edit{"seed", v})
					}
				}
			}
			if len(sp.rids) > 0 {
				var v []byte
				if r := sp.rid(i, j); r != "" {
					v = quote(r)
				}
				edits = append(edits, edit{"rid", v})
			}
			sub, err := parseRequest(editObject(b, ms, edits...))
			if err != nil { // not reached: the edits are valid JSON
				return nil, &failure{code: http.StatusInternalServerError, msg: "splitting the request: " + err.Error()}
			}
			sp.subs = append(sp.subs, sub)
		}
	}
	return sp, nil
}

// promptList reads a prompt member: a list whose first element is of a
// kind in wants is a batch of its elements (ok false when another element
// is of another kind); anything else is one prompt.
func promptList(raw []byte, wants []string) (elems [][]byte, batch, ok bool) {
	if kindOf(raw) != "array" {
		return nil, false, true
	}
	elems, err := arrayElems(raw)
	if err != nil || len(elems) == 0 {
		return nil, false, true
	}
	k0 := kindOf(elems[0])
	want := false
	for _, w := range wants {
		want = want || w == k0
	}
	if !want {
		return nil, false, true
	}
	for _, e := range elems[1:] {
		if kindOf(e) != k0 {
			return nil, false, false
		}
	}
	return elems, true, true
}

// intOf reads an integer member: absent or null is 1.
func intOf(raw []byte) (int, bool) {
	switch kindOf(raw) {
	case "absent", "null":
		return 1, true
	case "number":
		n, err := strconv.Atoi(string(raw))
		return n, err == nil
	}
	return 0, false
}

// sample is the sampling_params object o for sample j: without n, and
// from j > 0 with the first of the seed members given plus j.
func sample(o []byte, j int, seeds ...string) []byte {
	ms, err := objectMembers(o)
	if err != nil {
		return o
	}
	edits := []edit{{"n", nil}}
	if j > 0 {
		for _, name := range seeds {
			raw := lastMember(o, ms, name)
			if !given(raw) {
				continue
			}
			if v, ok := seedPlus(raw, j); ok {
				edits = append(edits, edit{name, v})
			}
			break
		}
	}
	return editObject(o, ms, edits...)
}

// seedPlus is the integer seed raw plus j (wrapping, as the servers add).
func seedPlus(raw []byte, j int) ([]byte, bool) {
	if kindOf(raw) != "number" {
		return nil, false
	}
	v, err := strconv.ParseInt(string(raw), 10, 64)
	if err != nil {
		return nil, false
	}
	return strconv.AppendInt(nil, v+int64(j), 10), true
}

// rid is generation (i, j)'s id, as the colocated server names it ("":
// the server picks one).
func (sp *splitReq) rid(i, j int) string {
	r := sp.rids
	switch {
	case len(r) == 0:
		return ""
	case sp.ridList && sp.n <= 1:
		return r[i]
	case sp.ridList:
		return r[i] + "_" + strconv.Itoa(j)
	case r[0] == "":
		return ""
	default:
		return r[0] + "_" + strconv.Itoa(i*sp.n+j)
	}
}

// openaiID is the id of a split OpenAI answer: the colocated server's,
// its first generation's.
func (sp *splitReq) openaiID() string {
	prefix := "cmpl-"
	if sp.ep == epChat {
		prefix = "chatcmpl-"
	}
	if r := sp.rid(0, 0); r != "" {
		return prefix + r
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}
