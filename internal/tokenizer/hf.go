package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ardanlabs/jinja"
)

// hfTokenizer is an HF tokenizer.json BPE tokenizer (model.type "BPE").
type hfTokenizer struct {
	model     *bpeModel
	tokens    []string // id -> token string (model vocab and added tokens)
	special   []bool   // id -> skipped by Decode
	added     []bool   // id -> an added token (decoded as its content)
	addedTrie addedSplitter

	normalize    func(string) string // nil: none
	pre          []preStep           // applied in order
	preByteLevel bool                // a pre-tokenizer is ByteLevel: words are byte-level runes
	preMixed     bool                // a Metaspace pre-tokenizer comes after a ByteLevel one
	preRegex     bool                // a pre-tokenizer splits by a regex: EncodeLimit caps words
	byteLevel    bool                // decoder is ByteLevel

	// Bounds on what one id stands for (see computeBounds); 0: none.
	maxTokenBytes int // text bytes: MaxTokenBytes
	maxWordUnits  int // units of a pre-tokenized word (runes if preByteLevel, else bytes)

	// sentencepiece-style decoding
	metaspace    bool // ▁ -> ' '
	byteFallback bool // <0xNN> -> byte
	stripLeft    int  // leading spaces stripped from the first decoded token

	prefix, suffix []int // ids added around a sequence when addBOS is set
	bos            int
	eos            []int
	chatTemplate   string
	bosText        string // tokenizer_config bos_token, for chat templates
	eosText        string
	chat           chatCache
}

var _ Tokenizer = (*hfTokenizer)(nil)

// preStep is one pre-tokenizer: it rewrites a word into words and calls yield with each,
// in order; first says whether the word is the first of a section that starts the text,
// and yield's first the same of the words it makes. It stops when yield returns false
// and reports whether it reached the end.
type preStep func(w string, first bool, yield func(w string, first bool) bool) bool

type hfAddedToken struct {
	ID      int    `json:"id"`
	Content string `json:"content"`
	LStrip  bool   `json:"lstrip"`
	RStrip  bool   `json:"rstrip"`
	Special bool   `json:"special"`
}

type hfNode struct {
	Type          string          `json:"type"`
	Normalizers   []hfNode        `json:"normalizers"`
	Pretokenizers []hfNode        `json:"pretokenizers"`
	Decoders      []hfNode        `json:"decoders"`
	Prepend       string          `json:"prepend"`
	Pattern       hfPattern       `json:"pattern"`
	Content       string          `json:"content"`
	Behavior      string          `json:"behavior"`
	Invert        bool            `json:"invert"`
	AddPrefix     *bool           `json:"add_prefix_space"`
	UseRegex      *bool           `json:"use_regex"`
	Replacement   string          `json:"replacement"`
	PrependScheme string          `json:"prepend_scheme"`
	Split         *bool           `json:"split"`
	Start         int             `json:"start"`
	Single        []hfTemplateSeg `json:"single"`
	Special       map[string]struct {
		IDs []int `json:"ids"`
	} `json:"special_tokens"`
}

type hfPattern struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

type hfTemplateSeg struct {
	SpecialToken *struct {
		ID string `json:"id"`
	} `json:"SpecialToken"`
	Sequence *struct {
		ID string `json:"id"`
	} `json:"Sequence"`
}

type hfFile struct {
	AddedTokens   []hfAddedToken `json:"added_tokens"`
	Normalizer    *hfNode        `json:"normalizer"`
	PreTokenizer  *hfNode        `json:"pre_tokenizer"`
	PostProcessor *hfNode        `json:"post_processor"`
	Decoder       *hfNode        `json:"decoder"`
	Model         struct {
		Type         string          `json:"type"`
		Vocab        map[string]int  `json:"vocab"`
		Merges       json.RawMessage `json:"merges"`
		UnkToken     *string         `json:"unk_token"`
		ByteFallback bool            `json:"byte_fallback"`
		FuseUnk      bool            `json:"fuse_unk"`
		IgnoreMerges bool            `json:"ignore_merges"`
		EndOfWord    *string         `json:"end_of_word_suffix"`
		Continuing   *string         `json:"continuing_subword_prefix"`
	} `json:"model"`
}

// hfConfig is the part of tokenizer_config.json we use.
type hfConfig struct {
	AddBOS       *bool           `json:"add_bos_token"`
	AddEOS       *bool           `json:"add_eos_token"`
	BOSToken     json.RawMessage `json:"bos_token"`
	EOSToken     json.RawMessage `json:"eos_token"`
	ChatTemplate json.RawMessage `json:"chat_template"`
}

// tokenContent reads a token given as a string or as {"content": ...}.
func tokenContent(raw json.RawMessage) string {
	if len(raw) == 0 {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var o struct {
		Content string `json:"content"`
	}
	if json.Unmarshal(raw, &o) == nil {
		return o.Content
	}
	return ""
}

// LoadHF loads dir/tokenizer.json and, if present, dir/tokenizer_config.json
// (add_bos_token, bos_token, eos_token, chat_template). dir may also name tokenizer.json.
func LoadHF(dir string) (Tokenizer, error) {
	if strings.HasSuffix(dir, ".json") {
		dir = filepath.Dir(dir)
	}
	tj, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	cj, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	t, err := ParseHF(tj, cj)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %s: %w", dir, err)
	}
	return t, nil
}

// ParseHF builds a tokenizer from the bytes of tokenizer.json and tokenizer_config.json
// (configJSON may be nil).
func ParseHF(tokenizerJSON, configJSON []byte) (Tokenizer, error) {
	var f hfFile
	if err := json.Unmarshal(tokenizerJSON, &f); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	var cfg hfConfig
	if len(configJSON) > 0 {
		if err := json.Unmarshal(configJSON, &cfg); err != nil {
			return nil, fmt.Errorf("tokenizer_config.json: %w", err)
		}
	}
	if f.Model.Type != "BPE" && !(f.Model.Type == "" && f.Model.Merges != nil) {
		return nil, fmt.Errorf("unsupported model type %q (only BPE)", f.Model.Type)
	}
	if (f.Model.EndOfWord != nil && *f.Model.EndOfWord != "") || (f.Model.Continuing != nil && *f.Model.Continuing != "") {
		return nil, errors.New("unsupported BPE continuing_subword_prefix/end_of_word_suffix")
	}
	t := &hfTokenizer{bos: -1}
	m := &bpeModel{
		vocab:        f.Model.Vocab,
		byteFallback: f.Model.ByteFallback,
		unk:          -1,
		fuseUnk:      f.Model.FuseUnk,
		ignoreMerges: f.Model.IgnoreMerges,
		cache:        make(map[string][]int),
	}
	t.model = m
	n := 0
	for _, id := range m.vocab {
		n = max(n, id+1)
	}
	for _, a := range f.AddedTokens {
		n = max(n, a.ID+1)
	}
	t.tokens = make([]string, n)
	t.special = make([]bool, n)
	t.added = make([]bool, n)
	for s, id := range m.vocab {
		if id < 0 {
			return nil, fmt.Errorf("negative id for %q", s)
		}
		t.tokens[id] = s
	}
	if f.Model.UnkToken != nil {
		if id, ok := m.vocab[*f.Model.UnkToken]; ok {
			m.unk = id
		}
	}
	for i := range m.byteIDs {
		m.byteIDs[i] = -1
		if id, ok := m.vocab[fmt.Sprintf("<0x%02X>", i)]; ok {
			m.byteIDs[i] = id
		}
	}
	if err := t.loadMerges(f.Model.Merges); err != nil {
		return nil, err
	}
	for _, a := range f.AddedTokens {
		if a.ID < 0 || a.Content == "" {
			continue
		}
		t.tokens[a.ID] = a.Content
		t.special[a.ID] = a.Special
		t.added[a.ID] = true
	}
	t.addedTrie = newAddedSplitter(f.AddedTokens)
	var err error
	shrink := 1
	if f.Normalizer != nil {
		if t.normalize, shrink, err = buildNormalizer(*f.Normalizer); err != nil {
			return nil, err
		}
	}
	if f.PreTokenizer != nil {
		if err := t.buildPre(*f.PreTokenizer); err != nil {
			return nil, err
		}
	}
	if f.Decoder != nil {
		if err := t.buildDecoder(*f.Decoder); err != nil {
			return nil, err
		}
	}
	t.setSpecials(f, cfg)
	t.computeBounds(f.AddedTokens, shrink)
	return t, nil
}

func (t *hfTokenizer) loadMerges(raw json.RawMessage) error {
	m := t.model
	var pairs [][2]string
	var strs []string
	if len(raw) > 0 && json.Unmarshal(raw, &strs) == nil {
		pairs = make([][2]string, 0, len(strs))
		for _, s := range strs {
			a, b, ok := strings.Cut(s, " ")
			if !ok || strings.Contains(b, " ") {
				return fmt.Errorf("bad merge %q", s)
			}
			pairs = append(pairs, [2]string{a, b})
		}
	} else if len(raw) > 0 {
		if err := json.Unmarshal(raw, &pairs); err != nil {
			return fmt.Errorf("merges: %w", err)
		}
	}
	m.merges = make(map[uint64]bpeMerge, len(pairs))
	for rank, p := range pairs {
		a, okA := m.vocab[p[0]]
		b, okB := m.vocab[p[1]]
		c, okC := m.vocab[p[0]+p[1]]
		if !okA || !okB || !okC {
			return fmt.Errorf("merge %q %q: token not in vocab", p[0], p[1])
		}
		k := pairKey(a, b)
		if _, dup := m.merges[k]; !dup {
			m.merges[k] = bpeMerge{rank: int32(rank), id: int32(c)}
		}
	}
	return nil
}

// buildNormalizer returns the normalizer and how much it may shrink a text: its output
// has at least 1/shrink of its input's bytes (0: no such bound).
func buildNormalizer(n hfNode) (f func(string) string, shrink int, err error) {
	switch n.Type {
	case "Sequence":
		var fs []func(string) string
		shrink = 1
		for _, c := range n.Normalizers {
			f, k, err := buildNormalizer(c)
			if err != nil {
				return nil, 0, err
			}
			if f != nil {
				fs = append(fs, f)
			}
			shrink *= k
		}
		return func(s string) string {
			for _, f := range fs {
				s = f(s)
			}
			return s
		}, shrink, nil
	case "Prepend":
		p := n.Prepend
		return func(s string) string {
			if s == "" {
				return s
			}
			return p + s
		}, 1, nil
	case "Replace":
		if n.Pattern.String == nil {
			return nil, 0, errors.New("unsupported normalizer Replace with a regex pattern")
		}
		from, to := *n.Pattern.String, n.Content
		shrink = 1
		switch {
		case from != "" && to == "":
			shrink = 0 // it deletes
		case len(from) > len(to):
			shrink = (len(from) + len(to) - 1) / len(to)
		}
		return func(s string) string { return strings.ReplaceAll(s, from, to) }, shrink, nil
	case "NFC", "NFD", "NFKC", "NFKD":
		return unicodeNormalizer(n.Type), unicodeShrink, nil
	}
	return nil, 0, fmt.Errorf("unsupported normalizer %q", n.Type)
}

func (t *hfTokenizer) buildPre(n hfNode) error {
	switch n.Type {
	case "Sequence":
		for _, c := range n.Pretokenizers {
			if err := t.buildPre(c); err != nil {
				return err
			}
		}
		return nil
	case "Split":
		if n.Pattern.Regex == nil {
			return errors.New("unsupported Split pre-tokenizer with a string pattern")
		}
		sp := knownSplitter(*n.Pattern.Regex)
		if sp == nil {
			return fmt.Errorf("unsupported Split regex %q", *n.Pattern.Regex)
		}
		if n.Behavior != "Isolated" || n.Invert {
			return fmt.Errorf("unsupported Split behavior %q invert=%v", n.Behavior, n.Invert)
		}
		t.preRegex = true
		t.pre = append(t.pre, splitStep(sp))
		return nil
	case "ByteLevel":
		addPrefix := n.AddPrefix != nil && *n.AddPrefix
		useRegex := n.UseRegex == nil || *n.UseRegex
		gpt2 := knownSplitter(patGPT2)
		t.preByteLevel = true
		t.preRegex = t.preRegex || useRegex
		t.pre = append(t.pre, func(w string, first bool, yield func(string, bool) bool) bool {
			if addPrefix && first && !strings.HasPrefix(w, " ") {
				w = " " + w
			}
			if !useRegex {
				return yield(byteLevelMap(w), first)
			}
			return gpt2(w, func(p string) bool {
				ok := yield(byteLevelMap(p), first)
				first = false
				return ok
			})
		})
		return nil
	case "Metaspace":
		if t.preByteLevel {
			t.preMixed = true
		}
		rep := n.Replacement
		if rep == "" {
			rep = "▁"
		}
		scheme := n.PrependScheme
		if scheme == "" {
			scheme = "always"
			if n.AddPrefix != nil && !*n.AddPrefix {
				scheme = "never"
			}
		}
		split := n.Split == nil || *n.Split
		t.pre = append(t.pre, func(w string, first bool, yield func(string, bool) bool) bool {
			w = strings.ReplaceAll(w, " ", rep)
			if (scheme == "always" || (scheme == "first" && first)) && !strings.HasPrefix(w, rep) {
				w = rep + w
			}
			if !split {
				return yield(w, first)
			}
			start := 0
			for i := 1; i < len(w); i++ {
				if strings.HasPrefix(w[i:], rep) {
					if !yield(w[start:i], first) {
						return false
					}
					first = false
					start = i
				}
			}
			return yield(w[start:], first)
		})
		return nil
	}
	return fmt.Errorf("unsupported pre-tokenizer %q", n.Type)
}

func splitStep(sp splitter) preStep {
	return func(w string, first bool, yield func(string, bool) bool) bool {
		return sp(w, func(p string) bool {
			ok := yield(p, first)
			first = false
			return ok
		})
	}
}

func (t *hfTokenizer) buildDecoder(n hfNode) error {
	switch n.Type {
	case "Sequence":
		for _, c := range n.Decoders {
			if err := t.buildDecoder(c); err != nil {
				return err
			}
		}
	case "ByteLevel":
		t.byteLevel = true
	case "Replace":
		if n.Pattern.String == nil || *n.Pattern.String != "▁" || n.Content != " " {
			return errors.New("unsupported Replace decoder (only ▁ -> space)")
		}
		t.metaspace = true
	case "ByteFallback":
		t.byteFallback = true
	case "Fuse":
	case "Strip":
		if n.Content != " " {
			return fmt.Errorf("unsupported Strip decoder content %q", n.Content)
		}
		t.stripLeft = n.Start
	case "Metaspace":
		t.metaspace = true
		if n.PrependScheme != "never" && (n.AddPrefix == nil || *n.AddPrefix) {
			t.stripLeft = 1
		}
	default:
		return fmt.Errorf("unsupported decoder %q", n.Type)
	}
	return nil
}

// setSpecials decides BOS, the ids added by Encode(addBOS=true), and the stop ids.
// BOS is added when tokenizer_config's add_bos_token is true, or when it is absent and
// either the post_processor template starts with a special token or a bos_token is named
// (Llama 3 files whose post_processor is plain ByteLevel still want <|begin_of_text|>).
func (t *hfTokenizer) setSpecials(f hfFile, cfg hfConfig) {
	lookup := func(s string) int {
		if s == "" {
			return -1
		}
		for _, a := range f.AddedTokens {
			if a.Content == s {
				return a.ID
			}
		}
		if id, ok := t.model.vocab[s]; ok {
			return id
		}
		return -1
	}
	var tmplPrefix, tmplSuffix []int
	if pp := f.PostProcessor; pp != nil && pp.Type == "TemplateProcessing" {
		seenSeq := false
		for _, seg := range pp.Single {
			switch {
			case seg.Sequence != nil:
				seenSeq = true
			case seg.SpecialToken != nil:
				ids := pp.Special[seg.SpecialToken.ID].IDs
				if seenSeq {
					tmplSuffix = append(tmplSuffix, ids...)
				} else {
					tmplPrefix = append(tmplPrefix, ids...)
				}
			}
		}
	}
	t.bos = lookup(tokenContent(cfg.BOSToken))
	if t.bos < 0 && len(tmplPrefix) == 1 {
		t.bos = tmplPrefix[0]
	}
	switch {
	case cfg.AddBOS != nil && !*cfg.AddBOS:
	case len(tmplPrefix) > 0:
		t.prefix = tmplPrefix
	case t.bos >= 0:
		t.prefix = []int{t.bos}
	}
	if cfg.AddEOS != nil && *cfg.AddEOS {
		if e := lookup(tokenContent(cfg.EOSToken)); e >= 0 {
			t.suffix = []int{e}
		}
	} else if cfg.AddEOS == nil {
		t.suffix = tmplSuffix
	}
	seen := map[int]bool{}
	addEOS := func(id int) {
		if id >= 0 && !seen[id] {
			seen[id] = true
			t.eos = append(t.eos, id)
		}
	}
	addEOS(lookup(tokenContent(cfg.EOSToken)))
	for _, s := range []string{"</s>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>", "<end_of_turn>"} {
		if id := lookup(s); id >= 0 && id < len(t.special) && t.special[id] {
			addEOS(id)
		}
	}
	t.chatTemplate = parseChatTemplate(cfg.ChatTemplate)
	t.bosText = tokenContent(cfg.BOSToken)
	t.eosText = tokenContent(cfg.EOSToken)
}

func (t *hfTokenizer) compiledChat() (*jinja.Template, error) { return t.chat.get(t.chatTemplate) }
func (t *hfTokenizer) chatTokens() (string, string)           { return t.bosText, t.eosText }

func parseChatTemplate(raw json.RawMessage) string {
	if len(raw) == 0 {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var named []struct{ Name, Template string }
	if json.Unmarshal(raw, &named) == nil {
		for _, n := range named {
			if n.Name == "default" {
				return n.Template
			}
		}
		if len(named) > 0 {
			return named[0].Template
		}
	}
	return ""
}

// Encode implements Tokenizer.
func (t *hfTokenizer) Encode(text string, addBOS bool) ([]int, error) {
	return t.EncodeLimit(text, addBOS, -1)
}

// EncodeLimit implements Tokenizer. It goes through the text a section and a
// pre-tokenized word at a time, and checks a word's length against the limit before
// merging it (the merges of one word are global). With a limit, a tokenizer that splits
// words by a regex refuses a word longer than MaxWordBytes.
func (t *hfTokenizer) EncodeLimit(text string, addBOS bool, limit int) ([]int, error) {
	var prefix, suffix []int
	if addBOS {
		prefix, suffix = t.prefix, t.suffix
	}
	if err := checkLength(text, limit, t.maxTokenBytes, len(prefix)+len(suffix)); err != nil {
		return nil, err
	}
	capacity := len(text)/3 + 4
	if limit >= 0 {
		capacity = min(capacity, limit+1)
	}
	ids := append(make([]int, 0, capacity), prefix...)
	atLeast := 0 // when the limit is passed: a lower bound on the text's ids
	room := func(more int) bool {
		if n := len(ids) + more + len(suffix); limit >= 0 && n > limit {
			atLeast = n
			return false
		}
		return true
	}
	var wordErr error
	word := func(w string, _ bool) bool {
		units := len(w)
		if t.preByteLevel {
			units = utf8.RuneCountInString(w)
		}
		if limit >= 0 && !room(minTokens(units, t.maxWordUnits)) {
			return false
		}
		if limit >= 0 && t.preRegex && units > MaxWordBytes {
			wordErr = &WordTooLongError{Bytes: units, Limit: MaxWordBytes}
			return false
		}
		ids = t.model.encodeWord(ids, w)
		return room(0)
	}
	t.addedTrie.each(text, func(sec section) bool {
		if sec.id >= 0 {
			ids = append(ids, sec.id)
			return room(0)
		}
		s := sec.text
		if t.normalize != nil {
			s = t.normalize(s)
		}
		if s == "" {
			return true
		}
		return t.words(0, s, sec.start == 0, word)
	})
	switch {
	case atLeast > 0:
		return nil, &TooLongError{Limit: limit, Tokens: atLeast, Bytes: len(text)}
	case wordErr != nil:
		return nil, wordErr
	}
	return append(ids, suffix...), nil
}

// words runs pre-tokenizers i and after on w and calls yield with each word they make.
func (t *hfTokenizer) words(i int, w string, first bool, yield func(string, bool) bool) bool {
	if i == len(t.pre) {
		return yield(w, first)
	}
	return t.pre[i](w, first, func(w string, first bool) bool { return t.words(i+1, w, first, yield) })
}

// EncodeWithSpecial implements Tokenizer; it is Encode.
func (t *hfTokenizer) EncodeWithSpecial(text string, addBOS bool) ([]int, error) {
	return t.Encode(text, addBOS)
}

func (t *hfTokenizer) appendPiece(dst []byte, st *decodeState, id int) []byte {
	st.prev = id
	if id < 0 || id >= len(t.tokens) || t.special[id] {
		return dst
	}
	tok := t.tokens[id]
	first := !st.emitted
	st.emitted = true
	if t.added[id] {
		return append(dst, tok...)
	}
	if t.byteLevel {
		start := len(dst)
		for _, r := range tok {
			b, ok := byteLevelDec[r]
			if !ok {
				return append(dst[:start], tok...)
			}
			dst = append(dst, b)
		}
		return dst
	}
	start := len(dst)
	if b, ok := parseByteToken(tok); ok && t.byteFallback {
		dst = append(dst, b)
	} else if t.metaspace {
		dst = append(dst, strings.ReplaceAll(tok, "▁", " ")...)
	} else {
		dst = append(dst, tok...)
	}
	if first {
		for k := 0; k < t.stripLeft && start < len(dst) && dst[start] == ' '; k++ {
			dst = append(dst[:start], dst[start+1:]...)
		}
	}
	return dst
}

// parseByteToken reads "<0xNN>".
func parseByteToken(s string) (byte, bool) {
	if len(s) != 6 || !strings.HasPrefix(s, "<0x") || s[5] != '>' {
		return 0, false
	}
	v, err := strconv.ParseUint(s[3:5], 16, 8)
	if err != nil {
		return 0, false
	}
	return byte(v), true
}

// Decode implements Tokenizer.
func (t *hfTokenizer) Decode(ids []int) string { return decodeWith(t, ids) }

// VocabSize implements Tokenizer.
func (t *hfTokenizer) VocabSize() int { return len(t.tokens) }

// BOS implements Tokenizer.
func (t *hfTokenizer) BOS() int { return t.bos }

// MaxTokenBytes implements Tokenizer; see computeBounds.
func (t *hfTokenizer) MaxTokenBytes() int { return t.maxTokenBytes }

// EOS implements Tokenizer.
func (t *hfTokenizer) EOS() []int { return append([]int(nil), t.eos...) }

// ChatTemplate implements Tokenizer.
func (t *hfTokenizer) ChatTemplate() string { return t.chatTemplate }

// TokenText implements Tokenizer.
func (t *hfTokenizer) TokenText(id int) string {
	if id < 0 || id >= len(t.tokens) {
		return ""
	}
	if t.special[id] {
		return t.tokens[id]
	}
	return string(t.appendPiece(nil, &decodeState{prev: -1, emitted: true}, id))
}
