package fdshare

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeHost stands in for the engine: Dial runs the handler registered for
// the kind on the other end of a pipe (no handshake: the transports' own
// suites run the real one).
type fakeHost struct {
	transfer.Host
	self *transfer.Descriptor

	mu       sync.Mutex
	handlers map[string]func(net.Conn, transfer.Hello)
	wg       sync.WaitGroup
}

func newFakeHost() *fakeHost {
	var b [8]byte
	rand.Read(b[:])
	return &fakeHost{self: &transfer.Descriptor{Name: "target", Incarnation: "test-" + hex.EncodeToString(b[:])},
		handlers: map[string]func(net.Conn, transfer.Hello){}}
}

func (h *fakeHost) Logger() *zap.Logger        { return zap.NewNop() }
func (h *fakeHost) Self() *transfer.Descriptor { return h.self }
func (h *fakeHost) Timeout() time.Duration     { return 5 * time.Second }
func (h *fakeHost) Handle(kind string, fn func(net.Conn, transfer.Hello)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.handlers[kind] = fn
}

func (h *fakeHost) Dial(ctx context.Context, peer *transfer.Descriptor, kind string) (net.Conn, error) {
	h.mu.Lock()
	fn := h.handlers[kind]
	h.mu.Unlock()
	if fn == nil {
		return nil, errors.New("no handler")
	}
	a, b := net.Pipe()
	h.wg.Go(func() { fn(b, transfer.Hello{Kind: kind, Name: "initiator"}) })
	return a, nil
}

const kind = "fdtest"

// rig is a started server and a client of it.
type rig struct {
	host    *fakeHost
	srv     *Server
	cl      *Client
	wg      sync.WaitGroup
	revoked chan uint64
	gone    chan error
}

func newRig(t *testing.T, w *Wire) *rig {
	t.Helper()
	r := &rig{host: newFakeHost(), revoked: make(chan uint64, 8), gone: make(chan error, 1)}
	r.srv = NewServer(ServerConfig{Kind: kind, Wire: w})
	if err := r.srv.Start(r.host, nil); err != nil {
		t.Fatal(err)
	}
	info, _ := json.Marshal(map[string]any{"socket": r.srv.Socket(), "version": 1})
	peer := &transfer.Descriptor{Name: "target", Incarnation: r.host.self.Incarnation, PID: 1,
		Transports: map[string]json.RawMessage{kind: info}}
	r.cl = NewClient(ClientConfig{Kind: kind, Version: 1, Wire: w, Host: r.host, Self: "initiator-inc", Peer: peer,
		Go:       func(fn func()) bool { r.wg.Go(fn); return true },
		OnRevoke: func(id uint64) { r.revoked <- id },
		OnGone:   func(why error) { r.cl.Close(); r.gone <- why },
	})
	t.Cleanup(func() {
		r.srv.Close()
		r.cl.Die(transfer.ErrClosed)
		r.cl.Close()
		r.wg.Wait()
		r.host.wg.Wait()
	})
	return r
}

func memfd(t *testing.T, size int64) int {
	t.Helper()
	fd, err := unix.MemfdCreate("fdshare-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Skipf("memfd_create: %v", err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	return fd
}

func TestFetchRevokeGone(t *testing.T) {
	for _, w := range []*Wire{compact, wide} {
		t.Run(w.Name, func(t *testing.T) {
			r := newRig(t, w)
			ctx := context.Background()
			fd := memfd(t, 8192)
			defer unix.Close(fd)
			shared, err := ShareMemfd(fd, false)
			if err != nil {
				t.Fatal(err)
			}
			id, err := r.srv.Add(Item{FD: shared, Reply: Packet{Offset: 4096, Size: 4096}})
			if err != nil {
				t.Fatal(err)
			}
			keyed, _ := r.srv.Add(Item{FD: -1, Reply: Packet{Flags: FlagWritable, Size: 1, Key: [64]byte{7}}})

			if err := r.cl.Connect(ctx); err != nil {
				t.Fatal(err)
			}
			if !r.cl.Connected() || r.cl.Alive() != nil {
				t.Fatalf("connected %v, alive %v", r.cl.Connected(), r.cl.Alive())
			}
			var got []Reply
			refused, err := r.cl.Fetch(ctx, []uint64{id, keyed, 999}, func(i int, rep Reply) error {
				got = append(got, rep)
				if rep.Status != 0 {
					return errors.New(rep.Text)
				}
				return nil
			})
			if err != nil || len(refused) != 1 || refused[999] == nil || got[2].Status != StatusNotRegistered {
				t.Fatalf("fetch: refused %v, err %v", refused, err)
			}
			if got[0].FD < 0 || got[0].Offset != 4096 || got[0].Size != 4096 || got[0].Region != id {
				t.Fatalf("item: %+v", got[0])
			}
			var st unix.Stat_t
			if err := unix.Fstat(got[0].FD, &st); err != nil || st.Size != 8192 {
				t.Fatalf("fd: size %d, %v", st.Size, err)
			}
			if fl, _ := unix.FcntlInt(uintptr(got[0].FD), unix.F_GETFL, 0); fl&unix.O_ACCMODE != unix.O_RDONLY {
				t.Fatalf("read-only item passed with flags %#x", fl)
			}
			unix.Close(got[0].FD)
			if got[1].FD != -1 || got[1].Flags != FlagWritable || got[1].Key[0] != 7 {
				t.Fatalf("fd-less item: %+v", got[1])
			}

			r.srv.Remove(id)
			select {
			case rid := <-r.revoked:
				if rid != id {
					t.Fatalf("revoked %d, want %d", rid, id)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("no revoke")
			}

			r.srv.Close()
			select {
			case why := <-r.gone:
				if !errors.Is(why, transfer.ErrPeerDead) {
					t.Fatalf("gone: %v, want ErrPeerDead", why)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("server closed, client not told")
			}
			if err := r.cl.Alive(); !errors.Is(err, transfer.ErrPeerDead) {
				t.Fatalf("alive after the server closed: %v", err)
			}
			if _, err := r.srv.Add(Item{FD: -1}); !errors.Is(err, transfer.ErrClosed) {
				t.Fatalf("add after close: %v", err)
			}
		})
	}
}

func TestConnectChecksVersion(t *testing.T) {
	r := newRig(t, compact)
	r.cl.cfg.Version = 2
	if err := r.cl.Connect(context.Background()); err == nil {
		t.Fatal("connected to a peer of another protocol version")
	}
}

// rawUnix connects to the server's socket, skipping the engine: what a
// process that never proved the cluster secret can do.
func rawUnix(t *testing.T, sock string) *net.UnixConn {
	t.Helper()
	c, err := net.Dial("unixpacket", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(5 * time.Second))
	return c.(*net.UnixConn)
}

// readAllFDs reads up to max packets (-1: any number) until the connection
// ends or times out, and counts the fds that came with them (closing them).
func readAllFDs(t *testing.T, w *Wire, c *net.UnixConn, max int) (pks []Packet, fds int) {
	t.Helper()
	buf := make([]byte, w.MaxPacket()+1)
	oob := make([]byte, unix.CmsgSpace(4*4))
	for max < 0 || len(pks) < max {
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if oobn > 0 {
			msgs, _ := unix.ParseSocketControlMessage(oob[:oobn])
			for _, m := range msgs {
				got, _ := unix.ParseUnixRights(&m)
				fds += len(got)
			}
			CloseRights(oob[:oobn])
		}
		if err != nil || n == 0 {
			return pks, fds
		}
		p, err := w.Decode(buf[:n])
		if err != nil {
			t.Fatalf("bad packet: %v", err)
		}
		pks = append(pks, p)
	}
	return pks, fds
}

// TestNoTicketNoFD: a unix connection with a forged ticket, or with a
// ticket already used, is refused and gets no fd, whatever it asks for;
// admissions and refusals are logged with the peer's pid and uid.
func TestNoTicketNoFD(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	w := compact
	host := newFakeHost()
	srv := NewServer(ServerConfig{Kind: kind, Wire: w})
	if err := srv.Start(host, zap.New(core)); err != nil {
		t.Fatal(err)
	}
	defer func() { srv.Close(); host.wg.Wait() }()
	fd := memfd(t, 4096)
	id, err := srv.Add(Item{FD: fd, Reply: Packet{Size: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	// attempt sends a hello with ticket, reads the answer, then asks for
	// the item anyway and reads whatever comes until the end (or timeout).
	attempt := func(ticket []byte, text string, timeout time.Duration) ([]Packet, int) {
		c := rawUnix(t, srv.Socket())
		hello := Packet{Type: TypeHello, Text: text}
		copy(hello.Key[:32], ticket)
		var buf [MaxPacket]byte
		if _, _, err := c.WriteMsgUnix(w.Append(buf[:0], &hello), nil, nil); err != nil {
			t.Fatal(err)
		}
		c.SetReadDeadline(time.Now().Add(time.Second))
		pks, fds := readAllFDs(t, w, c, 1)
		req := Packet{Type: TypeMapReq, Req: 1, Region: id}
		c.WriteMsgUnix(w.Append(buf[:0], &req), nil, nil)
		c.SetReadDeadline(time.Now().Add(timeout))
		more, n := readAllFDs(t, w, c, -1)
		return append(pks, more...), fds + n
	}
	forged := make([]byte, 32)
	rand.Read(forged)
	pks, fds := attempt(forged, "intruder", 5*time.Second)
	if fds != 0 || len(pks) != 1 || pks[0].Type != TypeWelcome || pks[0].Status == 0 {
		t.Fatalf("forged ticket: %d fds, packets %+v", fds, pks)
	}
	// A ticket handed out on an (authenticated) engine connection admits
	// one unix connection, once.
	tc, err := host.Dial(context.Background(), nil, kind)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	var tk ticketMsg
	if err := transfer.ReadFrame(tc, &tk); err != nil {
		t.Fatal(err)
	}
	// The server keeps an admitted connection open: read until a deadline.
	pks, fds = attempt(tk.Ticket, "initiator-inc", 500*time.Millisecond)
	if fds != 1 || len(pks) != 2 || pks[0].Status != 0 || pks[1].Type != TypeMapReply {
		t.Fatalf("valid ticket: %d fds, packets %+v", fds, pks)
	}
	pks, fds = attempt(tk.Ticket, "intruder", 5*time.Second)
	if fds != 0 || len(pks) != 1 || pks[0].Status == 0 {
		t.Fatalf("used ticket: %d fds, packets %+v", fds, pks)
	}
	me := strconv.Itoa(os.Getpid())
	for msg, n := range map[string]int{"peer admitted": 1, "unix connection refused": 2} {
		var got int
		for _, e := range logs.FilterMessageSnippet(msg).All() {
			if fmt.Sprint(e.ContextMap()["pid"]) == me && fmt.Sprint(e.ContextMap()["uid"]) == strconv.Itoa(os.Getuid()) {
				got++
			}
		}
		if got != n {
			t.Errorf("%d %q lines with pid %s and uid %d, want %d: %v", got, msg, me, os.Getuid(), n, logs.All())
		}
	}
}
