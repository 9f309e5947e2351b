package dl

import (
	"errors"
	"strings"
	"testing"
	"unsafe"
)

func TestOpenMissing(t *testing.T) {
	_, err := Open("libdoes-not-exist-mooncake.so.9", RTLD_NOW)
	if err == nil {
		t.Fatal("opening a missing library succeeded")
	}
	var e *Error
	if !errors.As(err, &e) || e.Op != "dlopen" || e.Msg == "" {
		t.Fatalf("want *dl.Error with dlerror text, got %#v", err)
	}
	if !strings.Contains(err.Error(), "libdoes-not-exist-mooncake.so.9") {
		t.Fatalf("error does not name the library: %v", err)
	}
}

func TestOpenLibcAndSym(t *testing.T) {
	h, err := OpenFirst([]string{"libdoes-not-exist.so", "libc.so.6"}, RTLD_NOW)
	if err != nil {
		if errors.Is(err, ErrUnavailable) || strings.Contains(err.Error(), "without cgo") {
			t.Skipf("no dlopen: %v", err)
		}
		t.Fatalf("OpenFirst libc: %v", err)
	}
	defer h.Close()
	if p, err := h.Sym("malloc"); err != nil || p == nil {
		t.Fatalf("Sym(malloc) = %v, %v", p, err)
	}
	if _, err := h.Sym("mooncake_no_such_symbol"); err == nil {
		t.Fatal("Sym of a missing symbol succeeded")
	}
}

// TestBind: a library that does not load and a binding that lacks a symbol
// both fail wrapping the caller's error, naming why; a full binding gets
// the soname.
func TestBind(t *testing.T) {
	errNone := errors.New("no libx")
	ok := func(unsafe.Pointer) string { return "" }
	if _, err := Bind([]string{"libdoes-not-exist-mooncake.so.9"}, errNone, ok); !errors.Is(err, errNone) {
		t.Fatalf("missing library: %v", err)
	}
	name, err := Bind([]string{"libc.so.6"}, errNone, ok)
	if errors.Is(err, ErrUnavailable) || (err != nil && strings.Contains(err.Error(), "without cgo")) {
		t.Skipf("no dlopen: %v", err)
	}
	if err != nil || name != "libc.so.6" {
		t.Fatalf("libc: %q %v", name, err)
	}
	var got unsafe.Pointer
	_, err = Bind([]string{"libc.so.6"}, errNone, func(raw unsafe.Pointer) string { got = raw; return "mc_nothing" })
	if !errors.Is(err, errNone) || !strings.Contains(err.Error(), "libc.so.6: missing symbol mc_nothing") || got == nil {
		t.Fatalf("missing symbol: %v (handle %v)", err, got)
	}
}
