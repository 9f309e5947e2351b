package lb

import (
	"encoding/json"
	"errors"
)

// Editing valid JSON in place: the LB splits a batch into requests of one
// generation and joins their answers into one, changing a few members and
// passing every other byte on as the servers wrote it.

// jsonMember is one member of a JSON object: its name unescaped (the
// servers match names exactly) and the spans of its raw name and value.
type jsonMember struct {
	name  string
	key   [2]int // the name, quotes included
	value [2]int
}

// memberName unescapes a raw JSON member name (valid, quotes included).
func memberName(key []byte) string {
	inner := key[1 : len(key)-1]
	for _, c := range inner {
		if c == '\\' {
			var s string
			_ = json.Unmarshal(key, &s) // valid: the scanner read it
			return s
		}
	}
	return string(inner)
}

// objectMembers splits the JSON object b into its members.
func objectMembers(b []byte) ([]jsonMember, error) {
	s := scanner{b: b}
	s.ws()
	if !s.eat('{') {
		return nil, errors.New("not a JSON object")
	}
	var out []jsonMember
	s.ws()
	if s.eat('}') {
		return out, nil
	}
	for {
		ks := s.i
		key, err := s.str()
		if err != nil {
			return nil, err
		}
		s.ws()
		if !s.eat(':') {
			return nil, s.errf("':'")
		}
		s.ws()
		vs := s.i
		if err := s.value(0); err != nil {
			return nil, err
		}
		out = append(out, jsonMember{name: memberName(key), key: [2]int{ks, ks + len(key)}, value: [2]int{vs, s.i}})
		s.ws()
		if s.eat('}') {
			return out, nil
		}
		if !s.eat(',') {
			return nil, s.errf("',' or '}'")
		}
		s.ws()
	}
}

// arrayElems splits the JSON array b into its elements.
func arrayElems(b []byte) ([][]byte, error) {
	s := scanner{b: b}
	s.ws()
	if !s.eat('[') {
		return nil, errors.New("not a JSON array")
	}
	out := [][]byte{}
	s.ws()
	if s.eat(']') {
		return out, nil
	}
	for {
		start := s.i
		if err := s.value(0); err != nil {
			return nil, err
		}
		out = append(out, b[start:s.i])
		s.ws()
		if s.eat(']') {
			return out, nil
		}
		if !s.eat(',') {
			return nil, s.errf("',' or ']'")
		}
		s.ws()
	}
}

// kindOf is the kind of the JSON value b: object, array, string, number,
// bool or null; absent for nil.
func kindOf(b []byte) string {
	s := scanner{b: b}
	s.ws()
	if s.i >= len(b) {
		return "absent"
	}
	switch b[s.i] {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "bool"
	case 'n':
		return "null"
	}
	return "number"
}

// lastMember is the value of the last member named name (the one the
// servers decode), or nil.
func lastMember(b []byte, ms []jsonMember, name string) []byte {
	var v []byte
	for _, m := range ms {
		if m.name == name {
			v = b[m.value[0]:m.value[1]]
		}
	}
	return v
}

// given reports a value that is there and not null.
func given(v []byte) bool { k := kindOf(v); return k != "absent" && k != "null" }

// edit is a change of one member: its new value, or nil to drop it.
type edit struct {
	name  string
	value []byte
}

// editObject is the object b (members ms) with each edit applied: the
// member's every occurrence dropped and, for a value, the new one written
// where the last occurrence was, or at the end.
func editObject(b []byte, ms []jsonMember, edits ...edit) []byte {
	last := map[string]int{}
	for i, m := range ms {
		last[m.name] = i
	}
	byName := map[string][]byte{}
	for _, e := range edits {
		byName[e.name] = e.value
	}
	out := make([]byte, 0, len(b)+64)
	out = append(out, '{')
	put := func(name string, v []byte) {
		if len(out) > 1 {
			out = append(out, ',')
		}
		out = append(out, quote(name)...)
		out = append(out, ':')
		out = append(out, v...)
	}
	for i, m := range ms {
		v, edited := byName[m.name]
		switch {
		case !edited:
			if len(out) > 1 {
				out = append(out, ',')
			}
			out = append(out, b[m.key[0]:m.value[1]]...)
		case v != nil && last[m.name] == i:
			put(m.name, v)
		}
	}
	for _, e := range edits {
		if _, there := last[e.name]; !there && e.value != nil {
			put(e.name, e.value)
		}
	}
	return append(out, '}')
}

// setMembers is editObject on a JSON object given whole.
func setMembers(b []byte, edits ...edit) ([]byte, error) {
	ms, err := objectMembers(b)
	if err != nil {
		return nil, err
	}
	return editObject(b, ms, edits...), nil
}

// joinArray is a JSON array of the given (valid) values.
func joinArray(elems [][]byte) []byte {
	n := 2
	for _, e := range elems {
		n += len(e) + 1
	}
	out := make([]byte, 0, n)
	out = append(out, '[')
	for i, e := range elems {
		if i > 0 {
			out = append(out, ',')
		}
		out = append(out, e...)
	}
	return append(out, ']')
}

// quote is s as a JSON string.
func quote(s string) []byte {
	b, _ := json.Marshal(s)
	return b
}
