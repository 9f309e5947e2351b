// Package ibv is the real verbs.Provider: libibverbs.so.1 loaded at run
// time with dlopen, its few types declared here (no verbs.h), so one binary
// builds everywhere and fails with a clear error where the library or a
// device is missing. Without cgo every call fails with ErrUnavailable.
//
// ibv_post_send and ibv_poll_cq are inline functions in verbs.h that call
// through the context's ops table; the wrappers do the same.
package ibv

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

// Libraries are the sonames tried, in order.
var Libraries = []string{"libibverbs.so.1", "libibverbs.so"}

// Error is a failed verbs call: the call and errno's text.
type Error struct {
	Call  string
	Errno error
}

func (e *Error) Error() string { return fmt.Sprintf("ibv: %s: %v", e.Call, e.Errno) }
func (e *Error) Unwrap() error { return e.Errno }

// modify masks (ibv_qp_attr_mask)
const (
	maskState          = 1 << 0
	maskAccessFlags    = 1 << 3
	maskPkeyIndex      = 1 << 4
	maskPort           = 1 << 5
	maskAV             = 1 << 7
	maskPathMTU        = 1 << 8
	maskTimeout        = 1 << 9
	maskRetryCnt       = 1 << 10
	maskRNRRetry       = 1 << 11
	maskRQPSN          = 1 << 12
	maskMaxQPRdAtomic  = 1 << 13
	maskMinRNRTimer    = 1 << 15
	maskSQPSN          = 1 << 16
	maskMaxDestRdAtomc = 1 << 17
	maskDestQPN        = 1 << 20
)

var _ verbs.Provider = (*provider)(nil)
