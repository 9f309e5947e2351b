package engine

import (
	"strings"

	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// contextTokens is how many prompt tokens prime a request's stream decoder,
// so the first output token decodes as it reads after the prompt (a
// sentencepiece "▁word" keeps its space) rather than as the start of a text.
const contextTokens = 8

// textOut turns one request's output tokens into text deltas: complete UTF-8
// only (tokenizer.StreamDecoder), cut at the first stop string, and holding
// back any tail that may still become a stop string.
type textOut struct {
	dec   *tokenizer.StreamDecoder
	stops []string
	held  string // decoded, not yet emitted; may be the start of a stop string
}

func newTextOut(tok tokenizer.Tokenizer, prompt []int32, stops []string) *textOut {
	t := &textOut{dec: tokenizer.NewStreamDecoder(tok), stops: stops}
	for _, id := range prompt[max(0, len(prompt)-contextTokens):] {
		t.dec.Push(int(id)) // the prompt's own text is not output
	}
	return t
}

// push adds an output token and returns the text that is safe to emit; if a
// stop string completed, matched is it and the text is what precedes it.
func (t *textOut) push(id int) (text string, matched string, stop bool) {
	return t.add(t.dec.Push(id))
}

// flush ends the output (at a stop token or the length limit): it returns
// all text still held back, cut at a stop string if one completes now.
func (t *textOut) flush() (text string, matched string, stop bool) {
	text, matched, stop = t.add(t.dec.Flush())
	if !stop {
		text += t.held
		t.held = ""
	}
	return text, matched, stop
}

func (t *textOut) add(delta string) (string, string, bool) {
	if len(t.stops) == 0 {
		return delta, "", false
	}
	t.held += delta
	// Every match starts inside held: text already emitted never ends with
	// a prefix of a stop string (see holdLen).
	best, which := -1, ""
	for _, s := range t.stops {
		i := strings.Index(t.held, s)
		if i >= 0 && (best < 0 || i < best || (i == best && len(s) > len(which))) {
			best, which = i, s
		}
	}
	if best >= 0 {
		out := t.held[:best]
		t.held = ""
		return out, which, true
	}
	k := len(t.held) - holdLen(t.held, t.stops)
	out := t.held[:k]
	t.held = t.held[k:]
	return out, "", false
}

// holdLen is the length of the longest suffix of s that is a proper prefix
// of a stop string. Such a suffix starts where a stop string starts, so at a
// rune boundary.
func holdLen(s string, stops []string) int {
	n := 0
	for _, st := range stops {
		for l := min(len(st)-1, len(s)); l > n; l-- {
			if strings.HasSuffix(s, st[:l]) {
				n = l
				break
			}
		}
	}
	return n
}
