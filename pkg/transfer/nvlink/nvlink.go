// Package nvlink holds the GPU transports of the transfer engine.
//
// Transport "nvlink" moves bytes between processes of one machine (same
// boot, machine-id and network namespace) with one scatter-kernel launch
// per batch on a stream of the initiator's GPU: GPU memory to a peer's GPU
// memory over NVLink (or PCIe peer-to-peer), GPU memory to a peer's
// memfd-backed host memory, and pinned local host memory to a peer's GPU
// memory.
//
// The serving side publishes, per region, a handle naming how the region
// is shared: "vmm-fd" (a cuda.Pool of POSIX-FD shareable VMM memory, given
// with transfer.WithMemory), "vmm-fabric" (a FABRIC pool), "ipc" (legacy IPC
// of cuMemAlloc memory) or "host" (memfd-backed host memory, from
// Engine.AllocHost). The exported objects themselves (fds, IPC handles)
// are never in the descriptor: as in package shm, an initiator first proves
// itself through the engine's handshake (h.Dial, kind "nvlink"; cluster
// token and incarnation checked) and gets a one-time ticket, presents it on
// the serving side's abstract unix socket ("@mooncake-nvlink-<incarnation>",
// per network namespace), and then asks for each region, whose fd comes back
// with SCM_RIGHTS (or whose IPC handle comes back in the reply). Each remote
// region is imported once per (peer incarnation, region) and cached: VMM
// pools with cuMemImportFromShareableHandle + cuMemMap, IPC memory with
// cuIpcOpenMemHandle, host memory with mmap + cuMemHostRegister. The unix
// connection stays open: its end marks the peer dead (transfer.ErrPeerDead)
// and releases its imports once the kernels using them finished.
//
// Transport "mnnvl" (NewMNNVL) uses fabric handles across the NVLink fabric
// of a multi-node NVLink domain. It is active only when NVML reports the
// GPU's fabric registration complete and a trial FABRIC allocation succeeds;
// otherwise its Start logs one line saying why, it registers nothing and
// serves nothing, and the engine falls back to the next transport.
//
// Wire format: docs/format/nvlink.md.
package nvlink

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"

	"go.uber.org/zap"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/fdshare"
)

// Names in descriptors, logs and metrics.
const (
	Name      = "nvlink"
	NameMNNVL = "mnnvl"
)

// Handle kinds in the descriptor.
const (
	KindVMMFD     = "vmm-fd"
	KindVMMFabric = "vmm-fabric"
	KindIPC       = "ipc"
	KindHost      = "host"
)

// Config configures a GPU transport. Zero values mean the defaults noted.
type Config struct {
	// Kernels compiles and caches the copy kernels (nil: a cache in
	// cuda.DefaultKernelCacheDir).
	Kernels *cuda.Kernels
	// Copier tunes the scatter kernel (zero: cuda's defaults).
	Copier cuda.CopierConfig
}

// Validate reports a configuration the transport cannot use.
func (c Config) Validate() error {
	if c.Copier.ChunkBytes%16 != 0 {
		return fmt.Errorf("nvlink: config: Copier.ChunkBytes %d is not a multiple of 16", c.Copier.ChunkBytes)
	}
	return nil
}

// Info is the transport's segment-level entry in the descriptor.
type Info struct {
	// Socket is the abstract unix socket (nvlink only).
	Socket  string `json:"socket,omitempty"`
	Version int    `json:"version"`
	// GPUs are the PCI bus ids of the process's CUDA devices, by ordinal.
	GPUs []string `json:"gpus"`
	// ClusterUUID and CliqueID name the NVLink fabric domain (mnnvl only).
	ClusterUUID string `json:"cluster_uuid,omitempty"`
	CliqueID    uint32 `json:"clique_id,omitempty"`
}

// Handle is a region's entry in the descriptor. Kind comes first so a
// peer's selector can read it without decoding.
type Handle struct {
	Kind     string `json:"kind"`
	ID       uint64 `json:"id"`
	Device   int    `json:"device"` // owner's CUDA ordinal; -1 for host memory
	PCIBusID string `json:"pci_bus_id,omitempty"`
	// Size is the exported object's size (pool, IPC allocation, memfd
	// prefix); the region starts at Offset inside it.
	Size        uint64 `json:"size"`
	Offset      uint64 `json:"offset"`
	Granularity uint64 `json:"granularity,omitempty"`
	// Fabric is the fabric handle (mnnvl only: it is meaningful only inside
	// the NVLink domain the peer's descriptor names).
	Fabric []byte `json:"fabric,omitempty"`
}

const protocolVersion = 1

// Transport is the nvlink (or mnnvl) transport. Create it with New or
// NewMNNVL and hand it to transfer.New in Config.Transports.
type Transport struct {
	name   string
	fabric bool // mnnvl
	cfg    Config
	h      transfer.Host
	lg     *zap.Logger
	srv    *fdshare.Server // served regions by id (listening for nvlink only)
	sock   string
	inc    string
	ndev   int
	buses  []string
	active bool   // mnnvl: fabric usable
	why    string // mnnvl: why not
	info   Info

	// peers is the initiator side, by peer incarnation; its goroutines
	// (batches, kernel completions, readers) are the transport's.
	peers *fdshare.Peers[*peer]

	devMu sync.Mutex
	devs  map[int]*device

	mu     sync.Mutex
	byReg  map[*transfer.Region]uint64 // served region -> id
	pinned map[*transfer.Region]*pin   // local host regions registered for the GPU
	closed bool
}

var (
	_ transfer.Transport  = (*Transport)(nil)
	_ transfer.PageLister = (*Transport)(nil)
)

// New returns the nvlink transport, or an error saying why no GPU transport
// can work in this process (no driver, no device, built without cgo).
func New(cfg Config) (*Transport, error) {
	return newTransport(Name, false, cfg)
}

func newTransport(name string, fabric bool, cfg Config) (*Transport, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	n, err := cuda.DeviceCount()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if n == 0 {
		return nil, fmt.Errorf("%s: %w", name, cuda.ErrNoDevice)
	}
	buses := make([]string, n)
	for i := range buses {
		d, err := cuda.GetDevice(i)
		if err == nil {
			buses[i], err = d.PCIBusID()
		}
		if err != nil {
			return nil, fmt.Errorf("%s: GPU %d: %w", name, i, err)
		}
		buses[i] = normBus(buses[i])
	}
	t := &Transport{
		name: name, fabric: fabric, cfg: cfg, lg: zap.NewNop(), ndev: n, buses: buses, active: !fabric,
		devs:  map[int]*device{},
		srv:   fdshare.NewServer(fdshare.ServerConfig{Kind: Name, Wire: &wire}),
		byReg: map[*transfer.Region]uint64{}, pinned: map[*transfer.Region]*pin{},
	}
	t.peers = fdshare.NewPeers(t.newPeer, (*peer).shut)
	return t, nil
}

// Name implements transfer.Transport.
func (t *Transport) Name() string { return t.name }

// PageLists says the transport moves page-list tasks page by page.
func (t *Transport) PageLists() bool { return true }

// Reach implements transfer.Transport: nvlink serves the same machine;
// an active mnnvl peers in the same NVLink domain, which may be other
// machines (an inactive one claims no reach beyond the machine, so it does
// not widen the engine's default registration scope).
func (t *Transport) Reach() transfer.Reach {
	if t.fabric && t.active {
		return transfer.ReachNetwork
	}
	return transfer.ReachSameMachine
}

// Start listens on the abstract unix socket (nvlink) or decides whether the
// fabric is usable (mnnvl).
func (t *Transport) Start(h transfer.Host) error {
	t.h = h
	t.lg = h.Logger().Named(t.name)
	t.inc = h.Self().Incarnation
	t.info = Info{Version: protocolVersion, GPUs: t.buses}
	if t.fabric {
		return t.startFabric()
	}
	if err := t.srv.Start(h, t.lg); err != nil {
		return err
	}
	t.sock = t.srv.Socket()
	t.info.Socket = t.sock
	return nil
}

// Info implements transfer.Transport (nil for an inactive mnnvl).
func (t *Transport) Info() json.RawMessage {
	if !t.active {
		return nil
	}
	b, _ := json.Marshal(t.info)
	return b
}

// Active reports whether the transport serves anything (false for an mnnvl
// transport whose fabric is unusable); Reason says why not.
func (t *Transport) Active() bool { return t.active }

// Reason is why the transport is inactive ("" when active).
func (t *Transport) Reason() string { return t.why }

// served is a region this process serves, as export prepares it.
type served struct {
	kind     string
	fd       int // vmm-fd, host: this transport's own fd
	key      [64]byte
	size     uint64
	off      uint64
	gran     uint64
	writable bool
}

func (s *served) wireKind() byte {
	switch s.kind {
	case KindVMMFD:
		return wireVMMFD
	case KindIPC:
		return wireIPC
	case KindHost:
		return wireHost
	}
	return wireVMMFabric
}

// item is what the server hands peers for s: its fd (vmm-fd, host) and the
// map reply's fields.
func (s *served) item() fdshare.Item {
	it := fdshare.Item{FD: s.fd, Reply: fdshare.Packet{Kind: s.wireKind(), Offset: s.off, Size: s.size, Gran: s.gran, Key: s.key}}
	if s.writable {
		it.Reply.Flags = fdshare.FlagWritable
	}
	return it
}

// RegisterRegion publishes a handle for GPU memory it can export (a
// transfer.Memory given WithMemory, such as a cuda.Pool, or cuMemAlloc
// memory through legacy IPC) and
// for memfd-backed host memory; anything else is ErrCannotRegister with the
// reason.
func (t *Transport) RegisterRegion(r *transfer.Region) (json.RawMessage, error) {
	if !t.active {
		return nil, fmt.Errorf("%w: %s inactive: %s", transfer.ErrCannotRegister, t.name, t.why)
	}
	s, h, err := t.export(r)
	if err != nil {
		return nil, err
	}
	id, err := t.srv.Add(s.item()) // the server owns s.fd now
	if err != nil {
		return nil, err
	}
	t.mu.Lock()
	t.byReg[r] = id
	t.mu.Unlock()
	h.ID = id
	b, _ := json.Marshal(h)
	return b, nil
}

// export prepares what peers need for r.
func (t *Transport) export(r *transfer.Region) (*served, Handle, error) {
	cannot := func(format string, a ...any) (*served, Handle, error) {
		return nil, Handle{}, fmt.Errorf("%w: %s: %v region [%#x, +%d): %s", transfer.ErrCannotRegister, t.name,
			r.Location, r.Addr, r.Len, fmt.Sprintf(format, a...))
	}
	writable := r.Access&transfer.AccessWrite != 0
	s := &served{fd: -1, writable: writable}
	switch r.Location.Kind {
	case transfer.CPU:
		if t.fabric {
			return cannot("mnnvl serves GPU memory only")
		}
		if r.Host == nil || r.Host.FD() < 0 {
			return cannot("host memory is not memfd-backed (allocate it with Engine.AllocHost or register it WithHostMemory), so GPU peers cannot map it")
		}
		if r.HostOffset < 0 || uint64(r.HostOffset)+r.Len > uint64(r.Host.Size()) {
			return nil, Handle{}, fmt.Errorf("nvlink: region of %d bytes at offset %d does not fit its host memory of %d bytes", r.Len, r.HostOffset, r.Host.Size())
		}
		// Peers that may only read get the memfd reopened read-only.
		fd, err := fdshare.ShareMemfd(r.Host.FD(), writable)
		if err != nil {
			return nil, Handle{}, fmt.Errorf("nvlink: %w", err)
		}
		s.kind, s.fd, s.off, s.size = KindHost, fd, uint64(r.HostOffset), uint64(r.HostOffset)+r.Len
		return s, Handle{Kind: KindHost, Device: -1, Size: s.size, Offset: s.off}, nil
	case transfer.CUDA:
	default:
		return cannot("unknown memory kind")
	}
	dev := r.Location.Index
	if dev < 0 || dev >= t.ndev {
		return cannot("this process sees %d GPU(s)", t.ndev)
	}
	h := Handle{Device: dev, PCIBusID: t.buses[dev]}
	if m := r.Memory; m != nil {
		base := m.Base()
		e, err := m.Share()
		if err != nil {
			return cannot("%v", err)
		}
		bad := ""
		switch {
		case e.Device != dev:
			bad = fmt.Sprintf("the memory lives on GPU %d", e.Device)
		case e.Kind != transfer.HandleFabric && t.fabric:
			bad = fmt.Sprintf("the memory is %s shareable, not fabric", e.Kind)
		case e.Kind != transfer.HandleFabric && e.Kind != transfer.HandlePosixFD:
			bad = fmt.Sprintf("the memory's handle kind %q is not importable", e.Kind)
		case e.Kind == transfer.HandleFabric && len(e.Fabric) != len(s.key):
			bad = fmt.Sprintf("fabric handle of %d bytes", len(e.Fabric))
		case r.End() > base+e.Size:
			bad = fmt.Sprintf("the shared handle covers [%#x, +%d) only", base, e.Size)
		}
		if bad != "" {
			e.Close()
			return cannot("%s", bad)
		}
		s.size, s.off, s.gran = e.Size, r.Addr-base, e.Granularity
		h.Size, h.Offset, h.Granularity = s.size, s.off, s.gran
		if e.Kind == transfer.HandlePosixFD {
			s.kind, s.fd, h.Kind = KindVMMFD, e.FD, KindVMMFD
		} else {
			s.kind, h.Kind = KindVMMFabric, KindVMMFabric
			copy(s.key[:], e.Fabric)
			if t.fabric {
				h.Fabric = append([]byte(nil), e.Fabric...)
			}
		}
		return s, h, nil
	}
	if t.fabric {
		return cannot("not fabric-shareable memory (register a FABRIC pool WithMemory(pool))")
	}
	d, err := t.device(dev)
	if err != nil {
		return cannot("%v", err)
	}
	e, err := d.ctx.ExportIPC(cuda.DevicePtr(r.Addr))
	if err != nil {
		return cannot("no shareable memory given (WithMemory) and legacy IPC export failed: %v", err)
	}
	if e.Offset+r.Len > e.Size {
		return cannot("spans beyond its cuMemAlloc allocation of %d bytes", e.Size)
	}
	s.kind, s.size, s.off = KindIPC, e.Size, e.Offset
	copy(s.key[:], e.Handle[:])
	h.Kind, h.Size, h.Offset = KindIPC, e.Size, e.Offset
	return s, h, nil
}

// UnregisterRegion forgets a served region (peers are told to drop it) or a
// local host region pinned for the GPU.
func (t *Transport) UnregisterRegion(r *transfer.Region) {
	t.mu.Lock()
	id, ok := t.byReg[r]
	delete(t.byReg, r)
	pn := t.pinned[r]
	delete(t.pinned, r)
	t.mu.Unlock()
	if pn != nil {
		pn.release()
	}
	if ok {
		t.srv.Remove(id)
	}
}

// CanServe implements transfer.Transport: local GPU memory to a peer's GPU
// or host region, local host memory to a peer's GPU region, when the peer
// published a handle of this transport.
func (t *Transport) CanServe(loc transfer.Location, peer *transfer.Descriptor, rem *transfer.RegionInfo) bool {
	if !t.active {
		return false
	}
	if inf := peer.Transports[t.name]; len(inf) == 0 || string(inf) == "null" { // absent or inactive
		return false
	}
	if _, ok := rem.Handles[t.name]; !ok {
		return false
	}
	if t.fabric && !t.sameFabric(peer) {
		return false
	}
	switch loc.Kind {
	case transfer.CUDA:
		return loc.Index >= 0 && loc.Index < t.ndev
	case transfer.CPU:
		return rem.Location.Kind == transfer.CUDA
	}
	return false
}

// DropPeer releases a peer incarnation's imports and closes its socket.
func (t *Transport) DropPeer(d *transfer.Descriptor) { t.peers.Drop(d) }

// Close stops serving (listener, served connections, exported fds),
// closes every peer connection and releases its imports once the kernels
// using them finished, waits for the transport's goroutines (and so for
// the kernels in flight), then releases pinned host memory and the per-GPU
// streams and copiers.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	t.byReg = map[*transfer.Region]uint64{}
	pins := t.pinned
	t.pinned = map[*transfer.Region]*pin{}
	t.mu.Unlock()
	var errs []error
	if e := t.srv.Close(); e != nil {
		errs = append(errs, e)
	}
	t.peers.Close()
	for _, pn := range pins {
		pn.release()
	}
	t.devMu.Lock()
	for _, d := range t.devs {
		errs = append(errs, d.close())
	}
	t.devs = map[int]*device{}
	t.devMu.Unlock()
	return errors.Join(errs...)
}

// busIndex is the local ordinal of the GPU with PCI bus id bus (-1 if this
// process does not see it).
func (t *Transport) busIndex(bus string) int {
	bus = normBus(bus)
	for i, b := range t.buses {
		if b == bus && bus != "" {
			return i
		}
	}
	return -1
}

func normBus(s string) string {
	b := []byte(s)
	for i, c := range b {
		if c >= 'A' && c <= 'F' {
			b[i] = c + 'a' - 'A'
		}
	}
	s = string(b)
	// "00000000:19:00.0" (NVML) and "0000:19:00.0" (CUDA) name one device.
	for len(s) > 12 && s[0] == '0' && s[4] != ':' {
		s = s[1:]
	}
	return s
}
