// Package bench holds the logic of `mooncake-go bench transfer`, modelled
// on Mooncake's transfer_engine_bench: a target exposes memory, an
// initiator moves batches of blocks to or from it and reports throughput
// and latency, optionally against a plain baseline measured in the same run.
package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-go/mooncake-go/pkg/transfer"
)

// TransferConfig is `bench transfer`'s flags.
type TransferConfig struct {
	Mode            string // "target" | "initiator"
	LocalServerName string // host:port; the target listens there (port 0: a free port) and it is its segment name
	SegmentID       string // the target's segment name (initiator)
	MetadataServer  string // p2p | embedded | etcd://h:p | http://h:p/metadata (used by Deps.NewEngine)
	Protocol        string // auto | tcp | shm | nvlink | rdma (used by Deps.NewEngine)
	Operation       string // read | write
	BlockSize       int64
	BatchSize       int
	PageList        bool // each batch is one page-list request
	Scatter         bool // blocks at permuted slots instead of consecutive ones
	Threads         int
	Duration        time.Duration
	BufferSize      int64
	UseVRAM         bool
	GPUID           int
	Baseline        bool
	JSON            bool
	// Format is the report's form: "text" (""), "json" (as JSON) or "mooncake":
	// transfer_engine_bench's result line, in ReportUnit with ReportPrecision
	// decimals.
	Format          string
	ReportUnit      string // GB (""), GiB, Gb, MB, MiB, Mb, KB, KiB or Kb per second
	ReportPrecision int
}

// reportUnits are transfer_engine_bench's rate units, in bytes.
var reportUnits = map[string]float64{
	"GB": 1e9, "GiB": 1 << 30, "Gb": 1e9 / 8,
	"MB": 1e6, "MiB": 1 << 20, "Mb": 1e6 / 8,
	"KB": 1e3, "KiB": 1 << 10, "Kb": 1e3 / 8,
}

// DefaultTransferConfig returns the defaults of Mooncake's
// transfer_engine_bench, scaled to a small machine.
func DefaultTransferConfig() TransferConfig {
	return TransferConfig{Mode: "initiator", LocalServerName: "127.0.0.1:0", MetadataServer: "p2p", Protocol: "auto",
		Operation: "write", BlockSize: 64 << 10, BatchSize: 128, Threads: 4, Duration: 10 * time.Second,
		BufferSize: 1 << 30, Format: "text", ReportUnit: "GB", ReportPrecision: 2}
}

// Validate reports flags RunTransfer cannot use.
func (c *TransferConfig) Validate() error {
	switch {
	case c.Mode != "target" && c.Mode != "initiator":
		return fmt.Errorf("bench: --mode %q: want target or initiator", c.Mode)
	case c.Mode == "initiator" && c.SegmentID == "":
		return errors.New("bench: --segment-id (the target's segment name) is required for the initiator")
	case c.Operation != "read" && c.Operation != "write":
		return fmt.Errorf("bench: --operation %q: want read or write", c.Operation)
	case c.BlockSize <= 0:
		return fmt.Errorf("bench: --block-size %d must be positive", c.BlockSize)
	case c.BatchSize <= 0:
		return fmt.Errorf("bench: --batch-size %d must be positive", c.BatchSize)
	case c.Threads <= 0:
		return fmt.Errorf("bench: --threads %d must be positive", c.Threads)
	case c.Mode == "initiator" && c.Duration <= 0:
		return fmt.Errorf("bench: --duration %v must be positive", c.Duration)
	case c.BufferSize < c.BlockSize:
		return fmt.Errorf("bench: --buffer-size %d is smaller than --block-size %d", c.BufferSize, c.BlockSize)
	case c.Format != "" && c.Format != "text" && c.Format != "json" && c.Format != "mooncake":
		return fmt.Errorf("bench: --format %q: want text, json or mooncake", c.Format)
	case c.ReportUnit != "" && reportUnits[c.ReportUnit] == 0:
		return fmt.Errorf("bench: --report-unit %q: want GB, GiB, Gb, MB, MiB, Mb, KB, KiB or Kb", c.ReportUnit)
	case c.ReportPrecision < 0 || c.ReportPrecision > 12:
		return fmt.Errorf("bench: --report-precision %d: want 0 to 12", c.ReportPrecision)
	}
	return nil
}

// Deps is what RunTransfer needs from the command line's composition root.
type Deps struct {
	// NewEngine builds the engine: registry from MetadataServer, transports
	// for Protocol. listen is the address to listen on; name the segment
	// name ("" = the listen address).
	NewEngine func(ctx context.Context, listen, name string) (*transfer.Engine, error)
	// AllocDevice, if set, allocates and registers size bytes of GPU memory
	// for --use-vram, returning its address and a release function.
	AllocDevice func(ctx context.Context, e *transfer.Engine, size int64, gpu int) (uintptr, func(), error)
}

// RawKind is the connection kind of the baseline: a target accepts it on
// its engine listener (after the same handshake as a tcp lane). The
// initiator sends one byte: 'W' and then streams bytes that the target
// reads into its buffer and drops, or 'R' and then reads what the target
// streams from its buffer, until it closes the connection.
const RawKind = "bench-raw"

// RawChunk is the size of one write of the raw baseline.
const RawChunk = 1 << 20

// rawScratch bounds the host buffer of the raw baseline with --use-vram.
const rawScratch = 64 << 20

// Result is one initiator run (the --json object).
type Result struct {
	Transport   string    `json:"transport"`
	Operation   string    `json:"operation"`
	BlockSize   int64     `json:"block_size"`
	BatchSize   int       `json:"batch_size"`
	PageList    bool      `json:"page_list,omitempty"`
	Scatter     bool      `json:"scatter,omitempty"`
	Threads     int       `json:"threads"`
	Seconds     float64   `json:"seconds"`
	Bytes       int64     `json:"bytes"`
	Batches     int64     `json:"batches"`
	GBps        float64   `json:"gb_per_s"`
	GiBps       float64   `json:"gib_per_s"`
	P50Ms       float64   `json:"latency_p50_ms"`
	P99Ms       float64   `json:"latency_p99_ms"`
	Baseline    *Baseline `json:"baseline,omitempty"`
	Ratio       float64   `json:"ratio,omitempty"`
	SegmentName string    `json:"segment"`
}

// Baseline is the plain path measured in the same run.
type Baseline struct {
	Kind    string  `json:"kind"` // raw-tcp | memcpy
	Conns   int     `json:"conns,omitempty"`
	Seconds float64 `json:"seconds"`
	Bytes   int64   `json:"bytes"`
	GBps    float64 `json:"gb_per_s"`
}

// RunTransfer runs one side of the benchmark. The target serves until ctx
// is done; the initiator runs for cfg.Duration and writes its report to out.
func RunTransfer(ctx context.Context, cfg TransferConfig, deps Deps, out io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if deps.NewEngine == nil {
		return errors.New("bench: no engine constructor")
	}
	if cfg.Mode == "target" {
		return runTarget(ctx, cfg, deps, out)
	}
	res, err := runInitiator(ctx, cfg, deps)
	if err != nil {
		return err
	}
	return report(out, cfg, res)
}

// buffer allocates the benchmark's registered memory.
func buffer(ctx context.Context, cfg TransferConfig, deps Deps, e *transfer.Engine) (uintptr, []byte, func(), error) {
	if cfg.UseVRAM {
		if deps.AllocDevice == nil {
			return 0, nil, nil, errors.New("bench: --use-vram: no GPU memory support in this build")
		}
		a, free, err := deps.AllocDevice(ctx, e, cfg.BufferSize, cfg.GPUID)
		if err != nil {
			return 0, nil, nil, err
		}
		// The raw-TCP baseline streams host memory: the same sockets
		// without the GPU. Its connections share the scratch (the bytes
		// are dropped), which lies outside the Go heap.
		scratch, err := transfer.AllocHost(min(cfg.BufferSize, rawScratch), "bench-raw")
		if err != nil {
			free()
			return 0, nil, nil, err
		}
		return a, scratch.Bytes(), func() { free(); scratch.Close() }, nil
	}
	m, err := e.AllocHost(ctx, cfg.BufferSize, 0, transfer.AccessReadWrite)
	if err != nil {
		return 0, nil, nil, err
	}
	return uintptr(m.Addr()), m.Bytes(), func() { e.FreeHost(context.Background(), m) }, nil
}

func runTarget(ctx context.Context, cfg TransferConfig, deps Deps, out io.Writer) error {
	e, err := deps.NewEngine(ctx, cfg.LocalServerName, "")
	if err != nil {
		return err
	}
	defer e.Close()
	_, buf, free, err := buffer(ctx, cfg, deps, e)
	if err != nil {
		return err
	}
	defer free()
	if buf != nil {
		e.Handle(RawKind, func(c net.Conn, _ transfer.Hello) { serveRaw(c, buf) })
	}
	fmt.Fprintf(out, "listening on %s\n", e.Name())
	<-ctx.Done()
	return nil
}

// serveRaw is the target side of the raw-TCP baseline.
func serveRaw(c net.Conn, buf []byte) {
	defer c.Close()
	var op [1]byte
	if _, err := io.ReadFull(c, op[:]); err != nil {
		return
	}
	n := int64(min(RawChunk, len(buf)))
	slots := int64(len(buf)) / n
	for i := int64(0); ; i++ {
		b := buf[(i%slots)*n : (i%slots+1)*n]
		var err error
		if op[0] == 'W' {
			_, err = io.ReadFull(c, b)
		} else {
			_, err = c.Write(b)
		}
		if err != nil {
			return
		}
	}
}

type run struct {
	e      *transfer.Engine
	cfg    TransferConfig
	seg    transfer.SegmentID
	local  uintptr
	remote transfer.RegionInfo
	op     transfer.Op
}

func runInitiator(ctx context.Context, cfg TransferConfig, deps Deps) (*Result, error) {
	e, err := deps.NewEngine(ctx, cfg.LocalServerName, "")
	if err != nil {
		return nil, err
	}
	defer e.Close()
	local, buf, free, err := buffer(ctx, cfg, deps, e)
	if err != nil {
		return nil, err
	}
	defer free()
	seg, err := e.OpenSegment(ctx, cfg.SegmentID)
	if err != nil {
		return nil, err
	}
	d, err := e.SegmentDescriptor(seg)
	if err != nil {
		return nil, err
	}
	r := &run{e: e, cfg: cfg, seg: seg, local: local, op: transfer.Write}
	need := transfer.AccessWrite
	if cfg.Operation == "read" {
		r.op, need = transfer.Read, transfer.AccessRead
	}
	found := false
	for _, reg := range d.Regions {
		if reg.Access&need == need && int64(reg.Len) >= cfg.BlockSize && (!found || reg.Len > r.remote.Len) {
			r.remote, found = reg, true
		}
	}
	if !found {
		return nil, fmt.Errorf("bench: segment %s has no region of %d bytes or more granting %v", cfg.SegmentID, cfg.BlockSize, need)
	}
	// Warm up (connections, page faults) before measuring.
	tp, err := r.batch(ctx, 0)
	if err != nil {
		return nil, err
	}
	res := &Result{Transport: tp, Operation: cfg.Operation, BlockSize: cfg.BlockSize, BatchSize: cfg.BatchSize,
		PageList: cfg.PageList, Scatter: cfg.Scatter, Threads: cfg.Threads, SegmentName: cfg.SegmentID}
	var base *Baseline
	var kind string
	conns := 0
	if cfg.Baseline {
		switch tp {
		case "tcp":
			kind, conns = "raw-tcp", lanes(e.Self())
		case "shm":
			if !cfg.UseVRAM {
				kind = "memcpy"
			}
		}
		if kind != "" {
			base = &Baseline{Kind: kind, Conns: conns}
		}
	}
	// Alternate transport and baseline in rounds so both see the same noise.
	rounds := 1
	if base != nil {
		rounds = 4
	}
	var lat []time.Duration
	slice := cfg.Duration / time.Duration(rounds)
	for i := 0; i < rounds; i++ {
		n, b, l, el, err := r.measure(ctx, slice)
		if err != nil {
			return nil, err
		}
		res.Bytes += n
		res.Batches += b
		res.Seconds += el.Seconds()
		lat = append(lat, l...)
		if base != nil {
			var bn int64
			var bel time.Duration
			if kind == "raw-tcp" {
				bn, bel, err = rawTCP(ctx, e, d, buf, conns, r.op, slice)
			} else {
				bn, bel = memcpy(buf, cfg, slice)
			}
			if err != nil {
				return nil, fmt.Errorf("bench: baseline: %w", err)
			}
			base.Bytes += bn
			base.Seconds += bel.Seconds()
		}
	}
	slices.Sort(lat)
	res.GBps = float64(res.Bytes) / res.Seconds / 1e9
	res.GiBps = float64(res.Bytes) / res.Seconds / (1 << 30)
	res.P50Ms = pct(lat, 0.50)
	res.P99Ms = pct(lat, 0.99)
	if base != nil {
		base.GBps = float64(base.Bytes) / base.Seconds / 1e9
		res.Baseline = base
		if base.GBps > 0 {
			res.Ratio = res.GBps / base.GBps
		}
	}
	return res, nil
}

func pct(l []time.Duration, p float64) float64 {
	if len(l) == 0 {
		return 0
	}
	i := min(len(l)-1, int(float64(len(l))*p))
	return float64(l[i]) / 1e6
}

// lanes is the number of tcp lanes the engine opens per peer (from its tcp
// descriptor entry), the connection count of the raw baseline.
func lanes(d *transfer.Descriptor) int {
	var inf struct {
		Lanes int `json:"lanes"`
	}
	if raw := d.Transports["tcp"]; raw != nil {
		_ = json.Unmarshal(raw, &inf)
	}
	if inf.Lanes <= 0 {
		return 4
	}
	return inf.Lanes
}

// reqs builds thread t's batch: BatchSize blocks at consecutive slots of
// both buffers (or, with Scatter, slots permuted differently on each side),
// wrapping around; with PageList, as one page-list request.
func (r *run) reqs(t int) []transfer.Request {
	cfg := r.cfg
	lslots := cfg.BufferSize / cfg.BlockSize
	rslots := int64(r.remote.Len) / cfg.BlockSize
	lstride, rstride := int64(1), int64(1)
	if cfg.Scatter {
		lstride, rstride = coprimeStride(lslots, 40503), coprimeStride(rslots, 26371)
	}
	out := make([]transfer.Request, cfg.BatchSize)
	for i := range out {
		k := int64(t*cfg.BatchSize + i)
		out[i] = transfer.Request{Op: r.op, Local: r.local + uintptr((k*lstride%lslots)*cfg.BlockSize), Len: uint64(cfg.BlockSize),
			Segment: r.seg, Remote: r.remote.Addr + uint64((k*rstride%rslots)*cfg.BlockSize)}
	}
	if !cfg.PageList {
		return out
	}
	l := transfer.Request{Op: r.op, Local: r.local, Len: uint64(cfg.BlockSize), Segment: r.seg, Remote: r.remote.Addr,
		Pages: make([]transfer.PageOffset, len(out))}
	for i, q := range out {
		l.Pages[i] = transfer.PageOffset{Local: uint64(q.Local - r.local), Remote: q.Remote - r.remote.Addr}
	}
	return []transfer.Request{l}
}

// coprimeStride is the first stride from s up that is coprime with n, so
// that k*stride mod n visits every slot.
func coprimeStride(n, s int64) int64 {
	for ; ; s++ {
		a, b := s, n
		for b != 0 {
			a, b = b, a%b
		}
		if a == 1 {
			return s % max(n, 1)
		}
	}
}

func (r *run) batch(ctx context.Context, t int) (string, error) {
	b, err := r.e.Submit(ctx, r.reqs(t))
	if err != nil {
		return "", err
	}
	if err := b.Wait(context.WithoutCancel(ctx)); err != nil {
		return "", err
	}
	return b.Status(0).Transport, nil
}

// measure runs Threads goroutines submitting batches for d.
func (r *run) measure(ctx context.Context, d time.Duration) (bytes, batches int64, lat []time.Duration, el time.Duration, err error) {
	var mu sync.Mutex
	var firstErr error
	var nb atomic.Int64
	start := time.Now()
	end := start.Add(d)
	var wg sync.WaitGroup
	for t := 0; t < r.cfg.Threads; t++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			reqs := r.reqs(t)
			var my []time.Duration
			for time.Now().Before(end) && ctx.Err() == nil {
				t0 := time.Now()
				if err := r.e.Transfer(ctx, reqs); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
				my = append(my, time.Since(t0))
				nb.Add(1)
			}
			mu.Lock()
			lat = append(lat, my...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	el = time.Since(start)
	if firstErr != nil {
		return 0, 0, nil, el, firstErr
	}
	if err := ctx.Err(); err != nil {
		return 0, 0, nil, el, err
	}
	batches = nb.Load()
	return batches * int64(r.cfg.BatchSize) * r.cfg.BlockSize, batches, lat, el, nil
}

// rawTCP streams RawChunk writes over conns connections of kind RawKind to
// the target for d: the plain-TCP ceiling between the same two processes.
func rawTCP(ctx context.Context, e *transfer.Engine, d *transfer.Descriptor, buf []byte, conns int, op transfer.Op, dur time.Duration) (int64, time.Duration, error) {
	cs := make([]net.Conn, conns)
	for i := range cs {
		c, err := e.Dial(ctx, d, RawKind)
		if err != nil {
			for _, c := range cs[:i] {
				c.Close()
			}
			return 0, 0, err
		}
		dir := byte('W')
		if op == transfer.Read {
			dir = 'R'
		}
		if _, err := c.Write([]byte{dir}); err != nil {
			return 0, 0, err
		}
		cs[i] = c
	}
	var total atomic.Int64
	start := time.Now()
	end := start.Add(dur)
	var wg sync.WaitGroup
	n := int64(min(RawChunk, len(buf)))
	slots := int64(len(buf)) / n
	for ci, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int64(ci); time.Now().Before(end); i++ {
				b := buf[(i%slots)*n : (i%slots+1)*n]
				var err error
				if op == transfer.Write {
					_, err = c.Write(b)
				} else {
					_, err = io.ReadFull(c, b)
				}
				if err != nil {
					return
				}
				total.Add(n)
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	for _, c := range cs {
		c.Close()
	}
	return total.Load(), el, nil
}

// memcpy copies the same blocks inside the initiator for d: the ceiling of
// a same-machine transport.
func memcpy(buf []byte, cfg TransferConfig, d time.Duration) (int64, time.Duration) {
	half := int64(len(buf)) / 2
	slots := max(1, half/cfg.BlockSize)
	var total atomic.Int64
	start := time.Now()
	end := start.Add(d)
	var wg sync.WaitGroup
	for t := 0; t < cfg.Threads; t++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(end) {
				for i := 0; i < cfg.BatchSize; i++ {
					k := int64(t*cfg.BatchSize+i) % slots
					o := k * cfg.BlockSize
					if o+cfg.BlockSize > half {
						o = 0
					}
					copy(buf[half+o:half+o+cfg.BlockSize], buf[o:o+cfg.BlockSize])
				}
				total.Add(int64(cfg.BatchSize) * cfg.BlockSize)
			}
		}()
	}
	wg.Wait()
	return total.Load(), time.Since(start)
}

// MooncakeLine is transfer_engine_bench's result line for r: its duration, batch
// count and throughput in unit (GB when "") with prec decimals.
func MooncakeLine(r *Result, unit string, prec int) string {
	if unit == "" {
		unit = "GB"
	}
	rate := 0.0
	if r.Seconds > 0 {
		rate = float64(r.Bytes) / r.Seconds / reportUnits[unit]
	}
	return fmt.Sprintf("Test completed: duration %.2f, batch count %d, throughput %.*f %s/s", r.Seconds, r.Batches, prec, rate, unit)
}

func report(out io.Writer, cfg TransferConfig, r *Result) error {
	switch {
	case cfg.JSON || cfg.Format == "json":
		enc := json.NewEncoder(out)
		return enc.Encode(r)
	case cfg.Format == "mooncake":
		_, err := fmt.Fprintln(out, MooncakeLine(r, cfg.ReportUnit, cfg.ReportPrecision))
		return err
	}
	form := ""
	if r.PageList {
		form += "  page-list"
	}
	if r.Scatter {
		form += "  scattered"
	}
	fmt.Fprintf(out, "segment %s  transport %s  operation %s  block %d  batch %d%s  threads %d\n",
		r.SegmentName, r.Transport, r.Operation, r.BlockSize, r.BatchSize, form, r.Threads)
	fmt.Fprintf(out, "throughput %.3f GB/s (%.3f GiB/s)  %d batches in %.2fs  latency p50 %.3f ms  p99 %.3f ms\n",
		r.GBps, r.GiBps, r.Batches, r.Seconds, r.P50Ms, r.P99Ms)
	if b := r.Baseline; b != nil {
		conns := ""
		if b.Conns > 0 {
			conns = fmt.Sprintf(" over %d connections of %d KiB writes", b.Conns, RawChunk>>10)
		}
		fmt.Fprintf(out, "baseline %s %.3f GB/s%s\n", b.Kind, b.GBps, conns)
		fmt.Fprintf(out, "ratio %.2f\n", r.Ratio)
	} else if cfg.Baseline {
		fmt.Fprintf(out, "baseline: none for transport %s\n", r.Transport)
	}
	return nil
}
