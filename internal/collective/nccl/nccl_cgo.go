//go:build cgo

package nccl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>

// The few NCCL types and entry points used, declared here (no nccl.h).
typedef int nres_t;    // ncclResult_t
typedef void *ncomm_t; // ncclComm_t

static nres_t (*p_get_version)(int *);
static nres_t (*p_init_all)(ncomm_t *, int, const int *);
static nres_t (*p_destroy)(ncomm_t);
static nres_t (*p_abort)(ncomm_t);
static const char *(*p_error_string)(nres_t);
static nres_t (*p_all_reduce)(const void *, void *, size_t, int, int, ncomm_t, void *);
static nres_t (*p_all_gather)(const void *, void *, size_t, int, ncomm_t, void *);
static nres_t (*p_broadcast)(const void *, void *, size_t, int, int, ncomm_t, void *);

static const char *mc_nccl_bind(void *lib) {
#define B(v, n) do { *(void **)(&v) = dlsym(lib, n); if (!v) return n; } while (0)
	B(p_get_version, "ncclGetVersion");
	B(p_init_all, "ncclCommInitAll");
	B(p_destroy, "ncclCommDestroy");
	B(p_abort, "ncclCommAbort");
	B(p_error_string, "ncclGetErrorString");
	B(p_all_reduce, "ncclAllReduce");
	B(p_all_gather, "ncclAllGather");
	B(p_broadcast, "ncclBroadcast");
#undef B
	return 0;
}

static nres_t mc_version(int *v) { return p_get_version(v); }
static nres_t mc_init_all(uintptr_t *out, int n, const int *devs) {
	ncomm_t cs[64];
	if (n > 64) return 4; // ncclInvalidArgument
	nres_t r = p_init_all(cs, n, devs);
	for (int i = 0; i < n; i++) out[i] = r == 0 ? (uintptr_t)cs[i] : 0;
	return r;
}
static nres_t mc_destroy(uintptr_t c) { return p_destroy((ncomm_t)c); }
static nres_t mc_abort(uintptr_t c) { return p_abort((ncomm_t)c); }
static const char *mc_error_string(nres_t r) { return p_error_string ? p_error_string(r) : 0; }
static nres_t mc_all_reduce(uintptr_t s, uintptr_t d, size_t n, int dt, int op, uintptr_t c, uintptr_t st) {
	return p_all_reduce((const void *)s, (void *)d, n, dt, op, (ncomm_t)c, (void *)st);
}
static nres_t mc_all_gather(uintptr_t s, uintptr_t d, size_t n, int dt, uintptr_t c, uintptr_t st) {
	return p_all_gather((const void *)s, (void *)d, n, dt, (ncomm_t)c, (void *)st);
}
static nres_t mc_broadcast(uintptr_t b, size_t n, int dt, int root, uintptr_t c, uintptr_t st) {
	return p_broadcast((const void *)b, (void *)b, n, dt, root, (ncomm_t)c, (void *)st);
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

var lib struct {
	once sync.Once
	name string
	err  error
	// bound: the entry points are set (errorString may call them).
	bound bool
}

// Load loads libnccl (once per process) and reports the soname used.
func Load() (string, error) {
	lib.once.Do(func() {
		lib.name, lib.err = dl.Bind(Libraries, ErrNoLibrary, func(raw unsafe.Pointer) string {
			if miss := C.mc_nccl_bind(raw); miss != nil {
				return C.GoString(miss)
			}
			return ""
		})
		lib.bound = lib.err == nil
	})
	return lib.name, lib.err
}

func errorString(r Result) string {
	if !lib.bound {
		return ""
	}
	if p := C.mc_error_string(C.nres_t(r)); p != nil {
		return C.GoString(p)
	}
	return ""
}

func version() (int, error) {
	var v C.int
	err := check("ncclGetVersion", Result(C.mc_version(&v)))
	return int(v), err
}

func initAll(devs []int) ([]uintptr, error) {
	if len(devs) > 64 {
		return nil, fmt.Errorf("nccl: %d devices (at most 64)", len(devs))
	}
	cd := make([]C.int, len(devs))
	for i, d := range devs {
		cd[i] = C.int(d)
	}
	out := make([]C.uintptr_t, len(devs))
	// ncclCommInitAll sets the calling thread's current device.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := check("ncclCommInitAll", Result(C.mc_init_all(&out[0], C.int(len(devs)), &cd[0]))); err != nil {
		return nil, err
	}
	hs := make([]uintptr, len(out))
	for i, h := range out {
		hs[i] = uintptr(h)
	}
	return hs, nil
}

func destroy(h uintptr) Result { return Result(C.mc_destroy(C.uintptr_t(h))) }

func abort(h uintptr) Result { return Result(C.mc_abort(C.uintptr_t(h))) }

func allReduce(send, recv uintptr, n int, h, stream uintptr) Result {
	return Result(C.mc_all_reduce(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(n), typeFloat32, opSum, C.uintptr_t(h), C.uintptr_t(stream)))
}

func allGather(send, recv uintptr, n int, h, stream uintptr) Result {
	return Result(C.mc_all_gather(C.uintptr_t(send), C.uintptr_t(recv), C.size_t(n), typeFloat32, C.uintptr_t(h), C.uintptr_t(stream)))
}

func broadcast(b uintptr, n, root int, h, stream uintptr) Result {
	return Result(C.mc_broadcast(C.uintptr_t(b), C.size_t(n), typeFloat32, C.int(root), C.uintptr_t(h), C.uintptr_t(stream)))
}
