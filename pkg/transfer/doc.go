// Package transfer is mooncake-go's transfer engine: it moves bytes between
// the registered memory of processes, on one machine or across machines.
//
// The model follows the Mooncake Transfer Engine. Each process runs one
// Engine. The memory a process exposes is its segment, named host:port by
// default; the segment's descriptor (its transports, its registered regions
// and their handles) is published in a Registry (etcd, an HTTP metadata
// server, or none at all: in P2P mode the name is the address and the
// descriptor is fetched from the peer itself). A transfer is a batch of
// requests, each a READ or WRITE between local memory and an address inside a
// region the target published. Every request is checked against the target's
// regions and access rights before any byte moves, and every batch finishes,
// with a per-task status, within a bounded time.
//
// Transports (tcp, shm, nvlink, ...) live in subpackages and are handed to
// New; per request the engine picks the first one, in Config.Transports
// order, that can serve the pair of memory locations.
//
// Memory a backend owns (a CUDA pool) is registered WithMemory: Memory gives
// transports its base, size and a shareable handle (nvlink maps it in the
// peer), and DeviceMemory adds copies to and from host staging on the
// backend's own streams (tcp stages GPU memory through them). Transports see
// only these interfaces, so this package and its host-memory transports
// import no CUDA package.
package transfer
