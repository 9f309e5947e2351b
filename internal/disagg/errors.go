package disagg

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/mooncake-go/mooncake-go/internal/engine"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// Errors a room's failure may wrap, for errors.Is.
var (
	ErrKVTimeout          = errors.New("disagg: KV wait timed out")
	ErrPoolFull           = errors.New("disagg: decode KV pool stayed full")
	ErrPrefillUnreachable = errors.New("disagg: prefill server unreachable")
	ErrDecodeClosing      = errors.New("disagg: decode server shutting down")
	ErrAuth               = errors.New("disagg: bootstrap peer failed authentication")
)

// Reason is why a room failed: the label of mooncake_disagg_failures_total
// and what picks the HTTP status. The set is closed.
type Reason string

const (
	ReasonBootstrapTimeout Reason = "bootstrap_timeout" // the other half of the room did not come in time
	ReasonKVTimeout        Reason = "kv_timeout"        // decode: the KV did not arrive in time
	ReasonPoolFull         Reason = "pool_full"         // decode: no pages within the queue bound
	ReasonPeerDead         Reason = "peer_dead"         // the other server is gone or restarted
	ReasonAuth             Reason = "auth"              // the other server does not hold the cluster secret
	ReasonMismatch         Reason = "mismatch"          // the servers disagree on model, layout or tokens
	ReasonTransfer         Reason = "transfer"          // a KV transfer or its notification failed
	ReasonBounds           Reason = "bounds"            // a transfer was refused by the bounds checks
	ReasonPrefill          Reason = "prefill"           // the prefill's compute failed
	ReasonCanceled         Reason = "canceled"          // the client or the other side gave up
	ReasonShutdown         Reason = "shutdown"          // a server is shutting down
	ReasonRefused          Reason = "refused"           // the prefill refused the room (a duplicate, a bad registration)
	ReasonInvalid          Reason = "invalid"           // the request itself cannot be served (too long for the pool)
	ReasonOverloaded       Reason = "overloaded"        // a server's admission queue was full or its wait bound passed
	ReasonBadDescriptor    Reason = "bad_descriptor"    // the peer's registry entry failed its seal check
)

// RoomError is a room's failure: its room, its Reason, and the cause.
type RoomError struct {
	Room   uint64
	Reason Reason
	Err    error
}

func (e *RoomError) Error() string {
	return fmt.Sprintf("room %d: %s: %v", e.Room, e.Reason, e.Err)
}

func (e *RoomError) Unwrap() error { return e.Err }

// HTTPStatus is the status a server answers with when this failure ends
// a request.
func (e *RoomError) HTTPStatus() int {
	switch e.Reason {
	case ReasonKVTimeout, ReasonBootstrapTimeout:
		return http.StatusGatewayTimeout
	case ReasonPoolFull, ReasonShutdown, ReasonOverloaded:
		return http.StatusServiceUnavailable
	case ReasonCanceled:
		return 499 // the client went away; logged, never sent
	case ReasonInvalid:
		return http.StatusBadRequest
	}
	return http.StatusBadGateway
}

// roomErr makes a RoomError; an err that already is one keeps its reason
// (and gets the room if it had none).
func roomErr(room uint64, reason Reason, err error) *RoomError {
	var re *RoomError
	if errors.As(err, &re) {
		if re.Room == 0 {
			return &RoomError{Room: room, Reason: re.Reason, Err: re.Err}
		}
		return re
	}
	return &RoomError{Room: room, Reason: reason, Err: err}
}

// reasonOf is the Reason of err: the RoomError's, else the one its
// transfer-engine sentinel implies, else fallback.
func reasonOf(err error, fallback Reason) Reason {
	var re *RoomError
	switch {
	case errors.As(err, &re):
		return re.Reason
	case errors.Is(err, transfer.ErrBadDescriptor):
		return ReasonBadDescriptor
	case errors.Is(err, transfer.ErrAuth), errors.Is(err, ErrAuth):
		return ReasonAuth
	case errors.Is(err, transfer.ErrOutOfBounds), errors.Is(err, transfer.ErrAccessDenied):
		return ReasonBounds
	case errors.Is(err, transfer.ErrPeerDead), errors.Is(err, transfer.ErrPeerRestarted), errors.Is(err, ErrPrefillUnreachable):
		return ReasonPeerDead
	case errors.Is(err, transfer.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return ReasonTransfer
	case errors.Is(err, context.Canceled):
		return ReasonCanceled
	case errors.Is(err, engine.ErrOverloaded), errors.Is(err, engine.ErrQueueTimeout):
		return ReasonOverloaded
	case errors.Is(err, engine.ErrBadRequest), errors.Is(err, engine.ErrPromptTooLong):
		return ReasonInvalid
	}
	return fallback
}

// knownReason maps a Reason that came over the wire back into the closed
// set (an unknown one from a newer peer becomes ReasonTransfer).
func knownReason(r Reason) Reason {
	switch r {
	case ReasonBootstrapTimeout, ReasonKVTimeout, ReasonPoolFull, ReasonPeerDead, ReasonAuth, ReasonMismatch,
		ReasonTransfer, ReasonBounds, ReasonPrefill, ReasonCanceled, ReasonShutdown, ReasonRefused, ReasonInvalid, ReasonOverloaded, ReasonBadDescriptor:
		return r
	}
	return ReasonTransfer
}
