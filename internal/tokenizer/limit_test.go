package tokenizer

import (
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// TestUnicodeShrink proves unicodeShrink for the normalization tables we use: no form
// makes less than a quarter of the bytes of its input. Each output character stands for
// the input characters whose normalization starts inside it; they are at most one per
// character of its canonical decomposition, each at most as long as the longest input
// whose decomposition starts with that character.
func TestUnicodeShrink(t *testing.T) {
	forms := []norm.Form{norm.NFC, norm.NFD, norm.NFKC, norm.NFKD}
	longest := map[rune]int{} // first character of a normalization -> its longest input
	for r := rune(0); r <= utf8.MaxRune; r++ {
		if !utf8.ValidRune(r) {
			continue
		}
		s := string(r)
		longest[r] = max(longest[r], len(s))
		for _, f := range forms {
			out := f.String(s)
			if out == "" {
				t.Fatalf("%U normalizes to nothing", r)
			}
			first, _ := utf8.DecodeRuneInString(out)
			longest[first] = max(longest[first], len(s))
		}
	}
	worst, at := 0.0, rune(0)
	for o := rune(0); o <= utf8.MaxRune; o++ {
		if !utf8.ValidRune(o) {
			continue
		}
		in := 0
		for _, d := range norm.NFD.String(string(o)) {
			in += longest[d]
		}
		if r := float64(in) / float64(utf8.RuneLen(o)); r > worst {
			worst, at = r, o
		}
	}
	if worst > unicodeShrink {
		t.Fatalf("%U can stand for %.2f times its bytes, more than unicodeShrink (%d)", at, worst, unicodeShrink)
	}
	t.Logf("worst shrink %.2f (at %U)", worst, at)
	for _, s := range []string{"𝐀𝐁𝐂", "\u1100\u1161\u11a8", "Ａ", "\u212a"} {
		for _, f := range forms {
			if out := f.String(s); len(out)*unicodeShrink < len(s) {
				t.Fatalf("%q -> %q", s, out)
			}
		}
	}
}

type boundTok struct {
	name string
	tok  Tokenizer
}

// boundToks are the tokenizers we serve: built-in, stories260K (llama2.c and its HF
// conversion), the byte-fallback one of random weights, Llama 2, Llama 3, Qwen3.
func boundToks(t *testing.T) []boundTok {
	var out []boundTok
	for _, ft := range fuzzToks() {
		out = append(out, boundTok{ft.name, ft.tok})
	}
	tj, cj, err := ByteFallbackHFJSON()
	if err != nil {
		t.Fatal(err)
	}
	bf, err := ParseHF(tj, cj)
	if err != nil {
		t.Fatal(err)
	}
	out = append(out, boundTok{"byte-fallback", bf})
	npm := os.Getenv("MOONCAKE_NPM_DIR")
	if npm == "" {
		npm = filepath.Join("..", "..", ".cache", "npm")
	}
	if h, err := LoadHF(filepath.Join(npm, "node_modules", "@lenml", "tokenizer-llama2", "models")); err == nil {
		out = append(out, boundTok{"llama2", h})
	}
	names := make([]string, len(out))
	for i, b := range out {
		names[i] = b.name
	}
	t.Logf("tokenizers: %v", names)
	return out
}

// boundTexts are texts that are hard on the bound: the corpus, every token's own text,
// the longest token's text repeated, random sequences of token texts and random bytes.
func boundTexts(tok Tokenizer) []string {
	texts := append([]string(nil), referenceCorpus...)
	longest := ""
	for id := 0; id < tok.VocabSize(); id++ {
		s := tok.Decode([]int{id})
		texts = append(texts, s, tok.TokenText(id))
		if len(s) > len(longest) {
			longest = s
		}
	}
	texts = append(texts, strings.Repeat(longest, 200), strings.Repeat(" ", 5000), strings.Repeat("\n", 5000),
		strings.Repeat("a", 5000), strings.Repeat("🙂", 1000), strings.Repeat("𝐀", 1000))
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		ids := make([]int, 1+rng.IntN(40))
		for i := range ids {
			ids[i] = rng.IntN(tok.VocabSize())
		}
		texts = append(texts, tok.Decode(ids))
		b := make([]byte, 1+rng.IntN(64))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		texts = append(texts, string(b))
	}
	return texts
}

// TestMaxTokenBytes checks the bound on every tokenizer we serve: each has one, and no
// text has fewer ids than its bytes divided by it.
func TestMaxTokenBytes(t *testing.T) {
	for _, bt := range boundToks(t) {
		t.Run(bt.name, func(t *testing.T) {
			m := bt.tok.MaxTokenBytes()
			if m <= 0 {
				t.Fatalf("no bound (%d)", m)
			}
			tightest := 0.0
			for _, text := range boundTexts(bt.tok) {
				ids, err := bt.tok.Encode(text, false)
				if err != nil {
					t.Fatal(err)
				}
				if len(ids)*m < len(text) {
					t.Fatalf("%q (%d bytes) has %d ids: below the bound of %d bytes per id", text, len(text), len(ids), m)
				}
				if len(ids) > 0 {
					tightest = max(tightest, float64(len(text))/float64(len(ids)))
				}
			}
			t.Logf("MaxTokenBytes %d; at most %.1f bytes per id seen", m, tightest)
		})
	}
}

// TestMaxTokenBytesNone: the tokenizers for which no bound holds say so.
func TestMaxTokenBytesNone(t *testing.T) {
	for _, tc := range []struct {
		name, json, text string
	}{
		{"fused unk", `{"model":{"type":"BPE","unk_token":"<unk>","fuse_unk":true,"vocab":{"<unk>":0,"a":1},"merges":[]}}`,
			strings.Repeat("z", 1000)},
		{"dropped characters", `{"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}`, "a" + strings.Repeat("z", 1000)},
		{"rstrip", `{"added_tokens":[{"id":1,"content":"<x>","rstrip":true}],"model":{"type":"BPE","byte_fallback":true,"vocab":` +
			byteVocab() + `,"merges":[]}}`, "<x>" + strings.Repeat(" ", 1000)},
		{"deleting normalizer", `{"normalizer":{"type":"Replace","pattern":{"String":"z"},"content":""},"model":{"type":"BPE","byte_fallback":true,"vocab":` +
			byteVocab() + `,"merges":[]}}`, strings.Repeat("z", 1000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok, err := ParseHF([]byte(tc.json), nil)
			if err != nil {
				t.Fatal(err)
			}
			if m := tok.MaxTokenBytes(); m != 0 {
				t.Fatalf("MaxTokenBytes = %d, want 0", m)
			}
			ids, err := tok.Encode(tc.text, false)
			if err != nil || len(ids) > 1 {
				t.Fatalf("%d bytes gave %v, %v: expected at most one id (why there is no bound)", len(tc.text), ids, err)
			}
			if _, err := tok.EncodeLimit(tc.text+"a", false, 0); !errors.Is(err, ErrTooLong) && len(ids) > 0 {
				t.Fatalf("EncodeLimit(limit 0): %v", err)
			}
		})
	}
}

// byteVocab is a vocabulary of the 256 byte tokens <0xNN> (ids 2..257).
func byteVocab() string {
	var b strings.Builder
	b.WriteString(`{"<0x00>":2`)
	for i := 1; i < 256; i++ {
		b.WriteString(`,"<0x` + strings.ToUpper(string("0123456789abcdef"[i>>4])+string("0123456789abcdef"[i&15])) + `>":`)
		b.WriteString(itoa(2 + i))
	}
	b.WriteString("}")
	return b.String()
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}

// TestEncodeLimit: within the limit EncodeLimit is Encode; one id past it is an error
// that says so.
func TestEncodeLimit(t *testing.T) {
	for _, bt := range boundToks(t) {
		t.Run(bt.name, func(t *testing.T) {
			for _, text := range referenceCorpus {
				for _, bos := range []bool{false, true} {
					want, _ := bt.tok.Encode(text, bos)
					for _, limit := range []int{-1, len(want), len(want) + 1} {
						got, err := bt.tok.EncodeLimit(text, bos, limit)
						if err != nil || !slices.Equal(got, want) {
							t.Fatalf("EncodeLimit(%q, %v, %d) = %v, %v; Encode %v", text, bos, limit, got, err, want)
						}
					}
					if len(want) == 0 {
						continue
					}
					_, err := bt.tok.EncodeLimit(text, bos, len(want)-1)
					var tl *TooLongError
					if !errors.As(err, &tl) || !errors.Is(err, ErrTooLong) || tl.Limit != len(want)-1 || tl.Tokens <= tl.Limit || tl.Tokens > len(want) {
						t.Fatalf("EncodeLimit(%q, %v, %d) = %v; want a TooLongError (%d ids)", text, bos, len(want)-1, err, len(want))
					}
				}
			}
		})
	}
}

// TestEncodeLimitStops: an 8 MiB text is refused at a limit it passes without being
// encoded whole: by its length when that proves it, else after about limit ids.
func TestEncodeLimitStops(t *testing.T) {
	words := strings.Fields(strings.Join(referenceCorpus, " "))
	var b strings.Builder
	rng := rand.New(rand.NewPCG(3, 4))
	for b.Len() < 8<<20 {
		b.WriteString(words[rng.IntN(len(words))])
		b.WriteByte(' ')
	}
	text := b.String()
	word := strings.Repeat("a", 2<<20) // one pre-tokenized word
	for _, bt := range boundToks(t) {
		t.Run(bt.name, func(t *testing.T) {
			for _, tc := range []struct {
				text   string
				limit  int
				length bool // refused by length alone
			}{
				{text, 4096, true},
				{text, len(text)/bt.tok.MaxTokenBytes() + 8, false},
				{word, 1000, true},
			} {
				if !tc.length && (bt.name == "llama2c" || bt.name == "bytes" || tc.limit > 1<<18) {
					// An exact bound (bytes), global merges (llama2.c), or a limit beyond
					// any context (a text without pre-tokenizer is one word, merged whole
					// once its length allows it): only the length stops them.
					continue
				}
				var before, after runtime.MemStats
				runtime.ReadMemStats(&before)
				start := time.Now()
				_, err := bt.tok.EncodeLimit(tc.text, true, tc.limit)
				took := time.Since(start)
				runtime.ReadMemStats(&after)
				var tl *TooLongError
				if !errors.As(err, &tl) || tl.Length != tc.length {
					t.Fatalf("%d bytes, limit %d: %v (want a TooLongError, by length %v)", len(tc.text), tc.limit, err, tc.length)
				}
				alloc := after.TotalAlloc - before.TotalAlloc
				if alloc > 64<<20 {
					t.Fatalf("%d bytes, limit %d: allocated %d MiB", len(tc.text), tc.limit, alloc>>20)
				}
				t.Logf("%d bytes, limit %d: %v, %d KiB allocated, by length %v", len(tc.text), tc.limit, took, alloc>>10, tl.Length)
			}
		})
	}
}

// TestEncodeLimitWord: a word is refused before its merges when its length proves it
// too long, also where the text's length could not (a normalizer that may shrink).
func TestEncodeLimitWord(t *testing.T) {
	var h *hfTokenizer
	for _, bt := range boundToks(t) {
		if bt.name == "qwen3" {
			h = bt.tok.(*hfTokenizer)
		}
	}
	if h == nil {
		t.Skip("the Qwen3 tokenizer is not installed (scripts/npm-fixtures.sh)")
	}
	if h.maxWordUnits*2 > h.maxTokenBytes {
		t.Fatalf("word bound %d, text bound %d: the test needs NFC's factor", h.maxWordUnits, h.maxTokenBytes)
	}
	word := strings.Repeat("a", 2<<20)
	limit := len(word)/h.maxTokenBytes + 1
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, err := h.EncodeLimit(word, false, limit)
	runtime.ReadMemStats(&after)
	var tl *TooLongError
	if !errors.As(err, &tl) || tl.Length || tl.Tokens < len(word)/h.maxWordUnits {
		t.Fatalf("EncodeLimit: %v", err)
	}
	if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 16<<20 {
		t.Fatalf("allocated %d MiB: the word was merged", alloc>>20)
	}
}

// TestMaxWordBytes: with a limit, a tokenizer that splits by a regex refuses a word longer
// than MaxWordBytes, whatever the limit; one of MaxWordBytes is merged; Encode merges any.
func TestMaxWordBytes(t *testing.T) {
	n := 0
	for _, bt := range boundToks(t) {
		h, ok := bt.tok.(*hfTokenizer)
		if !ok || !h.preRegex {
			continue
		}
		n++
		t.Run(bt.name, func(t *testing.T) {
			long := "x" + strings.Repeat(" ", MaxWordBytes+2) + "y" // " y" is a word: the spaces before are one more than MaxWordBytes
			_, err := h.EncodeLimit(long, true, 1<<30)
			var wl *WordTooLongError
			if !errors.As(err, &wl) || !errors.Is(err, ErrWordTooLong) || wl.Bytes <= MaxWordBytes {
				t.Fatalf("EncodeLimit(a word of %d spaces) = %v", MaxWordBytes+1, err)
			}
			if _, err := h.EncodeLimit("x"+strings.Repeat(" ", MaxWordBytes+1)+"y", true, 1<<30); err != nil {
				t.Fatalf("a word of %d: %v", MaxWordBytes, err)
			}
			if ids, err := h.Encode(long, true); err != nil || len(ids) == 0 {
				t.Fatalf("Encode: %v", err)
			}
		})
	}
	if n == 0 {
		t.Skip("no regex-splitting tokenizer installed (scripts/npm-fixtures.sh)")
	}
}
