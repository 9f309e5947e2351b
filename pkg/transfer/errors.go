package transfer

import (
	"errors"
	"fmt"
)

// Sentinel errors. Wrapped errors keep them reachable through errors.Is.
var (
	ErrClosed          = errors.New("transfer: engine closed")
	ErrSegmentNotFound = errors.New("transfer: segment not found")
	ErrOutOfBounds     = errors.New("transfer: address range not inside a registered region")
	ErrAccessDenied    = errors.New("transfer: access denied")
	ErrNoTransport     = errors.New("transfer: no transport can serve this request")
	ErrPeerDead        = errors.New("transfer: peer is not alive")
	ErrPeerRestarted   = errors.New("transfer: peer restarted (new incarnation)")
	ErrTimeout         = errors.New("transfer: timed out")
	// ErrAuth: a peer (or this side) does not hold the cluster secret the
	// other side requires, or one side runs without authentication.
	ErrAuth = errors.New("transfer: authentication failed")
	// ErrBadDescriptor: a descriptor does not decode, is not valid, or is
	// not sealed with this cluster secret (see DescriptorError).
	ErrBadDescriptor  = errors.New("transfer: bad descriptor")
	ErrRegistry       = errors.New("transfer: registry unreachable")
	ErrCannotRegister = errors.New("transfer: no transport can serve this region")
	ErrRegionInUse    = errors.New("transfer: region still in use by transfers")
)

// OpError describes a failed operation on a segment.
type OpError struct {
	Op        string // "write", "read", "open", "notify", "probe", "register"
	Segment   string
	Transport string
	Err       error
}

func (e *OpError) Error() string {
	s := "transfer: " + e.Op
	if e.Segment != "" {
		s += " " + e.Segment
	}
	if e.Transport != "" {
		s += " via " + e.Transport
	}
	return s + ": " + e.Err.Error()
}

func (e *OpError) Unwrap() error { return e.Err }

// DescriptorError is a descriptor that failed to decode, to validate or its
// seal check. It wraps ErrBadDescriptor and the reason.
type DescriptorError struct {
	// Key is where the descriptor came from: a registry key
	// ("mooncake/ram/host:port"), or "handshake with host:port".
	Key string
	Err error
}

func (e *DescriptorError) Error() string {
	return fmt.Sprintf("%v at %s: %v", ErrBadDescriptor, e.Key, e.Err)
}

func (e *DescriptorError) Unwrap() []error { return []error{ErrBadDescriptor, e.Err} }

// RangeError names an address range a check refused.
type RangeError struct {
	Addr, Len uint64
	Err       error // ErrOutOfBounds or ErrAccessDenied
	Detail    string
}

func (e *RangeError) Error() string {
	end := e.Addr + e.Len
	s := fmt.Sprintf("%v: [%#x, %#x) (%d bytes)", e.Err, e.Addr, end, e.Len)
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

func (e *RangeError) Unwrap() error { return e.Err }
