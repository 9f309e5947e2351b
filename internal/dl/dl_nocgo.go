//go:build !cgo

package dl

import "unsafe"

// Flags for Open (values of glibc's dlfcn.h).
const (
	RTLD_LAZY     = 0x1
	RTLD_NOW      = 0x2
	RTLD_GLOBAL   = 0x100
	RTLD_LOCAL    = 0
	RTLD_NODELETE = 0x1000
)

// Handle is an open shared library; without cgo none can be opened.
type Handle struct {
	Name  string
	Flags int
}

// Open always fails without cgo.
func Open(name string, flags int) (*Handle, error) {
	return nil, &Error{Op: "dlopen", Name: name, Msg: ErrUnavailable.Error()}
}

// OpenFirst always fails without cgo.
func OpenFirst(names []string, flags int) (*Handle, error) {
	n := ""
	if len(names) > 0 {
		n = names[0]
	}
	return Open(n, flags)
}

// Sym always fails without cgo.
func (h *Handle) Sym(name string) (unsafe.Pointer, error) {
	return nil, &Error{Op: "dlsym", Name: name, Msg: ErrUnavailable.Error()}
}

// Raw returns nil without cgo.
func (h *Handle) Raw() unsafe.Pointer { return nil }

// Close is a no-op without cgo.
func (h *Handle) Close() error { return nil }
