package server

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/tokenizer"
)

// SGLang's /tokenize, /detokenize and /abort_request.

type tokenizeRequest struct {
	Model            string          `json:"model"`
	Prompt           json.RawMessage `json:"prompt"`
	AddSpecialTokens *bool           `json:"add_special_tokens"`
}

func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var q tokenizeRequest
	if !s.readObject(w, r, &q) {
		return
	}
	if e := s.checkModel(q.Model); e != nil {
		writeError(w, e)
		return
	}
	ps, batch, e := decodePrompts("prompt", q.Prompt, promptText)
	if e != nil {
		writeError(w, e)
		return
	}
	if len(ps) > s.cfg.MaxBatch {
		writeError(w, badRequest("prompt", "%d prompts: more than this server takes in one request (%d)", len(ps), s.cfg.MaxBatch))
		return
	}
	addBOS := q.AddSpecialTokens == nil || *q.AddSpecialTokens
	limit := -1
	if s.cfg.ContextLen > 0 {
		limit = s.cfg.ContextLen
	}
	tokens := make([][]int, len(ps))
	counts := make([]int, len(ps))
	for i, p := range ps {
		ids, err := s.cfg.Tokenizer.EncodeLimit(p.text, addBOS, limit)
		var tl *tokenizer.TooLongError
		switch {
		case errors.As(err, &tl):
			writeError(w, s.tooLong("prompt", tl))
			return
		case err != nil:
			writeError(w, badRequest("prompt", "prompt: tokenizing: %v", err))
			return
		}
		if ids == nil {
			ids = []int{}
		}
		tokens[i], counts[i] = ids, len(ids)
	}
	maxLen := s.cfg.ContextLen
	if maxLen == 0 {
		maxLen = -1
	}
	if !batch {
		writeJSON(w, http.StatusOK, map[string]any{"tokens": tokens[0], "count": counts[0], "max_model_len": maxLen})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"tokens": tokens, "count": counts, "max_model_len": maxLen})
}

type detokenizeRequest struct {
	Model             string          `json:"model"`
	Tokens            json.RawMessage `json:"tokens"`
	SkipSpecialTokens *bool           `json:"skip_special_tokens"`
}

// decoder is an optional Tokenizer method: the text of ids, special tokens skipped.
type decoder interface {
	Decode(ids []int) string
}

func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	var q detokenizeRequest
	if !s.readObject(w, r, &q) {
		return
	}
	if e := s.checkModel(q.Model); e != nil {
		writeError(w, e)
		return
	}
	if v := q.SkipSpecialTokens; v != nil && !*v {
		writeError(w, badRequest("skip_special_tokens", "skip_special_tokens false is not supported: special tokens are always skipped"))
		return
	}
	if jsonKind(q.Tokens) == "array" && len(elements(q.Tokens)) == 0 {
		writeJSON(w, http.StatusOK, map[string]any{"text": ""})
		return
	}
	ps, batch, e := decodePrompts("tokens", q.Tokens, promptIDs)
	if e != nil {
		writeError(w, e)
		return
	}
	if len(ps) > s.cfg.MaxBatch {
		writeError(w, badRequest("tokens", "%d lists: more than this server takes in one request (%d)", len(ps), s.cfg.MaxBatch))
		return
	}
	vocab := s.cfg.Tokenizer.VocabSize()
	texts := make([]string, len(ps))
	for i, p := range ps {
		for _, id := range p.ids {
			if id < 0 || (vocab > 0 && id >= vocab) {
				writeError(w, badRequest("tokens", "tokens: token id %d is outside the vocabulary [0, %d)", id, vocab))
				return
			}
		}
		texts[i] = s.decode(p.ids)
	}
	if !batch {
		writeJSON(w, http.StatusOK, map[string]any{"text": texts[0]})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"text": texts})
}

// decode is the tokenizer's Decode, or the tokens' texts joined.
func (s *Server) decode(ids []int) string {
	if d, ok := s.cfg.Tokenizer.(decoder); ok {
		return d.Decode(ids)
	}
	var b strings.Builder
	for _, id := range ids {
		b.WriteString(s.cfg.Tokenizer.TokenText(id))
	}
	return b.String()
}

// ErrAbortRequested is the cause of a request ended by POST /abort_request: it is
// answered with what it generated and finish_reason abort.
var ErrAbortRequested = errors.New("server: aborted by /abort_request")

// live are the generations running, by rid, for /abort_request.
type live struct {
	mu    sync.Mutex
	byRID map[string]map[*run]context.CancelCauseFunc
}

func (l *live) add(rid string, k *run, cancel context.CancelCauseFunc) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.byRID == nil {
		l.byRID = map[string]map[*run]context.CancelCauseFunc{}
	}
	m := l.byRID[rid]
	if m == nil {
		m = map[*run]context.CancelCauseFunc{}
		l.byRID[rid] = m
	}
	m[k] = cancel
}

func (l *live) remove(rid string, k *run) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if m := l.byRID[rid]; m != nil {
		delete(m, k)
		if len(m) == 0 {
			delete(l.byRID, rid)
		}
	}
}

// abort cancels the generations of rid (every one with all); it returns how many.
func (l *live) abort(rid string, all bool) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for r, m := range l.byRID {
		if all || r == rid {
			for _, cancel := range m {
				cancel(ErrAbortRequested)
				n++
			}
		}
	}
	return n
}

type abortRequest struct {
	RID      string `json:"rid"`
	AbortAll bool   `json:"abort_all"`
}

var abortExtras = fieldRules{"finished_reason": {info: true}, "abort_message": {info: true}}

func (*abortRequest) extraFields() fieldRules { return abortExtras }

// handleAbort is SGLang's POST /abort_request: {"rid": ...} or {"abort_all": true}.
func (s *Server) handleAbort(w http.ResponseWriter, r *http.Request) {
	var q abortRequest
	if !s.readObject(w, r, &q) {
		return
	}
	if q.RID == "" && !q.AbortAll {
		writeError(w, badRequest("rid", "rid is required (or abort_all)"))
		return
	}
	n := s.live.abort(q.RID, q.AbortAll)
	s.lg.Info("abort requested", zap.String("rid", q.RID), zap.Bool("all", q.AbortAll), zap.Int("aborted", n))
	writeJSON(w, http.StatusOK, map[string]any{"aborted": n})
}
