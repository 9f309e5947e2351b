package tcp_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func newTransports() []transfer.Transport { return []transfer.Transport{tcp.New(tcp.Config{})} }

func TestMain(m *testing.M) {
	transfertest.TargetMain(newTransports)
	goleak.VerifyTestMain(m)
}

func TestConformance(t *testing.T) {
	transfertest.Run(t, newTransports)
}

// Small chunks and one in-flight request per lane exercise splitting and
// the in-flight limit.
func TestConformanceSmallChunks(t *testing.T) {
	transfertest.Run(t, func() []transfer.Transport {
		return []transfer.Transport{tcp.New(tcp.Config{Lanes: 3, MaxInflight: 1, ChunkSize: 4096 + 3})}
	})
}

func TestProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	transfertest.RunProcess(t, newTransports)
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []tcp.Config{{Lanes: -1}, {MaxInflight: -1}, {ChunkSize: tcp.MaxChunk + 1}, {StagingChunk: -1},
		{StagingChunk: tcp.MaxChunk + 1}, {StagingSlots: 65}, {MaxServedStaging: -1}} {
		if err := c.Validate(); err == nil {
			t.Errorf("%+v: no error", c)
		}
		if _, err := transfer.New(context.Background(), transfer.Config{Transports: []transfer.Transport{tcp.New(c)}}); err == nil {
			t.Errorf("%+v: engine started", c)
		}
	}
	if got := tcp.New(tcp.Config{}).Config(); got.Lanes == 0 || got.MaxInflight == 0 || got.ChunkSize == 0 {
		t.Errorf("defaults not filled: %+v", got)
	}
}

// TestServerChecksEveryRequest speaks the wire format directly, bypassing
// the initiator's checks: the serving side must refuse out-of-range and
// read-only targets itself, keep the lane usable, and close it on a bad
// frame.
func TestServerChecksEveryRequest(t *testing.T) {
	b := transfertest.NewNode(t, newTransports, nil)
	rw := b.Alloc(t, 1<<16, transfer.AccessReadWrite)
	ro := b.Alloc(t, 1<<16, transfer.AccessRead)
	a := transfertest.NewNode(t, newTransports, nil)
	conn, err := a.E.Dial(context.Background(), b.E.Self(), tcp.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	payload := []byte("0123456789")
	cases := []struct {
		name   string
		op     uint8
		addr   uint64
		n      uint64
		status uint8
		errHas string
	}{
		{"write crosses end", tcp.OpWrite, rw.Addr() + 1<<16 - 5, 10, tcp.StatusOutOfBounds, "crosses the end"},
		{"write unregistered", tcp.OpWrite, 0x10000, 10, tcp.StatusOutOfBounds, "not in any"},
		{"write read-only", tcp.OpWrite, ro.Addr(), 10, tcp.StatusDenied, "grants read"},
		{"read crosses end", tcp.OpRead, ro.Addr() + 1<<16 - 1, 10, tcp.StatusOutOfBounds, "crosses the end"},
		{"write ok", tcp.OpWrite, rw.Addr() + 7, 10, tcp.StatusOK, ""},
		{"read ok", tcp.OpRead, rw.Addr() + 7, 10, tcp.StatusOK, ""},
	}
	for i, c := range cases {
		var p []byte
		if c.op == tcp.OpWrite {
			p = payload
		}
		if _, err := conn.Write(append(tcp.EncodeRequest(c.op, uint64(i), c.addr, c.n), p...)); err != nil {
			t.Fatal(err)
		}
		status, id, body, err := tcp.ReadResponse(conn)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if status != c.status || id != uint64(i) {
			t.Fatalf("%s: status %d id %d (%q), want %d id %d", c.name, status, id, body, c.status, i)
		}
		if c.errHas != "" && (!strings.Contains(string(body), c.errHas) || !strings.Contains(string(body), "0x")) {
			t.Errorf("%s: error %q does not name the range and %q", c.name, body, c.errHas)
		}
		if c.name == "read ok" && string(body) != string(payload) {
			t.Errorf("read back %q", body)
		}
	}
	for i, c := range rw.Bytes() {
		if (i < 7 || i >= 17) && c != transfertest.Poison {
			t.Fatalf("byte %d written", i)
		}
	}
	for _, c := range ro.Bytes() {
		if c != transfertest.Poison {
			t.Fatal("read-only region written")
		}
	}
	// A bad frame: answered with status bad request, then the lane closes.
	bad := tcp.EncodeRequest(tcp.OpWrite, 99, rw.Addr(), 1<<40)
	conn.Write(bad)
	status, _, body, err := tcp.ReadResponse(conn)
	if err != nil || status != tcp.StatusBadRequest {
		t.Fatalf("bad frame: status %d %q %v", status, body, err)
	}
	if _, err := conn.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("lane not closed after a bad frame: %v", err)
	}
}

// TestConformanceDevice: device memory (a fake whose addresses the CPU
// cannot touch) staged on either side.
func TestConformanceDevice(t *testing.T) {
	transfertest.RunDevice(t, newTransports, transfertest.FakeDevices)
}

// Small staging chunks and one slot per direction: every transfer is many
// staged pieces queued for few slots.
func TestConformanceDeviceSmallStaging(t *testing.T) {
	transfertest.RunDevice(t, func() []transfer.Transport {
		return []transfer.Transport{tcp.New(tcp.Config{Lanes: 2, MaxInflight: 3, StagingChunk: 4096 + 5, StagingSlots: 1})}
	}, transfertest.FakeDevices)
}

// anyTransport registers any region (for same-machine peers) and serves
// nothing: it lets a GPU region without DeviceMemory exist beside tcp.
type anyTransport struct{}

func (anyTransport) Name() string                                             { return "any" }
func (anyTransport) Reach() transfer.Reach                                    { return transfer.ReachSameMachine }
func (anyTransport) Start(transfer.Host) error                                { return nil }
func (anyTransport) Info() json.RawMessage                                    { return nil }
func (anyTransport) RegisterRegion(*transfer.Region) (json.RawMessage, error) { return nil, nil }
func (anyTransport) UnregisterRegion(*transfer.Region)                        {}
func (anyTransport) CanServe(transfer.Location, *transfer.Descriptor, *transfer.RegionInfo) bool {
	return false
}
func (anyTransport) Submit(_ context.Context, _ *transfer.Descriptor, ts []*transfer.Task) {
	for _, t := range ts {
		t.Done(errors.New("any: serves nothing"))
	}
}
func (anyTransport) DropPeer(*transfer.Descriptor) {}
func (anyTransport) Close() error                  { return nil }

// shareOnly hides a FakeDevice's copies: Memory, not DeviceMemory.
type shareOnly struct{ transfer.Memory }

// TestDeviceWithoutCopies: tcp refuses to register GPU memory it cannot
// stage; and where such a region exists (registered for another transport)
// neither side of tcp touches it: the target answers status 4, the
// initiator fails the task, both naming the range. The fake's addresses
// are inaccessible, so touching them would crash the test.
func TestDeviceWithoutCopies(t *testing.T) {
	f, err := transfertest.NewFakeDevice(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ctx := context.Background()
	loc := transfertest.DeviceLocation
	tcpOnly := transfertest.NewNode(t, newTransports, nil)
	err = tcpOnly.E.RegisterMemory(ctx, uintptr(f.Base()), 1<<20, loc, transfer.AccessReadWrite, transfer.WithMemory(shareOnly{f}))
	if !errors.Is(err, transfer.ErrCannotRegister) || !strings.Contains(err.Error(), "DeviceMemory") {
		t.Fatalf("register GPU memory without copies for tcp: %v, want ErrCannotRegister naming DeviceMemory", err)
	}
	both := func() []transfer.Transport { return []transfer.Transport{tcp.New(tcp.Config{}), anyTransport{}} }
	b := transfertest.NewNode(t, both, nil)
	if err := b.E.RegisterMemory(ctx, uintptr(f.Base()), 1<<20, loc, transfer.AccessReadWrite, transfer.WithMemory(shareOnly{f}),
		transfer.WithScope(transfer.ScopeSameMachine)); err != nil {
		t.Fatal(err)
	}
	bh := b.Alloc(t, 1<<16, transfer.AccessReadWrite)
	a := transfertest.NewNode(t, newTransports, nil)
	conn, err := a.E.Dial(ctx, b.E.Self(), tcp.Name)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	for i, op := range []uint8{tcp.OpWrite, tcp.OpRead} {
		req := tcp.EncodeRequest(op, uint64(i), f.Base()+64, 10)
		if op == tcp.OpWrite {
			req = append(req, "0123456789"...)
		}
		if _, err := conn.Write(req); err != nil {
			t.Fatal(err)
		}
		status, id, body, err := tcp.ReadResponse(conn)
		if err != nil || status != tcp.StatusDevice || id != uint64(i) || !strings.Contains(string(body), "DeviceMemory") {
			t.Fatalf("op %d: status %d id %d %q %v, want status %d naming DeviceMemory", op, status, id, body, err, tcp.StatusDevice)
		}
	}
	// The lane still serves host memory.
	if _, err := conn.Write(append(tcp.EncodeRequest(tcp.OpWrite, 7, bh.Addr(), 3), "abc"...)); err != nil {
		t.Fatal(err)
	}
	if status, _, _, err := tcp.ReadResponse(conn); err != nil || status != tcp.StatusOK {
		t.Fatalf("host write after refusals: status %d %v", status, err)
	}
	// Initiator side: b's GPU region as the local side of a transfer.
	seg, err := b.E.OpenSegment(ctx, a.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	am := a.Alloc(t, 1<<16, transfer.AccessReadWrite)
	err = b.E.Transfer(ctx, []transfer.Request{{Op: transfer.Write, Local: uintptr(f.Base()), Len: 100, Segment: seg, Remote: am.Addr()}})
	if !errors.Is(err, transfer.ErrDeviceCopy) || !strings.Contains(err.Error(), "DeviceMemory") {
		t.Fatalf("transfer from GPU memory without copies: %v", err)
	}
}

// TestServedStagingBudget: a target whose served lanes' staging is at its
// limit refuses device requests (ErrDeviceCopy naming the limit) and still
// serves host memory.
func TestServedStagingBudget(t *testing.T) {
	small := func() []transfer.Transport {
		return []transfer.Transport{tcp.New(tcp.Config{MaxServedStaging: 1 << 20})}
	}
	b := transfertest.NewNode(t, small, nil)
	bd := b.AllocDevice(t, transfertest.FakeDevices, 1<<20, transfer.AccessReadWrite)
	bh := b.Alloc(t, 1<<20, transfer.AccessReadWrite)
	a := transfertest.NewNode(t, newTransports, nil)
	am := a.Alloc(t, 1<<20, transfer.AccessReadWrite)
	seg, err := a.E.OpenSegment(context.Background(), b.E.Name())
	if err != nil {
		t.Fatal(err)
	}
	err = a.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Write, Local: uintptr(am.Addr()), Len: 4096, Segment: seg, Remote: bd.Addr}})
	if !errors.Is(err, transfer.ErrDeviceCopy) || !strings.Contains(err.Error(), "MaxServedStaging") {
		t.Fatalf("device write past the staging budget: %v", err)
	}
	if err := a.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Write, Local: uintptr(am.Addr()), Len: 4096, Segment: seg, Remote: bh.Addr()}}); err != nil {
		t.Fatalf("host write: %v", err)
	}
}
