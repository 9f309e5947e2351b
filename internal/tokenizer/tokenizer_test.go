package tokenizer

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

func streamAll(tok Tokenizer, ids []int) (string, []string) {
	sd := NewStreamDecoder(tok)
	var parts []string
	for _, id := range ids {
		parts = append(parts, sd.Push(id))
	}
	parts = append(parts, sd.Flush())
	return strings.Join(parts, ""), parts
}

func TestByteLevel(t *testing.T) {
	tok := NewByteLevel()
	if tok.VocabSize() != 320 || tok.BOS() != 256 || !slices.Equal(tok.EOS(), []int{257}) {
		t.Fatalf("vocab %d bos %d eos %v", tok.VocabSize(), tok.BOS(), tok.EOS())
	}
	text := "héllo 🙂"
	ids, _ := tok.Encode(text, true)
	if ids[0] != 256 || len(ids) != len(text)+1 {
		t.Fatalf("Encode = %v", ids)
	}
	if got := tok.Decode(append(ids, 257, 300)); got != text {
		t.Fatalf("Decode = %q", got)
	}
	got, parts := streamAll(tok, ids)
	if got != text {
		t.Fatalf("stream = %q", got)
	}
	for _, p := range parts {
		if !utf8.ValidString(p) {
			t.Fatalf("stream emitted invalid UTF-8 %q", p)
		}
	}
	// The 4 bytes of 🙂 come out at once, with the last byte.
	if n := len(parts); parts[n-2] != "🙂" || parts[n-3] != "" {
		t.Fatalf("parts = %q", parts)
	}
	if tok.TokenText(256) != "<s>" || tok.TokenText('a') != "a" {
		t.Fatal("TokenText")
	}
}

func TestStreamDecoderInvalidBytes(t *testing.T) {
	tok := NewByteLevel()
	for _, b := range [][]byte{
		{0xE2, 0x82},             // truncated at the end
		{0xE2, 0x82, 'A'},        // truncated in the middle
		{0xF0, 0x9F, 0x99, 0x82}, // complete
		{0x80, 0xBF, 'x'},        // stray continuation bytes
		{0xED, 0xA0, 0x80},       // surrogate
		{0xC0, 0xAF},             // overlong
	} {
		ids := make([]int, len(b))
		for i, c := range b {
			ids[i] = int(c)
		}
		want := tok.Decode(ids)
		got, parts := streamAll(tok, ids)
		if got != want || !utf8.ValidString(got) {
			t.Errorf("% x: stream %q, Decode %q", b, got, want)
		}
		for _, p := range parts {
			if !utf8.ValidString(p) {
				t.Errorf("% x: invalid part %q", b, p)
			}
		}
	}
}

// foreign is a Tokenizer from outside the package (no piecer): the stream decoder falls
// back to re-decoding.
type foreign struct{ Tokenizer }

func TestStreamDecoderForeign(t *testing.T) {
	tok := foreign{NewByteLevel()}
	text := "añ🙂b"
	ids, _ := tok.Encode(text, false)
	if got, _ := streamAll(tok, ids); got != text {
		t.Fatalf("stream = %q", got)
	}
}

func TestChatBuiltin(t *testing.T) {
	msgs := []Message{{Role: "system", Content: "be nice"}, {Role: "user", Content: "hi"}}
	got, err := ApplyChatTemplate(NewByteLevel(), msgs)
	if err != nil {
		t.Fatal(err)
	}
	if want := "system: be nice\nuser: hi\nassistant:"; got != want {
		t.Fatalf("got %q want %q", got, want)
	}
	if got, _ := RenderChat(NewByteLevel(), msgs, false); got != "system: be nice\nuser: hi\n" {
		t.Fatalf("no generation prompt: %q", got)
	}
}

// writeTiny writes a small byte-level HF tokenizer with the given chat template.
func writeTiny(t *testing.T, template string) string {
	t.Helper()
	dir := t.TempDir()
	tj := `{"added_tokens":[{"id":3,"content":"<|end|>","special":true},{"id":4,"content":"<|bos|>","special":true}],
"normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,"use_regex":true},
"post_processor":null,"decoder":{"type":"ByteLevel"},
"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":[["a","b"]]}}`
	cfg := `{"bos_token":"<|bos|>","eos_token":{"content":"<|end|>"},"chat_template":` + template + `}`
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), []byte(tj), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestChatTemplate(t *testing.T) {
	msgs := []Message{{Role: "user", Content: "ab"}}
	for _, tc := range []struct {
		name, template, want string
		wantErr              bool
	}{
		{"jinja", `"{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m['content'] }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"`,
			"<|bos|>[user]ab<|end|>[assistant]", false},
		{"broken", `"{% for m in messages %}"`, "user: ab\nassistant:", false},
		{"raises", `"{{ raise_exception('no') }}"`, "", true},
		{"named", `[{"name":"tool_use","template":"x"},{"name":"default","template":"D{{ messages|length }}"}]`, "D1", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok, err := LoadHF(writeTiny(t, tc.template))
			if err != nil {
				t.Fatal(err)
			}
			got, err := ApplyChatTemplate(tok, msgs)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func TestTinyHF(t *testing.T) {
	tok, err := LoadHF(writeTiny(t, `""`))
	if err != nil {
		t.Fatal(err)
	}
	if tok.BOS() != 4 || !slices.Equal(tok.EOS(), []int{3}) || tok.VocabSize() != 5 {
		t.Fatalf("bos %d eos %v vocab %d", tok.BOS(), tok.EOS(), tok.VocabSize())
	}
	ids, _ := tok.Encode("abab<|end|>a", true)
	if want := []int{4, 2, 2, 3, 0}; !slices.Equal(ids, want) {
		t.Fatalf("Encode = %v, want %v", ids, want)
	}
	if got := tok.Decode(ids); got != "ababa" {
		t.Fatalf("Decode = %q", got)
	}
	if tok.TokenText(3) != "<|end|>" || tok.TokenText(2) != "ab" {
		t.Fatal("TokenText")
	}
}

func TestLoad(t *testing.T) {
	if tok, err := Load("", ""); err != nil || tok.VocabSize() != ByteLevelVocabSize {
		t.Fatalf("built-in: %v", err)
	}
	dir := writeTiny(t, `""`)
	if tok, err := Load(dir, ""); err != nil || tok.VocabSize() != 5 {
		t.Fatalf("HF dir: %v", err)
	}
	if _, err := Load(filepath.Join(dir, "tokenizer.json"), ""); err == nil {
		t.Fatal("a file model path without a tokenizer path should fail")
	}
	sh := sharedDir(t)
	tok, err := Load(filepath.Join(sh, "models", "stories260K", "stories260K.bin"),
		filepath.Join(sh, "models", "stories260K", "tok512.bin"))
	if err != nil || tok.VocabSize() != 512 {
		t.Fatalf("llama2.c: %v", err)
	}
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := LoadHF(dir); err == nil {
		t.Fatal("missing tokenizer.json should fail")
	}
	bad := filepath.Join(dir, "tok.bin")
	if err := os.WriteFile(bad, []byte{1, 0, 0, 0, 0, 0, 0, 0, 99, 0, 0, 0}, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadLlama2C(bad, 0); err == nil {
		t.Fatal("a bad length should fail")
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), []byte(`{"model":{"type":"Unigram"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadHF(dir); err == nil || !strings.Contains(err.Error(), "Unigram") {
		t.Fatalf("Unigram: %v", err)
	}
}

func TestMetaspace(t *testing.T) {
	dir := t.TempDir()
	tj := `{"added_tokens":[{"id":0,"content":"<s>","special":true}],
"normalizer":null,"pre_tokenizer":{"type":"Metaspace","replacement":"▁","prepend_scheme":"first","split":true},
"decoder":{"type":"Sequence","decoders":[{"type":"Metaspace","replacement":"▁","prepend_scheme":"first"},{"type":"ByteFallback"},{"type":"Fuse"}]},
"model":{"type":"BPE","byte_fallback":true,"vocab":{"<s>":0,"▁":1,"a":2,"b":3,"▁a":4,"▁ab":5,"ab":6,"<0x21>":7},
"merges":["▁ a","a b","▁a b"]}}`
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), []byte(tj), 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := LoadHF(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		text string
		want []int
		dec  string
	}{
		{"ab ab", []int{5, 5}, "ab ab"},
		{"ab!", []int{5, 7}, "ab!"},
		{"<s>ab", []int{0, 6}, "ab"}, // "first": no ▁ after an added token
		{" a", []int{4}, "a"},        // as HF: no second ▁, and the decoder strips one space
	} {
		got, _ := tok.Encode(tc.text, false)
		if !slices.Equal(got, tc.want) {
			t.Errorf("Encode(%q) = %v, want %v", tc.text, got, tc.want)
		}
		if d := tok.Decode(got); d != tc.dec {
			t.Errorf("Decode(%v) = %q, want %q", got, d, tc.dec)
		}
	}
}

func TestConcurrentEncode(t *testing.T) {
	tok, err := LoadHF(writeTiny(t, `""`))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan []int)
	for i := 0; i < 8; i++ {
		go func() {
			var ids []int
			for j := 0; j < 200; j++ {
				ids, _ = tok.Encode(strings.Repeat("ab", j%7+1)+" ba", true)
			}
			done <- ids
		}()
	}
	for i := 0; i < 8; i++ {
		if ids := <-done; len(ids) == 0 {
			t.Fatal("empty")
		}
	}
}

func TestByteFallbackHFJSON(t *testing.T) {
	tj, cj, err := ByteFallbackHFJSON()
	if err != nil {
		t.Fatal(err)
	}
	tok, err := ParseHF(tj, cj)
	if err != nil {
		t.Fatal(err)
	}
	text := "héllo 🌍"
	ids, err := tok.Encode(text, true)
	if err != nil {
		t.Fatal(err)
	}
	// BOS, ▁, the bytes of "héllo", ▁, the bytes of "🌍".
	want := 1 + 1 + len("héllo") + 1 + len("🌍")
	if len(ids) != want || ids[0] != 1 {
		t.Fatalf("ids %v: want %d ids starting with BOS", ids, want)
	}
	if got := tok.Decode(ids); got != text {
		t.Fatalf("round trip %q -> %q", text, got)
	}
}
