package server

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"strings"
)

// Request bodies are decoded strictly, by decodeObject: a field is either one its struct
// decodes (by its json tag, spelled exactly), or one the struct's extraFields names
// (informational, or refused unless it holds its default), or unknown and refused. Every
// error names the field by its path in the API ("sampling_params.temperature",
// "messages[2].content"), never by a Go name.

// fieldRule is what a request does with a field it knows but does not decode.
type fieldRule struct {
	info   bool     // informational: any value is accepted and ignored
	accept []string // else: the values (compact JSON) accepted as their default; null always is
	why    string   // what is not supported, for the error
}

// fieldRules are a request struct's known fields that it does not decode, by JSON name.
type fieldRules map[string]fieldRule

// extraFields is implemented by request structs that know fields they do not decode.
type extraFields interface{ extraFields() fieldRules }

var (
	unmarshalerType = reflect.TypeFor[json.Unmarshaler]()
	rawMessageType  = reflect.TypeFor[json.RawMessage]()
)

// fieldPath joins an object's path and a field name.
func fieldPath(path, name string) string {
	if path == "" {
		return name
	}
	return path + "." + name
}

// jsonFields maps the JSON names of t's fields (those of embedded structs promoted, as
// encoding/json does) to their indexes.
func jsonFields(t reflect.Type) map[string][]int {
	out := map[string][]int{}
	var walk func(t reflect.Type, index []int)
	walk = func(t reflect.Type, index []int) {
		for i := range t.NumField() {
			f := t.Field(i)
			idx := append(slices.Clone(index), i)
			if f.Anonymous && f.Type.Kind() == reflect.Struct {
				walk(f.Type, idx)
				continue
			}
			name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
			if !f.IsExported() || name == "" || name == "-" {
				continue
			}
			out[name] = idx
		}
	}
	walk(t, nil)
	return out
}

// decodeObject decodes the JSON object raw (valid JSON: unmarshalObject checks the
// body once) into v, a pointer to a struct; path is the object's own path ("" for the
// body).
func decodeObject(path string, raw []byte, v any) *Error {
	return decodeStruct(path, raw, reflect.ValueOf(v).Elem())
}

func decodeStruct(path string, raw []byte, sv reflect.Value) *Error {
	if k := jsonKind(raw); k != "object" {
		if path == "" {
			return badRequest("", "request body must be a JSON object")
		}
		return badRequest(path, "%s: expected an object, got JSON %s", path, k)
	}
	obj, err := members(raw)
	if err != nil {
		return jsonError(err)
	}
	fields := jsonFields(sv.Type())
	var rules fieldRules
	if x, ok := sv.Addr().Interface().(extraFields); ok {
		rules = x.extraFields()
	}
	names := make([]string, 0, len(obj))
	for name := range obj {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		p, val := fieldPath(path, name), obj[name]
		idx, ok := fields[name]
		if !ok {
			if e := checkExtra(p, val, rules, name); e != nil {
				return e
			}
			continue
		}
		if e := decodeValue(p, val, sv.FieldByIndex(idx)); e != nil {
			return e
		}
	}
	return nil
}

// checkExtra applies the rule for a field its struct does not decode.
func checkExtra(p string, val json.RawMessage, rules fieldRules, name string) *Error {
	r, ok := rules[name]
	if !ok {
		return badRequest(p, "unknown field %s", p)
	}
	if r.info || jsonKind(val) == "null" {
		return nil
	}
	var c bytes.Buffer
	if json.Compact(&c, val) == nil && slices.Contains(r.accept, c.String()) {
		return nil
	}
	msg := p + " is not supported"
	if r.why != "" {
		msg += " (" + r.why + ")"
	}
	if len(r.accept) > 0 {
		msg += "; accepted: " + strings.Join(r.accept, ", ")
	}
	return badRequest(p, "%s", msg)
}

// selfDecoder is implemented by field types that decode themselves strictly: values of
// several JSON shapes whose parts are objects (decodeStruct them).
type selfDecoder interface {
	decodeField(path string, raw json.RawMessage) *Error
}

// decodeValue decodes raw into the field fv at path p: structs and lists of structs
// field by field, anything else with encoding/json.
func decodeValue(p string, raw json.RawMessage, fv reflect.Value) *Error {
	if d, ok := fv.Addr().Interface().(selfDecoder); ok {
		return d.decodeField(p, raw)
	}
	t := fv.Type()
	custom := reflect.PointerTo(t).Implements(unmarshalerType)
	switch {
	case t == rawMessageType:
		fv.SetBytes(raw) // valid JSON already: no copy, no second scan
		return nil
	case custom:
	case t.Kind() == reflect.Struct:
		return decodeStruct(p, raw, fv)
	case t.Kind() == reflect.Pointer && t.Elem().Kind() == reflect.Struct && !t.Implements(unmarshalerType):
		if jsonKind(raw) == "null" {
			fv.SetZero()
			return nil
		}
		nv := reflect.New(t.Elem())
		if e := decodeStruct(p, raw, nv.Elem()); e != nil {
			return e
		}
		fv.Set(nv)
		return nil
	case t.Kind() == reflect.Slice && t.Elem().Kind() == reflect.Struct && !reflect.PointerTo(t.Elem()).Implements(unmarshalerType):
		switch jsonKind(raw) {
		case "null":
			fv.SetZero()
			return nil
		case "array":
		default:
			return badRequest(p, "%s: wrong type: expected an array, got JSON %s", p, jsonKind(raw))
		}
		elems := elements(raw)
		s := reflect.MakeSlice(t, len(elems), len(elems))
		for i, el := range elems {
			if e := decodeValue(p+"["+strconv.Itoa(i)+"]", el, s.Index(i)); e != nil {
				return e
			}
		}
		fv.Set(s)
		return nil
	}
	if err := json.Unmarshal(raw, fv.Addr().Interface()); err != nil {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return badRequest(p, "%s: wrong type: expected %s, got JSON %s", p, typeName(t), te.Value)
		}
		return badRequest(p, "%s: %v", p, err)
	}
	return nil
}

// typeName names a Go type the way a JSON user thinks of it.
func typeName(t reflect.Type) string {
	switch t {
	case reflect.TypeFor[stopList](), reflect.TypeFor[ridList]():
		return "a string or a list of strings"
	}
	switch t.Kind() {
	case reflect.Pointer:
		return typeName(t.Elem())
	case reflect.Slice, reflect.Array:
		return "an array of " + strings.TrimPrefix(strings.TrimPrefix(typeName(t.Elem()), "an "), "a ") + "s"
	case reflect.Map, reflect.Struct:
		return "an object"
	case reflect.String:
		return "a string"
	case reflect.Bool:
		return "a boolean"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64,
		reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		if t.Kind() >= reflect.Uint {
			return "a non-negative integer"
		}
		return "an integer"
	}
	return fmt.Sprint(t)
}

// Splitting valid JSON into its parts: one scan per level at memchr speed through
// strings, where encoding/json would validate and scan each level again.

// members splits a valid JSON object into its members (the last of a repeated key wins,
// as encoding/json does).
func members(b []byte) (map[string]json.RawMessage, error) {
	out := map[string]json.RawMessage{}
	i := skipSpace(b, 1) // after '{'
	for i < len(b) && b[i] != '}' {
		ke := valueEnd(b, i)
		key, err := unquote(b[i:ke])
		if err != nil {
			return nil, err
		}
		i = skipSpace(b, skipSpace(b, ke)+1) // after ':'
		ve := valueEnd(b, i)
		out[key] = b[i:ve]
		i = skipSpace(b, ve)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return out, nil
}

// elements splits a valid JSON array into its elements.
func elements(b []byte) []json.RawMessage {
	var out []json.RawMessage
	i := skipSpace(b, 1) // after '['
	for i < len(b) && b[i] != ']' {
		e := valueEnd(b, i)
		out = append(out, b[i:e])
		i = skipSpace(b, e)
		if i < len(b) && b[i] == ',' {
			i = skipSpace(b, i+1)
		}
	}
	return out
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// valueEnd is the end of the valid JSON value that starts at b[i].
func valueEnd(b []byte, i int) int {
	switch b[i] {
	case '"':
		return stringEnd(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				j = stringEnd(b, j) - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return j + 1
				}
			}
		}
		return len(b)
	default: // a number, true, false, null
		j := i
		for j < len(b) && !strings.ContainsRune(",]} \t\n\r", rune(b[j])) {
			j++
		}
		return j
	}
}

// stringEnd is the end of the JSON string whose opening quote is b[i].
func stringEnd(b []byte, i int) int {
	for j := i + 1; ; {
		k := bytes.IndexByte(b[j:], '"')
		if k < 0 {
			return len(b)
		}
		q := j + k
		n := 0 // backslashes before the quote: an odd number escapes it
		for p := q - 1; p > i && b[p] == '\\'; p-- {
			n++
		}
		if n%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
}
