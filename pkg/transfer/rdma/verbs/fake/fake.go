// Package fake is an in-process HCA for tests of code written against
// package verbs. A Fabric connects every fake device made on it, so two
// transfer engines in one process can RDMA into each other's memory.
//
// It enforces what real verbs enforce: lkeys and rkeys name registered
// regions of the right protection domain, every access lies inside its
// region and is allowed by the region's and the responder QP's access flags,
// QPs move RESET -> INIT -> RTR -> RTS only in that order and post only in
// RTS (a QP in ERR flushes what is posted), the send queue holds at most its
// depth, a full CQ is an overrun that moves its QPs to ERR, and a failed work
// request completes in error, moves its QP to ERR and flushes the rest.
// Faults are injected per device (FailNth, ErrorAfter, SetDown, Stall,
// OverrunCQs, RefuseDmabuf).
//
// Work requests execute when posted (a real HCA completes them later; the
// order of completions is the same).
package fake

import (
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

// Fabric is the network the fake devices share.
type Fabric struct {
	mu      sync.Mutex
	devs    map[verbs.GID]*HCA
	nextGID uint32
	nextKey uint32
	nextQPN uint32
}

// NewFabric returns an empty fabric.
func NewFabric() *Fabric { return &Fabric{devs: map[verbs.GID]*HCA{}, nextKey: 0x100, nextQPN: 0x40} }

// Host is one machine's set of devices: a verbs.Provider.
type Host struct {
	f    *Fabric
	hcas []*HCA
}

// NewHost adds a host with one device (one active port) per name.
func (f *Fabric) NewHost(names ...string) *Host {
	h := &Host{f: f}
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range names {
		f.nextGID++
		var g verbs.GID
		g[0], g[1] = 0xfe, 0x80
		g[12], g[13], g[14], g[15] = byte(f.nextGID>>24), byte(f.nextGID>>16), byte(f.nextGID>>8), byte(f.nextGID)
		d := &HCA{f: f, name: n, gid: g, lid: uint16(f.nextGID), mrs: map[uint32]*mr{}, qps: map[uint32]*qp{}, failNth: -1, errAfter: -1}
		f.devs[g] = d
		h.hcas = append(h.hcas, d)
	}
	return h
}

// HCA returns the host's device called name (nil if none).
func (h *Host) HCA(name string) *HCA {
	for _, d := range h.hcas {
		if d.name == name {
			return d
		}
	}
	return nil
}

// Devices lists the host's device names.
func (h *Host) Devices() ([]string, error) {
	var out []string
	for _, d := range h.hcas {
		out = append(out, d.name)
	}
	return out, nil
}

// Open opens a device of the host.
func (h *Host) Open(name string) (verbs.Device, error) {
	d := h.HCA(name)
	if d == nil {
		return nil, fmt.Errorf("%w: %s", verbs.ErrNoDevice, name)
	}
	d.mu.Lock()
	d.opens++
	d.mu.Unlock()
	return &device{d: d}, nil
}

// HCA is one fake device with one port.
type HCA struct {
	f    *Fabric
	name string
	gid  verbs.GID
	lid  uint16

	mu       sync.Mutex
	mrs      map[uint32]*mr // by lkey and by rkey (the same value)
	qps      map[uint32]*qp
	opens    int
	down     bool
	failNth  int // WRs to let through before one fails (-1: none)
	failWith verbs.Status
	errAfter int // WRs to let through before the posting QP goes to ERR (-1: none)
	stall    bool
	noDmabuf bool
	posted   int
}

// RefuseDmabuf makes reg_dmabuf_mr fail with EOPNOTSUPP (a NIC or driver
// without dma-buf support) from now on, or work again.
func (d *HCA) RefuseDmabuf(on bool) {
	d.mu.Lock()
	d.noDmabuf = on
	d.mu.Unlock()
}

// Stall holds every request posted from now on without executing it (a
// hung HCA or a lost packet); moving its QP to ERR or destroying it flushes
// the held requests. Stall(false) executes them.
func (d *HCA) Stall(on bool) {
	d.mu.Lock()
	d.stall = on
	var qps []*qp
	if !on {
		for _, q := range d.qps {
			qps = append(qps, q)
		}
	}
	d.mu.Unlock()
	for _, q := range qps {
		q.mu.Lock()
		held := q.held
		q.held = nil
		q.mu.Unlock()
		for _, w := range held {
			q.run(w)
		}
	}
}

// OverrunCQs makes every CQ of the device overflow now: polls fail and
// their QPs go to ERR (what a CQ too small for its QPs does).
func (d *HCA) OverrunCQs() {
	d.mu.Lock()
	cqs := map[*cq]bool{}
	for _, q := range d.qps {
		cqs[q.cq] = true
	}
	d.mu.Unlock()
	for c := range cqs {
		c.mu.Lock()
		c.overrun = true
		qps := c.qps
		c.mu.Unlock()
		for _, q := range qps {
			q.mu.Lock()
			q.state = verbs.QPError
			q.mu.Unlock()
		}
	}
}

// FailNth makes the work request posted n requests from now (0: the next)
// fail with status s.
func (d *HCA) FailNth(n int, s verbs.Status) {
	d.mu.Lock()
	d.failNth, d.failWith = n, s
	d.mu.Unlock()
}

// ErrorAfter moves the QP that posts the request n requests from now to
// ERR before that request executes: it and everything after it flush.
func (d *HCA) ErrorAfter(n int) {
	d.mu.Lock()
	d.errAfter = n
	d.mu.Unlock()
}

// SetDown takes the device's link down (true) or up: requests to or from a
// down device fail with a retry-exceeded completion.
func (d *HCA) SetDown(down bool) {
	d.mu.Lock()
	d.down = down
	d.mu.Unlock()
}

// Posted is how many work requests were posted on the device.
func (d *HCA) Posted() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.posted
}

// Live counts the device's open contexts, MRs and QPs (zero once all are
// closed).
func (d *HCA) Live() (opens, mrs, qps int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.opens, len(d.mrs), len(d.qps)
}

type device struct {
	d      *HCA
	closed bool
}

func (c *device) Name() string { return c.d.name }

func (c *device) QueryPort(port uint8) (verbs.PortAttr, error) {
	if port != 1 {
		return verbs.PortAttr{}, fmt.Errorf("fake %s: no port %d", c.d.name, port)
	}
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	st := verbs.PortActive
	if c.d.down {
		st = verbs.PortDown
	}
	return verbs.PortAttr{State: st, ActiveMTU: verbs.MTU4096, LID: c.d.lid, LinkLayer: verbs.LinkInfiniBand, GIDTableLen: 1}, nil
}

func (c *device) QueryGID(port uint8, index int) (verbs.GID, error) {
	if port != 1 || index != 0 {
		return verbs.GID{}, fmt.Errorf("fake %s: no GID %d on port %d", c.d.name, index, port)
	}
	return c.d.gid, nil
}

func (c *device) AllocPD() (verbs.PD, error) { return &pd{d: c.d}, nil }

func (c *device) CreateCQ(depth int) (verbs.CQ, error) {
	if depth <= 0 || depth > 1<<16 {
		return nil, fmt.Errorf("fake %s: CQ depth %d not in [1, 65536]", c.d.name, depth)
	}
	return &cq{d: c.d, depth: depth}, nil
}

func (c *device) Close() error {
	c.d.mu.Lock()
	defer c.d.mu.Unlock()
	if c.closed {
		return fmt.Errorf("fake %s: context closed twice", c.d.name)
	}
	c.closed = true
	c.d.opens--
	return nil
}

type pd struct{ d *HCA }

type mr struct {
	d      *HCA
	pd     *pd
	key    uint32
	addr   uint64
	n      uint64
	access verbs.Access
	// host is where address addr lives for this process (addr itself, or
	// the mapping of a dma-buf registered at an iova).
	host    uint64
	mapping []byte
	// inUse is held for reading while a request touches the memory;
	// deregistration takes it for writing, so no access outlives it.
	inUse sync.RWMutex
}

func (p *pd) RegMR(addr uintptr, n uint64, a verbs.Access) (verbs.MR, error) {
	if addr == 0 || n == 0 || uint64(addr)+n < uint64(addr) {
		return nil, fmt.Errorf("fake %s: reg_mr [%#x, +%d): bad range", p.d.name, addr, n)
	}
	if a&verbs.AccessRemoteWrite != 0 && a&verbs.AccessLocalWrite == 0 {
		return nil, fmt.Errorf("fake %s: reg_mr: remote write needs local write (EINVAL)", p.d.name)
	}
	p.d.f.mu.Lock()
	p.d.f.nextKey += 0x101
	k := p.d.f.nextKey
	p.d.f.mu.Unlock()
	m := &mr{d: p.d, pd: p, key: k, addr: uint64(addr), n: n, access: a, host: uint64(addr)}
	p.d.mu.Lock()
	p.d.mrs[k] = m
	p.d.mu.Unlock()
	return m, nil
}

// RegDmabufMR maps the fd's range (any mappable fd stands for a dma-buf)
// and registers it at address iova: work requests name iova addresses,
// the fake moves the mapped bytes.
func (p *pd) RegDmabufMR(off, n, iova uint64, fd int, a verbs.Access) (verbs.MR, error) {
	if n == 0 || iova == 0 || iova+n < iova {
		return nil, fmt.Errorf("fake %s: reg_dmabuf_mr [%#x, +%d): bad range", p.d.name, iova, n)
	}
	p.d.mu.Lock()
	refuse := p.d.noDmabuf
	p.d.mu.Unlock()
	if refuse {
		return nil, fmt.Errorf("fake %s: reg_dmabuf_mr: %w", p.d.name, unix.EOPNOTSUPP)
	}
	pg := uint64(unix.Getpagesize())
	start := off &^ (pg - 1)
	b, err := unix.Mmap(fd, int64(start), int(off-start+n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("fake %s: reg_dmabuf_mr: mapping fd %d: %w", p.d.name, fd, err)
	}
	m, err := p.RegMR(uintptr(iova), n, a)
	if err != nil {
		unix.Munmap(b)
		return nil, err
	}
	fm := m.(*mr)
	fm.host = uint64(uintptr(unsafe.Pointer(&b[0]))) + off - start
	fm.mapping = b
	return fm, nil
}

func (p *pd) CreateQP(c verbs.CQ, maxSendWR int) (verbs.QP, error) {
	fc, ok := c.(*cq)
	if !ok || fc.d != p.d {
		return nil, fmt.Errorf("fake %s: create_qp: CQ of another device", p.d.name)
	}
	if maxSendWR <= 0 || maxSendWR > 1<<15 {
		return nil, fmt.Errorf("fake %s: create_qp: max_send_wr %d not in [1, 32768]", p.d.name, maxSendWR)
	}
	p.d.f.mu.Lock()
	p.d.f.nextQPN++
	n := p.d.f.nextQPN
	p.d.f.mu.Unlock()
	q := &qp{d: p.d, pd: p, cq: fc, num: n, max: maxSendWR}
	p.d.mu.Lock()
	p.d.qps[n] = q
	p.d.mu.Unlock()
	fc.mu.Lock()
	fc.qps = append(fc.qps, q)
	fc.mu.Unlock()
	return q, nil
}

func (p *pd) Close() error { return nil }

func (m *mr) LKey() uint32 { return m.key }
func (m *mr) RKey() uint32 { return m.key }

func (m *mr) Close() error {
	m.d.mu.Lock()
	if m.d.mrs[m.key] != m {
		m.d.mu.Unlock()
		return fmt.Errorf("fake %s: dereg_mr of key %#x twice", m.d.name, m.key)
	}
	delete(m.d.mrs, m.key)
	m.d.mu.Unlock()
	m.inUse.Lock() // wait for requests touching it
	m.inUse.Unlock()
	if m.mapping != nil {
		unix.Munmap(m.mapping)
	}
	return nil
}

type cq struct {
	d     *HCA
	depth int

	mu      sync.Mutex
	entries []verbs.WC
	overrun bool
	qps     []*qp
}

func (c *cq) Depth() int { return c.depth }

func (c *cq) Poll(wc []verbs.WC) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.overrun {
		return 0, fmt.Errorf("fake %s: %w (depth %d)", c.d.name, verbs.ErrCQOverrun, c.depth)
	}
	n := copy(wc, c.entries)
	c.entries = c.entries[n:]
	for _, w := range wc[:n] {
		for _, q := range c.qps {
			if q.num == w.QPN {
				q.done(1) // its send queue slot frees when polled
			}
		}
	}
	return n, nil
}

// push adds a completion and reports whether it was queued; a full queue
// overruns: the CQ and its QPs are in error from then on. Called with no
// lock held.
func (c *cq) push(w verbs.WC) bool {
	c.mu.Lock()
	if c.overrun {
		c.mu.Unlock()
		return false
	}
	if len(c.entries) >= c.depth {
		c.overrun = true
		qps := c.qps
		c.mu.Unlock()
		for _, q := range qps {
			q.mu.Lock()
			q.state = verbs.QPError
			q.mu.Unlock()
		}
		return false
	}
	c.entries = append(c.entries, w)
	c.mu.Unlock()
	return true
}

func (c *cq) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, q := range c.qps {
		if !q.closed {
			return fmt.Errorf("fake %s: destroy_cq: QP %#x still uses it (EBUSY)", c.d.name, q.num)
		}
	}
	return nil
}

type qp struct {
	d   *HCA
	pd  *pd
	cq  *cq
	num uint32
	max int

	mu       sync.Mutex
	state    verbs.QPState
	port     uint8
	access   verbs.Access
	remote   verbs.Remote
	closed   bool
	inflight int            // requests posted whose completion was not polled yet
	held     []verbs.SendWR // requests held by Stall
}

func (q *qp) Num() uint32 { return q.num }

func (q *qp) State() verbs.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.state
}

func (q *qp) move(from, to verbs.QPState) error {
	if q.closed {
		return fmt.Errorf("fake %s: QP %#x destroyed", q.d.name, q.num)
	}
	if q.state != from {
		return fmt.Errorf("fake %s: QP %#x %v -> %v: %w (it is %v)", q.d.name, q.num, from, to, verbs.ErrQPState, q.state)
	}
	q.state = to
	return nil
}

func (q *qp) Init(port uint8, a verbs.Access) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if port != 1 {
		return fmt.Errorf("fake %s: QP %#x: no port %d", q.d.name, q.num, port)
	}
	q.port, q.access = port, a
	return q.move(verbs.QPReset, verbs.QPInit)
}

func (q *qp) ReadyToReceive(r verbs.Remote) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if r.QPN == 0 || r.GID.IsZero() {
		return fmt.Errorf("fake %s: QP %#x -> RTR: no remote QPN or GID", q.d.name, q.num)
	}
	q.remote = r
	return q.move(verbs.QPInit, verbs.QPRTR)
}

func (q *qp) ReadyToSend(psn uint32) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.move(verbs.QPRTR, verbs.QPRTS)
}

func (q *qp) Fail() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return fmt.Errorf("fake %s: QP %#x destroyed", q.d.name, q.num)
	}
	q.state = verbs.QPError
	held := q.held
	q.held = nil
	q.mu.Unlock()
	for _, w := range held {
		q.run(w)
	}
	return nil
}

func (q *qp) Close() error {
	q.mu.Lock()
	if q.closed {
		q.mu.Unlock()
		return fmt.Errorf("fake %s: destroy_qp %#x twice", q.d.name, q.num)
	}
	q.closed = true
	q.state = verbs.QPError
	q.held = nil // destroyed: no completion for them
	q.mu.Unlock()
	q.d.mu.Lock()
	delete(q.d.qps, q.num)
	q.d.mu.Unlock()
	return nil
}

// PostSend executes each request in order and queues its completion.
func (q *qp) PostSend(wrs []verbs.SendWR) (int, error) {
	q.mu.Lock()
	switch {
	case q.closed:
		q.mu.Unlock()
		return 0, fmt.Errorf("fake %s: post_send on destroyed QP %#x", q.d.name, q.num)
	case q.state != verbs.QPRTS && q.state != verbs.QPError:
		st := q.state
		q.mu.Unlock()
		return 0, fmt.Errorf("fake %s: post_send on QP %#x: %w (%v, not RTS)", q.d.name, q.num, verbs.ErrQPState, st)
	}
	for i, w := range wrs {
		if w.Op != verbs.OpWrite && w.Op != verbs.OpRead {
			q.mu.Unlock()
			return i, fmt.Errorf("fake %s: post_send: %w: opcode %d", q.d.name, verbs.ErrBadWR, w.Op)
		}
	}
	if q.inflight+len(wrs) > q.max {
		q.mu.Unlock()
		return 0, fmt.Errorf("fake %s: post_send of %d on QP %#x: %w (depth %d)", q.d.name, len(wrs), q.num, verbs.ErrQueueFull, q.max)
	}
	q.inflight += len(wrs)
	q.mu.Unlock()
	for _, w := range wrs {
		q.execute(w)
	}
	return len(wrs), nil
}

func (q *qp) execute(w verbs.SendWR) {
	d := q.d
	d.mu.Lock()
	d.posted++
	fail, errNow := verbs.StatusSuccess, false
	if d.failNth >= 0 {
		if d.failNth == 0 {
			fail = d.failWith
		}
		d.failNth--
	}
	if d.errAfter >= 0 {
		if d.errAfter == 0 {
			errNow = true
		}
		d.errAfter--
	}
	down, stall := d.down, d.stall
	d.mu.Unlock()

	q.mu.Lock()
	if errNow {
		q.state = verbs.QPError
	}
	if stall && q.state == verbs.QPRTS {
		q.held = append(q.held, w)
		q.mu.Unlock()
		return
	}
	q.mu.Unlock()
	q.complete(w, fail, down)
}

// run executes a request Stall held.
func (q *qp) run(w verbs.SendWR) {
	q.d.mu.Lock()
	down := q.d.down
	q.d.mu.Unlock()
	q.complete(w, verbs.StatusSuccess, down)
}

// complete executes w (or flushes it, in ERR) and queues its completion.
func (q *qp) complete(w verbs.SendWR, fail verbs.Status, down bool) {
	q.mu.Lock()
	state, remote := q.state, q.remote
	q.mu.Unlock()
	st := verbs.StatusFlushErr
	if state == verbs.QPRTS {
		st = fail
		if st == verbs.StatusSuccess {
			st = q.transfer(w, remote, down)
		}
		if st != verbs.StatusSuccess {
			q.mu.Lock()
			q.state = verbs.QPError
			q.mu.Unlock()
		}
	}
	if w.Signaled || st != verbs.StatusSuccess {
		if !q.cq.push(verbs.WC{ID: w.ID, Status: st, QPN: q.num}) {
			q.done(1)
		}
		return
	}
	q.done(1) // an unsignaled request's slot frees at once here
}

func (q *qp) done(n int) {
	q.mu.Lock()
	q.inflight -= n
	q.mu.Unlock()
}

// transfer checks both ends of w as an HCA does and moves the bytes.
func (q *qp) transfer(w verbs.SendWR, r verbs.Remote, down bool) verbs.Status {
	f := q.d.f
	f.mu.Lock()
	rd := f.devs[r.GID]
	f.mu.Unlock()
	if down || rd == nil {
		return verbs.StatusRetryExc
	}
	rd.mu.Lock()
	rq := rd.qps[r.QPN]
	rdown := rd.down
	rd.mu.Unlock()
	if rdown || rq == nil {
		return verbs.StatusRetryExc
	}
	rq.mu.Lock()
	rstate, raccess := rq.state, rq.access
	rq.mu.Unlock()
	if rstate != verbs.QPRTR && rstate != verbs.QPRTS {
		return verbs.StatusRetryExc
	}
	need := verbs.AccessRemoteWrite
	if w.Op == verbs.OpRead {
		need = verbs.AccessRemoteRead
	}
	if raccess&need == 0 {
		return verbs.StatusRemInvReq
	}
	// The local side: lkey of this PD, range inside, local write for reads.
	q.d.mu.Lock()
	lm := q.d.mrs[w.LKey]
	q.d.mu.Unlock()
	if lm == nil || lm.pd != q.pd || w.Local < lm.addr || w.Local+uint64(w.Len) > lm.addr+lm.n || w.Local+uint64(w.Len) < w.Local {
		return verbs.StatusLocProtErr
	}
	if w.Op == verbs.OpRead && lm.access&verbs.AccessLocalWrite == 0 {
		return verbs.StatusLocProtErr
	}
	rd.mu.Lock()
	rm := rd.mrs[w.RKey]
	rd.mu.Unlock()
	if rm == nil || rm.pd != rq.pd || w.Remote < rm.addr || w.Remote+uint64(w.Len) > rm.addr+rm.n || w.Remote+uint64(w.Len) < w.Remote ||
		rm.access&need == 0 {
		return verbs.StatusRemAccess
	}
	if w.Len == 0 {
		return verbs.StatusSuccess
	}
	lm.inUse.RLock()
	defer lm.inUse.RUnlock()
	if rm != lm {
		rm.inUse.RLock()
		defer rm.inUse.RUnlock()
	}
	// The MRs may have been deregistered between the lookup and the lock.
	rd.mu.Lock()
	rok := rd.mrs[w.RKey] == rm
	rd.mu.Unlock()
	q.d.mu.Lock()
	lok := q.d.mrs[w.LKey] == lm
	q.d.mu.Unlock()
	if !lok {
		return verbs.StatusLocProtErr
	}
	if !rok {
		return verbs.StatusRemAccess
	}
	l, rb := mem(lm.host+(w.Local-lm.addr), w.Len), mem(rm.host+(w.Remote-rm.addr), w.Len)
	if w.Op == verbs.OpWrite {
		copy(rb, l)
	} else {
		copy(l, rb)
	}
	return verbs.StatusSuccess
}

var (
	_ verbs.Provider = (*Host)(nil)
	_ verbs.Device   = (*device)(nil)
	_ verbs.PD       = (*pd)(nil)
	_ verbs.MR       = (*mr)(nil)
	_ verbs.CQ       = (*cq)(nil)
	_ verbs.QP       = (*qp)(nil)
)

// mem is registered memory at [addr, addr+n), after the checks above (the
// same conversion as unsafe.Pointer(uintptr(addr)), spelled for go vet).
func mem(addr uint64, n uint32) []byte {
	p := uintptr(addr)
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&p))), n)
}
