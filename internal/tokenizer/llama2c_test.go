package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

type refCase struct {
	Prompt        string `json:"prompt"`
	PromptIDs     []int  `json:"prompt_ids"`
	GreedyNextIDs []int  `json:"greedy_next_ids"`
	Text          string `json:"text"`
}

func loadStories(t *testing.T) (tokPath string, cases []refCase) {
	t.Helper()
	sh := sharedDir(t)
	tokPath = filepath.Join(sh, "models", "stories260K", "tok512.bin")
	data, err := os.ReadFile(filepath.Join(sh, "reference", "stories260K-greedy.json"))
	if err != nil {
		t.Skipf("reference outputs missing: %v", err)
	}
	var ref struct{ Cases []refCase }
	if err := json.Unmarshal(data, &ref); err != nil {
		t.Fatal(err)
	}
	if len(ref.Cases) == 0 {
		t.Fatal("no cases in reference file")
	}
	return tokPath, ref.Cases
}

func TestLlama2CReference(t *testing.T) {
	tokPath, cases := loadStories(t)
	tok, err := LoadLlama2C(tokPath, 512)
	if err != nil {
		t.Fatal(err)
	}
	if tok.VocabSize() != 512 || tok.BOS() != 1 || !slices.Equal(tok.EOS(), []int{2, 1}) {
		t.Fatalf("vocab %d bos %d eos %v", tok.VocabSize(), tok.BOS(), tok.EOS())
	}
	for _, c := range cases {
		t.Run(c.Prompt, func(t *testing.T) {
			ids, err := tok.Encode(c.Prompt, true)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(ids, c.PromptIDs) {
				t.Fatalf("Encode = %v, want %v", ids, c.PromptIDs)
			}
			all := append(slices.Clone(c.PromptIDs), c.GreedyNextIDs...)
			if got := tok.Decode(all); got != c.Text {
				t.Fatalf("Decode = %q, want %q", got, c.Text)
			}
			sd := NewStreamDecoder(tok)
			var s string
			for _, id := range all {
				s += sd.Push(id)
			}
			if s += sd.Flush(); s != c.Text {
				t.Fatalf("stream = %q, want %q", s, c.Text)
			}
		})
	}
}

func TestLlama2CConvertedHF(t *testing.T) {
	tokPath, cases := loadStories(t)
	l2c, err := LoadLlama2C(tokPath, 512)
	if err != nil {
		t.Fatal(err)
	}
	tj, cj, err := Llama2CToHFJSON(tokPath, 512)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), tj, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), cj, 0o644); err != nil {
		t.Fatal(err)
	}
	hf, err := LoadHF(dir)
	if err != nil {
		t.Fatal(err)
	}
	if hf.VocabSize() != 512 || hf.BOS() != 1 {
		t.Fatalf("vocab %d bos %d", hf.VocabSize(), hf.BOS())
	}
	extra := []string{"", "a", "Hello world", "  two  spaces ", "tabs\tand\nnewlines\n\n", "naïve café 日本語 🙂", "12345 + 678 = 13023", "Tom's dog's ball!"}
	texts := extra
	for _, s := range referenceCorpus {
		if !strings.Contains(s, "<") { // HF parses "<s>" as BOS; llama2.c does not
			texts = append(texts, s)
		}
	}
	for _, c := range cases {
		texts = append(texts, c.Prompt, c.Text)
	}
	for _, s := range texts {
		want, _ := l2c.Encode(s, true)
		got, _ := hf.Encode(s, true)
		if !slices.Equal(got, want) {
			t.Errorf("%q: HF %v, llama2.c %v", s, got, want)
		}
		if d := hf.Decode(got); d != s && s != "" {
			t.Errorf("%q: HF decode %q", s, d)
		}
	}
	for _, c := range cases {
		all := append(slices.Clone(c.PromptIDs), c.GreedyNextIDs...)
		if got := hf.Decode(all); got != c.Text {
			t.Errorf("HF Decode = %q, want %q", got, c.Text)
		}
	}
}
