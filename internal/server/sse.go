package server

import (
	"encoding/json"
	"net/http"
)

// sse writes server-sent events: `data: <json>\n\n` per event, flushed at
// once. Write errors are sticky: after one, every call does nothing (the
// client is gone; the request context aborts the generation).
type sse struct {
	w   http.ResponseWriter
	rc  *http.ResponseController
	err error
}

func startSSE(w http.ResponseWriter) *sse {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	s.flush()
	return s
}

func (s *sse) flush() {
	if s.err == nil {
		if err := s.rc.Flush(); err != nil && err != http.ErrNotSupported {
			s.err = err
		}
	}
}

func (s *sse) raw(data []byte) {
	if s.err != nil {
		return
	}
	buf := make([]byte, 0, len(data)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, '\n', '\n')
	if _, err := s.w.Write(buf); err != nil {
		s.err = err
		return
	}
	s.flush()
}

// event writes one JSON event.
func (s *sse) event(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		s.err = err
		return
	}
	s.raw(b)
}

// done ends a successful stream.
func (s *sse) done() { s.raw([]byte("[DONE]")) }

// fail ends a stream with an error event and no [DONE].
func (s *sse) fail(e *Error) { s.event(e.body()) }
