package tokenizer

import "unicode/utf8"

// StreamDecoder turns ids into text one at a time. It holds back the bytes of a UTF-8
// sequence until it is complete, so every string it returns is valid UTF-8, and the
// concatenation of all Push results and Flush equals Decode of the whole sequence.
// It is not safe for concurrent use.
type StreamDecoder struct {
	t       Tokenizer
	p       piecer // nil for foreign Tokenizer implementations
	st      decodeState
	pending []byte

	ids  []int // foreign tokenizers only: the sequence so far
	sent int   // bytes of Decode(ids) already returned
}

// NewStreamDecoder returns a decoder for one sequence of t.
func NewStreamDecoder(t Tokenizer) *StreamDecoder {
	d := &StreamDecoder{t: t, st: decodeState{prev: -1}}
	d.p, _ = t.(piecer)
	return d
}

// Push adds id and returns the text that became complete ("" if none).
func (d *StreamDecoder) Push(id int) string {
	if d.p == nil {
		d.ids = append(d.ids, id)
		full := d.t.Decode(d.ids)
		if len(full) < d.sent || (len(full) > d.sent && full[len(full)-1] == 0xBD &&
			len(full) >= 3 && full[len(full)-3:] == "\uFFFD") {
			return "" // possibly an incomplete sequence: wait
		}
		out := full[d.sent:]
		d.sent = len(full)
		return out
	}
	d.pending = d.p.appendPiece(d.pending, &d.st, id)
	cut := completePrefix(d.pending)
	if cut == 0 {
		return ""
	}
	out := toValidUTF8(d.pending[:cut])
	d.pending = append(d.pending[:0], d.pending[cut:]...)
	return out
}

// Flush returns whatever is held back (an incomplete sequence becomes U+FFFD).
func (d *StreamDecoder) Flush() string {
	if d.p == nil {
		full := d.t.Decode(d.ids)
		if len(full) < d.sent {
			return ""
		}
		out := full[d.sent:]
		d.sent = len(full)
		return out
	}
	out := toValidUTF8(d.pending)
	d.pending = d.pending[:0]
	return out
}

// completePrefix returns the length of b without a trailing UTF-8 sequence that is still
// incomplete (one that more bytes could make valid).
func completePrefix(b []byte) int {
	i := len(b) - 1
	for i >= 0 && len(b)-i <= 3 && b[i]&0xC0 == 0x80 {
		i--
	}
	if i >= 0 && b[i] >= 0xC0 && !utf8.FullRune(b[i:]) {
		return i
	}
	return len(b)
}
