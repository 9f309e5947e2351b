package server

import (
	"bytes"
	"encoding/json"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// apiParam is what an error's param may look like: JSON names and list indexes.
var apiParam = regexp.MustCompile(`^[a-z_]+(\[\d+\])*(\.[a-z_]+(\[\d+\])*)*$`)

type decoderCase struct {
	name   string
	typ    reflect.Type
	base   func() map[string]any // a valid body
	decode func([]byte) *Error
}

func decoderCases() []decoderCase {
	return []decoderCase{
		{"generate", reflect.TypeFor[generateRequest](), func() map[string]any { return map[string]any{"text": "a"} },
			func(b []byte) *Error { _, e := decodeGenerate(b); return e }},
		{"completions", reflect.TypeFor[completionRequest](), func() map[string]any { return map[string]any{"prompt": "a"} },
			func(b []byte) *Error { _, e := decodeCompletion(b); return e }},
		{"chat", reflect.TypeFor[chatRequest](), func() map[string]any {
			return map[string]any{"messages": []any{map[string]any{"role": "user", "content": "a"}}}
		}, func(b []byte) *Error { _, e := decodeChat(b); return e }},
	}
}

// wrongValue is a JSON value of the wrong type for a field of type t.
func wrongValue(name string, t reflect.Type) any {
	switch {
	case t == reflect.TypeFor[json.RawMessage]():
		return map[string]any{"text": true, "input_ids": "1 2", "prompt": true, "content": 5}[name]
	case t == reflect.TypeFor[stopList](), t == reflect.TypeFor[biasObject](), t == reflect.TypeFor[ridList](), t == reflect.TypeFor[samplingParams]():
		return 5
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.String:
		return 5
	case reflect.Slice:
		return "x"
	case reflect.Struct:
		return []any{1}
	default:
		return "x"
	}
}

// object is a JSON object of a request: its API path, its Go type and a way to put a
// field into it in a (valid) body.
type object struct {
	path string
	typ  reflect.Type
	put  func(body map[string]any, name string, v any)
}

// objects lists o and the objects of its fields, recursively.
func objects(o object) []object {
	out := []object{o}
	for _, f := range reflect.VisibleFields(o.typ) {
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if f.Anonymous || !f.IsExported() || name == "" {
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		p := fieldPath(o.path, name)
		switch {
		case ft.Kind() == reflect.Struct && !reflect.PointerTo(ft).Implements(unmarshalerType):
			out = append(out, objects(object{p, ft, func(body map[string]any, n string, v any) {
				o.put(body, name, map[string]any{n: v})
			}})...)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			out = append(out, objects(object{p + "[0]", ft.Elem(), func(body map[string]any, n string, v any) {
				el := map[string]any{"role": "user", "content": "a"} // a valid message
				el[n] = v
				o.put(body, name, []any{el})
			}})...)
		}
	}
	return out
}

func topPut(body map[string]any, name string, v any) {
	if name == "input_ids" {
		delete(body, "text")
	}
	body[name] = v
}

// TestWrongTypeParams sends every field of every request, nested ones included, with a
// value of the wrong type: each gets a 400 whose param is the field's API path.
func TestWrongTypeParams(t *testing.T) {
	n := 0
	for _, dc := range decoderCases() {
		for _, o := range objects(object{"", dc.typ, topPut}) {
			for _, f := range reflect.VisibleFields(o.typ) {
				name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
				if f.Anonymous || !f.IsExported() || name == "" {
					continue
				}
				p := fieldPath(o.path, name)
				body := dc.base()
				o.put(body, name, wrongValue(name, f.Type))
				b, _ := json.Marshal(body)
				e := dc.decode(b)
				if e == nil || e.Status != 400 || e.Param != p || !strings.Contains(e.Message, p) || !apiParam.MatchString(e.Param) {
					t.Errorf("%s %s: %+v, want a 400 naming %s", dc.name, b, e, p)
				}
				n++
			}
		}
	}
	if n < 60 {
		t.Fatalf("only %d fields walked", n)
	}
	t.Logf("%d fields", n)
}

// TestUnknownFields: a field no list knows is refused in every object, spelled exactly.
func TestUnknownFields(t *testing.T) {
	for _, dc := range decoderCases() {
		for _, o := range objects(object{"", dc.typ, topPut}) {
			body := dc.base()
			o.put(body, "zz_unknown", 1)
			p := fieldPath(o.path, "zz_unknown")
			b, _ := json.Marshal(body)
			if e := dc.decode(b); e == nil || e.Status != 400 || e.Param != p || !strings.Contains(e.Message, "unknown field "+p) {
				t.Errorf("%s %s: %+v, want unknown field %s", dc.name, b, e, p)
			}
		}
	}
	for _, body := range []string{`{"Text": "a"}`, `{"text": "a", "sampling_params": {"Temperature": 1}}`} {
		if _, e := decodeGenerate([]byte(body)); e == nil || !strings.Contains(e.Message, "unknown field") {
			t.Errorf("%s: %+v", body, e)
		}
	}
}

// FuzzSplit: members and elements split valid JSON as encoding/json does.
func FuzzSplit(f *testing.F) {
	for _, s := range []string{`{}`, `[]`, `{"a": 1, "b": [1, {"c": "]}"}], "a": "x\"y\\"}`, ` [ "\\\"", {}, [[]], -1.5e3, true, null ] `,
		`{"k\u00e9y": {"n": "\\\\"}, "": ""}`, `{"text": "a\"}", "x": {"y": ["}"]}}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !json.Valid(b) {
			return
		}
		b = bytes.TrimSpace(b)
		compact := func(r []byte) string {
			var c bytes.Buffer
			if err := json.Compact(&c, r); err != nil {
				t.Fatalf("part %q is not JSON: %v", r, err)
			}
			return c.String()
		}
		switch jsonKind(b) {
		case "object":
			var want map[string]json.RawMessage
			if err := json.Unmarshal(b, &want); err != nil {
				t.Fatal(err)
			}
			got, err := members(b)
			if err != nil || len(got) != len(want) {
				t.Fatalf("members(%q) = %q, %v; want %q", b, got, err, want)
			}
			for k, v := range want {
				if compact(got[k]) != compact(v) {
					t.Fatalf("members(%q)[%q] = %q, want %q", b, k, got[k], v)
				}
			}
		case "array":
			var want []json.RawMessage
			if err := json.Unmarshal(b, &want); err != nil {
				t.Fatal(err)
			}
			got := elements(b)
			if len(got) != len(want) {
				t.Fatalf("elements(%q) = %q; want %q", b, got, want)
			}
			for i := range want {
				if compact(got[i]) != compact(want[i]) {
					t.Fatalf("elements(%q)[%d] = %q, want %q", b, i, got[i], want[i])
				}
			}
		}
	})
}
