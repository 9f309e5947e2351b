// Package rdma is mooncake-go's RDMA transport: RDMA WRITE and READ over
// reliable-connected queue pairs, through the verbs interface (libibverbs
// at run time, or the in-process fake HCA in tests).
//
// Each local NIC gets a protection domain and one completion queue, polled
// by one goroutine. Registered host regions are registered with every NIC
// (ibv_reg_mr), GPU regions through a dma-buf (ibv_reg_dmabuf_mr); GPU
// memory the NICs cannot reach that way is staged through pinned host
// buffers on either side (stage.go). Queue pairs to a peer (one per local NIC, paired round-robin
// with the peer's NICs) are set up over a connection of kind "rdma" opened
// through the engine's handshake, so only a peer that proved the cluster
// secret learns a QP number or a remote key: keys are never in the
// descriptor, which a registry may show to anyone; the initiator asks the
// target for a region's keys on that connection. A task is cut into slices
// of Config.SliceSize spread over the peer's queue pairs; a slice whose queue
// pair fails (retry exceeded, flushed) is posted again on another one; a
// refusal by the remote HCA (remote access error: the region is gone or
// the key revoked) fails its task. When a batch's context ends, the queue
// pairs it used are moved to the error state, which flushes its requests, so
// a task is reported only once the HCA no longer touches its memory.
// docs/RDMA.md has the design, the tests and a runbook.
package rdma

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math/rand/v2"
	"net"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/internal/staging"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

// Name is the transport's name in descriptors, logs and metrics, and the
// connection kind of its control connections.
const Name = "rdma"

const version = 1

// Sentinel errors.
var (
	// ErrNoDevice: no usable RDMA device (none found, a named one missing,
	// or its port not active). Errors name the device.
	ErrNoDevice = errors.New("rdma: no usable RDMA device")
	// ErrPath: a queue pair failed (every path to the peer, once retries
	// on the others are spent).
	ErrPath = errors.New("rdma: queue pair failed")
)

// Config configures the transport. Zero values mean the defaults noted.
type Config struct {
	// Provider opens devices. Required: internal/ibv's for real hardware,
	// verbs/fake's in tests.
	Provider verbs.Provider
	// Devices are the NICs to use (default: every device the provider
	// lists). A named device that does not exist, or whose port is not
	// active, makes Start fail naming it.
	Devices []string
	// GPUDevices are the NICs for memory on each GPU (cuda:N), NUMADevices
	// those for host memory on each NUMA node (cpu:N): slices of a task go
	// to these NICs first, to the others only when these fail. Missing
	// entries mean every NIC.
	GPUDevices  map[int][]string
	NUMADevices map[int][]string
	// Port is the HCA port (default 1); GIDIndex the GID table entry
	// (default 0; RoCE v2 setups often need 3).
	Port     uint8
	GIDIndex int
	// GIDIndexes overrides GIDIndex per NIC (RoCEv2Indexes finds the
	// RoCE v2 entries in sysfs).
	GIDIndexes map[string]int
	// SliceSize is the largest work request: larger tasks and pages are
	// cut into slices of this size spread over the NICs (default 256 KiB).
	SliceSize int
	// MaxWR bounds the outstanding work requests of one queue pair
	// (default 128); CQDepth those of one NIC (default 4096).
	MaxWR   int
	CQDepth int
	// Tries bounds how often one slice is posted (default: NICs + 1).
	Tries int
	// StagingSize is the host staging for GPU memory without GPUDirect
	// RDMA: per peer on the initiator, per served connection on the target
	// (default 16 MiB). MaxServedStaging bounds the served staging of all
	// connections together (default 64 * StagingSize).
	StagingSize      int
	MaxServedStaging int64
	// Registerer gets the transport's metrics (nil: none); an engine's
	// second rdma transport on one registry shares the series.
	Registerer prometheus.Registerer
}

const (
	defaultSlice   = 256 << 10
	defaultMaxWR   = 128
	defaultCQDepth = 4096
	defaultStaging = 16 << 20
	maxMsg         = 1 << 20 // control message bound
)

// Validate reports a configuration the transport cannot use.
func (c *Config) Validate() error {
	switch {
	case c.Provider == nil:
		return errors.New("rdma: config: no verbs provider")
	case c.SliceSize < 0 || c.SliceSize > 1<<30:
		return fmt.Errorf("rdma: config: slice size %d not in [0, 1 GiB]", c.SliceSize)
	case c.MaxWR < 0 || c.MaxWR > 1<<14:
		return fmt.Errorf("rdma: config: max WR %d not in [0, 16384]", c.MaxWR)
	case c.CQDepth < 0 || c.CQDepth > 1<<16:
		return fmt.Errorf("rdma: config: CQ depth %d not in [0, 65536]", c.CQDepth)
	case c.GIDIndex < 0 || c.GIDIndex > 255:
		return fmt.Errorf("rdma: config: GID index %d not in [0, 255]", c.GIDIndex)
	case c.Tries < 0:
		return fmt.Errorf("rdma: config: negative tries %d", c.Tries)
	case c.StagingSize < 0 || c.StagingSize > 1<<30:
		return fmt.Errorf("rdma: config: staging size %d not in [0, 1 GiB]", c.StagingSize)
	case c.MaxServedStaging < 0:
		return fmt.Errorf("rdma: config: negative max served staging %d", c.MaxServedStaging)
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.Port == 0 {
		c.Port = 1
	}
	if c.SliceSize == 0 {
		c.SliceSize = defaultSlice
	}
	if c.MaxWR == 0 {
		c.MaxWR = defaultMaxWR
	}
	if c.CQDepth == 0 {
		c.CQDepth = defaultCQDepth
	}
	if c.CQDepth < c.MaxWR {
		c.CQDepth = c.MaxWR
	}
	if c.StagingSize == 0 {
		c.StagingSize = defaultStaging
	}
	if c.MaxServedStaging == 0 {
		c.MaxServedStaging = 64 * int64(c.StagingSize)
	}
	return c
}

// Transport is the rdma transport. Create it with New and hand it to
// transfer.New; the engine starts and closes it.
type Transport struct {
	cfg    Config
	cfgErr error
	h      transfer.Host
	lg     *zap.Logger
	nics   []*nic
	m      *metrics

	mu            sync.Mutex
	regions       map[*transfer.Region]*regEntry
	gen           atomic.Uint64   // registrations so far
	gpus          map[int]int     // GPU ordinal -> regions registered
	warned        map[string]bool // staging fallback reasons logged
	servedStaging *staging.Budget // staging of served connections
	peers         map[string]*peer
	served        map[net.Conn]struct{}
	closed        bool

	ctx    context.Context // canceled by Close: batches end
	cancel context.CancelFunc
	wg     sync.WaitGroup // batches, served connections
	// The pollers stop after the batches, so an ending batch still gets
	// its completions.
	pollCtx  context.Context
	stopPoll context.CancelFunc
	pollers  sync.WaitGroup
}

var (
	_ transfer.Transport  = (*Transport)(nil)
	_ transfer.PageLister = (*Transport)(nil)
)

// New returns an rdma transport. An invalid cfg makes Start fail.
func New(cfg Config) *Transport {
	t := &Transport{cfgErr: cfg.Validate(), cfg: cfg.withDefaults(), regions: map[*transfer.Region]*regEntry{}, gpus: map[int]int{},
		warned: map[string]bool{}, peers: map[string]*peer{}, served: map[net.Conn]struct{}{}}
	t.servedStaging = &staging.Budget{Max: t.cfg.MaxServedStaging}
	t.ctx, t.cancel = context.WithCancel(context.Background())
	t.pollCtx, t.stopPoll = context.WithCancel(context.Background())
	return t
}

// Config returns the configuration in use (defaults filled in).
func (t *Transport) Config() Config { return t.cfg }

func (t *Transport) Name() string          { return Name }
func (t *Transport) Reach() transfer.Reach { return transfer.ReachNetwork }

// PageLists says the transport moves page-list tasks page by page.
func (t *Transport) PageLists() bool { return true }

// nic is one open device with its PD, CQ and poller.
type nic struct {
	idx   int
	name  string
	dev   verbs.Device
	pd    verbs.PD
	cq    verbs.CQ
	port  uint8
	attr  verbs.PortAttr
	gid   verbs.GID
	gidIx int

	credits chan struct{} // one per CQ entry: posting never overruns the CQ
	kick    chan struct{}

	mu      sync.Mutex
	pending map[uint64]*slice
	nextID  uint64
	failed  error // the CQ failed: nothing more is posted here
}

// Start opens the devices and registers the connection handler.
func (t *Transport) Start(h transfer.Host) error {
	if t.cfgErr != nil {
		return t.cfgErr
	}
	t.h = h
	t.lg = h.Logger().Named(Name)
	m, err := newMetrics(t.cfg.Registerer)
	if err != nil {
		return fmt.Errorf("rdma: metrics: %w", err)
	}
	t.m = m
	names := t.cfg.Devices
	if len(names) == 0 {
		if names, err = t.cfg.Provider.Devices(); err != nil {
			return fmt.Errorf("%w: listing devices: %w", ErrNoDevice, err)
		}
		if len(names) == 0 {
			return fmt.Errorf("%w: the verbs library lists none", ErrNoDevice)
		}
	}
	for i, name := range names {
		n, err := t.openNIC(i, name)
		if err != nil {
			t.closeNICs()
			return err
		}
		t.nics = append(t.nics, n)
	}
	if t.cfg.Tries == 0 {
		t.cfg.Tries = len(t.nics) + 1
	}
	for _, n := range t.nics {
		t.pollers.Add(1)
		go t.poll(n)
		t.lg.Info("rdma device ready", zap.String("nic", n.name), zap.Uint8("port", n.port), zap.Int("gid_index", n.gidIx), zap.String("gid", n.gid.String()),
			zap.Uint16("lid", n.attr.LID), zap.Int("mtu", n.attr.ActiveMTU.Bytes()), zap.Int("link_layer", int(n.attr.LinkLayer)))
	}
	for _, g := range slices.Sorted(maps.Keys(t.cfg.GPUDevices)) {
		t.lg.Info("rdma NICs for GPU memory", zap.Int("gpu", g), zap.Strings("nics", t.cfg.GPUDevices[g]))
	}
	h.Handle(Name, t.serve)
	return nil
}

func (t *Transport) openNIC(i int, name string) (*nic, error) {
	dev, err := t.cfg.Provider.Open(name)
	if err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrNoDevice, name, err)
	}
	gidIx := t.cfg.GIDIndex
	if g, ok := t.cfg.GIDIndexes[name]; ok {
		gidIx = g
	}
	n := &nic{idx: i, name: name, dev: dev, port: t.cfg.Port, gidIx: gidIx, pending: map[uint64]*slice{},
		credits: make(chan struct{}, t.cfg.CQDepth), kick: make(chan struct{}, 1)}
	fail := func(err error) (*nic, error) {
		n.close()
		return nil, fmt.Errorf("%w: %s: %w", ErrNoDevice, name, err)
	}
	if n.attr, err = dev.QueryPort(n.port); err != nil {
		return fail(err)
	}
	if n.attr.State != verbs.PortActive {
		return fail(fmt.Errorf("port %d is not active (state %d)", n.port, n.attr.State))
	}
	if n.gid, err = dev.QueryGID(n.port, n.gidIx); err != nil {
		return fail(err)
	}
	if n.attr.LinkLayer == verbs.LinkEthernet && n.gid.IsZero() {
		return fail(fmt.Errorf("RoCE port %d has no GID at index %d", n.port, n.gidIx))
	}
	if n.pd, err = dev.AllocPD(); err != nil {
		return fail(err)
	}
	if n.cq, err = dev.CreateCQ(t.cfg.CQDepth); err != nil {
		return fail(err)
	}
	return n, nil
}

func (n *nic) close() {
	if n.cq != nil {
		n.cq.Close()
	}
	if n.pd != nil {
		n.pd.Close()
	}
	n.dev.Close()
}

func (t *Transport) closeNICs() {
	for _, n := range t.nics {
		n.close()
	}
	t.nics = nil
}

type nicInfo struct {
	Name string `json:"name"`
	GID  string `json:"gid"`
	LID  uint16 `json:"lid"`
	MTU  int    `json:"mtu"` // ibv_mtu
}

type info struct {
	Version int       `json:"version"`
	NICs    []nicInfo `json:"nics"`
}

// Info lists the NICs (names, GIDs, LIDs: addresses, not secrets).
func (t *Transport) Info() json.RawMessage {
	in := info{Version: version}
	for _, n := range t.nics {
		in.NICs = append(in.NICs, nicInfo{Name: n.name, GID: n.gid.String(), LID: n.attr.LID, MTU: int(n.attr.ActiveMTU)})
	}
	b, _ := json.Marshal(in)
	return b
}

// accessFlags are the MR rights for a region peers get access a on.
func accessFlags(a transfer.Access) verbs.Access {
	v := verbs.AccessLocalWrite
	if a&transfer.AccessRead != 0 {
		v |= verbs.AccessRemoteRead
	}
	if a&transfer.AccessWrite != 0 {
		v |= verbs.AccessRemoteWrite
	}
	return v
}

// DMABufMemory is device memory that exports a dma-buf for a range (for
// CUDA, cuMemGetHandleForAddressRange: internal/cuda's Pool), so that NICs
// register it with ibv_reg_dmabuf_mr and move its bytes directly
// (GPUDirect RDMA).
type DMABufMemory interface {
	transfer.Memory
	// DMABuf returns a dma-buf file descriptor holding [addr, addr+n) at
	// offset off; the caller closes fd.
	DMABuf(addr, n uint64) (fd int, off uint64, err error)
}

// regEntry is one registered local region.
type regEntry struct {
	mrs    []verbs.MR            // per NIC; nil for staged memory
	staged transfer.DeviceMemory // GPU memory the NICs cannot reach: staged through host buffers
	kind   string                // host, dmabuf, staged (metrics)
}

// RegisterRegion registers the region with every NIC: host memory with
// ibv_reg_mr, GPU memory that offers a dma-buf (DMABufMemory) with
// ibv_reg_dmabuf_mr. GPU memory without one, or that a NIC refuses, is
// staged through host buffers if it is a transfer.DeviceMemory (no MR of
// its own; logged once per reason and counted). The handle only says the
// region is reachable (and whether it is staged); its keys go to peers on
// request.
func (t *Transport) RegisterRegion(r *transfer.Region) (json.RawMessage, error) {
	e := &regEntry{kind: "host"}
	if r.Location.Kind == transfer.CUDA {
		mrs, reason, err := t.regDMABuf(r)
		if err == nil {
			e.mrs, e.kind = mrs, "dmabuf"
		} else {
			dev, ok := r.Memory.(transfer.DeviceMemory)
			if !ok {
				return nil, fmt.Errorf("%w: rdma: %v memory: %w; and it has no transfer.DeviceMemory to stage through (register it WithMemory)",
					transfer.ErrCannotRegister, r.Location, err)
			}
			e.staged, e.kind = dev, "staged"
			t.fellBack(r, reason, err)
		}
	} else {
		mrs, err := t.regAll(r, "ibv_reg_mr", func(n *nic) (verbs.MR, error) { return n.pd.RegMR(uintptr(r.Addr), r.Len, accessFlags(r.Access)) })
		if err != nil {
			if errors.Is(err, syscall.ENOMEM) {
				err = fmt.Errorf("%w (raise the locked-memory limit: ulimit -l unlimited, or LimitMEMLOCK=infinity in systemd)", err)
			}
			return nil, err
		}
		e.mrs = mrs
	}
	t.mu.Lock()
	t.regions[r] = e
	if r.Location.Kind == transfer.CUDA {
		t.gpus[r.Location.Index]++
	}
	t.mu.Unlock()
	t.m.regions.WithLabelValues(e.kind).Inc()
	// gen tells initiators that cached keys of an earlier registration at
	// the same address are void.
	if e.staged != nil {
		return json.RawMessage(fmt.Sprintf(`{"nics":0,"gen":%d,"staged":true}`, t.gen.Add(1))), nil
	}
	return json.RawMessage(fmt.Sprintf(`{"nics":%d,"gen":%d}`, len(e.mrs), t.gen.Add(1))), nil
}

// regAll registers with every NIC, or with none.
func (t *Transport) regAll(r *transfer.Region, call string, reg func(*nic) (verbs.MR, error)) ([]verbs.MR, error) {
	mrs := make([]verbs.MR, 0, len(t.nics))
	for _, n := range t.nics {
		m, err := reg(n)
		if err != nil {
			for _, m := range mrs {
				m.Close()
			}
			return nil, fmt.Errorf("rdma: %s: %s %v [%#x, +%d): %w", n.name, call, r.Location, r.Addr, r.Len, err)
		}
		mrs = append(mrs, m)
	}
	return mrs, nil
}

// Reasons GPU memory is staged (metric labels).
const (
	reasonNoDMABuf  = "no_dmabuf"     // the memory offers none
	reasonExport    = "dmabuf_export" // exporting it failed
	reasonRegDMABuf = "reg_dmabuf_mr" // a NIC refused it
)

// regDMABuf registers GPU memory through a dma-buf on every NIC, or says
// why it cannot.
func (t *Transport) regDMABuf(r *transfer.Region) ([]verbs.MR, string, error) {
	dm, ok := r.Memory.(DMABufMemory)
	if !ok {
		return nil, reasonNoDMABuf, errors.New("offers no dma-buf for GPUDirect RDMA")
	}
	fd, off, err := dm.DMABuf(r.Addr, r.Len)
	if err != nil {
		return nil, reasonExport, fmt.Errorf("dma-buf of [%#x, +%d): %w", r.Addr, r.Len, err)
	}
	defer closeFD(fd)
	mrs, err := t.regAll(r, "ibv_reg_dmabuf_mr", func(n *nic) (verbs.MR, error) {
		return n.pd.RegDmabufMR(off, r.Len, r.Addr, fd, accessFlags(r.Access))
	})
	if err != nil {
		return nil, reasonRegDMABuf, err
	}
	return mrs, "", nil
}

// fellBack counts a GPU region staged for want of GPUDirect RDMA and logs
// the first of each reason as a warning.
func (t *Transport) fellBack(r *transfer.Region, reason string, err error) {
	t.m.fallbacks.WithLabelValues(reason).Inc()
	t.mu.Lock()
	first := !t.warned[reason]
	t.warned[reason] = true
	t.mu.Unlock()
	log := t.lg.Debug
	if first {
		log = t.lg.Warn
	}
	log("rdma stages GPU memory through host buffers (no GPUDirect RDMA for it)", zap.String("location", r.Location.String()),
		zap.Uint64("addr", r.Addr), zap.Uint64("bytes", r.Len), zap.String("reason", reason), zap.Error(err))
}

// UnregisterRegion deregisters the region's MRs: once it returns, no
// HCA touches the memory and its keys are void.
func (t *Transport) UnregisterRegion(r *transfer.Region) {
	t.mu.Lock()
	e, ok := t.regions[r]
	delete(t.regions, r)
	if ok && r.Location.Kind == transfer.CUDA {
		t.gpus[r.Location.Index]--
	}
	t.mu.Unlock()
	if !ok {
		return
	}
	t.m.regions.WithLabelValues(e.kind).Dec()
	for i, m := range e.mrs {
		if err := m.Close(); err != nil {
			t.lg.Error("ibv_dereg_mr", zap.String("nic", t.nics[i].name), zap.Uint64("addr", r.Addr), zap.Error(err))
		}
	}
}

// CanServe: local host memory, or local GPU memory registered with rdma
// (through dma-buf or staged), and a remote region the peer registered
// with rdma.
func (t *Transport) CanServe(loc transfer.Location, peer *transfer.Descriptor, rem *transfer.RegionInfo) bool {
	if loc.Kind == transfer.CUDA {
		t.mu.Lock()
		n := t.gpus[loc.Index]
		t.mu.Unlock()
		if n == 0 {
			return false
		}
	} else if loc.Kind != transfer.CPU {
		return false
	}
	if _, ok := peer.Transports[Name]; !ok {
		return false
	}
	_, ok := rem.Handles[Name]
	return ok
}

// localEntry returns the registration of the local region holding
// [addr, addr+n).
func (t *Transport) localEntry(r *transfer.Region, addr, n uint64) (*regEntry, error) {
	t.mu.Lock()
	e := t.regions[r]
	t.mu.Unlock()
	if e == nil || r == nil {
		return nil, &transfer.RangeError{Addr: addr, Len: n, Err: transfer.ErrOutOfBounds, Detail: "rdma: local memory not registered with rdma"}
	}
	return e, nil
}

// lkeys are the entry's lkeys per NIC.
func (e *regEntry) lkeys() []uint32 {
	keys := make([]uint32, len(e.mrs))
	for i, m := range e.mrs {
		keys[i] = m.LKey()
	}
	return keys
}

// Close fails what is in flight, closes every queue pair and connection,
// then the devices.
func (t *Transport) Close() error {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return nil
	}
	t.closed = true
	peers := t.peers
	t.peers = map[string]*peer{}
	var served []net.Conn
	for c := range t.served {
		served = append(served, c)
	}
	t.mu.Unlock()
	t.cancel()
	for _, p := range peers {
		p.retire()
	}
	for _, c := range served {
		c.Close()
	}
	t.wg.Wait()
	t.stopPoll()
	t.pollers.Wait()
	t.mu.Lock()
	regs := t.regions
	t.regions = map[*transfer.Region]*regEntry{}
	t.mu.Unlock()
	for _, e := range regs {
		for _, m := range e.mrs {
			m.Close()
		}
		t.m.regions.WithLabelValues(e.kind).Dec()
	}
	t.closeNICs()
	return nil
}

// DropPeer retires the queue pairs of that incarnation of the peer.
func (t *Transport) DropPeer(d *transfer.Descriptor) {
	t.mu.Lock()
	p := t.peers[d.Name]
	if p == nil || p.inc != d.Incarnation {
		t.mu.Unlock()
		return
	}
	delete(t.peers, d.Name)
	t.mu.Unlock()
	p.retire()
}

// ---- control messages ----

type laneReq struct {
	NIC int    `json:"nic"` // the target's NIC index
	QPN uint32 `json:"qpn"`
	PSN uint32 `json:"psn"`
	GID string `json:"gid"`
	LID uint16 `json:"lid"`
	MTU int    `json:"mtu"`
}

type laneResp struct {
	QPN uint32 `json:"qpn"`
	PSN uint32 `json:"psn"`
}

type message struct {
	Op    string     `json:"op"` // "connect", "keys", "stage", "copy"
	Lanes []laneReq  `json:"lanes,omitempty"`
	Addr  uint64     `json:"addr,omitempty"`
	Err   string     `json:"err,omitempty"`
	Resp  []laneResp `json:"resp,omitempty"`
	// keys reply: the region and its rkey on each of the target's NICs.
	Len    uint64   `json:"len,omitempty"`
	Access uint8    `json:"access,omitempty"`
	RKeys  []uint32 `json:"rkeys,omitempty"`
	// keys reply: the region is staged (no rkeys: see "stage", "copy").
	Staged bool `json:"staged,omitempty"`
	// copy: device copies to or from the connection's staging area, and
	// the reply's result of each ("" for success).
	Copies []copyReq `json:"copies,omitempty"`
	Errs   []string  `json:"errs,omitempty"`
}

func writeMsg(w io.Writer, m *message) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	var hdr [4]byte
	binary.BigEndian.PutUint32(hdr[:], uint32(len(b)))
	_, err = w.Write(append(hdr[:], b...))
	return err
}

func readMsg(r io.Reader) (*message, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return nil, err
	}
	n := binary.BigEndian.Uint32(hdr[:])
	if n > maxMsg {
		return nil, fmt.Errorf("rdma: control message of %d bytes (limit %d)", n, maxMsg)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	var m message
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("rdma: bad control message: %w", err)
	}
	return &m, nil
}

// serve answers one peer's control connection: it sets up the target side
// of its queue pairs and hands out keys of registered regions. The peer
// proved the cluster secret before the engine called serve.
func (t *Transport) serve(conn net.Conn, from transfer.Hello) {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		conn.Close()
		return
	}
	t.served[conn] = struct{}{}
	t.wg.Add(1)
	t.mu.Unlock()
	var qps []verbs.QP
	st := &servedStaging{t: t}
	defer func() {
		conn.Close()
		for _, q := range qps {
			q.Close()
		}
		st.close() // after the QPs: no HCA touches it now
		t.mu.Lock()
		delete(t.served, conn)
		t.mu.Unlock()
		t.wg.Done()
	}()
	lg := t.lg.With(zap.String("peer", from.Name))
	for {
		m, err := readMsg(conn)
		if err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
				lg.Debug("control connection ended", zap.Error(err))
			}
			return
		}
		var resp *message
		switch m.Op {
		case "connect":
			if qps != nil {
				resp = &message{Op: m.Op, Err: "queue pairs already set up on this connection"}
				break
			}
			resp, qps = t.accept(m)
		case "keys":
			resp = t.keysFor(m.Addr)
		case "stage":
			resp = st.setup(m.Addr)
		case "copy":
			var broken bool
			if resp, broken = st.copy(m); broken {
				conn.SetWriteDeadline(time.Now().Add(t.h.Timeout()))
				writeMsg(conn, resp)
				lg.Warn("a device copy outlived its bound: ending the control connection", zap.Strings("errs", resp.Errs))
				return
			}
		default:
			resp = &message{Op: m.Op, Err: fmt.Sprintf("unknown op %q", m.Op)}
		}
		conn.SetWriteDeadline(time.Now().Add(t.h.Timeout()))
		if err := writeMsg(conn, resp); err != nil {
			lg.Debug("control reply", zap.Error(err))
			return
		}
		if resp.Err != "" {
			lg.Warn("refused a control request", zap.String("op", m.Op), zap.String("reason", resp.Err))
		}
	}
}

// accept creates the target's queue pairs for a connect request.
func (t *Transport) accept(m *message) (*message, []verbs.QP) {
	resp := &message{Op: "connect"}
	var made []verbs.QP
	fail := func(err error) (*message, []verbs.QP) {
		for _, q := range made {
			q.Close()
		}
		return &message{Op: "connect", Err: err.Error()}, nil
	}
	if len(m.Lanes) == 0 || len(m.Lanes) > 64 {
		return fail(fmt.Errorf("%d lanes asked (1..64)", len(m.Lanes)))
	}
	for _, l := range m.Lanes {
		if l.NIC < 0 || l.NIC >= len(t.nics) {
			return fail(fmt.Errorf("no NIC %d here", l.NIC))
		}
		n := t.nics[l.NIC]
		gid, err := parseGID(l.GID)
		if err != nil {
			return fail(err)
		}
		q, err := n.pd.CreateQP(n.cq, 1) // the target posts nothing
		if err != nil {
			return fail(fmt.Errorf("%s: create QP: %w", n.name, err))
		}
		made = append(made, q)
		psn := rand.Uint32() & 0xffffff
		r := verbs.Remote{QPN: l.QPN, PSN: l.PSN, GID: gid, LID: l.LID, MTU: min(verbs.MTU(l.MTU), n.attr.ActiveMTU), Port: n.port, GIDIndex: n.gidIx}
		if err := connectQP(q, n.port, r, psn); err != nil {
			return fail(fmt.Errorf("%s: %w", n.name, err))
		}
		resp.Resp = append(resp.Resp, laneResp{QPN: q.Num(), PSN: psn})
	}
	return resp, made
}

// connectQP moves q RESET -> INIT -> RTR -> RTS toward r.
func connectQP(q verbs.QP, port uint8, r verbs.Remote, psn uint32) error {
	if err := q.Init(port, verbs.AccessRemoteRead|verbs.AccessRemoteWrite|verbs.AccessLocalWrite); err != nil {
		return fmt.Errorf("QP %#x to INIT: %w", q.Num(), err)
	}
	if err := q.ReadyToReceive(r); err != nil {
		return fmt.Errorf("QP %#x to RTR: %w", q.Num(), err)
	}
	if err := q.ReadyToSend(psn); err != nil {
		return fmt.Errorf("QP %#x to RTS: %w", q.Num(), err)
	}
	return nil
}

func parseGID(s string) (verbs.GID, error) {
	var g verbs.GID
	ip := net.ParseIP(s)
	if ip == nil || len(ip.To16()) != 16 {
		return g, fmt.Errorf("bad GID %q", s)
	}
	copy(g[:], ip.To16())
	return g, nil
}

// keysFor answers a key request: the rkeys of the registered region
// starting at addr.
func (t *Transport) keysFor(addr uint64) *message {
	t.mu.Lock()
	defer t.mu.Unlock()
	for r, e := range t.regions {
		if r.Addr == addr {
			m := &message{Op: "keys", Addr: addr, Len: r.Len, Access: uint8(r.Access), Staged: e.staged != nil}
			for _, x := range e.mrs {
				m.RKeys = append(m.RKeys, x.RKey())
			}
			return m
		}
	}
	return &message{Op: "keys", Addr: addr, Err: fmt.Sprintf("no region registered at %#x", addr)}
}

// ---- initiator ----

// peer is the initiator's side of one peer incarnation.
type peer struct {
	name, inc string
	ready     chan struct{}
	err       error // set before ready closes
	conn      net.Conn
	connMu    sync.Mutex            // one control exchange at a time
	connErr   atomic.Pointer[error] // an exchange failed: the connection is out of step
	lanes     []*lane
	stg       peerStaging

	keysMu sync.Mutex
	keys   map[uint64]*remoteKeys
	m      *metrics

	mu      sync.Mutex
	users   int
	retired bool
	closed  bool
}

type remoteKeys struct {
	addr, n uint64
	access  transfer.Access
	rkeys   []uint32 // per target NIC
	handle  string   // the region's rdma handle when the keys came: a new one voids them
	staged  bool     // GPU memory the target stages: no rkeys
}

// lane is one queue pair to the peer.
type lane struct {
	p       *peer
	nic     *nic
	rnic    int
	qp      verbs.QP
	credits chan struct{}
	broken  atomic.Pointer[error]
	closeQP sync.Once
	counted bool // in mooncake_rdma_queue_pairs
}

// close destroys the lane's QP once.
func (l *lane) close(m *metrics) {
	l.closeQP.Do(func() {
		l.qp.Close()
		if l.counted {
			m.qps.WithLabelValues(l.nic.name).Dec()
		}
	})
}

func laneNames(ls []*lane) []string {
	var out []string
	for _, l := range ls {
		out = append(out, l.String())
	}
	return out
}

func (l *lane) String() string { return fmt.Sprintf("%s->%s#%d", l.nic.name, l.p.name, l.rnic) }

func (l *lane) healthy() bool { return l.broken.Load() == nil && l.nic.failedErr() == nil }

// breakWith marks the lane failed (first reason wins) and moves its QP to
// ERR, so what is still queued on it flushes.
func (l *lane) breakWith(err error) {
	if l.broken.CompareAndSwap(nil, &err) {
		l.qp.Fail()
	}
}

func (n *nic) failedErr() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.failed
}

// acquire takes a user reference, or reports that the peer is retired.
func (p *peer) acquire() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.retired {
		return false
	}
	p.users++
	return true
}

func (p *peer) release() {
	p.mu.Lock()
	p.users--
	last := p.users == 0 && p.retired && !p.closed
	if last {
		p.closed = true
	}
	p.mu.Unlock()
	if last {
		p.shut()
	}
}

// ref takes another user reference for a holder of one.
func (p *peer) ref() {
	p.mu.Lock()
	p.users++
	p.mu.Unlock()
}

// retire stops new batches from using p; it closes once the last batch
// using it ends.
func (p *peer) retire() {
	p.mu.Lock()
	p.retired = true
	last := p.users == 0 && !p.closed
	if last {
		p.closed = true
	}
	p.mu.Unlock()
	if last {
		p.shut()
	}
}

// shut closes the peer's queue pairs and connection; no batch uses them.
func (p *peer) shut() {
	<-p.ready
	if p.conn != nil {
		p.conn.Close()
	}
	for _, l := range p.lanes {
		l.close(p.m)
	}
	p.stg.close() // after the QPs: no HCA touches it now
}

// peerFor returns a connected peer for d, holding a user reference.
func (t *Transport) peerFor(ctx context.Context, d *transfer.Descriptor) (*peer, error) {
	for {
		t.mu.Lock()
		if t.closed {
			t.mu.Unlock()
			return nil, fmt.Errorf("rdma: %w", transfer.ErrClosed)
		}
		p := t.peers[d.Name]
		var old *peer
		if p != nil && p.inc != d.Incarnation {
			old, p = p, nil
			delete(t.peers, d.Name)
		}
		if p != nil {
			select {
			case <-p.ready:
				if p.err != nil || p.anyBroken() || p.connErr.Load() != nil {
					old, p = p, nil
					delete(t.peers, d.Name)
				}
			default:
			}
		}
		created := false
		if p == nil {
			p = &peer{name: d.Name, inc: d.Incarnation, ready: make(chan struct{}), keys: map[uint64]*remoteKeys{}, m: t.m}
			t.peers[d.Name] = p
			created = true
		}
		ok := p.acquire()
		t.mu.Unlock()
		if old != nil {
			old.retire()
		}
		if !ok {
			continue // retired between the lookup and acquire
		}
		if created {
			p.err = t.connect(ctx, p, d)
			close(p.ready)
		}
		select {
		case <-p.ready:
		case <-ctx.Done():
			p.release()
			return nil, fmt.Errorf("rdma: waiting for queue pairs to %s: %w", d.Name, ctx.Err())
		}
		if p.err != nil {
			p.release()
			t.mu.Lock()
			if t.peers[d.Name] == p {
				delete(t.peers, d.Name)
			}
			t.mu.Unlock()
			p.retire()
			return nil, p.err
		}
		return p, nil
	}
}

// anyBroken reports a lane that failed: the next batch gets new queue
// pairs (batches still using these keep them until they end).
func (p *peer) anyBroken() bool {
	for _, l := range p.lanes {
		if l.broken.Load() != nil {
			return true
		}
	}
	return false
}

// connect opens the control connection and sets up one queue pair per
// local NIC.
func (t *Transport) connect(ctx context.Context, p *peer, d *transfer.Descriptor) error {
	var in info
	if err := json.Unmarshal(d.Transports[Name], &in); err != nil || len(in.NICs) == 0 {
		return fmt.Errorf("rdma: %s publishes no RDMA NICs (%v)", d.Name, err)
	}
	conn, err := t.h.Dial(ctx, d, Name)
	if err != nil {
		return fmt.Errorf("rdma: control connection to %s: %w", d.Name, err)
	}
	p.conn = conn
	req := &message{Op: "connect"}
	for i, n := range t.nics {
		if err := n.failedErr(); err != nil {
			continue // out of use since its CQ failed
		}
		rn := i % len(in.NICs)
		q, err := n.pd.CreateQP(n.cq, t.cfg.MaxWR)
		if err != nil {
			return fmt.Errorf("rdma: %s: create QP to %s: %w", n.name, d.Name, err)
		}
		l := &lane{p: p, nic: n, rnic: rn, qp: q, credits: make(chan struct{}, t.cfg.MaxWR)}
		p.lanes = append(p.lanes, l)
		req.Lanes = append(req.Lanes, laneReq{NIC: rn, QPN: q.Num(), PSN: rand.Uint32() & 0xffffff, GID: n.gid.String(), LID: n.attr.LID, MTU: int(n.attr.ActiveMTU)})
	}
	if len(p.lanes) == 0 {
		return fmt.Errorf("%w: every local NIC is out of use", ErrPath)
	}
	resp, err := p.exchange(ctx, req, t.h.Timeout())
	if err != nil {
		return fmt.Errorf("rdma: connect to %s: %w", d.Name, err)
	}
	if resp.Err != "" || len(resp.Resp) != len(p.lanes) {
		return fmt.Errorf("rdma: %s refused the queue pairs: %s", d.Name, resp.Err)
	}
	for i, l := range p.lanes {
		ri := in.NICs[l.rnic]
		gid, err := parseGID(ri.GID)
		if err != nil {
			return fmt.Errorf("rdma: %s NIC %s: %w", d.Name, ri.Name, err)
		}
		r := verbs.Remote{QPN: resp.Resp[i].QPN, PSN: resp.Resp[i].PSN, GID: gid, LID: ri.LID,
			MTU: min(verbs.MTU(ri.MTU), l.nic.attr.ActiveMTU), Port: l.nic.port, GIDIndex: l.nic.gidIx}
		if err := connectQP(l.qp, l.nic.port, r, req.Lanes[i].PSN); err != nil {
			return fmt.Errorf("rdma: %s to %s %s: %w", l.nic.name, d.Name, ri.Name, err)
		}
	}
	for _, l := range p.lanes {
		t.m.qps.WithLabelValues(l.nic.name).Inc()
		l.counted = true
	}
	t.lg.Info("rdma queue pairs up", zap.String("peer", d.Name), zap.Strings("lanes", laneNames(p.lanes)))
	return nil
}

// exchange sends one control request and reads its reply, within bound
// and ctx.
//
// A failed exchange leaves the connection out of step (a late reply would
// answer the next request): every later one fails, and the next batch
// gets a new peer.
func (p *peer) exchange(ctx context.Context, m *message, bound time.Duration) (r *message, err error) {
	p.connMu.Lock()
	defer p.connMu.Unlock()
	if e := p.connErr.Load(); e != nil {
		return nil, fmt.Errorf("control connection failed earlier: %w", *e)
	}
	if err := ctx.Err(); err != nil {
		return nil, err // nothing sent: the connection is still in step
	}
	defer func() {
		if err != nil {
			p.connErr.CompareAndSwap(nil, &err)
		}
	}()
	dl := time.Now().Add(bound)
	if d, ok := ctx.Deadline(); ok && d.Before(dl) {
		dl = d
	}
	p.conn.SetDeadline(dl)
	stop := context.AfterFunc(ctx, func() { p.conn.SetDeadline(time.Now()) })
	defer stop()
	if err := writeMsg(p.conn, m); err != nil {
		return nil, err
	}
	if r, err = readMsg(p.conn); err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	return r, nil
}

// keysOf returns the remote keys of the region reg (asking the target once).
func (t *Transport) keysOf(ctx context.Context, p *peer, reg *transfer.RegionInfo) (*remoteKeys, error) {
	p.keysMu.Lock()
	k := p.keys[reg.Addr]
	p.keysMu.Unlock()
	if k != nil && k.handle == string(reg.Handles[Name]) {
		return k, nil
	}
	resp, err := p.exchange(ctx, &message{Op: "keys", Addr: reg.Addr}, t.h.Timeout())
	if err != nil {
		return nil, fmt.Errorf("rdma: asking %s for the keys of [%#x, +%d): %w", p.name, reg.Addr, reg.Len, err)
	}
	if resp.Err != "" {
		return nil, &transfer.RangeError{Addr: reg.Addr, Len: reg.Len, Err: transfer.ErrOutOfBounds, Detail: fmt.Sprintf("rdma: %s refused: %s", p.name, resp.Err)}
	}
	k = &remoteKeys{addr: reg.Addr, n: resp.Len, access: transfer.Access(resp.Access), rkeys: resp.RKeys, handle: string(reg.Handles[Name]), staged: resp.Staged}
	p.keysMu.Lock()
	p.keys[reg.Addr] = k
	p.keysMu.Unlock()
	return k, nil
}

func (p *peer) dropKeys(addr uint64) {
	p.keysMu.Lock()
	delete(p.keys, addr)
	p.keysMu.Unlock()
}

// job is one task's slices.
type job struct {
	task *transfer.Task
	left atomic.Int32
	mu   sync.Mutex
	err  error
	b    *batch
}

// slice is one work request.
type slice struct {
	j      *job
	p      *peer
	op     verbs.Opcode
	local  uint64
	remote uint64
	n      uint32
	keys   *remoteKeys
	lkeys  []uint32
	pref   []bool // NICs preferred for the local memory
	lane   *lane
	tries  int
	last   error
	// done, when set, takes the slice's result instead of its job (a
	// staged piece's transfer: its pipeline goes on from there). It must
	// not block.
	done func(error)
}

func (s *slice) finish(err error) {
	if s.done != nil {
		s.done(err)
		return
	}
	s.j.finish(err)
}

// batch is one Submit call.
type batch struct {
	ctx   context.Context
	dead  atomic.Pointer[error] // the batch's context ended: no retries
	jobs  atomic.Int32
	done  chan struct{}
	retry chan *slice
	// staged are the slices of staged pieces, from the batch's pipeline
	// (unbuffered: one is handed over only to the batch's goroutine);
	// loopDone closes when that goroutine stops taking them.
	staged   chan *slice
	loopDone chan struct{}
	used     sync.Map // *lane -> struct{}
	// Requests queued for one post_send list per lane; only the batch's
	// goroutine touches them.
	queued  map[*lane][]queuedWR
	order   []*lane
	scratch []verbs.SendWR
}

func (j *job) finish(err error) {
	if err != nil {
		j.mu.Lock()
		if j.err == nil {
			j.err = err
		}
		j.mu.Unlock()
	}
	if j.left.Add(-1) == 0 {
		j.mu.Lock()
		e := j.err
		j.mu.Unlock()
		j.task.Done(e)
		if j.b.jobs.Add(-1) == 0 {
			close(j.b.done)
		}
	}
}

// Submit moves the tasks over the peer's queue pairs on a goroutine of its
// own; it does not block.
func (t *Transport) Submit(ctx context.Context, d *transfer.Descriptor, tasks []*transfer.Task) {
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		for _, tk := range tasks {
			tk.Done(fmt.Errorf("rdma: %w", transfer.ErrClosed))
		}
		return
	}
	t.wg.Add(1)
	t.mu.Unlock()
	go func() {
		defer t.wg.Done()
		t.run(ctx, d, tasks)
	}()
}

func (t *Transport) run(ctx context.Context, d *transfer.Descriptor, tasks []*transfer.Task) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(t.ctx, cancel)
	defer stop()
	p, err := t.peerFor(ctx, d)
	if err != nil {
		for _, tk := range tasks {
			tk.Done(err)
		}
		return
	}
	defer p.release()
	b := &batch{ctx: ctx, done: make(chan struct{}), retry: make(chan *slice, 64), staged: make(chan *slice), loopDone: make(chan struct{})}
	var all []*slice
	var pieces []*piece
	var jobs []*job
	for _, tk := range tasks {
		ss, ps, err := t.slicesOf(ctx, p, tk)
		if err != nil {
			tk.Done(err)
			continue
		}
		if len(ss)+len(ps) == 0 {
			tk.Done(nil)
			continue
		}
		j := &job{task: tk, b: b}
		j.left.Store(int32(len(ss) + len(ps)))
		for _, s := range ss {
			s.j = j
		}
		for _, pc := range ps {
			pc.j = j
		}
		jobs = append(jobs, j)
		all = append(all, ss...)
		pieces = append(pieces, ps...)
	}
	if len(jobs) == 0 {
		return
	}
	b.jobs.Store(int32(len(jobs)))
	defer close(b.loopDone)
	if len(pieces) > 0 {
		t.startPipe(b, p, pieces)
	}
	rr := 0
	for i, s := range all {
		if b.dead.Load() != nil {
			for _, s := range all[i:] {
				s.finish(*b.dead.Load())
			}
			break
		}
		if err := t.post(b, s, &rr, nil); err != nil {
			s.finish(err)
		}
		t.drainRetries(b, &rr)
		if ctx.Err() != nil {
			t.abort(b, ctx.Err())
		}
	}
	t.flush(b)
	for {
		select {
		case <-b.done:
			return
		case s := <-b.retry:
			if err := t.post(b, s, &rr, s.lane); err != nil {
				s.finish(err)
			}
			t.drainRetries(b, &rr)
			t.flush(b)
		case s := <-b.staged:
			if err := t.post(b, s, &rr, nil); err != nil {
				s.finish(err)
			}
			t.drainRetries(b, &rr)
			t.flush(b)
		case <-ctx.Done():
			select {
			case <-b.done:
				return
			default:
			}
			t.abort(b, ctx.Err())
			t.reap(b)
			return
		}
	}
}

func (t *Transport) drainRetries(b *batch, rr *int) {
	for {
		select {
		case s := <-b.retry:
			if err := t.post(b, s, rr, s.lane); err != nil {
				s.finish(err)
			}
		case s := <-b.staged:
			if err := t.post(b, s, rr, nil); err != nil {
				s.finish(err)
			}
		default:
			return
		}
	}
}

// abort marks a batch whose context ended: nothing more of it is posted,
// and what completes from now on fails its task.
func (t *Transport) abort(b *batch, cause error) {
	err := fmt.Errorf("rdma: %w", cause)
	b.dead.CompareAndSwap(nil, &err)
}

// reap waits, bounded, for the outstanding requests of an aborted batch:
// up to the engine's Timeout for them to complete as they are; then the
// queue pairs the batch used go to ERR, which flushes them; if the HCA
// does not report even the flushes within a second, those queue pairs are
// destroyed (after which it touches no memory) and the tasks reported.
func (t *Transport) reap(b *batch) {
	wait := func(d time.Duration) bool {
		tm := time.NewTimer(d)
		defer tm.Stop()
		for {
			select {
			case <-b.done:
				return true
			case s := <-b.retry:
				s.finish(*b.dead.Load())
			case s := <-b.staged:
				s.finish(*b.dead.Load())
			case <-tm.C:
				return false
			}
		}
	}
	if wait(t.h.Timeout()) {
		return
	}
	b.used.Range(func(k, _ any) bool {
		k.(*lane).breakWith(fmt.Errorf("requests of an ended batch still outstanding after %v", t.h.Timeout()))
		return true
	})
	if wait(time.Second) {
		return
	}
	t.lg.Error("flushed work requests not completed in 1s: destroying their queue pairs")
	b.used.Range(func(k, _ any) bool {
		l := k.(*lane)
		l.close(t.m)
		for _, s := range l.nic.take(l) {
			s.finish(*b.dead.Load())
		}
		return true
	})
	for {
		select {
		case s := <-b.retry:
			s.finish(*b.dead.Load())
		case s := <-b.staged:
			s.finish(*b.dead.Load())
		default:
			return
		}
	}
}

// take removes and returns the pending slices of lane l.
func (n *nic) take(l *lane) []*slice {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []*slice
	for id, s := range n.pending {
		if s.lane == l {
			out = append(out, s)
			delete(n.pending, id)
			<-n.credits
		}
	}
	return out
}

// slicesOf checks a task's local and remote ranges against the
// registrations and cuts it into slices, or, when either side is staged GPU
// memory, into pieces for the batch's pipeline.
func (t *Transport) slicesOf(ctx context.Context, p *peer, tk *transfer.Task) ([]*slice, []*piece, error) {
	keys, err := t.keysOf(ctx, p, tk.Region)
	if err != nil {
		var re *transfer.RangeError
		if errors.As(err, &re) {
			return nil, nil, &transfer.RangeError{Addr: tk.Remote, Len: tk.Len, Err: re.Err, Detail: re.Detail}
		}
		return nil, nil, err
	}
	if len(keys.rkeys) == 0 && !keys.staged {
		return nil, nil, fmt.Errorf("rdma: %s sent no keys for [%#x, +%d)", p.name, keys.addr, keys.n)
	}
	le, err := t.localEntry(tk.LocalRegion, tk.Local, tk.Bytes())
	if err != nil {
		return nil, nil, err
	}
	op := verbs.OpWrite
	need := transfer.AccessWrite
	if tk.Op == transfer.Read {
		op, need = verbs.OpRead, transfer.AccessRead
	}
	if keys.access&need == 0 {
		return nil, nil, &transfer.RangeError{Addr: tk.Remote, Len: tk.Len, Err: transfer.ErrAccessDenied, Detail: fmt.Sprintf("rdma: %s grants %v", p.name, keys.access)}
	}
	pref := t.preferred(tk.LocalRegion)
	lr := tk.LocalRegion
	staged := le.staged != nil || keys.staged
	var lkeys []uint32
	if le.staged == nil {
		lkeys = le.lkeys()
	}
	var out []*slice
	var pcs []*piece
	cut := uint64(t.cfg.SliceSize)
	if staged {
		cut = uint64(t.pieceSize())
	}
	add := func(local, remote, n uint64) error {
		if remote < keys.addr || remote+n > keys.addr+keys.n || remote+n < remote {
			return &transfer.RangeError{Addr: remote, Len: n, Err: transfer.ErrOutOfBounds, Detail: fmt.Sprintf("rdma: outside %s's region [%#x, +%d)", p.name, keys.addr, keys.n)}
		}
		if local < lr.Addr || local+n > lr.End() || local+n < local {
			return &transfer.RangeError{Addr: local, Len: n, Err: transfer.ErrOutOfBounds, Detail: "rdma: outside the local region"}
		}
		for n > 0 {
			c := min(n, cut)
			if staged {
				pcs = append(pcs, &piece{op: op, local: local, remote: remote, n: int(c), lr: lr, ldev: le.staged, keys: keys, lkeys: lkeys, pref: pref})
			} else {
				out = append(out, &slice{p: p, op: op, local: local, remote: remote, n: uint32(c), keys: keys, lkeys: lkeys, pref: pref})
			}
			local, remote, n = local+c, remote+c, n-c
		}
		return nil
	}
	if tk.List != nil {
		for _, pg := range tk.List.Pages {
			if err := add(tk.Local+pg.Local, tk.Remote+pg.Remote, tk.List.PageLen); err != nil {
				return nil, nil, err
			}
		}
	} else if err := add(tk.Local, tk.Remote, tk.Len); err != nil {
		return nil, nil, err
	}
	return out, pcs, nil
}

// preferred marks the NICs configured for the local region's memory (nil:
// all alike).
func (t *Transport) preferred(r *transfer.Region) []bool {
	var names []string
	switch r.Location.Kind {
	case transfer.CUDA:
		names = t.cfg.GPUDevices[r.Location.Index]
	case transfer.CPU:
		names = t.cfg.NUMADevices[r.Location.Index]
	}
	if len(names) == 0 {
		return nil
	}
	pref := make([]bool, len(t.nics))
	any := false
	for i, n := range t.nics {
		pref[i] = slices.Contains(names, n.name)
		any = any || pref[i]
	}
	if !any {
		return nil
	}
	return pref
}

// pickLane chooses a healthy lane for s, round-robin over the preferred
// NICs first, never avoid unless it is the only one left.
func pickLane(p *peer, s *slice, rr *int, avoid *lane) *lane {
	var best *lane
	for pass := 0; pass < 2 && best == nil; pass++ {
		for k := 0; k < len(p.lanes); k++ {
			l := p.lanes[(*rr+k)%len(p.lanes)]
			if !l.healthy() || l == avoid {
				continue
			}
			if pass == 0 && s.pref != nil && !s.pref[l.nic.idx] {
				continue
			}
			best = l
			*rr = (*rr + k + 1) % len(p.lanes)
			break
		}
	}
	return best
}

// post sends s on a healthy lane (not avoid, the one that just failed it).
func (t *Transport) post(b *batch, s *slice, rr *int, avoid *lane) error {
	if e := b.dead.Load(); e != nil {
		return *e
	}
	s.tries++
	if s.tries > t.cfg.Tries {
		return fmt.Errorf("%w: %s of [%#x, +%d) failed %d times; last: %w", ErrPath, s.op, s.remote, s.n, s.tries-1, s.last)
	}
	p := s.p
	l := pickLane(p, s, rr, avoid)
	if l == nil && avoid != nil && avoid.healthy() {
		l = avoid
	}
	if l == nil {
		last := "no queue pair was set up"
		if s.last != nil {
			last = s.last.Error()
		}
		return fmt.Errorf("%w: %w: every queue pair to %s failed (%s)", ErrPath, transfer.ErrPeerDead, p.name, last)
	}
	// Credits: one CQ entry on the NIC, one send-queue slot on the QP.
	// Before waiting for one, post what is queued: only posted requests
	// give credits back.
	select {
	case l.nic.credits <- struct{}{}:
	default:
		t.flush(b)
		select {
		case l.nic.credits <- struct{}{}:
		case <-b.ctx.Done():
			return fmt.Errorf("rdma: waiting for a completion-queue slot on %s: %w", l.nic.name, b.ctx.Err())
		}
	}
	select {
	case l.credits <- struct{}{}:
	default:
		t.flush(b)
		select {
		case l.credits <- struct{}{}:
		case <-b.ctx.Done():
			<-l.nic.credits
			return fmt.Errorf("rdma: waiting for a send-queue slot on %s: %w", l, b.ctx.Err())
		}
	}
	b.used.Store(l, struct{}{})
	s.lane = l
	n := l.nic
	n.mu.Lock()
	if n.failed != nil {
		err := n.failed
		n.mu.Unlock()
		<-l.credits
		<-n.credits
		s.last = err
		return t.post(b, s, rr, l)
	}
	n.nextID++
	id := n.nextID
	n.pending[id] = s
	n.mu.Unlock()
	wr := verbs.SendWR{ID: id, Op: s.op, Local: s.local, Len: s.n, LKey: s.lkeys[n.idx], Remote: s.remote,
		RKey: s.keys.rkeys[l.rnic%len(s.keys.rkeys)], Signaled: true}
	if b.queued == nil {
		b.queued = map[*lane][]queuedWR{}
	}
	if len(b.queued[l]) == 0 {
		b.order = append(b.order, l)
	}
	b.queued[l] = append(b.queued[l], queuedWR{wr: wr, s: s})
	if len(b.queued[l]) >= postList {
		t.flushLane(b, l)
	}
	return nil
}

// postList is how many work requests one ibv_post_send call carries at
// most (one doorbell for the list).
const postList = 32

type queuedWR struct {
	wr verbs.SendWR
	s  *slice
}

// flush posts every lane's queued requests.
func (t *Transport) flush(b *batch) {
	for _, l := range b.order {
		t.flushLane(b, l)
	}
	b.order = b.order[:0]
}

// flushLane posts l's queued requests as one list. Those the QP refuses
// go back to the batch for another lane.
func (t *Transport) flushLane(b *batch, l *lane) {
	q := b.queued[l]
	if len(q) == 0 {
		return
	}
	b.queued[l] = nil
	b.scratch = b.scratch[:0]
	for _, x := range q {
		b.scratch = append(b.scratch, x.wr)
	}
	n := l.nic
	bad, err := l.qp.PostSend(b.scratch)
	if err == nil {
		bad = len(q)
	}
	t.m.requests.WithLabelValues(n.name, opLabel(q[0].s.op)).Add(float64(bad))
	select {
	case n.kick <- struct{}{}:
	default:
	}
	if err == nil {
		return
	}
	l.breakWith(fmt.Errorf("post_send: %w", err))
	for _, x := range q[bad:] {
		n.mu.Lock()
		_, mine := n.pending[x.wr.ID]
		delete(n.pending, x.wr.ID)
		n.mu.Unlock()
		if !mine {
			continue // reaped meanwhile
		}
		<-l.credits
		<-n.credits
		x.s.last = fmt.Errorf("%s: post_send: %w", l, err)
		t.retry(x.s)
	}
}

// poll reaps one NIC's completions until the transport closes.
func (t *Transport) poll(n *nic) {
	defer t.pollers.Done()
	wcs := make([]verbs.WC, 32)
	idle := 0
	nap := time.NewTimer(time.Hour)
	defer nap.Stop()
	for {
		k, err := n.cq.Poll(wcs)
		if err != nil {
			t.failNIC(n, err)
			return
		}
		for _, wc := range wcs[:k] {
			n.mu.Lock()
			s := n.pending[wc.ID]
			delete(n.pending, wc.ID)
			n.mu.Unlock()
			if s == nil {
				continue // reaped by an aborted batch
			}
			<-n.credits
			<-s.lane.credits
			t.complete(s, wc)
		}
		if k > 0 {
			idle = 0
			continue
		}
		n.mu.Lock()
		busy := len(n.pending) > 0
		n.mu.Unlock()
		if !busy {
			select {
			case <-n.kick:
			case <-t.pollCtx.Done():
				return
			}
			continue
		}
		// Work in flight: spin briefly, then sleep in short steps.
		idle++
		if idle < 64 {
			runtime.Gosched()
			continue
		}
		nap.Reset(20 * time.Microsecond)
		select {
		case <-nap.C:
		case <-t.pollCtx.Done():
			return
		}
	}
}

// failNIC: the NIC's CQ failed (overrun, device error). Its queue pairs
// are in error; every pending slice goes to another NIC.
func (t *Transport) failNIC(n *nic, err error) {
	t.lg.Error("rdma completion queue failed: the NIC is out of use", zap.String("nic", n.name), zap.Error(err))
	n.mu.Lock()
	n.failed = fmt.Errorf("%s: %w", n.name, err)
	pend := n.pending
	n.pending = map[uint64]*slice{}
	n.mu.Unlock()
	for _, s := range pend {
		<-n.credits
		<-s.lane.credits
		s.lane.breakWith(err)
		s.last = fmt.Errorf("%s: %w", n.name, err)
		t.retry(s)
	}
}

// complete handles one completion.
func (t *Transport) complete(s *slice, wc verbs.WC) {
	l := s.lane
	if wc.Status == verbs.StatusSuccess {
		t.m.bytes.WithLabelValues(l.nic.name, opLabel(s.op)).Add(float64(s.n))
		s.finish(nil)
		return
	}
	t.m.errors.WithLabelValues(l.nic.name, statusLabel(wc.Status)).Inc()
	werr := fmt.Errorf("%s: %v of [%#x, +%d) completed with %v (vendor %#x)", l, s.op, s.remote, s.n, wc.Status, wc.Vendor)
	l.breakWith(werr) // the QP is in ERR now
	switch wc.Status {
	case verbs.StatusFlushErr, verbs.StatusRetryExc, verbs.StatusRNRRetryExc, verbs.StatusFatal, verbs.StatusGeneral:
		if wc.Status != verbs.StatusFlushErr || s.last == nil {
			s.last = werr
		}
		if wc.Status != verbs.StatusFlushErr {
			t.lg.Warn("rdma work request failed: moving its slices to another queue pair", zap.String("lane", l.String()), zap.Stringer("status", wc.Status))
		}
		t.retry(s)
	case verbs.StatusRemAccess, verbs.StatusRemInvReq:
		l.p.dropKeys(s.keys.addr)
		s.finish(&transfer.RangeError{Addr: s.remote, Len: uint64(s.n), Err: transfer.ErrOutOfBounds,
			Detail: fmt.Sprintf("rdma: %s's HCA refused the %v (%v): the region is no longer registered there", l.p.name, s.op, wc.Status)})
	default:
		s.finish(werr)
	}
}

// retry hands s back to its batch to be posted on another lane.
func (t *Transport) retry(s *slice) {
	t.m.retries.WithLabelValues(s.lane.nic.name).Inc()
	b := s.j.b
	if e := b.dead.Load(); e != nil {
		s.finish(*e)
		return
	}
	select {
	case b.retry <- s:
	case <-b.done: // cannot happen: s's job is not finished
	default:
		// The batch's retry queue is full: post from here on a goroutine.
		t.wg.Add(1)
		go func() {
			defer t.wg.Done()
			select {
			case b.retry <- s:
			case <-b.ctx.Done():
				s.finish(fmt.Errorf("rdma: %w", b.ctx.Err()))
			}
		}()
	}
}

func closeFD(fd int) { unix.Close(fd) }
