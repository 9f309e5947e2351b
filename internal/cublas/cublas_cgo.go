//go:build cgo

package cublas

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <stddef.h>

typedef int st_t;
typedef void *hdl_t;

static st_t (*p_create)(hdl_t *);
static st_t (*p_destroy)(hdl_t);
static st_t (*p_set_stream)(hdl_t, void *);
static st_t (*p_set_math)(hdl_t, int);
static st_t (*p_get_version)(hdl_t, int *);
static st_t (*p_set_workspace)(hdl_t, void *, size_t);
static st_t (*p_gemm_ex)(hdl_t, int, int, int, int, int, const void *, const void *, int, int,
	const void *, int, int, const void *, void *, int, int, int, int);
static st_t (*p_gemm_sb)(hdl_t, int, int, int, int, int, const void *, const void *, int, int, long long,
	const void *, int, int, long long, const void *, void *, int, int, long long, int, int, int);

static const char *mc_cublas_bind(void *lib) {
#define B(v, n) do { *(void **)(&v) = dlsym(lib, n); if (!v) return n; } while (0)
	B(p_create, "cublasCreate_v2");
	B(p_destroy, "cublasDestroy_v2");
	B(p_set_stream, "cublasSetStream_v2");
	B(p_set_math, "cublasSetMathMode");
	B(p_get_version, "cublasGetVersion_v2");
	B(p_gemm_ex, "cublasGemmEx");
	B(p_gemm_sb, "cublasGemmStridedBatchedEx");
	*(void **)(&p_set_workspace) = dlsym(lib, "cublasSetWorkspace_v2");
#undef B
	return 0;
}

static st_t mc_create(uintptr_t *h) { hdl_t x = 0; st_t s = p_create(&x); *h = (uintptr_t)x; return s; }
static st_t mc_destroy(uintptr_t h) { return p_destroy((hdl_t)h); }
static st_t mc_set_stream(uintptr_t h, uintptr_t s) { return p_set_stream((hdl_t)h, (void *)s); }
static st_t mc_set_math(uintptr_t h, int m) { return p_set_math((hdl_t)h, m); }
static st_t mc_version(uintptr_t h, int *v) { return p_get_version((hdl_t)h, v); }
static st_t mc_set_workspace(uintptr_t h, uint64_t p, size_t n) {
	if (!p_set_workspace) return 15;
	return p_set_workspace((hdl_t)h, (void *)(uintptr_t)p, n);
}
static st_t mc_gemm(uintptr_t h, int ta, int tb, int m, int n, int k, float alpha,
	uint64_t a, int at, int lda, uint64_t b, int bt, int ldb, float beta,
	uint64_t c, int ct, int ldc, int compute, int algo) {
	return p_gemm_ex((hdl_t)h, ta, tb, m, n, k, &alpha, (const void *)(uintptr_t)a, at, lda,
		(const void *)(uintptr_t)b, bt, ldb, &beta, (void *)(uintptr_t)c, ct, ldc, compute, algo);
}
static st_t mc_gemm_sb(uintptr_t h, int ta, int tb, int m, int n, int k, float alpha,
	uint64_t a, int at, int lda, long long sa, uint64_t b, int bt, int ldb, long long sb, float beta,
	uint64_t c, int ct, int ldc, long long sc, int batch, int compute, int algo) {
	return p_gemm_sb((hdl_t)h, ta, tb, m, n, k, &alpha, (const void *)(uintptr_t)a, at, lda, sa,
		(const void *)(uintptr_t)b, bt, ldb, sb, &beta, (void *)(uintptr_t)c, ct, ldc, sc, batch, compute, algo);
}
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

var lib struct {
	once sync.Once
	name string
	err  error
}

// Load loads libcublas (once per process) and reports the soname used.
func Load() (string, error) {
	lib.once.Do(func() {
		lib.name, lib.err = dl.Bind(Libraries, ErrNoLibrary, func(raw unsafe.Pointer) string {
			if miss := C.mc_cublas_bind(raw); miss != nil {
				return C.GoString(miss)
			}
			return ""
		})
	})
	return lib.name, lib.err
}

// Create makes a handle in the calling thread's current context.
func Create() (*Handle, error) {
	if _, err := Load(); err != nil {
		return nil, err
	}
	var h C.uintptr_t
	if err := check("cublasCreate", Status(C.mc_create(&h))); err != nil {
		return nil, err
	}
	return &Handle{h: uintptr(h)}, nil
}

// Destroy releases the handle.
func (h *Handle) Destroy() error {
	if h == nil || h.h == 0 {
		return nil
	}
	x := h.h
	h.h = 0
	return check("cublasDestroy", Status(C.mc_destroy(C.uintptr_t(x))))
}

// SetStream sets the CUstream (raw handle; 0 is the legacy default stream).
func (h *Handle) SetStream(stream uintptr) error {
	return check("cublasSetStream", Status(C.mc_set_stream(C.uintptr_t(h.h), C.uintptr_t(stream))))
}

// SetMathMode sets the math mode (DefaultMath disables TF32 for fp32 GEMMs).
func (h *Handle) SetMathMode(m MathMode) error {
	return check("cublasSetMathMode", Status(C.mc_set_math(C.uintptr_t(h.h), C.int(m))))
}

// SetWorkspace gives cuBLAS a device workspace of n bytes at p.
func (h *Handle) SetWorkspace(p uint64, n uint64) error {
	return check("cublasSetWorkspace", Status(C.mc_set_workspace(C.uintptr_t(h.h), C.uint64_t(p), C.size_t(n))))
}

// Version is cuBLAS's version (major*10000 + minor*100 + patch).
func (h *Handle) Version() (int, error) {
	var v C.int
	err := check("cublasGetVersion", Status(C.mc_version(C.uintptr_t(h.h), &v)))
	return int(v), err
}

// GemmEx runs g with cublasGemmEx, or cublasGemmStridedBatchedEx when
// g.Batch > 1. Alpha and beta are host fp32 values (fp32 compute types).
func (h *Handle) GemmEx(g *Gemm) error {
	if g.Batch > 1 {
		return check("cublasGemmStridedBatchedEx", Status(C.mc_gemm_sb(C.uintptr_t(h.h), C.int(g.TransA), C.int(g.TransB),
			C.int(g.M), C.int(g.N), C.int(g.K), C.float(g.Alpha),
			C.uint64_t(g.A), C.int(g.AType), C.int(g.LDA), C.longlong(g.StrideA),
			C.uint64_t(g.B), C.int(g.BType), C.int(g.LDB), C.longlong(g.StrideB), C.float(g.Beta),
			C.uint64_t(g.C), C.int(g.CType), C.int(g.LDC), C.longlong(g.StrideC), C.int(g.Batch),
			C.int(g.Compute), C.int(GemmDefault))))
	}
	return check("cublasGemmEx", Status(C.mc_gemm(C.uintptr_t(h.h), C.int(g.TransA), C.int(g.TransB),
		C.int(g.M), C.int(g.N), C.int(g.K), C.float(g.Alpha),
		C.uint64_t(g.A), C.int(g.AType), C.int(g.LDA),
		C.uint64_t(g.B), C.int(g.BType), C.int(g.LDB), C.float(g.Beta),
		C.uint64_t(g.C), C.int(g.CType), C.int(g.LDC), C.int(g.Compute), C.int(GemmDefault))))
}
