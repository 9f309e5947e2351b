// Package cublas binds the parts of cuBLAS that the CUDA model backend uses
// (handles, streams, math mode, cublasGemmEx and its strided-batched form),
// loading libcublas.so.13 with dlopen at run time, so a binary built without
// the CUDA toolkit still builds and runs; every entry point then returns an
// error wrapping ErrNoLibrary.
//
// cuBLAS runs in the calling OS thread's current CUDA context (the device's
// primary context): lock the goroutine to its thread and make the context
// current (cuda.Context.SetCurrent) before calling into this package.
package cublas

import (
	"errors"
	"fmt"
)

// ErrNoLibrary is wrapped when libcublas cannot be loaded or lacks a symbol.
var ErrNoLibrary = errors.New("cublas: libcublas not found")

// ErrUnavailable is wrapped (with ErrNoLibrary) when built without cgo.
var ErrUnavailable = errors.New("cublas: unavailable (built without cgo)")

// Libraries are the sonames Load tries, in order.
var Libraries = []string{"libcublas.so.13", "libcublas.so.12", "libcublas.so"}

// Operation is a cublasOperation_t.
type Operation int

// Operations.
const (
	OpN Operation = 0 // no transpose
	OpT Operation = 1 // transpose
)

// DataType is a cudaDataType_t.
type DataType int

// Data types.
const (
	R32F  DataType = 0
	R16F  DataType = 2
	R16BF DataType = 14
)

// ComputeType is a cublasComputeType_t.
type ComputeType int

// Compute types.
const (
	Compute32F         ComputeType = 68 // fp32 accumulation; bf16/fp16 inputs use tensor cores
	Compute32FPedantic ComputeType = 69 // fp32 throughout, no reduced precision, no TF32
	Compute32FFastTF32 ComputeType = 77
)

// MathMode is a cublasMath_t.
type MathMode int

// Math modes.
const (
	DefaultMath                       MathMode = 0
	PedanticMath                      MathMode = 2
	TF32TensorOpMath                  MathMode = 3
	DisallowReducedPrecisionReduction MathMode = 16
)

// GemmDefault is CUBLAS_GEMM_DEFAULT.
const GemmDefault = -1

// Status is a cublasStatus_t.
type Status int

// Status codes.
const (
	StatusSuccess         Status = 0
	StatusNotInitialized  Status = 1
	StatusAllocFailed     Status = 3
	StatusInvalidValue    Status = 7
	StatusArchMismatch    Status = 8
	StatusMappingError    Status = 11
	StatusExecutionFailed Status = 13
	StatusInternalError   Status = 14
	StatusNotSupported    Status = 15
	StatusLicenseError    Status = 16
)

var statusNames = map[Status]string{
	0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
	7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
	13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR", 15: "CUBLAS_STATUS_NOT_SUPPORTED",
	16: "CUBLAS_STATUS_LICENSE_ERROR",
}

// Name is the status's C name.
func (s Status) Name() string {
	if n, ok := statusNames[s]; ok {
		return n
	}
	return fmt.Sprintf("CUBLAS_STATUS_%d", int(s))
}

// Error is a failed cuBLAS call.
type Error struct {
	Op     string
	Status Status
}

func (e *Error) Error() string { return fmt.Sprintf("cublas: %s: %s", e.Op, e.Status.Name()) }

func check(op string, s Status) error {
	if s == StatusSuccess {
		return nil
	}
	return &Error{Op: op, Status: s}
}

// Handle is a cuBLAS handle, bound to the context current when it was made.
type Handle struct{ h uintptr }

// Gemm describes one C = alpha*op(A)*op(B) + beta*C in cuBLAS's column-major
// terms; pointers are device addresses.
type Gemm struct {
	TransA, TransB Operation
	M, N, K        int
	Alpha, Beta    float32
	A              uint64
	AType          DataType
	LDA            int
	B              uint64
	BType          DataType
	LDB            int
	C              uint64
	CType          DataType
	LDC            int
	Compute        ComputeType
	// Strided-batched form (Batch > 1): element strides between matrices.
	Batch                     int
	StrideA, StrideB, StrideC int64
}
