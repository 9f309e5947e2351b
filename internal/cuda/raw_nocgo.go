//go:build !cgo

package cuda

import (
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

// Twin of raw_cgo.go for CGO_ENABLED=0: Init fails with ErrNoDriver wrapping
// ErrUnavailable, so nothing below is reached in practice; each call still
// returns an error code rather than panicking.

const cgoEnabled = false

const noCgo = ErrorNotInitialized

func bindDriver(*dl.Handle) error                                             { return ErrUnavailable }
func bindNVRTC(*dl.Handle) error                                              { return ErrUnavailable }
func nvrtcVersion() (int, int, error)                                         { return 0, 0, ErrUnavailable }
func driverErrorName(Result) string                                           { return "" }
func driverErrorString(Result) string                                         { return "" }
func cuInit() Result                                                          { return noCgo }
func cuDriverGetVersion() (int, Result)                                       { return 0, noCgo }
func cuDeviceGetCount() (int, Result)                                         { return 0, noCgo }
func cuDeviceGet(int) (int, Result)                                           { return 0, noCgo }
func cuDeviceGetName(Device) (string, Result)                                 { return "", noCgo }
func cuDeviceGetAttribute(DeviceAttribute, Device) (int, Result)              { return 0, noCgo }
func cuDeviceTotalMem(Device) (uint64, Result)                                { return 0, noCgo }
func cuDeviceGetPCIBusId(Device) (string, Result)                             { return "", noCgo }
func cuDeviceCanAccessPeer(Device, Device) (bool, Result)                     { return false, noCgo }
func cuDevicePrimaryCtxRetain(Device) (unsafe.Pointer, Result)                { return nil, noCgo }
func cuDevicePrimaryCtxRelease(Device) Result                                 { return noCgo }
func cuCtxSetCurrent(unsafe.Pointer) Result                                   { return noCgo }
func cuCtxSynchronize(unsafe.Pointer) Result                                  { return noCgo }
func cuCtxEnablePeerAccess(unsafe.Pointer, unsafe.Pointer) Result             { return noCgo }
func cuMemGetInfo(unsafe.Pointer) (uint64, uint64, Result)                    { return 0, 0, noCgo }
func cuStreamCreate(unsafe.Pointer, uint) (unsafe.Pointer, Result)            { return nil, noCgo }
func cuStreamDestroy(unsafe.Pointer, unsafe.Pointer) Result                   { return noCgo }
func cuStreamSynchronize(unsafe.Pointer, unsafe.Pointer) Result               { return noCgo }
func cuStreamQuery(unsafe.Pointer, unsafe.Pointer) Result                     { return noCgo }
func cuStreamWaitEvent(unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) Result { return noCgo }
func cuEventCreate(unsafe.Pointer, uint) (unsafe.Pointer, Result)             { return nil, noCgo }
func cuEventDestroy(unsafe.Pointer, unsafe.Pointer) Result                    { return noCgo }
func cuEventRecord(unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) Result     { return noCgo }
func cuEventSynchronize(unsafe.Pointer, unsafe.Pointer) Result                { return noCgo }
func cuEventQuery(unsafe.Pointer, unsafe.Pointer) Result                      { return noCgo }
func cuEventElapsedTime(unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) (float32, Result) {
	return 0, noCgo
}
func cuMemAlloc(unsafe.Pointer, uint64) (DevicePtr, Result)                             { return 0, noCgo }
func cuMemFree(unsafe.Pointer, DevicePtr) Result                                        { return noCgo }
func cuMemcpy(unsafe.Pointer, DevicePtr, DevicePtr, uint64) Result                      { return noCgo }
func cuMemcpyAsync(unsafe.Pointer, DevicePtr, DevicePtr, uint64, unsafe.Pointer) Result { return noCgo }
func cuMemcpyHtoD(unsafe.Pointer, DevicePtr, uintptr, uint64) Result                    { return noCgo }
func cuMemcpyDtoH(unsafe.Pointer, uintptr, DevicePtr, uint64) Result                    { return noCgo }
func cuMemcpyDtoD(unsafe.Pointer, DevicePtr, DevicePtr, uint64) Result                  { return noCgo }
func cuMemcpyHtoDAsync(unsafe.Pointer, DevicePtr, uintptr, uint64, unsafe.Pointer) Result {
	return noCgo
}
func cuMemcpyDtoHAsync(unsafe.Pointer, uintptr, DevicePtr, uint64, unsafe.Pointer) Result {
	return noCgo
}
func cuMemcpyDtoDAsync(unsafe.Pointer, DevicePtr, DevicePtr, uint64, unsafe.Pointer) Result {
	return noCgo
}
func cuMemcpy2DDtoDAsync(unsafe.Pointer, DevicePtr, uint64, DevicePtr, uint64, uint64, uint64, unsafe.Pointer) Result {
	return noCgo
}
func cuMemcpyPeer(DevicePtr, unsafe.Pointer, DevicePtr, unsafe.Pointer, uint64) Result { return noCgo }
func cuMemcpyPeerAsync(unsafe.Pointer, DevicePtr, unsafe.Pointer, DevicePtr, unsafe.Pointer, uint64, unsafe.Pointer) Result {
	return noCgo
}
func cuMemsetD8(unsafe.Pointer, DevicePtr, byte, uint64) Result { return noCgo }
func cuMemsetD8Async(unsafe.Pointer, DevicePtr, byte, uint64, unsafe.Pointer) Result {
	return noCgo
}
func cuMemHostAlloc(unsafe.Pointer, uint64, uint) (unsafe.Pointer, Result)       { return nil, noCgo }
func cuMemFreeHost(unsafe.Pointer, unsafe.Pointer) Result                        { return noCgo }
func cuMemHostRegister(unsafe.Pointer, uintptr, uint64, uint) Result             { return noCgo }
func cuMemHostUnregister(unsafe.Pointer, uintptr) Result                         { return noCgo }
func cuMemHostGetDevicePointer(unsafe.Pointer, uintptr) (DevicePtr, Result)      { return 0, noCgo }
func cuMemGetAllocationGranularity(Device, HandleType, bool) (uint64, Result)    { return 0, noCgo }
func cuMemCreate(unsafe.Pointer, uint64, Device, HandleType) (MemHandle, Result) { return 0, noCgo }
func cuMemRelease(MemHandle) Result                                              { return noCgo }
func cuMemAddressReserve(unsafe.Pointer, uint64, uint64) (DevicePtr, Result)     { return 0, noCgo }
func cuMemAddressFree(DevicePtr, uint64) Result                                  { return noCgo }
func cuMemMap(unsafe.Pointer, DevicePtr, uint64, uint64, MemHandle) Result       { return noCgo }
func cuMemUnmap(DevicePtr, uint64) Result                                        { return noCgo }
func cuMemSetAccess(unsafe.Pointer, DevicePtr, uint64, []Device) Result          { return noCgo }
func cuMemExportFD(MemHandle) (int, Result)                                      { return -1, noCgo }
func cuMemExportFabric(MemHandle) (FabricHandle, Result)                         { return FabricHandle{}, noCgo }
func cuMemImportFD(unsafe.Pointer, int) (MemHandle, Result)                      { return 0, noCgo }
func cuMemGetDmabufFD(unsafe.Pointer, DevicePtr, uint64) (int, Result)           { return -1, noCgo }
func cuMemImportFabric(unsafe.Pointer, FabricHandle) (MemHandle, Result)         { return 0, noCgo }
func cuIpcGetMemHandle(unsafe.Pointer, DevicePtr) (IpcMemHandle, Result) {
	return IpcMemHandle{}, noCgo
}
func cuIpcOpenMemHandle(unsafe.Pointer, IpcMemHandle, uint) (DevicePtr, Result) { return 0, noCgo }
func cuIpcCloseMemHandle(unsafe.Pointer, DevicePtr) Result                      { return noCgo }
func cuPointerGetAttribute(unsafe.Pointer, PointerAttribute, DevicePtr) (uint64, Result) {
	return 0, noCgo
}
func cuModuleLoadData(unsafe.Pointer, []byte) (unsafe.Pointer, Result) { return nil, noCgo }
func cuModuleUnload(unsafe.Pointer, unsafe.Pointer) Result             { return noCgo }
func cuModuleGetFunction(unsafe.Pointer, unsafe.Pointer, string) (unsafe.Pointer, Result) {
	return nil, noCgo
}
func cuFuncSetAttribute(unsafe.Pointer, unsafe.Pointer, int, int) Result   { return noCgo }
func cuFuncGetAttribute(unsafe.Pointer, unsafe.Pointer, int) (int, Result) { return 0, noCgo }
func cuLaunchKernel(unsafe.Pointer, unsafe.Pointer, Dim3, Dim3, uint32, unsafe.Pointer, []byte, []uint32) Result {
	return noCgo
}
func cuLaunchKernelPDL(unsafe.Pointer, unsafe.Pointer, Dim3, Dim3, uint32, unsafe.Pointer, []byte, []uint32) Result {
	return noCgo
}
func cuStreamBeginCapture(unsafe.Pointer, unsafe.Pointer, int) Result { return noCgo }
func cuStreamEndCapture(unsafe.Pointer, unsafe.Pointer) (unsafe.Pointer, Result) {
	return nil, noCgo
}
func cuStreamIsCapturing(unsafe.Pointer, unsafe.Pointer) (int, Result) { return 0, noCgo }
func cuGraphInstantiate(unsafe.Pointer, unsafe.Pointer, uint64) (unsafe.Pointer, Result) {
	return nil, noCgo
}
func cuGraphUpload(unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) Result            { return noCgo }
func cuGraphLaunch(unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) Result            { return noCgo }
func cuGraphExecUpdate(unsafe.Pointer, unsafe.Pointer, unsafe.Pointer) (int, Result) { return 0, noCgo }
func cuGraphExecDestroy(unsafe.Pointer, unsafe.Pointer) Result                       { return noCgo }
func cuGraphDestroy(unsafe.Pointer, unsafe.Pointer) Result                           { return noCgo }
func cuGraphNodeCount(unsafe.Pointer, unsafe.Pointer) (int, Result)                  { return 0, noCgo }
func nvrtcCompile(string, string, []string, bool) ([]byte, string, error) {
	return nil, "", ErrUnavailable
}
