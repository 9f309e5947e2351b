package tokenizer

import (
	"unicode"
	"unicode/utf8"
)

// The Split regexes of the byte-level tokenizers we know. Go's regexp has no lookahead, so
// each is matched by a hand-written scanner that follows the backtracking semantics of the
// original (Oniguruma in HF tokenizers: \s is Unicode White_Space, \p{L}/\p{N} categories).
const (
	// Llama 3 (tiktoken cl100k-like).
	patLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// Qwen2, Qwen2.5, Qwen3: as Llama 3 but single digits.
	patQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// GPT-2, also the ByteLevel pre-tokenizer with use_regex true.
	patGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// splitter cuts text into pre-tokens and calls yield with each, in order; every byte of
// text lands in exactly one piece. It stops when yield returns false and reports whether
// it reached the end.
type splitter func(text string, yield func(string) bool) bool

// knownSplitter returns the scanner for a Split regex, or nil if the pattern is unknown.
func knownSplitter(pattern string) splitter {
	switch pattern {
	case patLlama3:
		return func(s string, yield func(string) bool) bool { return splitWith(s, yield, 3, matchCL100K) }
	case patQwen2:
		return func(s string, yield func(string) bool) bool { return splitWith(s, yield, 1, matchCL100K) }
	case patGPT2:
		return func(s string, yield func(string) bool) bool { return splitWith(s, yield, 0, matchGPT2) }
	}
	return nil
}

func splitWith(s string, yield func(string) bool, digits int, match func(string, int) int) bool {
	for len(s) > 0 {
		n := match(s, digits)
		if n <= 0 {
			_, n = utf8.DecodeRuneInString(s)
		}
		if !yield(s[:n]) {
			return false
		}
		s = s[n:]
	}
	return true
}

func isL(r rune) bool     { return unicode.IsLetter(r) }
func isN(r rune) bool     { return unicode.IsNumber(r) }
func isSpace(r rune) bool { return unicode.IsSpace(r) }
func isCRLF(r rune) bool  { return r == '\r' || r == '\n' }

// runWhile returns the byte length of the longest prefix of s whose runes satisfy f.
func runWhile(s string, f func(rune) bool) int {
	i := 0
	for i < len(s) {
		r, n := utf8.DecodeRuneInString(s[i:])
		if !f(r) {
			break
		}
		i += n
	}
	return i
}

func lowerASCII(b byte) byte {
	if 'A' <= b && b <= 'Z' {
		return b + 'a' - 'A'
	}
	return b
}

// contraction matches 's 't 're 've 'm 'll 'd at the start of s (after the apostrophe
// check); fold makes it case-insensitive.
func contraction(s string, fold bool) int {
	if len(s) < 2 || s[0] != '\'' {
		return 0
	}
	c := func(i int) byte {
		if fold {
			return lowerASCII(s[i])
		}
		return s[i]
	}
	switch c(1) {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if len(s) >= 3 && c(2) == 'e' {
			return 3
		}
	case 'l':
		if len(s) >= 3 && c(2) == 'l' {
			return 3
		}
	}
	return 0
}

// trailingSpace handles `\s+(?!\S)|\s+` for a whitespace run of w bytes at the start of s.
func trailingSpace(s string, w int) int {
	if w == len(s) {
		return w
	}
	_, last := utf8.DecodeLastRuneInString(s[:w])
	if w-last > 0 {
		return w - last
	}
	return w
}

// matchCL100K matches the Llama 3 / Qwen2 pattern at the start of s; digits is the
// maximum length of a number piece.
func matchCL100K(s string, digits int) int {
	if n := contraction(s, true); n > 0 {
		return n
	}
	r, n := utf8.DecodeRuneInString(s)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	if isL(r) {
		return n + runWhile(s[n:], isL)
	}
	if !isCRLF(r) && !isN(r) {
		if r2, n2 := utf8.DecodeRuneInString(s[n:]); n < len(s) && isL(r2) {
			return n + n2 + runWhile(s[n+n2:], isL)
		}
	}
	// \p{N}{1,digits}
	if isN(r) {
		i, k := 0, 0
		for i < len(s) && k < digits {
			r2, n2 := utf8.DecodeRuneInString(s[i:])
			if !isN(r2) {
				break
			}
			i += n2
			k++
		}
		return i
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
	other := func(r rune) bool { return !isSpace(r) && !isL(r) && !isN(r) }
	j := 0
	if r == ' ' {
		j = 1
	}
	if k := runWhile(s[j:], other); k > 0 {
		e := j + k
		return e + runWhile(s[e:], isCRLF)
	}
	if isSpace(r) {
		w := runWhile(s, isSpace)
		// \s*[\r\n]+ : ends after the last CR/LF of the run.
		for i := w - 1; i >= 0; i-- {
			if s[i] == '\r' || s[i] == '\n' {
				return i + 1
			}
		}
		return trailingSpace(s, w)
	}
	return n
}

// matchGPT2 matches the GPT-2 pattern at the start of s.
func matchGPT2(s string, _ int) int {
	if n := contraction(s, false); n > 0 {
		return n
	}
	j := 0
	if s[0] == ' ' {
		j = 1
	}
	for _, f := range []func(rune) bool{isL, isN, func(r rune) bool { return !isSpace(r) && !isL(r) && !isN(r) }} {
		if k := runWhile(s[j:], f); k > 0 {
			return j + k
		}
	}
	if w := runWhile(s, isSpace); w > 0 {
		return trailingSpace(s, w)
	}
	_, n := utf8.DecodeRuneInString(s)
	return n
}

// byteLevelEnc maps each byte to the printable rune GPT-2's byte-level BPE uses for it.
var byteLevelEnc, byteLevelDec = buildByteLevel()

func buildByteLevel() (enc [256]rune, dec map[rune]byte) {
	dec = make(map[rune]byte, 256)
	n := 0
	for b := 0; b < 256; b++ {
		if ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b && b <= 0xFF) {
			enc[b] = rune(b)
		} else {
			enc[b] = rune(256 + n)
			n++
		}
		dec[enc[b]] = byte(b)
	}
	return enc, dec
}

// byteLevelMap rewrites the bytes of s as byte-level runes.
func byteLevelMap(s string) string {
	buf := make([]byte, 0, len(s)*2)
	for i := 0; i < len(s); i++ {
		buf = utf8.AppendRune(buf, byteLevelEnc[s[i]])
	}
	return string(buf)
}
