package lb

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// request is a client's JSON object, scanned once: the spans of its
// members that the LB passes on, byte for byte, and whether it asks for a
// stream. The bootstrap members are the LB's: a client's own are dropped in
// every spelling encoding/json would match to them (see matchName), so the
// servers decode only the LB's.
type request struct {
	body    []byte
	members []jsonMember // the members kept, in order
	stream  bool         // the last "stream" member is true
	prompt  [2]int       // the value of the first prompt member (see isPromptName)
	arr     [12]jsonMember
}

// Member names inject looks at, by index.
const (
	nameHost = iota
	namePort
	nameRoom
	nameStream
)

var names = [...]string{"bootstrap_host", "bootstrap_port", "bootstrap_room", "stream"}

// parseRequest scans body's top level once; values are checked only for
// their structure (the servers decode them fully). A 1K-token prompt is ~6
// KB of ids, which a decode and re-encode would copy twice.
func parseRequest(body []byte) (*request, error) {
	s := scanner{b: body}
	s.ws()
	if !s.eat('{') {
		return nil, errors.New("request body is not a JSON object")
	}
	req := &request{body: body}
	req.members = req.arr[:0]
	s.ws()
	if !s.eat('}') {
		for {
			start := s.i
			key, err := s.str()
			if err != nil {
				return nil, fmt.Errorf("request body: member name: %w", err)
			}
			s.ws()
			if !s.eat(':') {
				return nil, s.errf("':' after a member name")
			}
			s.ws()
			vstart := s.i
			if err := s.value(0); err != nil {
				return nil, fmt.Errorf("request body: value of %s: %w", key, err)
			}
			switch matchName(key) {
			case nameHost, namePort, nameRoom:
			case nameStream:
				req.stream = string(body[vstart:s.i]) == "true"
				fallthrough
			default:
				if req.prompt[1] == 0 && isPromptName(key) {
					req.prompt = [2]int{vstart, s.i}
				}
				req.members = append(req.members, jsonMember{name: memberName(key), key: [2]int{start, start + len(key)}, value: [2]int{vstart, s.i}})
			}
			s.ws()
			if s.eat('}') {
				break
			}
			if !s.eat(',') {
				return nil, s.errf("',' or '}' after a member")
			}
			s.ws()
		}
	}
	s.ws()
	if s.i != len(body) {
		return nil, s.errf("the end of the body after the object")
	}
	return req, nil
}

// isPromptName reports whether key, a raw JSON member name, is one that
// holds a prompt: /generate's text or input_ids, /v1/completions' prompt,
// /v1/chat/completions' messages (exactly: the servers take no other
// spelling).
func isPromptName(key []byte) bool {
	switch string(key) {
	case `"text"`, `"input_ids"`, `"prompt"`, `"messages"`:
		return true
	}
	return false
}

// key is the prompt as the client wrote it (a JSON value, raw), at most
// MaxKeyBytes; nil when the request has no prompt member. Prompts that
// share a prefix share a prefix of these bytes, as the same client writes
// them.
func (r *request) key() []byte {
	if r.prompt[1] == 0 {
		return nil
	}
	k := r.body[r.prompt[0]:r.prompt[1]]
	return k[:min(len(k), MaxKeyBytes)]
}

// with returns the body with the LB's bootstrap members first, then the
// kept members.
func (r *request) with(host string, port int64, room uint64) []byte {
	n := len(host) + 96
	for _, m := range r.members {
		n += m.value[1] - m.key[0] + 1
	}
	out := make([]byte, 0, n)
	out = append(out, `{"bootstrap_host":`...)
	out = strconv.AppendQuote(out, host)
	out = append(out, `,"bootstrap_port":`...)
	out = strconv.AppendInt(out, port, 10)
	out = append(out, `,"bootstrap_room":`...)
	out = strconv.AppendUint(out, room, 10)
	for _, m := range r.members {
		out = append(out, ',')
		out = append(out, r.body[m.key[0]:m.value[1]]...)
	}
	return append(out, '}')
}

// matchName returns the index in names of the name that key, a raw JSON
// string with its quotes, matches as encoding/json matches a member to a
// struct field: after unescaping, exactly or under Unicode simple case
// folding as strings.EqualFold ("BOOTSTRAP_HOST", "bootſtrap_host" with
// U+017F, "\u0062ootstrap_host"), or -1.
func matchName(key []byte) int {
	inner := key[1 : len(key)-1]
	plain := true
	for _, c := range inner {
		if c == '\\' || c >= utf8.RuneSelf {
			plain = false
			break
		}
	}
	if plain { // the common case: ASCII, no escapes
		for i, n := range names {
			if len(inner) == len(n) && asciiEqualFold(inner, n) {
				return i
			}
		}
		return -1
	}
	var name string
	if err := json.Unmarshal(key, &name); err != nil {
		return -1 // not reached: the scanner checked the string
	}
	for i, n := range names {
		if strings.EqualFold(name, n) {
			return i
		}
	}
	return -1
}

func asciiEqualFold(b []byte, s string) bool {
	for i := range b {
		x, y := b[i], s[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// maxDepth bounds the nesting of a request body's values.
const maxDepth = 1000

type scanner struct {
	b []byte
	i int
}

func (s *scanner) errf(want string) error {
	if s.i >= len(s.b) {
		return fmt.Errorf("request body ends early: want %s", want)
	}
	return fmt.Errorf("request body: want %s at byte %d, found %q", want, s.i, s.b[s.i])
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) eat(c byte) bool {
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// str scans a string and returns it raw, quotes included.
func (s *scanner) str() ([]byte, error) {
	start := s.i
	if !s.eat('"') {
		return nil, s.errf("'\"'")
	}
	for s.i < len(s.b) {
		switch c := s.b[s.i]; {
		case c == '"':
			s.i++
			return s.b[start:s.i], nil
		case c == '\\':
			if s.i+1 >= len(s.b) {
				return nil, s.errf("an escape")
			}
			switch s.b[s.i+1] {
			case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
				s.i += 2
			case 'u':
				if len(s.b)-s.i < 6 || !isHex4(s.b[s.i+2:s.i+6]) {
					return nil, s.errf("\\u and 4 hex digits")
				}
				s.i += 6
			default:
				return nil, s.errf("a valid escape")
			}
		case c < 0x20:
			return nil, s.errf("no control character in a string")
		default:
			s.i++
		}
	}
	return nil, s.errf("the end of a string")
}

// value scans one JSON value.
func (s *scanner) value(depth int) error {
	if depth > maxDepth {
		return fmt.Errorf("nested deeper than %d", maxDepth)
	}
	if s.i >= len(s.b) {
		return s.errf("a value")
	}
	switch s.b[s.i] {
	case '"':
		_, err := s.str()
		return err
	case '{', '[':
		open := s.b[s.i]
		end := byte('}')
		if open == '[' {
			end = ']'
		}
		s.i++
		s.ws()
		if s.eat(end) {
			return nil
		}
		for {
			if open == '{' {
				if _, err := s.str(); err != nil {
					return err
				}
				s.ws()
				if !s.eat(':') {
					return s.errf("':'")
				}
				s.ws()
			}
			if err := s.value(depth + 1); err != nil {
				return err
			}
			s.ws()
			if s.eat(end) {
				return nil
			}
			if !s.eat(',') {
				return s.errf("',' or '" + string(end) + "'")
			}
			s.ws()
		}
	case 't':
		return s.lit("true")
	case 'f':
		return s.lit("false")
	case 'n':
		return s.lit("null")
	default:
		return s.number()
	}
}

func isHex4(b []byte) bool {
	for _, c := range b {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
			return false
		}
	}
	return true
}

func (s *scanner) lit(w string) error {
	if len(s.b)-s.i < len(w) || string(s.b[s.i:s.i+len(w)]) != w {
		return s.errf(w)
	}
	s.i += len(w)
	return nil
}

// number scans -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
func (s *scanner) number() error {
	start := s.i
	digits := func() int {
		n := 0
		for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
			s.i++
			n++
		}
		return n
	}
	bad := func() error { s.i = start; return s.errf("a value") }
	s.eat('-')
	if s.eat('0') {
		// no more integer digits after a leading zero
	} else if digits() == 0 {
		return bad()
	}
	if s.eat('.') && digits() == 0 {
		return bad()
	}
	if s.eat('e') || s.eat('E') {
		if !s.eat('+') {
			s.eat('-')
		}
		if digits() == 0 {
			return bad()
		}
	}
	return nil
}

// isBootstrapName reports whether an error's param is one of the fields the
// LB sets (exactly: a server refusing "bootstrap_host.x" refuses the
// client's field, not the LB's).
func isBootstrapName(param string) bool {
	return slices.Contains(names[:3], param)
}
