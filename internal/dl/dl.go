//go:build cgo

// Package dl opens shared libraries at run time (dlopen/dlsym), so that a
// binary built on a machine without a vendor library still builds and runs
// there, and fails with a clear error only when the library is used.
//
// dlerror keeps its message in thread-local storage, so every call that may
// read it runs with the goroutine locked to its OS thread.
package dl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdlib.h>
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// Flags for Open, as in dlfcn.h.
const (
	RTLD_LAZY     = int(C.RTLD_LAZY)
	RTLD_NOW      = int(C.RTLD_NOW)
	RTLD_GLOBAL   = int(C.RTLD_GLOBAL)
	RTLD_LOCAL    = int(C.RTLD_LOCAL)
	RTLD_NODELETE = int(C.RTLD_NODELETE)
)

// Handle is an open shared library.
type Handle struct {
	Name  string
	Flags int
	h     unsafe.Pointer
}

// Open loads the library name with dlopen. The error carries dlerror's text.
func Open(name string, flags int) (*Handle, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	C.dlerror() // clear a stale message
	h := C.dlopen(cname, C.int(flags))
	if h == nil {
		return nil, &Error{Op: "dlopen", Name: name, Msg: lastError()}
	}
	return &Handle{Name: name, Flags: flags, h: h}, nil
}

// OpenFirst tries each name in turn and returns the first that opens. The
// error lists every attempt.
func OpenFirst(names []string, flags int) (*Handle, error) {
	var errs []string
	for _, n := range names {
		h, err := Open(n, flags)
		if err == nil {
			return h, nil
		}
		var e *Error
		if ok := asError(err, &e); ok {
			errs = append(errs, e.Msg)
		} else {
			errs = append(errs, err.Error())
		}
	}
	if len(names) == 0 {
		return nil, &Error{Op: "dlopen", Msg: "no library names given"}
	}
	return nil, &Error{Op: "dlopen", Name: names[0], Msg: joinMsgs(errs)}
}

// Sym looks up a symbol. A missing symbol is an error, never a nil pointer.
func (h *Handle) Sym(name string) (unsafe.Pointer, error) {
	if h == nil || h.h == nil {
		return nil, &Error{Op: "dlsym", Name: name, Msg: "library not open"}
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	C.dlerror()
	p := C.dlsym(h.h, cname)
	if msg := lastError(); msg != "" {
		return nil, &Error{Op: "dlsym", Name: name, Msg: msg}
	}
	if p == nil {
		return nil, &Error{Op: "dlsym", Name: name, Msg: fmt.Sprintf("symbol %s resolves to NULL", name)}
	}
	return p, nil
}

// Raw returns the dlopen handle, for C code that resolves its own symbols.
func (h *Handle) Raw() unsafe.Pointer {
	if h == nil {
		return nil
	}
	return h.h
}

// Close unloads the library (dlclose).
func (h *Handle) Close() error {
	if h == nil || h.h == nil {
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	C.dlerror()
	if C.dlclose(h.h) != 0 {
		return &Error{Op: "dlclose", Name: h.Name, Msg: lastError()}
	}
	h.h = nil
	return nil
}

// lastError must run on a locked OS thread.
func lastError() string {
	p := C.dlerror()
	if p == nil {
		return ""
	}
	return C.GoString(p)
}
