//go:build !cgo

package ibv

import (
	"fmt"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

type provider struct{}

func (provider) Devices() ([]string, error)        { return nil, unavailable() }
func (provider) Open(string) (verbs.Device, error) { return nil, unavailable() }

func unavailable() error { return fmt.Errorf("%w (built without cgo)", verbs.ErrUnavailable) }

// Load fails without cgo.
func Load() (string, error) { return "", unavailable() }

// Provider fails without cgo.
func Provider() (verbs.Provider, error) { return nil, unavailable() }
