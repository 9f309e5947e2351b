package lb

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
)

// inject is parseRequest and with in one call.
func inject(body []byte, host string, port int64, room uint64) ([]byte, error) {
	r, err := parseRequest(body)
	if err != nil {
		return nil, err
	}
	return r.with(host, port, room), nil
}

// member is one top-level member as encoding/json reads it: the unescaped
// name and the value's bytes as they are in the body.
type member struct {
	name string
	raw  string
}

// members reads a JSON object's top-level members in order with
// encoding/json; ok is false if body is not one JSON object.
func members(body []byte) ([]member, bool) {
	var obj map[string]json.RawMessage
	if json.Unmarshal(body, &obj) != nil || obj == nil {
		return nil, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, false
	}
	var out []member
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, false
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, false
		}
		out = append(out, member{tok.(string), string(raw)})
	}
	return out, true
}

// jsonField is the field of the server's request structs that encoding/json
// matches name to ("" for none): the oracle for matchName.
func jsonField(name string) string {
	key, _ := json.Marshal(name)
	var v struct {
		Host   *json.RawMessage `json:"bootstrap_host"`
		Port   *json.RawMessage `json:"bootstrap_port"`
		Room   *json.RawMessage `json:"bootstrap_room"`
		Stream *json.RawMessage `json:"stream"`
	}
	if err := json.Unmarshal([]byte(`{`+string(key)+`:0}`), &v); err != nil {
		panic(err)
	}
	switch {
	case v.Host != nil:
		return "bootstrap_host"
	case v.Port != nil:
		return "bootstrap_port"
	case v.Room != nil:
		return "bootstrap_room"
	case v.Stream != nil:
		return "stream"
	}
	return ""
}

const (
	testHost = "10.0.0.1"
	testPort = 8998
	testRoom = 1<<62 + 3
)

// checkInject compares inject with the oracle: encoding/json reads the
// LB's three bootstrap members first (exact values, the room with no
// float64 round trip), then every member of body that it would not match
// to a bootstrap field, in order and byte for byte; stream is what the
// last "stream" member says. ok: body is a JSON object.
func checkInject(t *testing.T, body []byte) (ok bool) {
	t.Helper()
	in, isObj := members(body)
	r, err := parseRequest(body)
	if err != nil {
		if isObj && !strings.Contains(err.Error(), "nested deeper") {
			t.Fatalf("parseRequest(%q): %v, but it is a JSON object", body, err)
		}
		return false
	}
	if !isObj {
		t.Fatalf("parseRequest(%q) accepted a body encoding/json rejects", body)
	}
	out := r.with(testHost, testPort, testRoom)
	got, ok := members(out)
	if !ok {
		t.Fatalf("inject(%q) = %q: not a JSON object", body, out)
	}
	want := []member{{"bootstrap_host", `"` + testHost + `"`}, {"bootstrap_port", fmt.Sprint(testPort)}, {"bootstrap_room", fmt.Sprint(uint64(testRoom))}}
	stream := false
	for _, m := range in {
		switch jsonField(m.name) {
		case "bootstrap_host", "bootstrap_port", "bootstrap_room":
			continue
		case "stream":
			stream = m.raw == "true"
		}
		want = append(want, m)
	}
	if !slices.Equal(got, want) {
		t.Fatalf("inject(%q) = %q:\n got %q\nwant %q", body, out, got, want)
	}
	if r.stream != stream {
		t.Fatalf("parseRequest(%q).stream = %v, want %v", body, r.stream, stream)
	}
	// What a server decodes: the LB's fields, whatever the client spelt.
	var srv struct {
		Host *string `json:"bootstrap_host"`
		Port *int    `json:"bootstrap_port"`
		Room *uint64 `json:"bootstrap_room"`
	}
	if err := json.Unmarshal(out, &srv); err != nil {
		var te *json.UnmarshalTypeError
		if !errors.As(err, &te) {
			t.Fatalf("inject(%q) = %q: %v", body, out, err)
		}
	}
	if srv.Host == nil || *srv.Host != testHost || srv.Port == nil || *srv.Port != testPort || srv.Room == nil || *srv.Room != testRoom {
		t.Fatalf("inject(%q) = %q: a server decodes %+v", body, out, srv)
	}
	return true
}

func TestInject(t *testing.T) {
	for _, c := range []struct {
		name, body string
		ok         bool
	}{
		{"ids", `{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":8,"stop":["}","\""]},"stream":true}`, true},
		{"empty", ` { } `, true},
		{"client bootstrap replaced", `{"bootstrap_room":5,"text":"a","bootstrap_host":"evil","bootstrap_port":1}`, true},
		{"escaped key", `{"bootstrap\u005froom":5,"text":"a"}`, true},
		{"escaped first letter", `{"\u0062ootstrap_host":"evil","\u0042OOTSTRAP_PORT":1}`, true},
		{"upper case", `{"BOOTSTRAP_HOST":"evil","Bootstrap_Port":1,"bootstrap_ROOM":7}`, true},
		{"long s", `{"bootſtrap_host":"evil","boot\u017ftrap_port":1}`, true},
		{"long s upper", `{"BOOTſTRAP_ROOM":7}`, true},
		{"duplicates", `{"bootstrap_host":"a","text":"x","bootstrap_host":"b","BOOTSTRAP_HOST":"c"}`, true},
		{"nested", `{"sampling_params":{"bootstrap_host":"keep"},"x":{"bootstrap_port":1}}`, true},
		{"near misses kept", `{"bootstrap_host ":"a","bootstrap_hos":"b","bootstrap-host":"c","bootstrap_host\u0000":"d","bootstrap_hoſt_":1}`, true},
		{"dotless i is not i", `{"str\u0131am":true}`, true},
		{"stream spelt", `{"STREAM":true,"text":"a"}`, true},
		{"stream last wins", `{"stream":true,"Stream":false}`, true},
		{"stream not true", `{"stream":"true"}`, true},
		{"escapes and unicode", `{"text":"a\"b\\c\u00e9\n","x":-0.5e+3,"y":null,"z":false,"w":[[],{}]}`, true},
		{"whitespace kept", "{ \"text\" :\t\"a\" ,\n\"x\" : [ 1 , 2 ] }", true},
		{"array", `[1,2]`, false},
		{"string", `"x"`, false},
		{"truncated", `{"text":"a`, false},
		{"trailing", `{"text":"a"} x`, false},
		{"two objects", `{}{}`, false},
		{"missing colon", `{"a" 1}`, false},
		{"trailing comma", `{"a":1,}`, false},
		{"bad literal", `{"a":tru}`, false},
		{"bad number", `{"a":01}`, false},
		{"bad escape", `{"a":"\x"}`, false},
		{"control char", "{\"a\":\"\x01\"}", false},
		{"deep", strings.Repeat("[", 2000) + strings.Repeat("]", 2000), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if ok := checkInject(t, []byte(c.body)); ok != c.ok {
				t.Fatalf("inject(%q): ok %v, want %v", c.body, ok, c.ok)
			}
		})
	}
	// Members are copied with their own spacing, and the LB's come first.
	out, err := inject([]byte("{ \"text\" :\t\"a\" ,\"BOOTSTRAP_HOST\":\"evil\", \"x\":1}"), "h", 1, 2)
	if want := "{\"bootstrap_host\":\"h\",\"bootstrap_port\":1,\"bootstrap_room\":2,\"text\" :\t\"a\",\"x\":1}"; err != nil || string(out) != want {
		t.Fatalf("inject = %q, %v; want %q", out, err, want)
	}
}

// TestFoldLikeEncodingJSON: matchName's folding is encoding/json's, on
// runes whose orbits leave ASCII (KELVIN SIGN and k, LONG S and s) and on
// ones that do not (dotless and dotted i).
func TestFoldLikeEncodingJSON(t *testing.T) {
	for _, name := range []string{"\u212Aey", "KEY", "ſtream", "\u212A\u212Ay", "ıey", "İey", "key", "kez"} {
		var v struct {
			Key *int `json:"key"`
		}
		key, _ := json.Marshal(name)
		if err := json.Unmarshal([]byte(`{`+string(key)+`:1}`), &v); err != nil {
			t.Fatal(err)
		}
		if got, want := strings.EqualFold(name, "key"), v.Key != nil; got != want {
			t.Errorf("%q: strings.EqualFold says %v, encoding/json %v", name, got, want)
		}
	}
}

// FuzzInject compares inject with the encoding/json oracle (checkInject) on
// any body. Seeds are here and in testdata/fuzz/FuzzInject.
func FuzzInject(f *testing.F) {
	for _, s := range []string{`{"input_ids":[1,2],"stream":true}`, `{}`, `{"a":{"b":[1,"}"]}}`, `{"bootstrap_port":1}`, `[]`,
		`{"a":"\u00e9"}`, `{"BOOTſTRAP_HOST":"x","b\u006fotstrap_room":1,"bootstrap_port":2,"bootstrap_port":3}`, `{"Stream":true,"ſtream":false}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if len(body) > 1<<16 {
			t.Skip()
		}
		checkInject(t, body)
	})
}
