package tokenizer

import (
	"bytes"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"unicode/utf8"
)

// Llama2CToHFJSON converts a llama2.c tokenizer.bin into an HF tokenizer.json and
// tokenizer_config.json: a sentencepiece-style BPE (byte_fallback, "▁" for space, the
// Prepend-▁ normalizer as Llama 2 has) whose merges come from the scores the way
// transformers' SentencePieceExtractor derives them: every split of a piece into two
// pieces of the vocabulary is a merge, ranked by the merged piece's score (highest
// first). LoadHF of the result encodes as LoadLlama2C does, except when two different
// merges have equal scores (llama2.c then takes the leftmost pair).
func Llama2CToHFJSON(tokBinPath string, vocabSize int) (tokenizerJSON []byte, tokenizerConfigJSON []byte, err error) {
	t, err := loadLlama2C(tokBinPath, vocabSize)
	if err != nil {
		return nil, nil, err
	}
	names := make([]string, len(t.pieces))
	vocab := make(map[string]int, len(t.pieces))
	for id, p := range t.pieces {
		var s string
		switch id {
		case llama2cUnk:
			s = "<unk>"
		case llama2cBOS:
			s = "<s>"
		case llama2cEOS:
			s = "</s>"
		default:
			s = strings.ReplaceAll(string(p), " ", "▁")
		}
		if _, dup := vocab[s]; dup || !utf8.ValidString(s) {
			s = fmt.Sprintf("<llama2c_%d>", id) // unreachable by BPE; keeps ids dense
		}
		names[id] = s
		vocab[s] = id
	}
	type merge struct {
		l, r  string
		lid   int
		rid   int
		score float32
		order int
	}
	var merges []merge
	for id, s := range names {
		if id <= llama2cEOS {
			continue
		}
		var local []merge
		for i := range s {
			if i == 0 {
				continue
			}
			l, r := s[:i], s[i:]
			lid, okL := vocab[l]
			rid, okR := vocab[r]
			if okL && okR && lid > llama2cEOS && rid > llama2cEOS {
				local = append(local, merge{l: l, r: r, lid: lid, rid: rid, score: t.scores[id]})
			}
		}
		sort.SliceStable(local, func(i, j int) bool {
			if local[i].lid != local[j].lid {
				return local[i].lid < local[j].lid
			}
			return local[i].rid < local[j].rid
		})
		merges = append(merges, local...)
	}
	sort.SliceStable(merges, func(i, j int) bool { return merges[i].score > merges[j].score })
	mergeStrs := make([]string, len(merges))
	for i, m := range merges {
		if strings.Contains(m.l, " ") || strings.Contains(m.r, " ") {
			return nil, nil, fmt.Errorf("tokenizer: merge %q %q contains a space", m.l, m.r)
		}
		mergeStrs[i] = m.l + " " + m.r
	}
	return sentencepieceJSON(vocab, mergeStrs)
}

// ByteFallbackHFJSON returns a minimal sentencepiece-style tokenizer.json
// (and tokenizer_config.json): <unk>, <s>, </s> and the 256 byte tokens
// <0x00>..<0xFF> (ids 3..258) and ▁ (259), no merges, so every text encodes byte by
// byte. `mooncake-go convert --random` writes it beside random weights.
func ByteFallbackHFJSON() (tokenizerJSON []byte, tokenizerConfigJSON []byte, err error) {
	vocab := map[string]int{"<unk>": 0, "<s>": 1, "</s>": 2}
	for b := 0; b < 256; b++ {
		vocab[fmt.Sprintf("<0x%02X>", b)] = 3 + b
	}
	vocab["▁"] = 259 // the word boundary, so spaces decode as spaces
	return sentencepieceJSON(vocab, []string{})
}

// sentencepieceJSON writes a Llama-2-style tokenizer.json and config around
// a BPE vocabulary and its merges (ids 0, 1, 2 are <unk>, <s>, </s>).
func sentencepieceJSON(vocab map[string]int, mergeStrs []string) (tokenizerJSON []byte, tokenizerConfigJSON []byte, err error) {
	type added struct {
		ID         int    `json:"id"`
		Content    string `json:"content"`
		SingleWord bool   `json:"single_word"`
		LStrip     bool   `json:"lstrip"`
		RStrip     bool   `json:"rstrip"`
		Normalized bool   `json:"normalized"`
		Special    bool   `json:"special"`
	}
	obj := func(kv ...any) map[string]any {
		m := map[string]any{}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
	tok := struct {
		Version       string         `json:"version"`
		Truncation    any            `json:"truncation"`
		Padding       any            `json:"padding"`
		AddedTokens   []added        `json:"added_tokens"`
		Normalizer    map[string]any `json:"normalizer"`
		PreTokenizer  any            `json:"pre_tokenizer"`
		PostProcessor map[string]any `json:"post_processor"`
		Decoder       map[string]any `json:"decoder"`
		Model         map[string]any `json:"model"`
	}{
		Version: "1.0",
		AddedTokens: []added{
			{ID: 0, Content: "<unk>", Special: true},
			{ID: 1, Content: "<s>", Special: true},
			{ID: 2, Content: "</s>", Special: true},
		},
		Normalizer: obj("type", "Sequence", "normalizers", []any{
			obj("type", "Prepend", "prepend", "▁"),
			obj("type", "Replace", "pattern", obj("String", " "), "content", "▁"),
		}),
		PostProcessor: obj("type", "TemplateProcessing",
			"single", []any{
				obj("SpecialToken", obj("id", "<s>", "type_id", 0)),
				obj("Sequence", obj("id", "A", "type_id", 0)),
			},
			"pair", []any{
				obj("SpecialToken", obj("id", "<s>", "type_id", 0)),
				obj("Sequence", obj("id", "A", "type_id", 0)),
				obj("SpecialToken", obj("id", "<s>", "type_id", 1)),
				obj("Sequence", obj("id", "B", "type_id", 1)),
			},
			"special_tokens", obj("<s>", obj("id", "<s>", "ids", []int{1}, "tokens", []string{"<s>"}))),
		Decoder: obj("type", "Sequence", "decoders", []any{
			obj("type", "Replace", "pattern", obj("String", "▁"), "content", " "),
			obj("type", "ByteFallback"),
			obj("type", "Fuse"),
			obj("type", "Strip", "content", " ", "start", 1, "stop", 0),
		}),
		Model: obj("type", "BPE", "dropout", nil, "unk_token", "<unk>",
			"continuing_subword_prefix", nil, "end_of_word_suffix", nil,
			"fuse_unk", true, "byte_fallback", true, "ignore_merges", false,
			"vocab", vocab, "merges", mergeStrs),
	}
	if tokenizerJSON, err = marshalJSON(tok); err != nil {
		return nil, nil, err
	}
	cfg := obj(
		"add_bos_token", true,
		"add_eos_token", false,
		"bos_token", "<s>",
		"eos_token", "</s>",
		"unk_token", "<unk>",
		"pad_token", nil,
		"clean_up_tokenization_spaces", false,
		"legacy", true,
		"model_max_length", 1<<20,
		"tokenizer_class", "LlamaTokenizer",
	)
	if tokenizerConfigJSON, err = marshalJSON(cfg); err != nil {
		return nil, nil, err
	}
	return tokenizerJSON, tokenizerConfigJSON, nil
}

// marshalJSON indents and keeps "<" and ">" readable (no \u003c escapes).
func marshalJSON(v any) ([]byte, error) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	enc.SetIndent("", " ")
	if err := enc.Encode(v); err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	return b.Bytes(), nil
}
