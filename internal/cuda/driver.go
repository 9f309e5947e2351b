package cuda

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

// ErrNoDevice is wrapped when the driver loads but reports no CUDA device.
var ErrNoDevice = errors.New("cuda: no CUDA device")

// DriverLibrary is the soname Init loads.
const DriverLibrary = "libcuda.so.1"

var drv struct {
	once  sync.Once
	err   error
	lib   *dl.Handle
	bound atomic.Bool
}

func driverBound() bool { return drv.bound.Load() }

// Init loads libcuda.so.1 and calls cuInit(0), once per process. Every entry
// point calls it, so calling it first is optional; its error says why CUDA is
// unusable and wraps ErrNoDriver (or ErrNoDevice).
func Init() error {
	drv.once.Do(func() { drv.err = initDriver() })
	return drv.err
}

func initDriver() error {
	if !cgoEnabled {
		return fmt.Errorf("%w (%s: built without cgo): %w", ErrNoDriver, DriverLibrary, ErrUnavailable)
	}
	lib, err := dl.Open(DriverLibrary, dl.RTLD_NOW|dl.RTLD_NODELETE)
	if err != nil {
		msg := err.Error()
		var de *dl.Error
		if errors.As(err, &de) {
			msg = de.Msg
		}
		return fmt.Errorf("%w (%s: %s)", ErrNoDriver, DriverLibrary, msg)
	}
	if err := bindDriver(lib); err != nil {
		return err
	}
	drv.lib = lib
	drv.bound.Store(true)
	if res := cuInit(); res != Success {
		e := &Error{Op: "cuInit", Code: res}
		if res == ErrorNoDevice {
			return fmt.Errorf("%w: %w", ErrNoDevice, e)
		}
		return fmt.Errorf("%w (%s loaded, but %w)", ErrNoDriver, DriverLibrary, e)
	}
	return nil
}

// DriverVersion is the CUDA version the driver supports, as 1000*major +
// 10*minor (13000 for 13.0).
func DriverVersion() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	v, res := cuDriverGetVersion()
	return v, check("cuDriverGetVersion", res)
}

// DeviceCount returns the number of CUDA devices.
func DeviceCount() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	n, res := cuDeviceGetCount()
	return n, check("cuDeviceGetCount", res)
}

// GetDevice returns the device with the given ordinal.
func GetDevice(ordinal int) (Device, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	d, res := cuDeviceGet(ordinal)
	return Device(d), check("cuDeviceGet", res)
}

// Name is the device's marketing name ("NVIDIA H200").
func (d Device) Name() (string, error) {
	if err := Init(); err != nil {
		return "", err
	}
	s, res := cuDeviceGetName(d)
	return s, check("cuDeviceGetName", res)
}

// Attribute reads a device attribute.
func (d Device) Attribute(a DeviceAttribute) (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	v, res := cuDeviceGetAttribute(a, d)
	return v, check("cuDeviceGetAttribute", res)
}

// TotalMem is the device's memory in bytes.
func (d Device) TotalMem() (uint64, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	v, res := cuDeviceTotalMem(d)
	return v, check("cuDeviceTotalMem", res)
}

// PCIBusID is the device's PCI address, "0000:19:00.0".
func (d Device) PCIBusID() (string, error) {
	if err := Init(); err != nil {
		return "", err
	}
	s, res := cuDeviceGetPCIBusId(d)
	return s, check("cuDeviceGetPCIBusId", res)
}

// ComputeCapability returns (major, minor), e.g. (9, 0) on Hopper.
func (d Device) ComputeCapability() (major, minor int, err error) {
	if major, err = d.Attribute(AttrComputeCapabilityMajor); err != nil {
		return 0, 0, err
	}
	minor, err = d.Attribute(AttrComputeCapabilityMinor)
	return major, minor, err
}

// CanAccessPeer reports whether d can map peer's memory (cuDeviceCanAccessPeer).
func (d Device) CanAccessPeer(peer Device) (bool, error) {
	if err := Init(); err != nil {
		return false, err
	}
	ok, res := cuDeviceCanAccessPeer(d, peer)
	return ok, check("cuDeviceCanAccessPeer", res)
}

// Retain retains the device's primary context; Release it when done.
func (d Device) Retain() (*Context, error) {
	if err := Init(); err != nil {
		return nil, err
	}
	h, res := cuDevicePrimaryCtxRetain(d)
	if err := check("cuDevicePrimaryCtxRetain", res); err != nil {
		return nil, err
	}
	return &Context{h: h, dev: d}, nil
}

// Release releases the primary context retained by Device.Retain.
func (c *Context) Release() error {
	if c == nil || c.h == nil {
		return nil
	}
	c.h = nil
	return check("cuDevicePrimaryCtxRelease", cuDevicePrimaryCtxRelease(c.dev))
}

// SetCurrent makes c current on the calling OS thread (for code that calls
// the driver directly; this package's calls do it themselves).
func (c *Context) SetCurrent() error { return check("cuCtxSetCurrent", cuCtxSetCurrent(c.h)) }

// Synchronize waits for all work in the context.
func (c *Context) Synchronize() error { return check("cuCtxSynchronize", cuCtxSynchronize(c.h)) }

// MemGetInfo returns the free and total memory of the context's device.
func (c *Context) MemGetInfo() (free, total uint64, err error) {
	f, t, res := cuMemGetInfo(c.h)
	return f, t, check("cuMemGetInfo", res)
}

// EnablePeerAccess lets kernels and copies in c reach memory of peer's
// device (cuCtxEnablePeerAccess); already-enabled is not an error.
func (c *Context) EnablePeerAccess(peer *Context) error {
	return check("cuCtxEnablePeerAccess", cuCtxEnablePeerAccess(c.h, peer.h))
}

// MultiprocessorCount is a shortcut for the SM count.
func (c *Context) MultiprocessorCount() (int, error) {
	return c.dev.Attribute(AttrMultiprocessorCount)
}
