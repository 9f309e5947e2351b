package tokenizer

import (
	"errors"
	"fmt"
	"unicode/utf8"
)

// ErrTooLong is the error EncodeLimit's *TooLongError wraps.
var ErrTooLong = errors.New("tokenizer: text has more tokens than the limit")

// TooLongError is EncodeLimit's answer to a text with more than Limit ids.
type TooLongError struct {
	Limit  int  // the limit passed
	Tokens int  // a lower bound on the text's ids (> Limit)
	Bytes  int  // the text's length in bytes
	Length bool // decided from Bytes and MaxTokenBytes alone, before encoding
}

func (e *TooLongError) Error() string {
	if e.Length {
		return fmt.Sprintf("tokenizer: a text of %d bytes has at least %d tokens, more than the limit of %d", e.Bytes, e.Tokens, e.Limit)
	}
	return fmt.Sprintf("tokenizer: the text has more than %d tokens", e.Limit)
}

func (e *TooLongError) Unwrap() error { return ErrTooLong }

// MaxWordBytes is the longest pre-tokenized word EncodeLimit (with a limit) merges with
// a tokenizer that splits words by a regex (Llama 3, Qwen): the merges of a word take about 80 bytes
// of memory per byte, and text has no words this long (runs of one letter or of spaces
// do). Tokenizers without such a split (sentencepiece-style) merge a whole section: their
// bound is the context's length times MaxTokenBytes.
const MaxWordBytes = 64 << 10

// ErrWordTooLong is the error EncodeLimit's *WordTooLongError wraps.
var ErrWordTooLong = errors.New("tokenizer: word too long")

// WordTooLongError is EncodeLimit's answer to a text with a word longer than Limit.
type WordTooLongError struct {
	Bytes int // the word's length
	Limit int // MaxWordBytes
}

func (e *WordTooLongError) Error() string {
	return fmt.Sprintf("tokenizer: a word of %d bytes (with no break the tokenizer splits at) is longer than the %d it merges", e.Bytes, e.Limit)
}

func (e *WordTooLongError) Unwrap() error { return ErrWordTooLong }

// minTokens is the fewest ids a text of n bytes can have when one id stands for at most
// perToken bytes (0: no bound, 0 ids).
func minTokens(n, perToken int) int {
	if perToken <= 0 {
		return 0
	}
	return (n + perToken - 1) / perToken
}

// checkLength is EncodeLimit's check before encoding: extra ids (BOS...) come on top of
// the text's.
func checkLength(text string, limit, perToken, extra int) error {
	if limit < 0 {
		return nil
	}
	if n := minTokens(len(text), perToken) + extra; n > limit {
		return &TooLongError{Limit: limit, Tokens: n, Bytes: len(text), Length: true}
	}
	return nil
}

// checkCount is EncodeLimit's check after encoding.
func checkCount(text string, ids []int, limit int) ([]int, error) {
	if limit >= 0 && len(ids) > limit {
		return nil, &TooLongError{Limit: limit, Tokens: len(ids), Bytes: len(text)}
	}
	return ids, nil
}

// unicodeShrink bounds how much NFC, NFD, NFKC and NFKD shrink a text: their output has
// at least a quarter of its input's bytes (a 4-byte letter such as U+1D400 becomes one
// byte; TestUnicodeShrink checks every code point and every composition).
const unicodeShrink = 4

// computeBounds sets maxWordUnits and maxTokenBytes. The argument, for a text with no
// added tokens that strip whitespace:
//
//   - an added token stands for its content;
//   - a plain section has at most shrink times the bytes the normalizer makes of it;
//   - the pre-tokenizers never shrink it: Split cuts, Metaspace only adds, ByteLevel
//     makes one rune of each byte; so the words hold at least that many units (runes
//     after ByteLevel, bytes without it);
//   - every unit of a word lands in one symbol (its character's id, or byte-fallback ids,
//     whose <0xNN> text is longer than the byte they stand for), and a merged id's text
//     is the concatenation of its parts': an id stands for at most the units of its text,
//     the longest of which is maxWordUnits;
//   - when a character can miss the vocabulary and the byte fallback, it becomes <unk>
//     (one character of at most 4 bytes, hence the factor 4), or, with no <unk> or with
//     fuse_unk, is dropped or fused: no bound.
func (t *hfTokenizer) computeBounds(added []hfAddedToken, shrink int) {
	t.maxWordUnits, t.maxTokenBytes = 0, 0
	if t.preMixed {
		return
	}
	units := func(s string) int {
		if t.preByteLevel {
			return utf8.RuneCountInString(s)
		}
		return len(s)
	}
	m := t.model
	longest := 0
	for s := range m.vocab {
		longest = max(longest, units(s))
	}
	complete := m.byteFallback
	for _, id := range m.byteIDs {
		complete = complete && id >= 0
	}
	if t.preByteLevel && !complete {
		complete = true
		for _, r := range byteLevelEnc {
			_, ok := m.vocab[string(r)]
			complete = complete && ok
		}
	}
	if !complete {
		if m.unk < 0 || m.fuseUnk || units(t.tokens[m.unk]) == 0 {
			return
		}
		longest *= 4
	}
	t.maxWordUnits = longest
	longestAdded := 0
	for _, a := range added {
		if a.LStrip || a.RStrip {
			return // they take any amount of whitespace with them
		}
		longestAdded = max(longestAdded, len(a.Content))
	}
	if shrink > 0 {
		t.maxTokenBytes = max(longest*shrink, longestAdded)
	}
}
