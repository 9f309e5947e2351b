//go:build !cgo

package topo

// NVMLLibrary is the soname that would be loaded.
const NVMLLibrary = "libnvidia-ml.so.1"

// Discover always fails without cgo.
func Discover() (*Topology, error) {
	return nil, &Error{Reason: "NVML unavailable (built without cgo)"}
}
