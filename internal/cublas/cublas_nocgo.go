//go:build !cgo

package cublas

import "fmt"

func unavailable() error { return fmt.Errorf("%w: %w", ErrNoLibrary, ErrUnavailable) }

// Load fails without cgo.
func Load() (string, error) { return "", unavailable() }

// Create fails without cgo.
func Create() (*Handle, error) { return nil, unavailable() }

// Destroy is a no-op without cgo.
func (h *Handle) Destroy() error { return nil }

// SetStream fails without cgo.
func (h *Handle) SetStream(stream uintptr) error { return unavailable() }

// SetMathMode fails without cgo.
func (h *Handle) SetMathMode(m MathMode) error { return unavailable() }

// SetWorkspace fails without cgo.
func (h *Handle) SetWorkspace(p uint64, n uint64) error { return unavailable() }

// Version fails without cgo.
func (h *Handle) Version() (int, error) { return 0, unavailable() }

// GemmEx fails without cgo.
func (h *Handle) GemmEx(g *Gemm) error { return unavailable() }
