package etcd

import (
	"errors"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
)

func isLeaseNotFound(err error) bool {
	return errors.Is(err, rpctypes.ErrLeaseNotFound) || rpctypes.ErrorDesc(err) == rpctypes.ErrLeaseNotFound.Error()
}

// badValueError marks a stored value that does not decode: op passes it on
// as it is, not as a registry failure.
type badValueError struct{ err error }

func (e *badValueError) Error() string { return e.err.Error() }
func (e *badValueError) Unwrap() error { return e.err }
