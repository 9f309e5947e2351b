package tokenizer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
)

// llama2.c tokenizer.bin layout (little-endian):
//
//	int32 max_token_length
//	vocab_size times: float32 score | int32 len | len bytes (the piece; spaces are ' ')
//
// Ids 0, 1, 2 are <unk>, BOS and EOS; ids 3..258 are the byte tokens <0x00>..<0xFF>.
type llama2c struct {
	maxBytes int // MaxTokenBytes
	pieces   [][]byte
	scores   []float32
	lookup   map[string]int // piece -> first id with it
	bytes    [256]int       // id of <0xNN>, -1 if absent
}

var _ Tokenizer = (*llama2c)(nil)

const (
	llama2cUnk = 0
	llama2cBOS = 1
	llama2cEOS = 2
)

// LoadLlama2C reads a llama2.c tokenizer.bin. vocabSize is the model's vocabulary size
// (the file holds exactly that many entries); 0 reads entries until the end of the file.
func LoadLlama2C(path string, vocabSize int) (Tokenizer, error) {
	t, err := loadLlama2C(path, vocabSize)
	if err != nil {
		return nil, err
	}
	return t, nil
}

func loadLlama2C(path string, vocabSize int) (*llama2c, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	t, err := parseLlama2C(data, vocabSize)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %s: %w", path, err)
	}
	return t, nil
}

func parseLlama2C(data []byte, vocabSize int) (*llama2c, error) {
	if len(data) < 4 {
		return nil, errors.New("llama2.c tokenizer: file too short")
	}
	maxLen := int(int32(binary.LittleEndian.Uint32(data)))
	off := 4
	t := &llama2c{lookup: map[string]int{}}
	for vocabSize <= 0 || len(t.pieces) < vocabSize {
		if off == len(data) && vocabSize <= 0 {
			break
		}
		if len(data)-off < 8 {
			return nil, fmt.Errorf("llama2.c tokenizer: truncated at entry %d: %w", len(t.pieces), io.ErrUnexpectedEOF)
		}
		score := math.Float32frombits(binary.LittleEndian.Uint32(data[off:]))
		n := int(int32(binary.LittleEndian.Uint32(data[off+4:])))
		off += 8
		if n < 0 || n > len(data)-off || (maxLen > 0 && n > maxLen) {
			return nil, fmt.Errorf("llama2.c tokenizer: entry %d has bad length %d", len(t.pieces), n)
		}
		p := data[off : off+n : off+n]
		off += n
		if _, dup := t.lookup[string(p)]; !dup {
			t.lookup[string(p)] = len(t.pieces)
		}
		t.pieces = append(t.pieces, p)
		t.scores = append(t.scores, score)
	}
	if len(t.pieces) < 3 {
		return nil, errors.New("llama2.c tokenizer: fewer than 3 tokens")
	}
	t.maxBytes = maxPieceBytes(t.pieces)
	for i := range t.bytes {
		t.bytes[i] = -1
		if id, ok := t.lookup[fmt.Sprintf("<0x%02X>", i)]; ok {
			t.bytes[i] = id
		}
	}
	return t, nil
}

// Encode reproduces llama2.c run.c's encode: a dummy-prefix " " token when text is not
// empty, one token per UTF-8 code point (or its bytes as byte tokens, id = byte+3), then
// repeated merging of the adjacent pair whose concatenation has the highest score
// (leftmost on ties). There is no special-token parsing in llama2.c; neither is there here.
func (t *llama2c) Encode(text string, addBOS bool) ([]int, error) {
	ids := make([]int, 0, len(text)+2)
	if addBOS {
		ids = append(ids, llama2cBOS)
	}
	if text == "" {
		return ids, nil
	}
	syms := make([]int, 0, len(text)+1)
	if id, ok := t.lookup[" "]; ok {
		syms = append(syms, id)
	} else {
		return nil, errors.New("tokenizer: llama2.c vocabulary has no \" \" token")
	}
	for i := 0; i < len(text); {
		// A code point is a lead byte and up to 3 continuation bytes, as run.c reads it.
		j := i + 1
		for j < len(text) && text[j]&0xC0 == 0x80 && j-i < 4 {
			j++
		}
		if id, ok := t.lookup[text[i:j]]; ok {
			syms = append(syms, id)
		} else {
			for k := i; k < j; k++ {
				syms = append(syms, int(text[k])+3)
			}
		}
		i = j
	}
	buf := make([]byte, 0, 64)
	look := func(a, b int) (int, float64, bool) {
		buf = append(append(buf[:0], t.pieces[a]...), t.pieces[b]...)
		id, ok := t.lookup[string(buf)]
		if !ok {
			return 0, 0, false
		}
		return id, -float64(t.scores[id]), true
	}
	return mergeSymbols(ids, syms, look), nil
}

// EncodeLimit implements Tokenizer. The merges are global (the best pair anywhere
// first), so a text is encoded whole once its length allows it.
func (t *llama2c) EncodeLimit(text string, addBOS bool, limit int) ([]int, error) {
	extra := 0
	if addBOS {
		extra = 1
	}
	if err := checkLength(text, limit, t.maxBytes, extra); err != nil {
		return nil, err
	}
	ids, err := t.Encode(text, addBOS)
	if err != nil {
		return nil, err
	}
	return checkCount(text, ids, limit)
}

// MaxTokenBytes implements Tokenizer; see maxPieceBytes.
func (t *llama2c) MaxTokenBytes() int { return t.maxBytes }

// maxPieceBytes is the longest piece. Every text byte lands in one symbol: a code point
// whose piece is its bytes, or the byte token byte+3, which stands for one byte; a merged
// token's piece is the concatenation of its parts'; the " " prefix and BOS stand for no
// text byte. So a token stands for at most its piece's length, provided that every byte
// token's piece is at least one byte long (it is <0xNN>); 0 (no bound) when not.
func maxPieceBytes(pieces [][]byte) int {
	if len(pieces) < 3+256 {
		return 0
	}
	for _, p := range pieces[3 : 3+256] {
		if len(p) == 0 {
			return 0
		}
	}
	n := 0
	for _, p := range pieces {
		n = max(n, len(p))
	}
	return n
}

// EncodeWithSpecial implements Tokenizer; it is Encode.
func (t *llama2c) EncodeWithSpecial(text string, addBOS bool) ([]int, error) {
	return t.Encode(text, addBOS)
}

// appendPiece follows run.c's decode: after BOS a leading space is dropped, <0xNN> is the
// raw byte. <unk>, BOS and EOS decode to nothing.
func (t *llama2c) appendPiece(dst []byte, st *decodeState, id int) []byte {
	prev := st.prev
	st.prev = id
	if id < 0 || id >= len(t.pieces) || id <= llama2cEOS {
		return dst
	}
	st.emitted = true
	p := t.pieces[id]
	if prev == llama2cBOS && len(p) > 0 && p[0] == ' ' {
		p = p[1:]
	}
	if b, ok := parseByteToken(string(p)); ok {
		return append(dst, b)
	}
	return append(dst, p...)
}

// Decode implements Tokenizer.
func (t *llama2c) Decode(ids []int) string { return decodeWith(t, ids) }

// VocabSize implements Tokenizer.
func (t *llama2c) VocabSize() int { return len(t.pieces) }

// BOS implements Tokenizer.
func (t *llama2c) BOS() int { return llama2cBOS }

// EOS is EOS (2) and BOS (1): llama2.c stops when the model emits BOS.
func (t *llama2c) EOS() []int { return []int{llama2cEOS, llama2cBOS} }

// TokenText implements Tokenizer; BOS and EOS read "<s>" and "</s>".
func (t *llama2c) TokenText(id int) string {
	switch {
	case id < 0 || id >= len(t.pieces):
		return ""
	case id == llama2cUnk:
		return "<unk>"
	case id == llama2cBOS:
		return "<s>"
	case id == llama2cEOS:
		return "</s>"
	}
	return string(t.appendPiece(nil, &decodeState{prev: -1}, id))
}

// ChatTemplate implements Tokenizer: llama2.c models have none.
func (t *llama2c) ChatTemplate() string { return "" }
