//go:build cgo

package cuda

/*
#cgo CFLAGS: -I${SRCDIR}/../../csrc
#include <stdlib.h>
#include "nvrtc_shim.h"
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

func bindNVRTC(lib *dl.Handle) error {
	var missing [128]C.char
	if C.mc_nvrtc_bind(lib.Raw(), &missing[0], C.int(len(missing))) != 0 {
		return fmt.Errorf("%w (%s: missing symbol %s)", ErrNoNVRTC, lib.Name, C.GoString(&missing[0]))
	}
	return nil
}

func nvrtcErr(op string, code C.nvrtcResult, log string) error {
	if code == 0 {
		return nil
	}
	msg := "symbol not found"
	if p := C.mc_nvrtcGetErrorString(code); p != nil {
		msg = C.GoString(p)
	}
	return &NVRTCError{Op: op, Code: int(code), Msg: msg, Log: log}
}

func nvrtcVersion() (int, int, error) {
	var a, b C.int
	if err := nvrtcErr("nvrtcVersion", C.mc_nvrtcVersion(&a, &b), ""); err != nil {
		return 0, 0, err
	}
	return int(a), int(b), nil
}

// nvrtcCompile compiles src; cubin selects nvrtcGetCUBIN over nvrtcGetPTX.
func nvrtcCompile(src, name string, opts []string, cubin bool) (out []byte, log string, err error) {
	csrc := C.CString(src)
	defer C.free(unsafe.Pointer(csrc))
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	var prog C.nvrtcProgram
	if err := nvrtcErr("nvrtcCreateProgram", C.mc_nvrtcCreateProgram(&prog, csrc, cname), ""); err != nil {
		return nil, "", err
	}
	defer C.mc_nvrtcDestroyProgram(&prog)

	copts := make([]*C.char, len(opts))
	for i, o := range opts {
		copts[i] = C.CString(o)
	}
	defer func() {
		for _, p := range copts {
			C.free(unsafe.Pointer(p))
		}
	}()
	var optp **C.char
	if len(copts) > 0 {
		// The array holds C pointers only, so it may live in C memory.
		arr := (**C.char)(C.malloc(C.size_t(len(copts)) * C.size_t(unsafe.Sizeof(uintptr(0)))))
		defer C.free(unsafe.Pointer(arr))
		s := unsafe.Slice(arr, len(copts))
		copy(s, copts)
		optp = arr
	}
	cres := C.mc_nvrtcCompileProgram(prog, C.int(len(copts)), optp)

	var lsz C.size_t
	if C.mc_nvrtcGetProgramLogSize(prog, &lsz) == 0 && lsz > 1 {
		lb := make([]byte, lsz)
		if C.mc_nvrtcGetProgramLog(prog, (*C.char)(unsafe.Pointer(&lb[0]))) == 0 {
			log = string(lb[:lsz-1])
		}
	}
	if err := nvrtcErr("nvrtcCompileProgram", cres, log); err != nil {
		return nil, log, err
	}
	var sz C.size_t
	if cubin {
		if err := nvrtcErr("nvrtcGetCUBINSize", C.mc_nvrtcGetCUBINSize(prog, &sz), ""); err != nil {
			return nil, log, err
		}
		out = make([]byte, sz)
		if sz > 0 {
			if err := nvrtcErr("nvrtcGetCUBIN", C.mc_nvrtcGetCUBIN(prog, (*C.char)(unsafe.Pointer(&out[0]))), ""); err != nil {
				return nil, log, err
			}
		}
	} else {
		if err := nvrtcErr("nvrtcGetPTXSize", C.mc_nvrtcGetPTXSize(prog, &sz), ""); err != nil {
			return nil, log, err
		}
		out = make([]byte, sz)
		if sz > 0 {
			if err := nvrtcErr("nvrtcGetPTX", C.mc_nvrtcGetPTX(prog, (*C.char)(unsafe.Pointer(&out[0]))), ""); err != nil {
				return nil, log, err
			}
		}
		// drop the terminating NUL
		for len(out) > 0 && out[len(out)-1] == 0 {
			out = out[:len(out)-1]
		}
	}
	return out, log, nil
}
