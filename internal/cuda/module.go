package cuda

import (
	"fmt"
	"math"
	"unsafe"
)

// LoadModule loads a CUBIN or PTX image into c (cuModuleLoadData).
func (c *Context) LoadModule(image []byte) (*Module, error) {
	if len(image) == 0 {
		return nil, fmt.Errorf("cuda: LoadModule: empty image")
	}
	h, res := cuModuleLoadData(c.h, image)
	if err := check("cuModuleLoadData", res); err != nil {
		return nil, err
	}
	return &Module{ctx: c, h: h}, nil
}

// Unload unloads the module.
func (m *Module) Unload() error {
	if m == nil || m.h == nil {
		return nil
	}
	h := m.h
	m.h = nil
	return check("cuModuleUnload", cuModuleUnload(m.ctx.h, h))
}

// Function looks up an extern "C" kernel.
func (m *Module) Function(name string) (*Function, error) {
	h, res := cuModuleGetFunction(m.ctx.h, m.h, name)
	if res != Success {
		return nil, fmt.Errorf("cuda: kernel %q: %w", name, &Error{Op: "cuModuleGetFunction", Code: res})
	}
	return &Function{mod: m, h: h, Name: name}, nil
}

// SetAttribute sets a function attribute (FuncAttr*), e.g. the dynamic
// shared memory limit above 48 KiB.
func (f *Function) SetAttribute(attr, v int) error {
	return check("cuFuncSetAttribute", cuFuncSetAttribute(f.mod.ctx.h, f.h, attr, v))
}

// Attribute reads a function attribute (FuncAttr*).
func (f *Function) Attribute(attr int) (int, error) {
	v, res := cuFuncGetAttribute(f.mod.ctx.h, f.h, attr)
	return v, check("cuFuncGetAttribute", res)
}

// Args packs kernel parameters in order, each at its natural alignment.
// Reuse one with Reset on hot paths.
type Args struct {
	buf []byte
	off []uint32
}

// Reset empties the argument list.
func (a *Args) Reset() { a.buf, a.off = a.buf[:0], a.off[:0] }

func (a *Args) put(align int, v []byte) *Args {
	for len(a.buf)%align != 0 {
		a.buf = append(a.buf, 0)
	}
	a.off = append(a.off, uint32(len(a.buf)))
	a.buf = append(a.buf, v...)
	return a
}

func (a *Args) put64(v uint64) *Args {
	var b [8]byte
	*(*uint64)(unsafe.Pointer(&b[0])) = v
	return a.put(8, b[:])
}

func (a *Args) put32(v uint32) *Args {
	var b [4]byte
	*(*uint32)(unsafe.Pointer(&b[0])) = v
	return a.put(4, b[:])
}

// Ptr appends a device pointer.
func (a *Args) Ptr(p DevicePtr) *Args { return a.put64(uint64(p)) }

// U64 appends an unsigned long long.
func (a *Args) U64(v uint64) *Args { return a.put64(v) }

// I64 appends a long long.
func (a *Args) I64(v int64) *Args { return a.put64(uint64(v)) }

// U32 appends an unsigned int.
func (a *Args) U32(v uint32) *Args { return a.put32(v) }

// I32 appends an int.
func (a *Args) I32(v int32) *Args { return a.put32(uint32(v)) }

// F32 appends a float.
func (a *Args) F32(v float32) *Args { return a.put32(math.Float32bits(v)) }

// F64 appends a double.
func (a *Args) F64(v float64) *Args { return a.put64(math.Float64bits(v)) }

// Bytes appends a struct passed by value (aligned to align bytes).
func (a *Args) Bytes(v []byte, align int) *Args { return a.put(align, v) }

// Len is the number of parameters.
func (a *Args) Len() int { return len(a.off) }

// Add appends v, which must be DevicePtr, uint64, int64, uint32, int32,
// float32 or float64 (plain int is refused: its C width is ambiguous).
func (a *Args) Add(v any) error {
	switch x := v.(type) {
	case DevicePtr:
		a.Ptr(x)
	case uint64:
		a.U64(x)
	case int64:
		a.I64(x)
	case uint32:
		a.U32(x)
	case int32:
		a.I32(x)
	case float32:
		a.F32(x)
	case float64:
		a.F64(x)
	default:
		return fmt.Errorf("cuda: kernel argument of type %T not supported (use a sized type)", v)
	}
	return nil
}

// Launch enqueues f on s with the given arguments (see Args.Add for types).
func (s *Stream) Launch(f *Function, grid, block Dim3, sharedMem uint32, args ...any) error {
	var a Args
	for i, v := range args {
		if err := a.Add(v); err != nil {
			return fmt.Errorf("%s arg %d: %w", f.Name, i, err)
		}
	}
	return s.LaunchArgs(f, grid, block, sharedMem, &a)
}

// LaunchPDL is Launch with programmatic dependent launch allowed: f may
// start before the kernel ahead of it on s has finished (once every block
// of that kernel has run griddepcontrol.launch_dependents or exited), so
// every block of f must run griddepcontrol.wait before it reads or writes
// memory the kernels ahead of it use. Under stream capture the dependency
// becomes a programmatic graph edge. Needs cuLaunchKernelEx (CUDA 12+).
func (s *Stream) LaunchPDL(f *Function, grid, block Dim3, sharedMem uint32, args ...any) error {
	var a Args
	for i, v := range args {
		if err := a.Add(v); err != nil {
			return fmt.Errorf("%s arg %d: %w", f.Name, i, err)
		}
	}
	if a.Len() > 64 {
		return fmt.Errorf("cuda: %s: %d kernel arguments, at most 64", f.Name, a.Len())
	}
	res := cuLaunchKernelPDL(s.ctx.h, f.h, grid, block, sharedMem, s.h, a.buf, a.off)
	if res != Success {
		return fmt.Errorf("cuda: launch %s (programmatic dependent): %w", f.Name, &Error{Op: "cuLaunchKernelEx", Code: res})
	}
	return nil
}

// LaunchArgs enqueues f on s with packed arguments.
func (s *Stream) LaunchArgs(f *Function, grid, block Dim3, sharedMem uint32, a *Args) error {
	if a.Len() > 64 {
		return fmt.Errorf("cuda: %s: %d kernel arguments, at most 64", f.Name, a.Len())
	}
	res := cuLaunchKernel(s.ctx.h, f.h, grid, block, sharedMem, s.h, a.buf, a.off)
	if res != Success {
		return fmt.Errorf("cuda: launch %s: %w", f.Name, &Error{Op: "cuLaunchKernel", Code: res})
	}
	return nil
}
