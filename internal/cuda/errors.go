package cuda

import (
	"errors"
	"fmt"
)

// ErrNoDriver is wrapped by every error that comes from a missing or
// unusable CUDA driver (no libcuda.so.1, a missing symbol, cuInit failing,
// or a binary built without cgo). Callers that can run without a GPU test
// for it with errors.Is.
var ErrNoDriver = errors.New("cuda: CUDA driver not found")

// ErrUnavailable is wrapped (together with ErrNoDriver) when the binary was
// built without cgo.
var ErrUnavailable = errors.New("cuda: unavailable (built without cgo)")

// ErrNoNVRTC is wrapped when libnvrtc cannot be loaded.
var ErrNoNVRTC = errors.New("cuda: NVRTC not found")

// Result is a CUDA driver status code (CUresult).
type Result int

// Status codes this package and its callers test for.
const (
	Success                    Result = 0
	ErrorInvalidValue          Result = 1
	ErrorOutOfMemory           Result = 2
	ErrorNotInitialized        Result = 3
	ErrorNoDevice              Result = 100
	ErrorInvalidDevice         Result = 101
	ErrorInvalidImage          Result = 200
	ErrorInvalidContext        Result = 201
	ErrorNoBinaryForGPU        Result = 209
	ErrorPeerAccessUnsupported Result = 217
	ErrorInvalidPTX            Result = 218
	ErrorSymbolNotFound        Result = 302
	ErrorInvalidHandle         Result = 400
	ErrorNotFound              Result = 500
	ErrorNotReady              Result = 600
	ErrorIllegalAddress        Result = 700
	ErrorPeerAccessNotEnabled  Result = 705
	ErrorHostMemoryRegistered  Result = 712
	ErrorLaunchFailed          Result = 719
	ErrorNotPermitted          Result = 800
	ErrorNotSupported          Result = 801
	// Graph capture and update.
	ErrorStreamCaptureUnsupported Result = 900
	ErrorStreamCaptureInvalidated Result = 901
	ErrorStreamCaptureImplicit    Result = 906
	ErrorStreamCaptureWrongThread Result = 908
	ErrorGraphExecUpdateFailure   Result = 910
	ErrorUnknown                  Result = 999
)

var resultNames = map[Result]string{
	0: "CUDA_SUCCESS", 1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY",
	3: "CUDA_ERROR_NOT_INITIALIZED", 4: "CUDA_ERROR_DEINITIALIZED", 34: "CUDA_ERROR_STUB_LIBRARY",
	46: "CUDA_ERROR_DEVICE_UNAVAILABLE", 100: "CUDA_ERROR_NO_DEVICE", 101: "CUDA_ERROR_INVALID_DEVICE",
	200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT", 205: "CUDA_ERROR_MAP_FAILED",
	208: "CUDA_ERROR_ALREADY_MAPPED", 209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 211: "CUDA_ERROR_NOT_MAPPED",
	217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", 218: "CUDA_ERROR_INVALID_PTX",
	222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", 302: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
	304: "CUDA_ERROR_OPERATING_SYSTEM", 400: "CUDA_ERROR_INVALID_HANDLE", 401: "CUDA_ERROR_ILLEGAL_STATE",
	500: "CUDA_ERROR_NOT_FOUND", 600: "CUDA_ERROR_NOT_READY", 700: "CUDA_ERROR_ILLEGAL_ADDRESS",
	701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", 709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	711: "CUDA_ERROR_TOO_MANY_PEERS", 712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
	713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", 716: "CUDA_ERROR_MISALIGNED_ADDRESS",
	719: "CUDA_ERROR_LAUNCH_FAILED", 800: "CUDA_ERROR_NOT_PERMITTED", 801: "CUDA_ERROR_NOT_SUPPORTED",
	802: "CUDA_ERROR_SYSTEM_NOT_READY", 803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", 901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
	902: "CUDA_ERROR_STREAM_CAPTURE_MERGE", 903: "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
	904: "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", 905: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
	906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", 907: "CUDA_ERROR_CAPTURED_EVENT",
	908: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", 910: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
	999: "CUDA_ERROR_UNKNOWN",
}

// Name is the CUDA error name (CUDA_ERROR_NOT_PERMITTED), from the driver
// when it is loaded, else from a built-in table.
func (r Result) Name() string {
	if n := driverErrorName(r); n != "" {
		return n
	}
	if n, ok := resultNames[r]; ok {
		return n
	}
	return fmt.Sprintf("CUDA_ERROR_%d", int(r))
}

// Error is a failed driver call.
type Error struct {
	Op   string // the driver function, e.g. "cuMemMap"
	Code Result
}

func (e *Error) Error() string {
	msg := fmt.Sprintf("cuda: %s: %s (%d)", e.Op, e.Code.Name(), int(e.Code))
	if s := driverErrorString(e.Code); s != "" {
		msg += ": " + s
	}
	return msg
}

// Is matches another *Error with the same code (its Op ignored), so that
// errors.Is(err, &cuda.Error{Code: cuda.ErrorNotPermitted}) works.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code
}

// Code returns the driver status code carried by err, or Success when err
// carries none.
func Code(err error) Result {
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	return Success
}

func check(op string, r Result) error {
	if r == Success {
		return nil
	}
	return &Error{Op: op, Code: r}
}

// NVRTCError is a failed NVRTC call; Log holds the compiler's output.
type NVRTCError struct {
	Op   string
	Code int
	Msg  string
	Log  string
}

func (e *NVRTCError) Error() string {
	s := fmt.Sprintf("cuda: %s: %s (%d)", e.Op, e.Msg, e.Code)
	if e.Log != "" {
		s += "\n" + e.Log
	}
	return s
}
