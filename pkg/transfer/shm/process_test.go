package shm

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

const targetEnv = "MOONCAKE_SHM_TEST_TARGET"

// runTarget is the target process of TestTwoProcesses: an engine with one
// shm region. It prints "ready <segment> <addr> <len>", answers a "sum"
// notification by printing the region's sha256, and lives until killed or
// its stdin closes.
func runTarget() int {
	var region atomic.Pointer[transfer.HostMemory]
	out := make(chan string, 16)
	e, err := transfer.New(context.Background(), transfer.Config{
		Transports: []transfer.Transport{New(Config{})},
		OnNotify: func(n transfer.Notification) {
			if m := region.Load(); m != nil && n.Topic == "sum" {
				s := sha256.Sum256(m.Bytes())
				out <- "sum " + hex.EncodeToString(s[:])
			}
		},
	})
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer e.Close()
	m, err := e.AllocHost(context.Background(), 8<<20, 0, transfer.AccessReadWrite, transfer.WithScope(transfer.ScopeSameMachine))
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fill(m.Bytes(), 0x5A)
	region.Store(m)
	fmt.Printf("ready %s %d %d\n", e.Name(), m.Addr(), m.Size())
	go func() {
		io.Copy(io.Discard, os.Stdin)
		close(out)
	}()
	for l := range out {
		fmt.Println(l)
	}
	return 0
}

func TestTwoProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), targetEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			stdin.Close()
			cmd.Process.Kill()
			cmd.Wait()
		}
	}()
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	next := func() string {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatal("target exited")
			}
			return l
		case <-time.After(10 * time.Second):
			t.Fatal("target said nothing for 10s")
		}
		return ""
	}
	f := strings.Fields(next())
	if len(f) != 4 || f[0] != "ready" {
		t.Fatalf("target: %q", f)
	}
	name := f[1]
	raddr, _ := strconv.ParseUint(f[2], 10, 64)
	rlen, _ := strconv.ParseUint(f[3], 10, 64)

	init, _ := newEngine(t)
	src := alloc(t, init, int64(rlen), transfer.AccessReadWrite)
	dst := alloc(t, init, int64(rlen), transfer.AccessReadWrite)
	ctx := context.Background()
	seg, err := init.OpenSegment(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := init.SegmentDescriptor(seg); d.PID != cmd.Process.Pid {
		t.Fatalf("segment pid %d, target pid %d", d.PID, cmd.Process.Pid)
	}

	// Read the target's poison, then write random data.
	fill(dst.Bytes(), 0)
	if err := init.Transfer(ctx, requests(transfer.Read, seg, dst.Addr(), raddr, rlen, 64<<10)); err != nil {
		t.Fatal(err)
	}
	for i, b := range dst.Bytes() {
		if b != 0x5A {
			t.Fatalf("target byte %d reads %#x, want 0x5a", i, b)
		}
	}
	random(t, src.Bytes())
	if err := init.Transfer(ctx, requests(transfer.Write, seg, src.Addr(), raddr, rlen, 64<<10)); err != nil {
		t.Fatal(err)
	}
	// The target process itself sees every byte.
	if err := init.Notify(ctx, name, "sum", nil); err != nil {
		t.Fatal(err)
	}
	want := sha256.Sum256(src.Bytes())
	if got := next(); got != "sum "+hex.EncodeToString(want[:]) {
		t.Fatalf("target's checksum %q, want %x", got, want)
	}
	fill(dst.Bytes(), 0xCD)
	if err := init.Transfer(ctx, requests(transfer.Read, seg, dst.Addr(), raddr, rlen, 64<<10)); err != nil {
		t.Fatal(err)
	}
	checkEqual(t, "read back", dst.Bytes(), src.Bytes())

	// kill -9 while batches run: every batch completes or fails with
	// ErrPeerDead, none hangs.
	errc := make(chan error, 1)
	go func() {
		for {
			if err := init.Transfer(ctx, requests(transfer.Write, seg, src.Addr(), raddr, rlen, 64<<10)); err != nil {
				errc <- err
				return
			}
		}
	}()
	time.Sleep(20 * time.Millisecond)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed = true
	cmd.Wait()
	start := time.Now()
	select {
	case err := <-errc:
		if !errors.Is(err, transfer.ErrPeerDead) {
			t.Fatalf("batch during kill -9: %v, want ErrPeerDead", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("batches kept succeeding after kill -9")
	}
	t.Logf("batch failed %v after the target was reaped", time.Since(start))
	// And a fresh batch to the dead peer fails too, though the memory was mapped.
	if err := init.Transfer(ctx, requests(transfer.Write, seg, src.Addr(), raddr, 4096, 4096)); err == nil {
		t.Fatal("write to a killed peer succeeded")
	}
}
