// Package tokenizer turns text into token ids and back for the models mooncake-go serves:
// HF tokenizer.json BPE (byte-level as in Llama 3 and Qwen2/3, sentencepiece-style with byte
// fallback as in Llama 2 and Mistral), llama2.c tokenizer.bin files, and a built-in byte
// tokenizer for the random-weight model. It also renders chat templates and detokenizes
// streams without ever emitting broken UTF-8.
//
// Encode parses added tokens (special or not, e.g. "<|eot_id|>") that appear in the text as
// their ids, as HF tokenizers do by default; EncodeWithSpecial is a synonym kept for
// readability at call sites that rely on it. A Tokenizer is safe for concurrent use.
package tokenizer

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unicode/utf8"
)

// Tokenizer is what the engine and the HTTP server need from a tokenizer.
type Tokenizer interface {
	// Encode returns the ids of text. Added/special tokens written in the text are parsed
	// as their ids. With addBOS, BOS is prepended if the model uses one.
	Encode(text string, addBOS bool) ([]int, error)
	// EncodeWithSpecial is the same as Encode.
	EncodeWithSpecial(text string, addBOS bool) ([]int, error)
	// EncodeLimit is Encode for at most limit ids (those addBOS adds included; a
	// negative limit is none). A text with more gets a *TooLongError as soon as that is
	// known: from its length alone when MaxTokenBytes proves it, else once limit+1 ids
	// are found, without encoding the rest. With a limit, a tokenizer that splits words by
	// a regex also refuses a word longer than MaxWordBytes (*WordTooLongError).
	EncodeLimit(text string, addBOS bool, limit int) ([]int, error)
	// MaxTokenBytes bounds the bytes of text one id stands for: a text of n bytes
	// encodes to at least ceil(n/MaxTokenBytes) ids (addBOS only adds to them). 0: no
	// bound (a token may stand for any number of bytes, as fused unknown characters do).
	MaxTokenBytes() int
	// Decode returns the text of ids, skipping special tokens (BOS, EOS, <|eot_id|> ...).
	// Bytes that do not form valid UTF-8 become U+FFFD. It follows the tokenizer's decoder
	// (HF: a leading space of the first token may be stripped) and never applies
	// clean_up_tokenization_spaces.
	Decode(ids []int) string
	// VocabSize is the number of ids (one more than the largest valid id).
	VocabSize() int
	// BOS is the beginning-of-sequence id, -1 if the model has none.
	BOS() int
	// EOS lists the ids that end generation (eos_token and chat end-of-turn tokens).
	EOS() []int
	// TokenText is the text of one token on its own, as it reads inside a sequence
	// (special tokens as their content; may hold a partial UTF-8 sequence).
	TokenText(id int) string
	// ChatTemplate is the raw Jinja chat template, "" if none.
	ChatTemplate() string
}

// ErrInvalidID is returned for token ids outside the vocabulary.
var ErrInvalidID = errors.New("tokenizer: token id out of range")

// Load picks a loader as `serve` needs it: tokenizerPath, if set, is an HF directory, a
// tokenizer.json, or a llama2.c tokenizer.bin (all its entries are read); otherwise
// modelPath must be an HF directory; an empty modelPath gives NewByteLevel().
func Load(modelPath, tokenizerPath string) (Tokenizer, error) {
	if tokenizerPath != "" {
		st, err := os.Stat(tokenizerPath)
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %w", err)
		}
		if st.IsDir() {
			return LoadHF(tokenizerPath)
		}
		if filepath.Ext(tokenizerPath) == ".json" {
			return LoadHF(filepath.Dir(tokenizerPath))
		}
		return LoadLlama2C(tokenizerPath, 0)
	}
	if modelPath == "" {
		return NewByteLevel(), nil
	}
	st, err := os.Stat(modelPath)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	if st.IsDir() {
		return LoadHF(modelPath)
	}
	return nil, fmt.Errorf("tokenizer: %s is a file: a llama2.c model needs a tokenizer path", modelPath)
}

// decodeState is the per-sequence state pieces depend on (leading-space stripping).
type decodeState struct {
	prev    int  // previous id, -1 at the start
	emitted bool // a non-skipped token was decoded
}

// piecer is implemented by every tokenizer here: it appends the bytes of id to dst
// (nothing for skipped special tokens) and advances st.
type piecer interface {
	appendPiece(dst []byte, st *decodeState, id int) []byte
}

// decodeWith decodes ids through p into valid UTF-8.
func decodeWith(p piecer, ids []int) string {
	st := decodeState{prev: -1}
	var b []byte
	for _, id := range ids {
		b = p.appendPiece(b, &st, id)
	}
	return toValidUTF8(b)
}

// toValidUTF8 converts b to a string, replacing each byte of an invalid sequence by U+FFFD.
func toValidUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	out := make([]byte, 0, len(b)+8)
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r == utf8.RuneError && n == 1 {
			out = utf8.AppendRune(out, utf8.RuneError)
		} else {
			out = append(out, b[:n]...)
		}
		b = b[n:]
	}
	return string(out)
}
