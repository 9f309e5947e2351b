package tokenizer

// The built-in byte tokenizer of the random-weight model: ids 0..255 are the bytes,
// 256 is BOS, 257 is EOS, and 258..319 are unused padding (they decode to nothing), so the
// vocabulary is 320, a multiple of 64.
const (
	ByteLevelBOS       = 256
	ByteLevelEOS       = 257
	ByteLevelVocabSize = 320
)

type byteTokenizer struct{}

var _ Tokenizer = byteTokenizer{}

// NewByteLevel returns the built-in byte tokenizer (see ByteLevelBOS). It parses no
// special tokens in text.
func NewByteLevel() Tokenizer { return byteTokenizer{} }

func (byteTokenizer) Encode(text string, addBOS bool) ([]int, error) {
	ids := make([]int, 0, len(text)+1)
	if addBOS {
		ids = append(ids, ByteLevelBOS)
	}
	for i := 0; i < len(text); i++ {
		ids = append(ids, int(text[i]))
	}
	return ids, nil
}

// EncodeLimit implements Tokenizer: one id per byte, so the length decides.
func (b byteTokenizer) EncodeLimit(text string, addBOS bool, limit int) ([]int, error) {
	extra := 0
	if addBOS {
		extra = 1
	}
	if err := checkLength(text, limit, 1, extra); err != nil {
		return nil, err
	}
	return b.Encode(text, addBOS)
}

// MaxTokenBytes implements Tokenizer: every id is one byte.
func (byteTokenizer) MaxTokenBytes() int { return 1 }

func (b byteTokenizer) EncodeWithSpecial(text string, addBOS bool) ([]int, error) {
	return b.Encode(text, addBOS)
}

func (byteTokenizer) appendPiece(dst []byte, st *decodeState, id int) []byte {
	st.prev = id
	if id < 0 || id > 255 {
		return dst
	}
	st.emitted = true
	return append(dst, byte(id))
}

func (b byteTokenizer) Decode(ids []int) string { return decodeWith(b, ids) }
func (byteTokenizer) VocabSize() int            { return ByteLevelVocabSize }
func (byteTokenizer) BOS() int                  { return ByteLevelBOS }
func (byteTokenizer) EOS() []int                { return []int{ByteLevelEOS} }
func (byteTokenizer) ChatTemplate() string      { return "" }

func (byteTokenizer) TokenText(id int) string {
	switch {
	case id >= 0 && id < 256:
		return string([]byte{byte(id)})
	case id == ByteLevelBOS:
		return "<s>"
	case id == ByteLevelEOS:
		return "</s>"
	}
	return ""
}
