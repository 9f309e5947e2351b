package transfertest

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/auth"
)

// Environment of a target process started by StartTarget.
const (
	EnvTarget     = "MOONCAKE_TRANSFERTEST_TARGET" // "1": run as a target
	envTargetSize = "MOONCAKE_TRANSFERTEST_SIZE"
	envTargetTok  = "MOONCAKE_TRANSFERTEST_TOKEN"
	envTargetReg  = "MOONCAKE_TRANSFERTEST_REGISTRY"
)

// ProcessToken is the cluster token of the two-process data tests (a
// registry server they use must hold it too).
const ProcessToken = "process-test-token"

// OpenRegistry, when set (by a test package, before TargetMain), opens the
// registry a spec names with a cluster secret, in the target and in
// RunProcessRegistry's initiator. It keeps this package free of registry
// implementations.
var OpenRegistry func(ctx context.Context, spec string, secret auth.Secret) (transfer.Registry, io.Closer, error)

// TargetMain makes a test binary usable as a target process. Call it first
// in TestMain: when the binary was started by StartTarget it runs the
// target (an engine with newTransports, BufferSize bytes of poisoned
// read-write host memory) and exits; otherwise it returns at once.
//
// The target prints `listening on host:port` and `region 0xADDR SIZE`, then
// serves until its standard input closes (so it never outlives its parent).
func TargetMain(newTransports func() []transfer.Transport) {
	if os.Getenv(EnvTarget) != "1" {
		return
	}
	if err := runTarget(newTransports); err != nil {
		fmt.Fprintln(os.Stderr, "target:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

func runTarget(newTransports func() []transfer.Transport) error {
	size, err := strconv.ParseInt(os.Getenv(envTargetSize), 10, 64)
	if err != nil {
		return fmt.Errorf("bad %s: %v", envTargetSize, err)
	}
	ctx := context.Background()
	var reg transfer.Registry
	if spec := os.Getenv(envTargetReg); spec != "" {
		if OpenRegistry == nil {
			return fmt.Errorf("%s=%s but OpenRegistry is not set", envTargetReg, spec)
		}
		r, closer, err := OpenRegistry(ctx, spec, Secret(os.Getenv(envTargetTok)))
		if err != nil {
			return err
		}
		defer closer.Close()
		reg = r
	}
	e, err := transfer.New(ctx, transfer.Config{Listen: "127.0.0.1:0", Transports: newTransports(),
		Secret: Secret(os.Getenv(envTargetTok)), Registry: reg})
	if err != nil {
		return err
	}
	defer e.Close()
	m, err := e.AllocHost(ctx, size, 0, transfer.AccessReadWrite)
	if err != nil {
		return err
	}
	fill(m.Bytes(), Poison)
	fmt.Printf("listening on %s\nregion %#x %d\n", e.Name(), m.Addr(), m.Size())
	io.Copy(io.Discard, os.Stdin)
	return nil
}

// Target is a target process started by StartTarget.
type Target struct {
	Name   string // segment name (host:port)
	Region uint64 // address of its read-write region
	Size   uint64
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	exited chan struct{}
}

// StartTarget re-executes the test binary as a target process (see
// TargetMain) with size bytes of memory, and waits for its readiness lines.
// The process is stopped when the test ends.
func StartTarget(t testing.TB, size int64, token string) *Target {
	return StartTargetRegistry(t, size, token, "")
}

// StartTargetRegistry is StartTarget with the target's descriptor published
// in the registry spec names ("" = P2P).
func StartTargetRegistry(t testing.TB, size int64, token, spec string) *Target {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), EnvTarget+"=1", envTargetSize+"="+strconv.FormatInt(size, 10), envTargetTok+"="+token,
		envTargetReg+"="+spec)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start target: %v", err)
	}
	tg := &Target{cmd: cmd, stdin: stdin, exited: make(chan struct{})}
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
		io.Copy(io.Discard, stdout)
		cmd.Wait()
		close(tg.exited)
	}()
	t.Cleanup(func() {
		stdin.Close()
		select {
		case <-tg.exited:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			<-tg.exited
		}
	})
	timeout := time.After(20 * time.Second)
	for tg.Name == "" || tg.Region == 0 {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatal("target exited before it was ready")
			}
			if s, ok := strings.CutPrefix(l, "listening on "); ok {
				tg.Name = s
			} else if s, ok := strings.CutPrefix(l, "region "); ok {
				if _, err := fmt.Sscanf(s, "%v %d", &tg.Region, &tg.Size); err != nil {
					t.Fatalf("target said %q: %v", l, err)
				}
			}
		case <-timeout:
			t.Fatal("target not ready after 20s")
		}
	}
	go func() {
		for range lines {
		}
	}()
	return tg
}

// Kill sends SIGKILL to the target.
func (tg *Target) Kill() error { return tg.cmd.Process.Signal(syscall.SIGKILL) }

// Exited is closed when the target process has exited.
func (tg *Target) Exited() <-chan struct{} { return tg.exited }

// RunProcess runs the two-process suite: the test binary re-executed as a
// target (TestMain must call TargetMain with the same newTransports), this
// process as the initiator.
func RunProcess(t *testing.T, newTransports func() []transfer.Transport) {
	t.Run("Data", func(t *testing.T) { testProcessData(t, newTransports) })
	t.Run("Kill", func(t *testing.T) { testProcessKill(t, newTransports) })
}

// RunProcessRegistry runs the two-process data test with both processes
// using the registry spec names (OpenRegistry must be set): the initiator
// finds the target's segment through the registry, not by dialing it.
func RunProcessRegistry(t *testing.T, newTransports func() []transfer.Transport, spec string) {
	if OpenRegistry == nil {
		t.Fatal("transfertest.OpenRegistry is not set")
	}
	reg, closer, err := OpenRegistry(context.Background(), spec, Secret(ProcessToken))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { closer.Close() })
	testProcessDataWith(t, newTransports, spec, reg)
}

func testProcessData(t *testing.T, nt func() []transfer.Transport) {
	testProcessDataWith(t, nt, "", nil)
}

func testProcessDataWith(t *testing.T, nt func() []transfer.Transport, spec string, reg transfer.Registry) {
	const size = 8 << 20
	tg := StartTargetRegistry(t, size, ProcessToken, spec)
	a := NewNode(t, nt, func(c *transfer.Config) { c.Secret = Secret(ProcessToken); c.Registry = reg })
	am := a.Alloc(t, size, transfer.AccessReadWrite)
	check := a.Alloc(t, size, transfer.AccessReadWrite)
	seg := open(t, a.E, tg.Name)
	rng := rand.New(rand.NewPCG(21, 22))
	readBack := func() []byte {
		fill(check.Bytes(), 0)
		err := a.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Read, Local: addrOf(check.Bytes()),
			Len: size, Segment: seg, Remote: tg.Region}})
		if err != nil {
			t.Fatalf("read back: %v", err)
		}
		return check.Bytes()
	}
	// The target's memory is poison: every write is checked by reading the
	// whole region back; every read is checked against what was written.
	var remote []byte = readBack()
	remote = append([]byte(nil), remote...)
	checkBytes(t, "initial target memory", remote, bytesOf(Poison, size))
	for _, c := range append(dataCases, pageCases()...) {
		if c.count*c.size(rng) > size/2 {
			continue
		}
		t.Run(c.name, func(t *testing.T) {
			spans := layout(rng, c.count, size, func() int { return c.size(rng) })
			fillRandom(rng, am.Bytes())
			want := append([]byte(nil), remote...)
			reqs := make([]transfer.Request, len(spans))
			for i, s := range spans {
				copy(want[s.dst:s.dst+s.n], am.Bytes()[s.src:s.src+s.n])
				reqs[i] = transfer.Request{Op: transfer.Write, Local: addrOf(am.Bytes()) + uintptr(s.src), Len: uint64(s.n),
					Segment: seg, Remote: tg.Region + uint64(s.dst)}
			}
			if c.pages {
				reqs = PageList(reqs)
			}
			if err := a.E.Transfer(context.Background(), reqs); err != nil {
				t.Fatal(err)
			}
			remote = append(remote[:0], readBack()...)
			checkBytes(t, "target memory after write", remote, want)
			// Read the same spans back into poisoned local memory.
			fill(am.Bytes(), Poison)
			wantLocal := bytesOf(Poison, size)
			for _, s := range spans {
				copy(wantLocal[s.src:s.src+s.n], remote[s.dst:s.dst+s.n])
			}
			for i := range reqs {
				reqs[i].Op = transfer.Read
			}
			if err := a.E.Transfer(context.Background(), reqs); err != nil {
				t.Fatal(err)
			}
			checkBytes(t, "local memory after read", am.Bytes(), wantLocal)
		})
	}
	t.Run("OutOfBounds", func(t *testing.T) {
		end := tg.Region + tg.Size
		err := a.E.Transfer(context.Background(), []transfer.Request{{Op: transfer.Write, Local: addrOf(am.Bytes()),
			Len: 100, Segment: seg, Remote: end - 50}})
		mustFail(t, err, transfer.ErrOutOfBounds, end-50, 100, nil)
		checkBytes(t, "target memory after refused write", readBack(), remote)
	})
}

func bytesOf(v byte, n int) []byte {
	b := make([]byte, n)
	fill(b, v)
	return b
}

// testProcessKill: kill -9 of the target while batches are in flight fails
// the batch within the engine's Timeout + 1 s, with a reason.
func testProcessKill(t *testing.T, nt func() []transfer.Transport) {
	const size = 32 << 20
	const timeout = 2 * time.Second
	tg := StartTarget(t, size, "")
	a := NewNode(t, nt, func(c *transfer.Config) { c.Timeout = timeout })
	am := a.Alloc(t, size, transfer.AccessReadWrite)
	seg := open(t, a.E, tg.Name)
	var reqs []transfer.Request
	for off := uint64(0); off < size; off += 256 << 10 {
		reqs = append(reqs, transfer.Request{Op: transfer.Write, Local: addrOf(am.Bytes()) + uintptr(off), Len: 256 << 10,
			Segment: seg, Remote: tg.Region + off})
	}
	first := make(chan struct{})
	type result struct {
		err error
		at  time.Time
	}
	res := make(chan result, 1)
	go func() {
		for i := 0; ; i++ {
			err := a.E.Transfer(context.Background(), reqs)
			if i == 0 {
				close(first)
			}
			if err != nil {
				res <- result{err, time.Now()}
				return
			}
		}
	}()
	<-first
	killed := time.Now()
	if err := tg.Kill(); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-res:
		el := r.at.Sub(killed)
		t.Logf("batch failed %v after kill -9: %v", el, r.err)
		if el > timeout+time.Second {
			t.Errorf("batch failed %v after the kill, bound is %v", el, timeout+time.Second)
		}
		if !errors.Is(r.err, transfer.ErrPeerDead) && !errors.Is(r.err, transfer.ErrTimeout) && !errors.Is(r.err, transfer.ErrPeerRestarted) {
			t.Errorf("failure %v does not wrap ErrPeerDead or ErrTimeout", r.err)
		}
	case <-time.After(timeout + 5*time.Second):
		t.Fatal("no batch failed after the target was killed")
	}
	<-tg.Exited()
}
