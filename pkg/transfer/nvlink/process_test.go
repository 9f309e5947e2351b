package nvlink

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// The target process of the GPU tests: an engine with the nvlink transport
// serving four regions on one GPU, each filled with its own poison pattern:
//
//	pool  320 MiB of a POSIX-FD VMM pool (vmm-fd)
//	big   1 GiB VMM pool (speed tests)
//	ipc   64 MiB of cuMemAlloc memory (legacy IPC)
//	host  320 MiB of memfd host memory (GPU -> peer host)
//
// It prints "ready <json>", answers "check" notifications (every byte of a
// region compared with what the initiator says it wrote, then the poison
// restored) with "check <id> ok|bad <why>", and lives until stdin closes.

const (
	envTarget    = "MOONCAKE_NVLINK_TEST_TARGET"
	envTargetGPU = "MOONCAKE_NVLINK_TEST_GPU"
	envKernels   = "MOONCAKE_NVLINK_TEST_KERNELS"
	mib          = 1 << 20
)

func TestMain(m *testing.M) {
	if os.Getenv(envTarget) != "" {
		os.Exit(runTarget())
	}
	os.Exit(m.Run())
}

// tregion is a target region as the initiator learns it.
type tregion struct {
	Name   string `json:"name"`
	Addr   uint64 `json:"addr"`
	Len    uint64 `json:"len"`
	Poison uint64 `json:"poison"` // pattern seed of the region's initial bytes
	GPU    bool   `json:"gpu"`
}

type readyMsg struct {
	Segment string    `json:"segment"`
	Regions []tregion `json:"regions"`
}

// checkReq says what the initiator wrote: page i of N (Page bytes each,
// pattern Seed from byte offset i*Page) went to slot (i*Mul+Add)%Slots.
type checkReq struct {
	ID     int    `json:"id"`
	Region string `json:"region"`
	Seed   uint64 `json:"seed"`
	Page   uint64 `json:"page"`
	N      int    `json:"n"`
	Mul    uint64 `json:"mul"`
	Add    uint64 `json:"add"`
}

func slotOf(i int, mul, add, slots uint64) uint64 { return (uint64(i)*mul + add) % slots }

func testKernels() (*cuda.Kernels, error) {
	dir := os.Getenv(envKernels)
	if dir == "" {
		dir = cuda.DefaultKernelCacheDir()
	}
	return cuda.NewKernels(cuda.KernelsConfig{CacheDir: dir})
}

type targetState struct {
	ctx    *cuda.Context
	cp     *cuda.Copier
	stream *cuda.Stream
	regs   map[string]*tregion
	host   *transfer.HostMemory
}

func runTarget() int {
	fail := func(err error) int { fmt.Println("error", err); return 1 }
	gpu, _ := strconv.Atoi(os.Getenv(envTargetGPU))
	dev, err := cuda.GetDevice(gpu)
	if err != nil {
		return fail(err)
	}
	c, err := dev.Retain()
	if err != nil {
		return fail(err)
	}
	k, err := testKernels()
	if err != nil {
		return fail(err)
	}
	cp, err := cuda.NewCopier(c, k, cuda.CopierConfig{})
	if err != nil {
		return fail(err)
	}
	s, err := c.NewStream(cuda.StreamNonBlocking)
	if err != nil {
		return fail(err)
	}
	st := &targetState{ctx: c, cp: cp, stream: s, regs: map[string]*tregion{}}
	out := make(chan string, 16)
	nv, err := New(Config{Kernels: k})
	if err != nil {
		return fail(err)
	}
	var mu sync.Mutex
	e, err := transfer.New(context.Background(), transfer.Config{
		Listen: "127.0.0.1:0", Transports: []transfer.Transport{nv},
		OnNotify: func(n transfer.Notification) {
			if n.Topic != "check" {
				return
			}
			var r checkReq
			if err := json.Unmarshal(n.Data, &r); err != nil {
				out <- "check -1 bad " + err.Error()
				return
			}
			mu.Lock()
			err := st.check(r)
			mu.Unlock()
			if err != nil {
				out <- fmt.Sprintf("check %d bad %v", r.ID, err)
			} else {
				out <- fmt.Sprintf("check %d ok", r.ID)
			}
		},
	})
	if err != nil {
		return fail(err)
	}
	defer e.Close()
	ctx := context.Background()
	loc := transfer.Location{Kind: transfer.CUDA, Index: gpu}
	same := transfer.WithScope(transfer.ScopeSameMachine)
	var ready readyMsg
	ready.Segment = e.Name()
	for i, p := range []struct {
		name string
		size uint64
	}{{"pool", 320 * mib}, {"big", 1024 * mib}} {
		pool, err := c.NewPool(cuda.PoolConfig{Size: p.size})
		if err != nil {
			return fail(err)
		}
		r := &tregion{Name: p.name, Addr: uint64(pool.Ptr()), Len: p.size, Poison: 0xB00 + uint64(i), GPU: true}
		if err := st.poison(r); err != nil {
			return fail(err)
		}
		if err := e.RegisterMemory(ctx, uintptr(r.Addr), r.Len, loc, transfer.AccessReadWrite, transfer.WithMemory(pool), same); err != nil {
			return fail(err)
		}
		st.regs[r.Name] = r
	}
	ipc, err := c.MemAlloc(64 * mib)
	if err != nil {
		return fail(err)
	}
	r := &tregion{Name: "ipc", Addr: uint64(ipc), Len: 64 * mib, Poison: 0xB10, GPU: true}
	if err := st.poison(r); err != nil {
		return fail(err)
	}
	if err := e.RegisterMemory(ctx, uintptr(r.Addr), r.Len, loc, transfer.AccessReadWrite, same); err != nil {
		return fail(err)
	}
	st.regs[r.Name] = r
	h, err := e.AllocHost(ctx, 320*mib, 0, transfer.AccessReadWrite, same)
	if err != nil {
		return fail(err)
	}
	st.host = h
	r = &tregion{Name: "host", Addr: h.Addr(), Len: 320 * mib, Poison: 0xB20}
	cuda.PatternFill(h.Bytes(), 0, r.Poison)
	st.regs[r.Name] = r
	for _, n := range []string{"pool", "big", "ipc", "host"} {
		ready.Regions = append(ready.Regions, *st.regs[n])
	}
	b, _ := json.Marshal(ready)
	fmt.Printf("ready %s\n", b)
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(out)
	}()
	for l := range out {
		fmt.Println(l)
	}
	return 0
}

func (st *targetState) poison(r *tregion) error {
	if err := st.cp.Fill(st.stream, cuda.DevicePtr(r.Addr), r.Len, r.Poison); err != nil {
		return err
	}
	return st.stream.Synchronize()
}

// check compares every byte of the region with what it must hold, then
// restores the poison.
func (st *targetState) check(q checkReq) error {
	r := st.regs[q.Region]
	if r == nil {
		return fmt.Errorf("no region %q", q.Region)
	}
	var got []byte
	if r.GPU {
		got = make([]byte, r.Len)
		if err := st.ctx.MemcpyDtoH(got, cuda.DevicePtr(r.Addr)); err != nil {
			return err
		}
	} else {
		got = st.host.Bytes()[:r.Len]
	}
	slots := r.Len / q.Page
	from := make([]int32, slots)
	for i := range from {
		from[i] = -1
	}
	for i := 0; i < q.N; i++ {
		from[slotOf(i, q.Mul, q.Add, slots)] = int32(i)
	}
	want := make([]byte, q.Page)
	var bad error
	for j := uint64(0); j < slots && bad == nil; j++ {
		if i := from[j]; i >= 0 {
			cuda.PatternFill(want, uint64(i)*q.Page, q.Seed)
		} else {
			cuda.PatternFill(want, j*q.Page, r.Poison)
		}
		g := got[j*q.Page : (j+1)*q.Page]
		if !bytes.Equal(g, want) {
			k := 0
			for g[k] == want[k] {
				k++
			}
			bad = fmt.Errorf("slot %d (from page %d) differs at byte %d: got %#x want %#x", j, from[j], k, g[k], want[k])
		}
	}
	if tail := got[slots*q.Page:]; bad == nil && len(tail) > 0 {
		w := make([]byte, len(tail))
		cuda.PatternFill(w, slots*q.Page, r.Poison)
		if !bytes.Equal(w, tail) {
			bad = fmt.Errorf("tail after the last slot was written")
		}
	}
	if r.GPU {
		if err := st.poison(r); err != nil {
			return err
		}
	} else {
		for j := uint64(0); j < slots; j++ {
			if from[j] >= 0 {
				cuda.PatternFill(got[j*q.Page:(j+1)*q.Page], j*q.Page, r.Poison)
			}
		}
	}
	return bad
}

// target is a running target process.
type target struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	ready readyMsg
}

func startTarget(t testing.TB, gpu int) *target {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envTarget+"=1", envTargetGPU+"="+strconv.Itoa(gpu))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	tg := &target{cmd: cmd, stdin: stdin, lines: make(chan string, 16)}
	t.Cleanup(func() {
		stdin.Close()
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	go func() {
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			tg.lines <- sc.Text()
		}
		close(tg.lines)
	}()
	select {
	case l, ok := <-tg.lines:
		if !ok || !strings.HasPrefix(l, "ready ") {
			t.Fatalf("target did not start: %q", l)
		}
		if err := json.Unmarshal([]byte(strings.TrimPrefix(l, "ready ")), &tg.ready); err != nil {
			t.Fatal(err)
		}
	case <-time.After(120 * time.Second):
		t.Fatal("target did not start in 120 s")
	}
	return tg
}

func (tg *target) region(name string) tregion {
	for _, r := range tg.ready.Regions {
		if r.Name == name {
			return r
		}
	}
	panic("no region " + name)
}

func (tg *target) wait(t testing.TB, id int) {
	t.Helper()
	select {
	case l, ok := <-tg.lines:
		if !ok {
			t.Fatal("target exited")
		}
		want := fmt.Sprintf("check %d ok", id)
		if l != want {
			t.Fatalf("target: %s", l)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("no answer from the target's check")
	}
}
