package lb

import (
	"encoding/json"
	"maps"
	"strings"
	"testing"
)

// injectRef is inject done the slow way: decode, set, re-encode.
func injectRef(body []byte, host string, port int64, room uint64) (map[string]any, bool) {
	var obj map[string]any
	if err := json.Unmarshal(body, &obj); err != nil || obj == nil {
		return nil, false
	}
	obj["bootstrap_host"], obj["bootstrap_port"], obj["bootstrap_room"] = host, float64(port), float64(room)
	return obj, true
}

func TestInject(t *testing.T) {
	for _, c := range []struct {
		name, body string
		ok         bool
	}{
		{"ids", `{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":8,"stop":["}","\""]},"stream":true}`, true},
		{"empty", ` { } `, true},
		{"client bootstrap replaced", `{"bootstrap_room":5,"text":"a","bootstrap_host":"evil","bootstrap_port":1}`, true},
		{"escaped key replaced", `{"bootstrap\u005froom":5,"text":"a"}`, true},
		{"escapes and unicode", `{"text":"a\"b\\c\u00e9\n","x":-0.5e+3,"y":null,"z":false,"w":[[],{}]}`, true},
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
			out, err := inject([]byte(c.body), "10.0.0.1", 8998, 1<<62+3)
			if (err == nil) != c.ok {
				t.Fatalf("inject(%q) = %s, %v; want ok=%v", c.body, out, err, c.ok)
			}
			if err != nil {
				return
			}
			want, _ := injectRef([]byte(c.body), "10.0.0.1", 8998, 1<<62+3)
			var got map[string]any
			if err := json.Unmarshal(out, &got); err != nil {
				t.Fatalf("inject(%q) = %s: not JSON: %v", c.body, out, err)
			}
			if !maps.EqualFunc(got, want, func(a, b any) bool { x, _ := json.Marshal(a); y, _ := json.Marshal(b); return string(x) == string(y) }) {
				t.Fatalf("inject(%q) = %s, want %v", c.body, out, want)
			}
			if n := strings.Count(string(out), "bootstrap_room"); n != 1 {
				t.Fatalf("inject(%q) = %s: bootstrap_room %d times", c.body, out, n)
			}
			// The room is exact (a float64 round trip would lose it).
			var rm struct {
				BootstrapRoom uint64 `json:"bootstrap_room"`
			}
			if err := json.Unmarshal(out, &rm); err != nil || rm.BootstrapRoom != 1<<62+3 {
				t.Fatalf("room %d, %v", rm.BootstrapRoom, err)
			}
		})
	}
}

// FuzzInject: any body that is a JSON object gets the members the reference
// gives; anything inject accepts comes out as a valid JSON object.
func FuzzInject(f *testing.F) {
	for _, s := range []string{`{"input_ids":[1,2],"stream":true}`, `{}`, `{"a":{"b":[1,"}"]}}`, `{"bootstrap_port":1}`, `[]`, `{"a":"\u00e9"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		out, err := inject(body, "h", 1, 2)
		want, isObj := injectRef(body, "h", 1, 2)
		if isObj != (err == nil) && !(isObj && strings.Contains(err.Error(), "nested deeper")) {
			t.Fatalf("inject(%q): err %v, but the body is an object: %v", body, err, isObj)
		}
		if err != nil {
			return
		}
		var got map[string]any
		if err := json.Unmarshal(out, &got); err != nil {
			t.Fatalf("inject(%q) = %q: %v", body, out, err)
		}
		x, _ := json.Marshal(got)
		y, _ := json.Marshal(want)
		if string(x) != string(y) {
			t.Fatalf("inject(%q) = %s, want %s", body, x, y)
		}
	})
}
