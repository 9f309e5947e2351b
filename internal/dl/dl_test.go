package dl

import (
	"errors"
	"strings"
	"testing"
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
