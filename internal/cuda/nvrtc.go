package cuda

import (
	"errors"
	"fmt"
	"sync"

	"github.com/mooncake-go/mooncake-go/internal/dl"
)

// NVRTCLibraries are the sonames LoadNVRTC tries, in order.
var NVRTCLibraries = []string{"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"}

// NVRTC is the loaded run-time compiler (one per process).
type NVRTC struct {
	Library      string // soname that loaded
	Major, Minor int    // nvrtcVersion
	mu           sync.Mutex
}

var nvrtcState struct {
	once sync.Once
	nv   *NVRTC
	err  error
}

// LoadNVRTC loads libnvrtc (once per process). The error wraps ErrNoNVRTC.
func LoadNVRTC() (*NVRTC, error) {
	nvrtcState.once.Do(func() { nvrtcState.nv, nvrtcState.err = loadNVRTC() })
	return nvrtcState.nv, nvrtcState.err
}

func loadNVRTC() (*NVRTC, error) {
	if !cgoEnabled {
		return nil, fmt.Errorf("%w (libnvrtc: built without cgo): %w", ErrNoNVRTC, ErrUnavailable)
	}
	lib, err := dl.OpenFirst(NVRTCLibraries, dl.RTLD_NOW|dl.RTLD_NODELETE)
	if err != nil {
		msg := err.Error()
		var de *dl.Error
		if errors.As(err, &de) {
			msg = de.Msg
		}
		return nil, fmt.Errorf("%w (%s)", ErrNoNVRTC, msg)
	}
	if err := bindNVRTC(lib); err != nil {
		return nil, err
	}
	maj, min, err := nvrtcVersion()
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNoNVRTC, err)
	}
	return &NVRTC{Library: lib.Name, Major: maj, Minor: min}, nil
}

// Arch is a compile target: "sm_90" (CUBIN) or "compute_90" (PTX).
func Arch(major, minor int, ptx bool) string {
	if ptx {
		return fmt.Sprintf("compute_%d%d", major, minor)
	}
	return fmt.Sprintf("sm_%d%d", major, minor)
}

// Compile compiles CUDA C source for arch ("sm_90" gives CUBIN, "compute_90"
// PTX) with extra options. It returns the image and the compiler log.
func (n *NVRTC) Compile(src, name, arch string, opts ...string) ([]byte, string, error) {
	all := append([]string{"--gpu-architecture=" + arch, "--std=c++17"}, opts...)
	n.mu.Lock()
	defer n.mu.Unlock()
	return nvrtcCompile(src, name, all, len(arch) > 3 && arch[:3] == "sm_")
}
