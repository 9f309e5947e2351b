package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/mooncake-go/mooncake-go/internal/engine"
)

// statusClientClosed is the status logged (never sent) for a request whose
// client went away (nginx's convention).
const statusClientClosed = 499

// Error is an HTTP error: a status and the message of the OpenAI-style body
// {"error": {"message", "type", "code"}}. PrepareDisagg may return one to
// pick the status.
type Error struct {
	Status  int    // HTTP status
	Message string // for the client
	Param   string // the offending request field, if known
	Err     error  // cause, for errors.Is/As; may be nil
}

func (e *Error) Error() string { return e.Message }
func (e *Error) Unwrap() error { return e.Err }

func errorf(status int, format string, args ...any) *Error {
	return &Error{Status: status, Message: fmt.Sprintf(format, args...)}
}

func badRequest(param, format string, args ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Param: param, Message: fmt.Sprintf(format, args...)}
}

// errorType is the OpenAI "type" of an error with this status.
func errorType(status int) string {
	switch {
	case status == http.StatusUnauthorized:
		return "authentication_error"
	case status == http.StatusNotFound:
		return "not_found_error"
	case status == http.StatusServiceUnavailable:
		return "service_unavailable_error"
	case status >= 500:
		return "internal_server_error"
	default:
		return "invalid_request_error"
	}
}

// errorBody is {"error": {...}}, both as an HTTP body and as an SSE event.
type errorBody struct {
	Error errorObject `json:"error"`
}

type errorObject struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

func (e *Error) body() errorBody {
	o := errorObject{Message: e.Message, Type: errorType(e.Status), Code: e.Status}
	if e.Param != "" {
		p := e.Param
		o.Param = &p
	}
	return errorBody{Error: o}
}

// retryAfter is the Retry-After of a 503 (overloaded, not ready), in seconds.
const retryAfter = "1"

func writeError(w http.ResponseWriter, e *Error) {
	b, _ := json.Marshal(e.body())
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Set("X-Content-Type-Options", "nosniff")
	if e.Status == http.StatusServiceUnavailable {
		h.Set("Retry-After", retryAfter)
	}
	w.WriteHeader(e.Status)
	_, _ = w.Write(append(b, '\n'))
}

// StatusError is an error that knows its HTTP status (disaggregation's
// RoomError does).
type StatusError interface {
	error
	HTTPStatus() int
}

// asError classifies an error from Submit, PrepareDisagg or a request's
// abort into an HTTP error.
func asError(err error) *Error {
	var he *Error
	var se StatusError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &he):
		return he
	case errors.As(err, &se):
		return &Error{Status: se.HTTPStatus(), Message: err.Error(), Err: err}
	case errors.Is(err, engine.ErrBadRequest), errors.Is(err, engine.ErrPromptTooLong):
		return &Error{Status: http.StatusBadRequest, Message: err.Error(), Err: err}
	case errors.Is(err, engine.ErrOverloaded), errors.Is(err, engine.ErrQueueTimeout):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Err: err}
	case errors.Is(err, engine.ErrClosed):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Err: err}
	case errors.Is(err, context.Canceled):
		return &Error{Status: statusClientClosed, Message: err.Error(), Err: err}
	case errors.Is(err, context.DeadlineExceeded):
		return &Error{Status: http.StatusGatewayTimeout, Message: err.Error(), Err: err}
	default:
		return &Error{Status: http.StatusInternalServerError, Message: err.Error(), Err: err}
	}
}
