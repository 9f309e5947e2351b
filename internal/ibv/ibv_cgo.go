//go:build cgo

package ibv

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

// The parts of the libibverbs ABI used here, declared by layout.
struct mc_ibv_qp { void *context, *qp_context, *pd, *send_cq, *recv_cq, *srq; uint32_t handle, qp_num; };
struct mc_ibv_mr { void *context, *pd, *addr; size_t length; uint32_t handle, lkey, rkey; };
struct mc_ibv_port_attr {
	int state, max_mtu, active_mtu, gid_tbl_len;
	uint32_t port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr;
	uint16_t pkey_tbl_len, lid, sm_lid;
	uint8_t lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width, active_speed, phys_state, link_layer, flags;
	uint16_t port_cap_flags2;
	uint8_t spare[64]; // room for fields newer libraries add
};
struct mc_ibv_qp_cap { uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data; };
struct mc_ibv_qp_init_attr {
	void *qp_context, *send_cq, *recv_cq, *srq;
	struct mc_ibv_qp_cap cap;
	int qp_type, sq_sig_all;
};
struct mc_ibv_global_route { uint8_t dgid[16]; uint32_t flow_label; uint8_t sgid_index, hop_limit, traffic_class; };
struct mc_ibv_ah_attr { struct mc_ibv_global_route grh; uint16_t dlid; uint8_t sl, src_path_bits, static_rate, is_global, port_num; };
struct mc_ibv_qp_attr {
	int qp_state, cur_qp_state, path_mtu, path_mig_state;
	uint32_t qkey, rq_psn, sq_psn, dest_qp_num;
	unsigned int qp_access_flags;
	struct mc_ibv_qp_cap cap;
	struct mc_ibv_ah_attr ah_attr, alt_ah_attr;
	uint16_t pkey_index, alt_pkey_index;
	uint8_t en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout;
	uint32_t rate_limit;
};
struct mc_ibv_sge { uint64_t addr; uint32_t length, lkey; };
struct mc_ibv_send_wr {
	uint64_t wr_id;
	struct mc_ibv_send_wr *next;
	struct mc_ibv_sge *sg_list;
	int num_sge, opcode;
	unsigned int send_flags;
	uint32_t imm_data;
	union {
		struct { uint64_t remote_addr; uint32_t rkey; } rdma;
		struct { uint64_t remote_addr, compare_add, swap; uint32_t rkey; } atomic;
		struct { void *ah; uint32_t remote_qpn, remote_qkey; } ud;
	} wr;
	union { struct { uint32_t remote_srqn; } xrc; } qp_type;
	union {
		struct { void *mw; uint32_t rkey; struct { void *mr; uint64_t addr, length; unsigned int flags; } bind_info; } bind_mw;
		struct { void *hdr; uint16_t hdr_sz, mss; } tso;
	} ext;
};
struct mc_ibv_wc {
	uint64_t wr_id;
	int status, opcode;
	uint32_t vendor_err, byte_len, imm_data, qp_num, src_qp;
	unsigned int wc_flags;
	uint16_t pkey_index, slid;
	uint8_t sl, dlid_path_bits;
};

// The ABI's sizes and offsets on LP64 (rdma-core's verbs.h, stable since
// libibverbs 1.1): a transcription error fails the build, not a transfer.
_Static_assert(sizeof(void *) == 8, "LP64 only");
_Static_assert(sizeof(struct mc_ibv_wc) == 48, "ibv_wc");
_Static_assert(sizeof(struct mc_ibv_sge) == 16, "ibv_sge");
_Static_assert(sizeof(struct mc_ibv_send_wr) == 128, "ibv_send_wr");
_Static_assert(offsetof(struct mc_ibv_send_wr, wr) == 40, "ibv_send_wr.wr");
_Static_assert(offsetof(struct mc_ibv_qp, qp_num) == 52, "ibv_qp.qp_num");
_Static_assert(offsetof(struct mc_ibv_mr, lkey) == 36 && offsetof(struct mc_ibv_mr, rkey) == 40, "ibv_mr keys");
_Static_assert(offsetof(struct mc_ibv_qp_attr, ah_attr) == 56 && offsetof(struct mc_ibv_qp_attr, port_num) == 129, "ibv_qp_attr");
_Static_assert(offsetof(struct mc_ibv_port_attr, lid) == 34 && offsetof(struct mc_ibv_port_attr, link_layer) == 46, "ibv_port_attr");

// ibv_context starts with the device pointer, then the ops table; poll_cq
// and post_send are its 12th and 26th entries.
enum { MC_OPS_POLL_CQ = 11, MC_OPS_POST_SEND = 25 };

static void **(*p_get_device_list)(int *);
static void (*p_free_device_list)(void **);
static const char *(*p_get_device_name)(void *);
static void *(*p_open_device)(void *);
static int (*p_close_device)(void *);
static int (*p_query_port)(void *, uint8_t, struct mc_ibv_port_attr *);
static int (*p_query_gid)(void *, uint8_t, int, void *);
static void *(*p_alloc_pd)(void *);
static int (*p_dealloc_pd)(void *);
static void *(*p_reg_mr)(void *, void *, size_t, int);
static void *(*p_reg_dmabuf_mr)(void *, uint64_t, size_t, uint64_t, int, int);
static int (*p_dereg_mr)(void *);
static void *(*p_create_cq)(void *, int, void *, void *, int);
static int (*p_destroy_cq)(void *);
static void *(*p_create_qp)(void *, struct mc_ibv_qp_init_attr *);
static int (*p_modify_qp)(void *, struct mc_ibv_qp_attr *, int);
static int (*p_destroy_qp)(void *);

static const char *mc_ibv_bind(void *lib) {
#define B(v, n) do { *(void **)(&v) = dlsym(lib, n); if (!v) return n; } while (0)
	B(p_get_device_list, "ibv_get_device_list");
	B(p_free_device_list, "ibv_free_device_list");
	B(p_get_device_name, "ibv_get_device_name");
	B(p_open_device, "ibv_open_device");
	B(p_close_device, "ibv_close_device");
	B(p_query_port, "ibv_query_port");
	B(p_query_gid, "ibv_query_gid");
	B(p_alloc_pd, "ibv_alloc_pd");
	B(p_dealloc_pd, "ibv_dealloc_pd");
	B(p_reg_mr, "ibv_reg_mr");
	B(p_dereg_mr, "ibv_dereg_mr");
	B(p_create_cq, "ibv_create_cq");
	B(p_destroy_cq, "ibv_destroy_cq");
	B(p_create_qp, "ibv_create_qp");
	B(p_modify_qp, "ibv_modify_qp");
	B(p_destroy_qp, "ibv_destroy_qp");
#undef B
	*(void **)(&p_reg_dmabuf_mr) = dlsym(lib, "ibv_reg_dmabuf_mr"); // rdma-core >= 34
	return 0;
}

static int mc_has_dmabuf(void) { return p_reg_dmabuf_mr != 0; }

// mc_list writes up to max device names (64 bytes each) into out and
// returns how many devices exist, or -1 with errno.
static int mc_list(char *out, int max) {
	int n = 0;
	void **l = p_get_device_list(&n);
	if (!l) return -1;
	for (int i = 0; i < n && i < max; i++) {
		const char *s = p_get_device_name(l[i]);
		strncpy(out + 64 * i, s ? s : "", 63);
		out[64 * i + 63] = 0;
	}
	p_free_device_list(l);
	return n;
}

static uintptr_t mc_open(const char *name) {
	int n = 0;
	void **l = p_get_device_list(&n);
	if (!l) { errno = ENODEV; return 0; } // no verbs devices at all (ENOSYS: no uverbs)
	void *ctx = 0;
	int found = 0;
	for (int i = 0; i < n; i++) {
		const char *s = p_get_device_name(l[i]);
		if (s && strcmp(s, name) == 0) { found = 1; ctx = p_open_device(l[i]); break; }
	}
	int e = errno;
	p_free_device_list(l);
	errno = found ? e : ENODEV;
	return (uintptr_t)ctx;
}

static int mc_close_device(uintptr_t c) { return p_close_device((void *)c); }
static int mc_query_port(uintptr_t c, uint8_t port, struct mc_ibv_port_attr *a) {
	memset(a, 0, sizeof(*a));
	return p_query_port((void *)c, port, a);
}
static int mc_query_gid(uintptr_t c, uint8_t port, int idx, uint8_t *gid) { return p_query_gid((void *)c, port, idx, gid); }
static uintptr_t mc_alloc_pd(uintptr_t c) { return (uintptr_t)p_alloc_pd((void *)c); }
static int mc_dealloc_pd(uintptr_t pd) { return p_dealloc_pd((void *)pd); }
static uintptr_t mc_reg_mr(uintptr_t pd, uintptr_t addr, size_t n, int access) { return (uintptr_t)p_reg_mr((void *)pd, (void *)addr, n, access); }
static uintptr_t mc_reg_dmabuf_mr(uintptr_t pd, uint64_t off, size_t n, uint64_t iova, int fd, int access) {
	if (!p_reg_dmabuf_mr) { errno = ENOSYS; return 0; }
	return (uintptr_t)p_reg_dmabuf_mr((void *)pd, off, n, iova, fd, access);
}
static uint32_t mc_mr_lkey(uintptr_t m) { return ((struct mc_ibv_mr *)m)->lkey; }
static uint32_t mc_mr_rkey(uintptr_t m) { return ((struct mc_ibv_mr *)m)->rkey; }
static int mc_dereg_mr(uintptr_t m) { return p_dereg_mr((void *)m); }
static uintptr_t mc_create_cq(uintptr_t c, int depth) { return (uintptr_t)p_create_cq((void *)c, depth, 0, 0, 0); }
static int mc_destroy_cq(uintptr_t cq) { return p_destroy_cq((void *)cq); }
static uintptr_t mc_create_qp(uintptr_t pd, uintptr_t cq, int max_send_wr) {
	struct mc_ibv_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = a.recv_cq = (void *)cq;
	a.cap.max_send_wr = max_send_wr;
	a.cap.max_recv_wr = 1;
	a.cap.max_send_sge = 1;
	a.cap.max_recv_sge = 1;
	a.qp_type = 2; // IBV_QPT_RC
	return (uintptr_t)p_create_qp((void *)pd, &a);
}
static uint32_t mc_qp_num(uintptr_t q) { return ((struct mc_ibv_qp *)q)->qp_num; }
static int mc_modify_qp(uintptr_t q, struct mc_ibv_qp_attr *a, int mask) { return p_modify_qp((void *)q, a, mask); }
static int mc_destroy_qp(uintptr_t q) { return p_destroy_qp((void *)q); }

static int mc_poll_cq(uintptr_t cq, int n, struct mc_ibv_wc *wc) {
	void *ctx = *(void **)cq; // ibv_cq.context
	void **ops = (void **)((char *)ctx + sizeof(void *));
	int (*poll)(void *, int, struct mc_ibv_wc *) = (int (*)(void *, int, struct mc_ibv_wc *))ops[MC_OPS_POLL_CQ];
	return poll((void *)cq, n, wc);
}

// mc_post_send posts n single-SGE RDMA requests as one list; *bad is the
// index of the first not posted.
static int mc_post_send(uintptr_t q, int n, struct mc_ibv_send_wr *wr, struct mc_ibv_sge *sge, int *bad) {
	for (int i = 0; i < n; i++) {
		wr[i].sg_list = &sge[i];
		wr[i].num_sge = 1;
		wr[i].next = i + 1 < n ? &wr[i + 1] : 0;
	}
	void *ctx = *(void **)q; // ibv_qp.context
	void **ops = (void **)((char *)ctx + sizeof(void *));
	int (*post)(void *, struct mc_ibv_send_wr *, struct mc_ibv_send_wr **) =
		(int (*)(void *, struct mc_ibv_send_wr *, struct mc_ibv_send_wr **))ops[MC_OPS_POST_SEND];
	struct mc_ibv_send_wr *b = 0;
	int r = post((void *)q, wr, &b);
	*bad = b ? (int)(b - wr) : n;
	return r;
}
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/dl"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
)

var lib struct {
	once sync.Once
	name string
	err  error
}

// Load loads libibverbs (once per process) and reports the soname used.
func Load() (string, error) {
	lib.once.Do(func() {
		lib.name, lib.err = dl.Bind(Libraries, verbs.ErrUnavailable, func(raw unsafe.Pointer) string {
			if miss := C.mc_ibv_bind(raw); miss != nil {
				return C.GoString(miss)
			}
			return ""
		})
	})
	return lib.name, lib.err
}

type provider struct{}

// Provider loads libibverbs and returns the real provider.
func Provider() (verbs.Provider, error) {
	if _, err := Load(); err != nil {
		return nil, err
	}
	return provider{}, nil
}

func errnoOr(err error) error {
	if err == nil {
		return syscall.EIO
	}
	return err
}

// rc turns a verbs return code (0, or an errno value, or -1 with errno).
func rc(call string, r C.int, err error) error {
	switch {
	case r == 0:
		return nil
	case r > 0:
		return &Error{Call: call, Errno: syscall.Errno(r)}
	}
	return &Error{Call: call, Errno: errnoOr(err)}
}

func (provider) Devices() ([]string, error) {
	const max = 64
	buf := make([]byte, 64*max)
	n, err := C.mc_list((*C.char)(unsafe.Pointer(&buf[0])), max)
	if n < 0 {
		if errors.Is(err, syscall.ENOSYS) || errors.Is(err, syscall.ENODEV) {
			return nil, nil // no uverbs devices: the kernel has no RDMA device
		}
		return nil, &Error{Call: "ibv_get_device_list", Errno: errnoOr(err)}
	}
	var out []string
	for i := 0; i < int(n) && i < max; i++ {
		out = append(out, C.GoString((*C.char)(unsafe.Pointer(&buf[64*i]))))
	}
	return out, nil
}

func (provider) Open(name string) (verbs.Device, error) {
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	c, err := C.mc_open(cs)
	if c == 0 {
		if errors.Is(err, syscall.ENODEV) {
			return nil, fmt.Errorf("%w: %s (not in ibv_get_device_list)", verbs.ErrNoDevice, name)
		}
		return nil, &Error{Call: "ibv_open_device " + name, Errno: errnoOr(err)}
	}
	return &device{name: name, c: c}, nil
}

type device struct {
	name string
	c    C.uintptr_t
}

func (d *device) Name() string { return d.name }

func (d *device) QueryPort(port uint8) (verbs.PortAttr, error) {
	var a C.struct_mc_ibv_port_attr
	r, err := C.mc_query_port(d.c, C.uint8_t(port), &a)
	if e := rc("ibv_query_port", r, err); e != nil {
		return verbs.PortAttr{}, e
	}
	return verbs.PortAttr{State: verbs.PortState(a.state), ActiveMTU: verbs.MTU(a.active_mtu), LID: uint16(a.lid),
		LinkLayer: verbs.LinkLayer(a.link_layer), GIDTableLen: int(a.gid_tbl_len)}, nil
}

func (d *device) QueryGID(port uint8, index int) (verbs.GID, error) {
	var g verbs.GID
	var buf [16]C.uint8_t
	r, err := C.mc_query_gid(d.c, C.uint8_t(port), C.int(index), &buf[0])
	if e := rc("ibv_query_gid", r, err); e != nil {
		return g, e
	}
	for i := range g {
		g[i] = byte(buf[i])
	}
	return g, nil
}

func (d *device) AllocPD() (verbs.PD, error) {
	p, err := C.mc_alloc_pd(d.c)
	if p == 0 {
		return nil, &Error{Call: "ibv_alloc_pd", Errno: errnoOr(err)}
	}
	return &pd{p: p}, nil
}

func (d *device) CreateCQ(depth int) (verbs.CQ, error) {
	q, err := C.mc_create_cq(d.c, C.int(depth))
	if q == 0 {
		return nil, &Error{Call: "ibv_create_cq", Errno: errnoOr(err)}
	}
	return &cq{q: q, depth: depth}, nil
}

func (d *device) Close() error {
	r, err := C.mc_close_device(d.c)
	return rc("ibv_close_device", r, err)
}

type pd struct{ p C.uintptr_t }

func (p *pd) RegMR(addr uintptr, n uint64, a verbs.Access) (verbs.MR, error) {
	m, err := C.mc_reg_mr(p.p, C.uintptr_t(addr), C.size_t(n), C.int(a))
	if m == 0 {
		return nil, &Error{Call: "ibv_reg_mr", Errno: errnoOr(err)}
	}
	return &mr{m: m}, nil
}

func (p *pd) RegDmabufMR(off, n, iova uint64, fd int, a verbs.Access) (verbs.MR, error) {
	m, err := C.mc_reg_dmabuf_mr(p.p, C.uint64_t(off), C.size_t(n), C.uint64_t(iova), C.int(fd), C.int(a))
	if m == 0 {
		return nil, &Error{Call: "ibv_reg_dmabuf_mr", Errno: errnoOr(err)}
	}
	return &mr{m: m}, nil
}

func (p *pd) CreateQP(c verbs.CQ, maxSendWR int) (verbs.QP, error) {
	rq, ok := c.(*cq)
	if !ok {
		return nil, errors.New("ibv: create_qp: not an ibv CQ")
	}
	q, err := C.mc_create_qp(p.p, rq.q, C.int(maxSendWR))
	if q == 0 {
		return nil, &Error{Call: "ibv_create_qp", Errno: errnoOr(err)}
	}
	return &qp{q: q, num: uint32(C.mc_qp_num(q)), wr: make([]C.struct_mc_ibv_send_wr, 1), sge: make([]C.struct_mc_ibv_sge, 1)}, nil
}

func (p *pd) Close() error {
	r, err := C.mc_dealloc_pd(p.p)
	return rc("ibv_dealloc_pd", r, err)
}

type mr struct{ m C.uintptr_t }

func (m *mr) LKey() uint32 { return uint32(C.mc_mr_lkey(m.m)) }
func (m *mr) RKey() uint32 { return uint32(C.mc_mr_rkey(m.m)) }
func (m *mr) Close() error {
	r, err := C.mc_dereg_mr(m.m)
	return rc("ibv_dereg_mr", r, err)
}

type cq struct {
	q     C.uintptr_t
	depth int
	mu    sync.Mutex
	buf   []C.struct_mc_ibv_wc
}

func (c *cq) Depth() int { return c.depth }

func (c *cq) Poll(wc []verbs.WC) (int, error) {
	if len(wc) == 0 {
		return 0, nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.buf) < len(wc) {
		c.buf = make([]C.struct_mc_ibv_wc, len(wc))
	}
	n := C.mc_poll_cq(c.q, C.int(len(wc)), &c.buf[0])
	if n < 0 {
		return 0, fmt.Errorf("ibv: poll_cq: %w (returned %d)", verbs.ErrCQOverrun, int(n))
	}
	for i := 0; i < int(n); i++ {
		w := &c.buf[i]
		wc[i] = verbs.WC{ID: uint64(w.wr_id), Status: verbs.Status(w.status), Vendor: uint32(w.vendor_err), QPN: uint32(w.qp_num)}
	}
	return int(n), nil
}

func (c *cq) Close() error {
	r, err := C.mc_destroy_cq(c.q)
	return rc("ibv_destroy_cq", r, err)
}

type qp struct {
	q     C.uintptr_t
	num   uint32
	mu    sync.Mutex
	state verbs.QPState
	wr    []C.struct_mc_ibv_send_wr
	sge   []C.struct_mc_ibv_sge
}

func (q *qp) Num() uint32 { return q.num }

func (q *qp) State() verbs.QPState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.state
}

func (q *qp) modify(call string, a *C.struct_mc_ibv_qp_attr, mask int, to verbs.QPState) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	r, err := C.mc_modify_qp(q.q, a, C.int(mask))
	if e := rc(call, r, err); e != nil {
		return e
	}
	q.state = to
	return nil
}

func (q *qp) Init(port uint8, acc verbs.Access) error {
	var a C.struct_mc_ibv_qp_attr
	a.qp_state = C.int(verbs.QPInit)
	a.port_num = C.uint8_t(port)
	a.qp_access_flags = C.uint(acc)
	return q.modify("ibv_modify_qp(INIT)", &a, maskState|maskPkeyIndex|maskPort|maskAccessFlags, verbs.QPInit)
}

func (q *qp) ReadyToReceive(r verbs.Remote) error {
	var a C.struct_mc_ibv_qp_attr
	a.qp_state = C.int(verbs.QPRTR)
	a.path_mtu = C.int(r.MTU)
	a.dest_qp_num = C.uint32_t(r.QPN)
	a.rq_psn = C.uint32_t(r.PSN)
	a.max_dest_rd_atomic = 16
	a.min_rnr_timer = 12
	a.ah_attr.dlid = C.uint16_t(r.LID)
	a.ah_attr.port_num = C.uint8_t(r.Port)
	if r.LID == 0 { // RoCE, or routed: address by GID
		a.ah_attr.is_global = 1
		for i := range r.GID {
			a.ah_attr.grh.dgid[i] = C.uint8_t(r.GID[i])
		}
		a.ah_attr.grh.sgid_index = C.uint8_t(r.GIDIndex)
		a.ah_attr.grh.hop_limit = 64
	}
	return q.modify("ibv_modify_qp(RTR)", &a, maskState|maskAV|maskPathMTU|maskDestQPN|maskRQPSN|maskMaxDestRdAtomc|maskMinRNRTimer, verbs.QPRTR)
}

func (q *qp) ReadyToSend(psn uint32) error {
	var a C.struct_mc_ibv_qp_attr
	a.qp_state = C.int(verbs.QPRTS)
	a.timeout = 14 // 4.096 us * 2^14 = 67 ms per try
	a.retry_cnt = 7
	a.rnr_retry = 7
	a.sq_psn = C.uint32_t(psn)
	a.max_rd_atomic = 16
	return q.modify("ibv_modify_qp(RTS)", &a, maskState|maskTimeout|maskRetryCnt|maskRNRRetry|maskSQPSN|maskMaxQPRdAtomic, verbs.QPRTS)
}

func (q *qp) Fail() error {
	var a C.struct_mc_ibv_qp_attr
	a.qp_state = C.int(verbs.QPError)
	return q.modify("ibv_modify_qp(ERR)", &a, maskState, verbs.QPError)
}

func (q *qp) PostSend(wrs []verbs.SendWR) (int, error) {
	if len(wrs) == 0 {
		return 0, nil
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.state != verbs.QPRTS && q.state != verbs.QPError {
		return 0, fmt.Errorf("ibv: post_send: %w (%v)", verbs.ErrQPState, q.state)
	}
	if len(q.wr) < len(wrs) {
		q.wr = make([]C.struct_mc_ibv_send_wr, len(wrs))
		q.sge = make([]C.struct_mc_ibv_sge, len(wrs))
	}
	for i, w := range wrs {
		q.wr[i] = C.struct_mc_ibv_send_wr{}
		c := &q.wr[i]
		c.wr_id = C.uint64_t(w.ID)
		c.opcode = C.int(w.Op)
		if w.Signaled {
			c.send_flags = 1 << 1 // IBV_SEND_SIGNALED
		}
		rd := (*struct {
			addr uint64
			rkey uint32
		})(unsafe.Pointer(&c.wr))
		rd.addr, rd.rkey = w.Remote, w.RKey
		q.sge[i] = C.struct_mc_ibv_sge{addr: C.uint64_t(w.Local), length: C.uint32_t(w.Len), lkey: C.uint32_t(w.LKey)}
	}
	var bad C.int
	r := C.mc_post_send(q.q, C.int(len(wrs)), &q.wr[0], &q.sge[0], &bad)
	if r != 0 {
		return int(bad), &Error{Call: "ibv_post_send", Errno: syscall.Errno(r)}
	}
	return len(wrs), nil
}

func (q *qp) Close() error {
	r, err := C.mc_destroy_qp(q.q)
	return rc("ibv_destroy_qp", r, err)
}
