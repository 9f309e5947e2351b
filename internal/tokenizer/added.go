package tokenizer

import (
	"sort"
	"strings"
)

// addedSplitter finds added tokens in text, leftmost-longest, as HF tokenizers do.
type addedSplitter struct {
	byFirst *[256][]hfAddedToken // by first byte, longest first
}

type section struct {
	text  string
	start int // byte offset in the original text
	id    int // added token id, or -1 for plain text
}

func newAddedSplitter(toks []hfAddedToken) addedSplitter {
	s := addedSplitter{byFirst: new([256][]hfAddedToken)}
	for _, a := range toks {
		if a.Content != "" {
			s.byFirst[a.Content[0]] = append(s.byFirst[a.Content[0]], a)
		}
	}
	for _, l := range s.byFirst {
		if len(l) < 2 {
			continue
		}
		sort.SliceStable(l, func(i, j int) bool { return len(l[i].Content) > len(l[j].Content) })
	}
	return s
}

// each calls yield with the sections of text in order: plain text and added tokens. It
// stops when yield returns false and reports whether it reached the end.
func (s addedSplitter) each(text string, yield func(section) bool) bool {
	last := 0
	for i := 0; i < len(text); i++ {
		cands := s.byFirst[text[i]]
		if len(cands) == 0 {
			continue
		}
		for _, a := range cands {
			if !strings.HasPrefix(text[i:], a.Content) {
				continue
			}
			plain := text[last:i]
			if a.LStrip {
				plain = strings.TrimRight(plain, " \t\n\r\v\f")
			}
			if plain != "" && !yield(section{text: plain, start: last, id: -1}) {
				return false
			}
			if !yield(section{text: a.Content, start: i, id: a.ID}) {
				return false
			}
			i += len(a.Content)
			if a.RStrip {
				for i < len(text) && strings.IndexByte(" \t\n\r\v\f", text[i]) >= 0 {
					i++
				}
			}
			last = i
			i--
			break
		}
	}
	if last < len(text) {
		return yield(section{text: text[last:], start: last, id: -1})
	}
	return true
}
