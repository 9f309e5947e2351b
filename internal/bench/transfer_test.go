package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strings"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/tcp"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/transfertest"
)

func tcpDeps(lanes int) Deps {
	return Deps{NewEngine: func(ctx context.Context, listen, name string) (*transfer.Engine, error) {
		return transfer.New(ctx, transfer.Config{Listen: listen, Name: name,
			Transports: []transfer.Transport{tcp.New(tcp.Config{Lanes: lanes})}})
	}}
}

// TestMain doubles as a stand-in for `mooncake-go bench transfer` (tcp,
// P2P) so two processes can be measured before the CLI is wired:
//
//	go test -c -o /tmp/benchbin ./internal/bench
//	MOONCAKE_BENCH_ARGS="-mode target -local-server-name 127.0.0.1:0" /tmp/benchbin
//	MOONCAKE_BENCH_ARGS="-segment-id 127.0.0.1:PORT -baseline" /tmp/benchbin
func TestMain(m *testing.M) {
	if args := os.Getenv("MOONCAKE_BENCH_ARGS"); args != "" {
		if err := cliMain(strings.Fields(args)); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

func cliMain(args []string) error {
	c := DefaultTransferConfig()
	fs := flag.NewFlagSet("bench transfer", flag.ContinueOnError)
	fs.StringVar(&c.Mode, "mode", c.Mode, "")
	fs.StringVar(&c.LocalServerName, "local-server-name", c.LocalServerName, "")
	fs.StringVar(&c.SegmentID, "segment-id", c.SegmentID, "")
	fs.StringVar(&c.Operation, "operation", c.Operation, "")
	fs.Int64Var(&c.BlockSize, "block-size", c.BlockSize, "")
	fs.IntVar(&c.BatchSize, "batch-size", c.BatchSize, "")
	fs.IntVar(&c.Threads, "threads", c.Threads, "")
	fs.DurationVar(&c.Duration, "duration", c.Duration, "")
	fs.Int64Var(&c.BufferSize, "buffer-size", c.BufferSize, "")
	fs.BoolVar(&c.Baseline, "baseline", false, "")
	fs.BoolVar(&c.JSON, "json", false, "")
	lanes := fs.Int("lanes", 0, "tcp lanes per peer")
	prof := fs.String("cpuprofile", "", "")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *prof != "" {
		f, err := os.Create(*prof)
		if err != nil {
			return err
		}
		pprof.StartCPUProfile(f)
		defer pprof.StopCPUProfile()
	}
	ctx := context.Background()
	if c.Mode == "target" {
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		go func() { io.Copy(io.Discard, os.Stdin); cancel() }()
	}
	return RunTransfer(ctx, c, tcpDeps(*lanes), os.Stdout)
}

func TestValidate(t *testing.T) {
	for _, mod := range []func(*TransferConfig){
		func(c *TransferConfig) { c.Mode = "x" },
		func(c *TransferConfig) { c.SegmentID = "" },
		func(c *TransferConfig) { c.Operation = "copy" },
		func(c *TransferConfig) { c.BlockSize = 0 },
		func(c *TransferConfig) { c.BufferSize = 10 },
	} {
		c := DefaultTransferConfig()
		c.SegmentID = "x:1"
		mod(&c)
		if err := c.Validate(); err == nil {
			t.Errorf("%+v: no error", c)
		}
	}
}

// TestRunTransfer runs a target and an initiator in one process.
func TestRunTransfer(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	tcfg := DefaultTransferConfig()
	tcfg.Mode, tcfg.BufferSize = "target", 8<<20
	done := make(chan error, 1)
	go func() { done <- RunTransfer(ctx, tcfg, tcpDeps(2), pw); pw.Close() }()
	sc := bufio.NewScanner(pr)
	var name string
	for sc.Scan() {
		if s, ok := strings.CutPrefix(sc.Text(), "listening on "); ok {
			name = s
			break
		}
	}
	go io.Copy(io.Discard, pr)
	if name == "" {
		t.Fatal("target did not say where it listens")
	}
	for _, op := range []string{"write", "read"} {
		for _, js := range []bool{false, true} {
			c := DefaultTransferConfig()
			c.SegmentID, c.Operation, c.BufferSize, c.BatchSize, c.Threads = name, op, 8<<20, 16, 2
			c.Duration, c.Baseline, c.JSON = 200*time.Millisecond, true, js
			var out bytes.Buffer
			if err := RunTransfer(context.Background(), c, tcpDeps(2), &out); err != nil {
				t.Fatal(err)
			}
			t.Logf("%s", out.String())
			if js {
				var r Result
				if err := json.Unmarshal(out.Bytes(), &r); err != nil {
					t.Fatalf("json %q: %v", out.String(), err)
				}
				if r.Transport != "tcp" || r.Bytes == 0 || r.Baseline == nil || r.Baseline.Conns != 2 || r.Ratio <= 0 {
					t.Fatalf("result %+v", r)
				}
			} else if !strings.Contains(out.String(), "\nratio ") || !strings.Contains(out.String(), "GB/s") {
				t.Fatalf("report %q", out.String())
			}
		}
	}
	// Scattered blocks as one page-list request per batch.
	c := DefaultTransferConfig()
	c.SegmentID, c.BufferSize, c.BlockSize, c.BatchSize, c.Threads = name, 8<<20, 4096, 256, 2
	c.Duration, c.JSON, c.PageList, c.Scatter = 200*time.Millisecond, true, true, true
	var out bytes.Buffer
	if err := RunTransfer(context.Background(), c, tcpDeps(2), &out); err != nil {
		t.Fatal(err)
	}
	var r Result
	if err := json.Unmarshal(out.Bytes(), &r); err != nil {
		t.Fatalf("json %q: %v", out.String(), err)
	}
	if !r.PageList || !r.Scatter || r.Bytes == 0 || r.Bytes%(256*4096) != 0 {
		t.Fatalf("page-list result %+v", r)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestScatterSlots: the permuted slots of a batch are distinct and in range.
func TestScatterSlots(t *testing.T) {
	for _, n := range []int64{1, 2, 7, 1024, 1000, 40503, 262144} {
		s := coprimeStride(n, 40503)
		seen := map[int64]bool{}
		for k := int64(0); k < n; k++ {
			v := k * s % n
			if v < 0 || v >= n || seen[v] {
				t.Fatalf("n %d stride %d: slot %d repeated or out of range", n, s, v)
			}
			seen[v] = true
		}
	}
}

// fakeVRAM is Deps.AllocDevice over transfertest.FakeDevice: device memory
// that tcp must stage.
func fakeVRAM(ctx context.Context, e *transfer.Engine, size int64, gpu int) (uintptr, func(), error) {
	f, err := transfertest.NewFakeDevice(int(size))
	if err != nil {
		return 0, nil, err
	}
	if err := e.RegisterMemory(ctx, uintptr(f.Base()), uint64(size), transfer.Location{Kind: transfer.CUDA, Index: gpu},
		transfer.AccessReadWrite, transfer.WithMemory(f)); err != nil {
		f.Close()
		return 0, nil, err
	}
	return uintptr(f.Base()), func() { e.UnregisterMemory(context.Background(), uintptr(f.Base())); f.Close() }, nil
}

// TestRunTransferVRAM: --use-vram over tcp, GPU->GPU and GPU->host, with
// the raw-TCP baseline of the same processes.
func TestRunTransferVRAM(t *testing.T) {
	deps := tcpDeps(2)
	deps.AllocDevice = fakeVRAM
	for _, targetVRAM := range []bool{true, false} {
		ctx, cancel := context.WithCancel(context.Background())
		pr, pw := io.Pipe()
		tcfg := DefaultTransferConfig()
		tcfg.Mode, tcfg.BufferSize, tcfg.UseVRAM = "target", 8<<20, targetVRAM
		done := make(chan error, 1)
		go func() { done <- RunTransfer(ctx, tcfg, deps, pw); pw.Close() }()
		sc := bufio.NewScanner(pr)
		var name string
		for sc.Scan() {
			if s, ok := strings.CutPrefix(sc.Text(), "listening on "); ok {
				name = s
				break
			}
		}
		go io.Copy(io.Discard, pr)
		if name == "" {
			cancel()
			t.Fatal("target did not say where it listens")
		}
		for _, op := range []string{"write", "read"} {
			c := DefaultTransferConfig()
			c.SegmentID, c.Operation, c.BufferSize, c.BatchSize, c.Threads = name, op, 8<<20, 16, 2
			c.Duration, c.Baseline, c.JSON, c.UseVRAM = 200*time.Millisecond, true, true, true
			var out bytes.Buffer
			if err := RunTransfer(context.Background(), c, deps, &out); err != nil {
				cancel()
				t.Fatalf("target vram %v, %s: %v", targetVRAM, op, err)
			}
			var r Result
			if err := json.Unmarshal(out.Bytes(), &r); err != nil {
				t.Fatalf("json %q: %v", out.String(), err)
			}
			if r.Transport != "tcp" || r.Bytes == 0 || r.Baseline == nil || r.Baseline.Kind != "raw-tcp" || r.Ratio <= 0 {
				t.Fatalf("target vram %v, %s: result %+v", targetVRAM, op, r)
			}
			t.Logf("target vram %v, %s: %.2f GB/s, raw %.2f GB/s", targetVRAM, op, r.GBps, r.Baseline.GBps)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}
