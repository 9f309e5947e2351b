package server

import (
	"errors"
	"fmt"
	"net/http"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/lb/voucher"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// VoucherPolicy says which requests a prefill or decode server serves. By
// default only the load balancer's: they carry the bootstrap fields
// (bootstrap_host, bootstrap_port, bootstrap_room) and, in the header
// voucher.Header, the LB's voucher for them made with the cluster secret.
// A null-mode server ignores it.
type VoucherPolicy struct {
	// Secret checks the vouchers; required unless AllowUnsigned.
	Secret auth.Secret
	// AllowUnsigned takes bootstrap fields without a voucher (another
	// router, such as SGLang's, in front; or no cluster secret). Anyone who
	// reaches the server can then make a decode server dial an address of
	// their choosing.
	AllowUnsigned bool
	// AllowDirect serves a request without bootstrap fields by computing it
	// whole, as a colocated server would; otherwise it gets 400 naming the
	// LB.
	AllowDirect bool
}

// ErrDirectRequest is the cause of the 400 a prefill or decode server
// answers to a request that did not come through a load balancer.
var ErrDirectRequest = errors.New("server: a request without bootstrap fields on a prefill or decode server")

// newVoucherChecker returns the checker a server of cfg's mode needs (nil:
// none), logging what the policy allows.
func newVoucherChecker(cfg *Config, lg *zap.Logger) *voucher.Checker {
	if cfg.Mode != ModePrefill && cfg.Mode != ModeDecode {
		return nil
	}
	if cfg.Vouchers.AllowDirect {
		lg.Warn("serving requests that did not come through the LB (--allow-direct-requests): they are computed here, whole")
	}
	if cfg.Vouchers.AllowUnsigned {
		lg.Warn("taking bootstrap fields without the LB's voucher (--allow-unsigned-bootstrap): anyone who reaches this port can choose the address a decode server dials and the room it joins")
		return nil
	}
	return voucher.NewChecker(cfg.Vouchers.Secret, 0)
}

// admit decides, before any disaggregation work, whether a prefill or
// decode server serves a request: bootstrap fields need a valid voucher in
// h, a request without them needs AllowDirect.
func (s *Server) admit(h http.Header, boot *Bootstrap, rid string) *Error {
	if s.cfg.Mode != ModePrefill && s.cfg.Mode != ModeDecode {
		return nil
	}
	if boot == nil {
		if s.cfg.Vouchers.AllowDirect {
			return nil
		}
		return &Error{Status: http.StatusBadRequest, Param: "bootstrap_room", Err: ErrDirectRequest,
			Message: fmt.Sprintf("this is a %s server: send requests to mooncake-go lb, which pairs it with a %s server and sets bootstrap_host, bootstrap_port and bootstrap_room (or start this server with --allow-direct-requests to serve them here)",
				s.cfg.Mode, map[string]string{ModePrefill: ModeDecode, ModeDecode: ModePrefill}[s.cfg.Mode])}
	}
	if s.vouchers == nil {
		return nil
	}
	err := s.vouchers.Check(h.Get(voucher.Header), voucher.Fields{Host: boot.Host, Port: boot.Port, Room: boot.Room})
	if err == nil {
		return nil
	}
	s.lg.Warn("bootstrap fields refused", zap.String("rid", rid), zap.Uint64("room", boot.Room), zap.Error(err))
	switch {
	case errors.Is(err, voucher.ErrBusy):
		return &Error{Status: http.StatusServiceUnavailable, Message: err.Error(), Err: err}
	case errors.Is(err, voucher.ErrMissing):
		return &Error{Status: http.StatusBadRequest, Param: "bootstrap_room", Err: err,
			Message: "bootstrap fields are set only by mooncake-go lb; this request has none of its vouchers (start this server with --allow-unsigned-bootstrap if another router fronts it)"}
	default:
		return &Error{Status: http.StatusBadRequest, Param: "bootstrap_room", Err: err,
			Message: "bootstrap fields are set only by mooncake-go lb; this request's voucher is not valid: " + err.Error()}
	}
}
