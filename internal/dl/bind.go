package dl

import (
	"errors"
	"fmt"
	"unsafe"
)

// Bind opens the first of names that loads, for the life of the process
// (RTLD_NOW|RTLD_NODELETE), and hands its raw handle to bind, which sets a
// binding's entry points and names the first symbol it lacks ("" when none
// is missing). A failure wraps unavailable with dlerror's text or the
// missing symbol. It returns the soname that loaded.
func Bind(names []string, unavailable error, bind func(raw unsafe.Pointer) (missing string)) (string, error) {
	h, err := OpenFirst(names, RTLD_NOW|RTLD_NODELETE)
	if err != nil {
		msg := err.Error()
		var de *Error
		if errors.As(err, &de) {
			msg = de.Msg
		}
		return "", fmt.Errorf("%w (%s)", unavailable, msg)
	}
	if miss := bind(h.Raw()); miss != "" {
		return "", fmt.Errorf("%w (%s: missing symbol %s)", unavailable, h.Name, miss)
	}
	return h.Name, nil
}
