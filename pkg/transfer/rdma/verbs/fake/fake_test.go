package fake_test

import (
	"errors"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma/verbs/fake"
)

type end struct {
	dev verbs.Device
	pd  verbs.PD
	cq  verbs.CQ
	qp  verbs.QP
	buf []byte
	mr  verbs.MR
}

func addr(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

func open(t *testing.T, h *fake.Host, access verbs.Access, cqDepth, maxWR int) *end {
	t.Helper()
	d, err := h.Open("mlx5_0")
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := d.AllocPD()
	cq, err := d.CreateCQ(cqDepth)
	if err != nil {
		t.Fatal(err)
	}
	qp, err := pd.CreateQP(cq, maxWR)
	if err != nil {
		t.Fatal(err)
	}
	buf, err := unix.Mmap(-1, 0, 1<<16, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Munmap(buf) })
	mr, err := pd.RegMR(uintptr(addr(buf)), uint64(len(buf)), access)
	if err != nil {
		t.Fatal(err)
	}
	return &end{dev: d, pd: pd, cq: cq, qp: qp, buf: buf, mr: mr}
}

func connect(t *testing.T, a, b *end) {
	t.Helper()
	ga, _ := a.dev.QueryGID(1, 0)
	gb, _ := b.dev.QueryGID(1, 0)
	all := verbs.AccessLocalWrite | verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	for _, x := range []struct {
		e *end
		r verbs.Remote
	}{{a, verbs.Remote{QPN: b.qp.Num(), GID: gb, MTU: verbs.MTU4096, Port: 1}}, {b, verbs.Remote{QPN: a.qp.Num(), GID: ga, MTU: verbs.MTU4096, Port: 1}}} {
		if err := x.e.qp.Init(1, all); err != nil {
			t.Fatal(err)
		}
		if err := x.e.qp.ReadyToReceive(x.r); err != nil {
			t.Fatal(err)
		}
		if err := x.e.qp.ReadyToSend(0); err != nil {
			t.Fatal(err)
		}
	}
}

func poll(t *testing.T, cq verbs.CQ) []verbs.WC {
	t.Helper()
	wc := make([]verbs.WC, 64)
	n, err := cq.Poll(wc)
	if err != nil {
		t.Fatal(err)
	}
	return wc[:n]
}

// What real verbs enforce, the fake enforces.
func TestFakeEnforces(t *testing.T) {
	fab := fake.NewFabric()
	all := verbs.AccessLocalWrite | verbs.AccessRemoteRead | verbs.AccessRemoteWrite
	a := open(t, fab.NewHost("mlx5_0"), all, 8, 4)
	b := open(t, fab.NewHost("mlx5_0"), verbs.AccessLocalWrite|verbs.AccessRemoteRead, 8, 4) // read-only for peers

	// The state machine: no post before RTS, no RTR before INIT.
	if _, err := a.qp.PostSend([]verbs.SendWR{{ID: 1}}); !errors.Is(err, verbs.ErrQPState) {
		t.Fatalf("post in RESET: %v", err)
	}
	if err := a.qp.ReadyToReceive(verbs.Remote{QPN: 1, GID: verbs.GID{1}}); !errors.Is(err, verbs.ErrQPState) {
		t.Fatalf("RESET -> RTR: %v", err)
	}
	connect(t, a, b)
	wr := func(id uint64, op verbs.Opcode, local, remote uint64, n uint32, lkey, rkey uint32) verbs.SendWR {
		return verbs.SendWR{ID: id, Op: op, Local: local, Len: n, LKey: lkey, Remote: remote, RKey: rkey, Signaled: true}
	}
	copy(b.buf, "remote bytes")
	// A good read moves the bytes.
	if _, err := a.qp.PostSend([]verbs.SendWR{wr(1, verbs.OpRead, addr(a.buf), addr(b.buf), 12, a.mr.LKey(), b.mr.RKey())}); err != nil {
		t.Fatal(err)
	}
	if wc := poll(t, a.cq); len(wc) != 1 || wc[0].Status != verbs.StatusSuccess || string(a.buf[:12]) != "remote bytes" {
		t.Fatalf("read: %+v %q", wc, a.buf[:12])
	}
	// Refusals, each moving the QP to ERR and flushing what follows.
	for _, c := range []struct {
		name string
		w    verbs.SendWR
		want verbs.Status
	}{
		{"write into a read-only region", wr(2, verbs.OpWrite, addr(a.buf), addr(b.buf), 8, a.mr.LKey(), b.mr.RKey()), verbs.StatusRemAccess},
		{"bad rkey", wr(3, verbs.OpRead, addr(a.buf), addr(b.buf), 8, a.mr.LKey(), b.mr.RKey()+1), verbs.StatusRemAccess},
		{"past the remote region", wr(4, verbs.OpRead, addr(a.buf), addr(b.buf)+uint64(len(b.buf))-4, 8, a.mr.LKey(), b.mr.RKey()), verbs.StatusRemAccess},
		{"bad lkey", wr(5, verbs.OpRead, addr(a.buf), addr(b.buf), 8, a.mr.LKey()+7, b.mr.RKey()), verbs.StatusLocProtErr},
		{"past the local region", wr(6, verbs.OpRead, addr(a.buf)+uint64(len(a.buf))-1, addr(b.buf), 8, a.mr.LKey(), b.mr.RKey()), verbs.StatusLocProtErr},
	} {
		b.buf[0] = 'r'
		if _, err := a.qp.PostSend([]verbs.SendWR{c.w, wr(99, verbs.OpRead, addr(a.buf), addr(b.buf), 1, a.mr.LKey(), b.mr.RKey())}); err != nil {
			t.Fatalf("%s: post: %v", c.name, err)
		}
		wc := poll(t, a.cq)
		if len(wc) != 2 || wc[0].Status != c.want || wc[1].Status != verbs.StatusFlushErr || a.qp.State() != verbs.QPError {
			t.Fatalf("%s: completions %+v, QP %v; want %v then a flush, QP in ERR", c.name, wc, a.qp.State(), c.want)
		}
		if b.buf[0] != 'r' {
			t.Fatalf("%s: remote memory written", c.name)
		}
		// A new QP for the next case.
		a.qp.Close()
		b.qp.Close()
		a.qp, _ = a.pd.CreateQP(a.cq, 4)
		b.qp, _ = b.pd.CreateQP(b.cq, 4)
		connect(t, a, b)
	}
	// The send queue holds at most its depth until completions are polled.
	r := wr(7, verbs.OpRead, addr(a.buf), addr(b.buf), 1, a.mr.LKey(), b.mr.RKey())
	if _, err := a.qp.PostSend([]verbs.SendWR{r, r, r, r, r}); !errors.Is(err, verbs.ErrQueueFull) {
		t.Fatalf("5 requests on a queue of 4: %v", err)
	}
	if _, err := a.qp.PostSend([]verbs.SendWR{r, r, r, r}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.qp.PostSend([]verbs.SendWR{r}); !errors.Is(err, verbs.ErrQueueFull) {
		t.Fatalf("a fifth request before polling: %v", err)
	}
	poll(t, a.cq)
	// A CQ that overflows (9 completions, 8 entries) is an error, and its
	// QP goes to ERR.
	a.qp.Close()
	b.qp.Close()
	a.qp, _ = a.pd.CreateQP(a.cq, 16)
	b.qp, _ = b.pd.CreateQP(b.cq, 4)
	connect(t, a, b)
	if _, err := a.qp.PostSend([]verbs.SendWR{r, r, r, r, r, r, r, r, r}); err != nil {
		t.Fatal(err)
	}
	if _, err := a.cq.Poll(make([]verbs.WC, 1)); !errors.Is(err, verbs.ErrCQOverrun) || a.qp.State() != verbs.QPError {
		t.Fatalf("overflowed CQ: %v, QP %v", err, a.qp.State())
	}
	// Destroying a CQ that a live QP uses fails, as EBUSY does.
	if err := a.cq.Close(); err == nil {
		t.Fatal("destroyed a CQ in use")
	}
}

// RefuseDmabuf: reg_dmabuf_mr fails with EOPNOTSUPP while it is set, and
// works (mapping the fd at the iova) once it is cleared.
func TestRefuseDmabuf(t *testing.T) {
	h := fake.NewFabric().NewHost("mlx5_0")
	d, err := h.Open("mlx5_0")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	pd, _ := d.AllocPD()
	fd, err := unix.MemfdCreate("dmabuf", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, 1<<16); err != nil {
		t.Fatal(err)
	}
	h.HCA("mlx5_0").RefuseDmabuf(true)
	if _, err := pd.RegDmabufMR(0, 1<<16, 0x10_0000_0000, fd, verbs.AccessLocalWrite); !errors.Is(err, unix.EOPNOTSUPP) {
		t.Fatalf("refused reg_dmabuf_mr: %v", err)
	}
	if _, mrs, _ := h.HCA("mlx5_0").Live(); mrs != 0 {
		t.Fatalf("%d MRs after a refused registration", mrs)
	}
	h.HCA("mlx5_0").RefuseDmabuf(false)
	mr, err := pd.RegDmabufMR(0, 1<<16, 0x10_0000_0000, fd, verbs.AccessLocalWrite)
	if err != nil {
		t.Fatal(err)
	}
	if err := mr.Close(); err != nil {
		t.Fatal(err)
	}
}
