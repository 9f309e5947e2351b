package cuda

// GPU tests: each skips with the reason when no driver or too few GPUs.

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

const (
	envChild     = "MC_CUDA_TEST_CHILD"
	envKernelDir = "MC_CUDA_TEST_KERNEL_DIR"
	poison       = 0xA5
	mib          = 1 << 20
	batchBytes   = 256 * mib
)

func gpus(t testing.TB, n int) []*Context {
	t.Helper()
	if err := Init(); err != nil {
		t.Skipf("no CUDA: %v", err)
	}
	cnt, err := DeviceCount()
	if err != nil {
		t.Fatal(err)
	}
	if cnt < n {
		t.Skipf("need %d GPUs, found %d", n, cnt)
	}
	ctxs := make([]*Context, n)
	for i := range ctxs {
		d, err := GetDevice(i)
		if err != nil {
			t.Fatal(err)
		}
		if ctxs[i], err = d.Retain(); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, c := range ctxs {
			c.Release()
		}
	})
	return ctxs
}

var testKernels struct {
	once sync.Once
	k    *Kernels
	err  error
}

func kernels(t testing.TB) *Kernels {
	t.Helper()
	testKernels.once.Do(func() {
		dir := os.Getenv(envKernelDir)
		if dir == "" {
			dir, testKernels.err = os.MkdirTemp("", "mc-kernels-")
			if testKernels.err != nil {
				return
			}
			os.Setenv(envKernelDir, dir)
		}
		testKernels.k, testKernels.err = NewKernels(KernelsConfig{CacheDir: dir})
	})
	if testKernels.err != nil {
		if errors.Is(testKernels.err, ErrNoNVRTC) {
			t.Skipf("no NVRTC: %v", testKernels.err)
		}
		t.Fatal(testKernels.err)
	}
	return testKernels.k
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestGPUDevices(t *testing.T) {
	if err := Init(); err != nil {
		t.Skipf("no CUDA: %v", err)
	}
	v, err := DriverVersion()
	must(t, err)
	n, err := DeviceCount()
	must(t, err)
	t.Logf("driver supports CUDA %d.%d, %d device(s)", v/1000, v%1000/10, n)
	for i := 0; i < n; i++ {
		d, err := GetDevice(i)
		must(t, err)
		name, err := d.Name()
		must(t, err)
		mem, err := d.TotalMem()
		must(t, err)
		bus, err := d.PCIBusID()
		must(t, err)
		maj, min, err := d.ComputeCapability()
		must(t, err)
		attrs := map[string]DeviceAttribute{"SMs": AttrMultiprocessorCount, "VMM": AttrVirtualMemoryManagement,
			"POSIX_FD": AttrHandleTypePosixFD, "FABRIC": AttrHandleTypeFabric, "GDR": AttrGPUDirectRDMA,
			"UVA": AttrUnifiedAddressing, "L2": AttrL2CacheSize}
		var parts []string
		for _, k := range []string{"SMs", "VMM", "POSIX_FD", "FABRIC", "GDR", "UVA", "L2"} {
			v, err := d.Attribute(attrs[k])
			must(t, err)
			parts = append(parts, fmt.Sprintf("%s=%d", k, v))
		}
		g, err := d.AllocationGranularity(HandlePosixFD, false)
		must(t, err)
		t.Logf("GPU %d: %s sm_%d%d %.1f GiB %s %s granularity=%d", i, name, maj, min, gib(mem), bus, strings.Join(parts, " "), g)
		for j := 0; j < n; j++ {
			if j != i {
				ok, err := d.CanAccessPeer(Device(j))
				must(t, err)
				t.Logf("  can access peer %d: %v", j, ok)
			}
		}
	}
}

func TestGPUNVRTCCompile(t *testing.T) {
	ctx := gpus(t, 1)[0]
	k := kernels(t)
	t.Logf("NVRTC %d.%d from %s, cache %s", k.NVRTC().Major, k.NVRTC().Minor, k.NVRTC().Library, k.CacheDir())
	t0 := time.Now()
	m, err := k.Load(ctx, "copy_kernels")
	must(t, err)
	first := time.Since(t0)
	for _, fn := range []string{"mc_scatter_copy", "mc_fill_pattern"} {
		f, err := m.Function(fn)
		must(t, err)
		regs, _ := f.Attribute(FuncAttrNumRegs)
		local, _ := f.Attribute(FuncAttrLocalSizeBytes)
		t.Logf("%s: %d registers, %d bytes local memory", fn, regs, local)
	}
	must(t, m.Unload())
	t0 = time.Now()
	m, err = k.Load(ctx, "copy_kernels")
	must(t, err)
	t.Logf("load: first %v, cached %v", first, time.Since(t0))
	if _, err := m.Function("mc_no_such_kernel"); err == nil || Code(err) != ErrorNotFound {
		t.Errorf("missing kernel: %v", err)
	}
	m.Unload()
	ents, _ := os.ReadDir(k.CacheDir())
	if len(ents) == 0 {
		t.Fatal("nothing cached")
	}
}

// descriptors for n pages of plen bytes at stride, src page i -> dst slot perm[i].
func scatterDescs(src, dst DevicePtr, n int, plen, stride, srcOff, dstOff uint64, perm []int) []CopyDesc {
	d := make([]CopyDesc, n)
	for i := range d {
		d[i] = CopyDesc{Src: src.Add(uint64(i)*stride + srcOff), Dst: dst.Add(uint64(perm[i])*stride + dstOff), Len: plen}
	}
	return d
}

// verifyScatter checks host image got of the destination region: slot perm[i]
// holds the pattern bytes of source page i, all else is poison.
func verifyScatter(got []byte, seed uint64, n int, plen, stride, srcOff, dstOff uint64, perm []int) error {
	written := make([]int, len(got)/int(stride)+1)
	for i := range written {
		written[i] = -1
	}
	for i := 0; i < n; i++ {
		written[perm[i]] = i
	}
	want := make([]byte, plen)
	poisonBuf := bytes.Repeat([]byte{poison}, int(stride))
	for slot := 0; uint64(slot)*stride < uint64(len(got)); slot++ {
		lo := uint64(slot) * stride
		hi := min(lo+stride, uint64(len(got)))
		region := got[lo:hi]
		i := written[slot]
		if i < 0 {
			if !bytes.Equal(region, poisonBuf[:len(region)]) {
				return fmt.Errorf("slot %d (unwritten) changed", slot)
			}
			continue
		}
		PatternFill(want, uint64(i)*stride+srcOff, seed)
		if !bytes.Equal(region[dstOff:dstOff+plen], want) {
			for k := range want {
				if region[dstOff+uint64(k)] != want[k] {
					return fmt.Errorf("slot %d (page %d) byte %d: got %#x want %#x", slot, i, k, region[dstOff+uint64(k)], want[k])
				}
			}
		}
		if !bytes.Equal(region[:dstOff], poisonBuf[:dstOff]) || !bytes.Equal(region[dstOff+plen:], poisonBuf[:uint64(len(region))-dstOff-plen]) {
			return fmt.Errorf("slot %d: bytes outside the page changed", slot)
		}
	}
	return nil
}

func TestGPUCopierLocal(t *testing.T) {
	ctx := gpus(t, 1)[0]
	cp, err := NewCopier(ctx, kernels(t), CopierConfig{})
	must(t, err)
	defer cp.Close()
	s, err := ctx.NewStream(StreamNonBlocking)
	must(t, err)
	defer s.Destroy()
	const size = 64 * mib
	src, err := ctx.MemAlloc(size)
	must(t, err)
	defer ctx.MemFree(src)
	dst, err := ctx.MemAlloc(2 * size)
	must(t, err)
	defer ctx.MemFree(dst)
	cases := []struct {
		plen, stride, srcOff, dstOff uint64
		n                            int
	}{
		{4096, 4096, 0, 0, 1}, {4096, 4096, 0, 0, 16384}, {65536, 65536, 0, 0, 1024}, {mib, mib, 0, 0, 64},
		{4093, 4096, 3, 2, 1000}, {4090, 4096, 5, 5, 1000}, {1, 64, 0, 0, 100}, {100000, 131072, 16, 32, 100}, {0, 64, 0, 0, 3},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("len=%d/n=%d/off=%d,%d", c.plen, c.n, c.srcOff, c.dstOff), func(t *testing.T) {
			seed := rand.Uint64()
			perm := rand.Perm(2 * c.n)[:c.n]
			region := uint64(2*c.n) * c.stride
			must(t, cp.Fill(s, src, size, seed))
			must(t, s.MemsetD8(dst, poison, region))
			must(t, cp.Copy(s, scatterDescs(src, dst, c.n, c.plen, c.stride, c.srcOff, c.dstOff, perm)))
			must(t, s.Synchronize())
			got := make([]byte, region)
			must(t, ctx.MemcpyDtoH(got, dst))
			must(t, verifyScatter(got, seed, c.n, c.plen, c.stride, c.srcOff, c.dstOff, perm))
		})
	}
}

// TestGPUCopierVaried exercises the variable-size path (binary search over
// first_chunk): blocks of 0..200000 bytes at assorted alignments.
func TestGPUCopierVaried(t *testing.T) {
	ctx := gpus(t, 1)[0]
	cp, err := NewCopier(ctx, kernels(t), CopierConfig{})
	must(t, err)
	defer cp.Close()
	s, err := ctx.NewStream(StreamNonBlocking)
	must(t, err)
	defer s.Destroy()
	const stride, n = 256 << 10, 200
	src, err := ctx.MemAlloc(stride * n)
	must(t, err)
	defer ctx.MemFree(src)
	dst, err := ctx.MemAlloc(2 * stride * n)
	must(t, err)
	defer ctx.MemFree(dst)
	seed := rand.Uint64()
	perm := rand.Perm(2 * n)[:n]
	descs := make([]CopyDesc, n)
	offs := make([][2]uint64, n)
	for i := range descs {
		so, do := uint64(rand.IntN(64)), uint64(rand.IntN(64))
		if i%2 == 0 {
			do = so // co-aligned: vector body with byte head and tail
		}
		offs[i] = [2]uint64{so, do}
		descs[i] = CopyDesc{Src: src.Add(uint64(i)*stride + so), Dst: dst.Add(uint64(perm[i])*stride + do), Len: uint64(rand.IntN(200001))}
	}
	if p := cp.Plan(descs); p.ChunksPerDesc != 0 {
		t.Fatalf("varied sizes planned as uniform: %+v", p)
	}
	must(t, cp.Fill(s, src, stride*n, seed))
	must(t, s.MemsetD8(dst, poison, 2*stride*n))
	must(t, cp.Copy(s, descs))
	must(t, s.Synchronize())
	got := make([]byte, 2*stride*n)
	must(t, ctx.MemcpyDtoH(got, dst))
	exp := bytes.Repeat([]byte{poison}, len(got))
	for i, d := range descs {
		lo := uint64(perm[i])*stride + offs[i][1]
		PatternFill(exp[lo:lo+d.Len], uint64(i)*stride+offs[i][0], seed)
	}
	if !bytes.Equal(got, exp) {
		for k := range got {
			if got[k] != exp[k] {
				t.Fatalf("first difference at byte %d (slot %d): got %#x want %#x", k, k/stride, got[k], exp[k])
			}
		}
	}
}

func TestGPUPool(t *testing.T) {
	ctxs := gpus(t, 1)
	ctx := ctxs[0]
	core, logs := observer.New(zapcore.InfoLevel)
	fp := ctx.FabricProbe()
	t.Logf("FABRIC probe on GPU 0: %v", fp)
	pool, err := ctx.NewPool(PoolConfig{Size: 1<<30 + 1, Logger: zap.New(core)})
	must(t, err)
	defer pool.Close()
	for _, e := range logs.All() {
		t.Logf("log: %s %v", e.Message, e.ContextMap())
	}
	if !fp.Usable {
		if pool.HandleType() != HandlePosixFD || logs.FilterMessageSnippet("FABRIC handles unavailable").Len() != 1 {
			t.Fatalf("FABRIC unusable, yet pool uses %v with logs %v", pool.HandleType(), logs.All())
		}
	}
	g := pool.Granularity()
	if pool.Size() != (1<<30+1+g-1)/g*g {
		t.Fatalf("pool size %d not the request rounded to %d", pool.Size(), g)
	}
	pi, err := ctx.PointerInfo(pool.Ptr())
	must(t, err)
	t.Logf("pool: %v handles, %d bytes at %#x, granularity %d, pointer info %+v", pool.HandleType(), pool.Size(), pool.Ptr(), g, pi)
	must(t, ctx.MemsetD8(pool.Ptr(), 7, pool.Size()))
	b := make([]byte, 4096)
	must(t, ctx.MemcpyDtoH(b, pool.Ptr().Add(pool.Size()-4096)))
	if b[0] != 7 || b[4095] != 7 {
		t.Fatal("pool tail not writable")
	}

	free, total, err := ctx.MemGetInfo()
	must(t, err)
	_, err = ctx.NewPool(PoolConfig{Size: free + 1<<30})
	if !errors.Is(err, ErrOutOfMemory) || !strings.Contains(err.Error(), "requested") || !strings.Contains(err.Error(), "free of") {
		t.Fatalf("oversized pool: %v", err)
	}
	t.Logf("oversized pool refused: %v (total %d)", err, total)

	start := time.Now()
	big, err := ctx.NewPool(PoolConfig{Size: 100 << 30})
	if err != nil {
		t.Logf("100 GiB pool: %v", err)
	} else {
		t.Logf("100 GiB pool created and mapped in %v", time.Since(start))
		big.Close()
	}
}

// TestGPUCrossProcess: the parent owns a POSIX-FD pool and a cuMemAlloc
// buffer on GPU 0; a child process (this binary, re-executed) imports both on
// GPU 1 (fd inherited, IPC handle in the environment) and scatters pattern
// pages into them with the copy kernel; the parent checks every byte.
func TestGPUCrossProcess(t *testing.T) {
	if os.Getenv(envChild) != "" {
		crossProcessChild(t)
		return
	}
	ctxs := gpus(t, 2)
	ctx := ctxs[0]
	kernels(t) // compile once, so the child finds the cache
	pool, err := ctx.NewPool(PoolConfig{Size: 2 * batchBytes, HandleType: HandlePosixFD})
	must(t, err)
	defer pool.Close()
	exp, err := pool.Export()
	must(t, err)
	legacy, err := ctx.MemAlloc(64 * mib)
	must(t, err)
	defer ctx.MemFree(legacy)
	ipc, err := ctx.ExportIPC(legacy)
	must(t, err)

	cmd := exec.Command(os.Args[0], "-test.run=^TestGPUCrossProcess$", "-test.v")
	cmd.Env = append(os.Environ(), envChild+"=1",
		fmt.Sprintf("MC_POOL=%d,%d", exp.Size, exp.Granularity),
		fmt.Sprintf("MC_IPC=%x,%d,%d", ipc.Handle[:], ipc.Size, ipc.Offset))
	f := os.NewFile(uintptr(exp.FD), "pool-fd")
	cmd.ExtraFiles = []*os.File{f} // fd 3 in the child
	stdin, err := cmd.StdinPipe()
	must(t, err)
	stdout, err := cmd.StdoutPipe()
	must(t, err)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	must(t, cmd.Start())
	f.Close()
	defer func() {
		stdin.Close()
		if err := cmd.Wait(); err != nil {
			t.Errorf("child: %v\n%s", err, stderr.String())
		}
	}()
	rd := bufio.NewReader(stdout)
	ask := func(line string) (string, error) {
		if _, err := fmt.Fprintln(stdin, line); err != nil {
			return "", err
		}
		for {
			l, err := rd.ReadString('\n')
			if err != nil {
				return "", fmt.Errorf("child: %v\n%s", err, stderr.String())
			}
			if strings.HasPrefix(l, "ok ") || strings.HasPrefix(l, "err ") {
				return strings.TrimSpace(l), nil
			}
		}
	}

	type tc struct {
		target                       string
		plen, stride, srcOff, dstOff uint64
		n, reps                      int
	}
	var cases []tc
	for _, ps := range []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20} {
		cases = append(cases, tc{"pool", ps, ps, 0, 0, int(batchBytes / ps), 10})
	}
	cases = append(cases,
		tc{"pool", 4096, 4096, 0, 0, 1, 1}, tc{"pool", 1 << 20, 1 << 20, 0, 0, 17, 1},
		tc{"pool", 4093, 4096, 3, 2, 1000, 1}, tc{"pool", 4090, 4096, 5, 5, 1000, 1},
		tc{"ipc", 4096, 4096, 0, 0, 8192, 5}, tc{"ipc", 1 << 20, 1 << 20, 0, 0, 32, 5})
	var table []string
	for _, c := range cases {
		name := fmt.Sprintf("%s/page=%d/n=%d", c.target, c.plen, c.n)
		t.Run(name, func(t *testing.T) {
			seed := rand.Uint64()
			base := pool.Ptr()
			if c.target == "ipc" {
				base = legacy
			}
			region := uint64(2*c.n) * c.stride
			must(t, ctx.MemsetD8(base, poison, region))
			reply, err := ask(fmt.Sprintf("case %s %d %d %d %d %d %d %d", c.target, c.plen, c.stride, c.srcOff, c.dstOff, c.n, c.reps, seed))
			must(t, err)
			if !strings.HasPrefix(reply, "ok ") {
				t.Fatalf("child: %s", reply)
			}
			got := make([]byte, region)
			must(t, ctx.MemcpyDtoH(got, base))
			perm := permFor(seed, c.n)
			must(t, verifyScatter(got, seed, c.n, c.plen, c.stride, c.srcOff, c.dstOff, perm))
			table = append(table, fmt.Sprintf("%-34s %s", name, strings.TrimPrefix(reply, "ok ")))
		})
	}
	t.Log("cross-process GPU1 -> GPU0 (kernel on GPU 1 storing into GPU 0 memory), every byte checked:\n" + strings.Join(table, "\n"))
}

func permFor(seed uint64, n int) []int {
	r := rand.New(rand.NewPCG(seed, 1))
	return r.Perm(2 * n)[:n]
}

func crossProcessChild(t *testing.T) {
	ctxs := gpus(t, 2)
	ctx := ctxs[1]
	var size, gran uint64
	fmt.Sscanf(os.Getenv("MC_POOL"), "%d,%d", &size, &gran)
	imp, err := ctx.ImportPool(PoolExport{HandleType: HandlePosixFD, FD: 3, Size: size, Granularity: gran})
	must(t, err)
	defer imp.Close()
	var ie IpcExport
	parts := strings.Split(os.Getenv("MC_IPC"), ",")
	hb := make([]byte, 64)
	fmt.Sscanf(parts[0], "%x", &hb)
	copy(ie.Handle[:], hb)
	ie.Size, _ = strconv.ParseUint(parts[1], 10, 64)
	ie.Offset, _ = strconv.ParseUint(parts[2], 10, 64)
	legacy, err := ctx.ImportIPC(ie)
	must(t, err)
	defer ctx.IpcCloseMemHandle(legacy - DevicePtr(ie.Offset))

	cp, err := NewCopier(ctx, kernels(t), CopierConfig{})
	must(t, err)
	defer cp.Close()
	s, err := ctx.NewStream(StreamNonBlocking)
	must(t, err)
	defer s.Destroy()
	src, err := ctx.MemAlloc(batchBytes + mib)
	must(t, err)
	defer ctx.MemFree(src)
	e0, _ := ctx.NewEvent(EventDefault)
	e1, _ := ctx.NewEvent(EventDefault)
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		var target string
		var plen, stride, srcOff, dstOff, seed uint64
		var n, reps int
		if _, err := fmt.Sscanf(sc.Text(), "case %s %d %d %d %d %d %d %d", &target, &plen, &stride, &srcOff, &dstOff, &n, &reps, &seed); err != nil {
			fmt.Printf("err parse %q: %v\n", sc.Text(), err)
			continue
		}
		reply := func() string {
			base := imp.Ptr()
			if target == "ipc" {
				base = legacy
			}
			if err := cp.Fill(s, src, batchBytes+mib, seed); err != nil {
				return "err " + err.Error()
			}
			descs := scatterDescs(src, base, n, plen, stride, srcOff, dstOff, permFor(seed, n))
			if err := cp.Copy(s, descs); err != nil {
				return "err " + err.Error()
			}
			if err := s.Synchronize(); err != nil {
				return "err " + err.Error()
			}
			e0.Record(s)
			for r := 0; r < reps; r++ {
				if err := cp.Copy(s, descs); err != nil {
					return "err " + err.Error()
				}
			}
			e1.Record(s)
			if err := e1.Synchronize(); err != nil {
				return "err " + err.Error()
			}
			ms, _ := ElapsedMs(e0, e1)
			bytes := float64(plen) * float64(n) * float64(reps)
			return fmt.Sprintf("ok %8.1f GB/s (%d x %d B, %d reps, %.3f ms per batch)", bytes/float64(ms)/1e6, n, plen, reps, float64(ms)/float64(reps))
		}()
		fmt.Println(reply)
	}
}

// TestGPUToHost scatters pages from GPU 0 into registered, shared-mapped
// host memory (as a peer's memfd region would be) and checks every byte.
func TestGPUToHost(t *testing.T) {
	ctx := gpus(t, 1)[0]
	cp, err := NewCopier(ctx, kernels(t), CopierConfig{})
	must(t, err)
	defer cp.Close()
	s, err := ctx.NewStream(StreamNonBlocking)
	must(t, err)
	defer s.Destroy()
	const hostSize = 2 * batchBytes
	mem, err := syscall.Mmap(-1, 0, hostSize, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_ANON)
	must(t, err)
	defer syscall.Munmap(mem)
	hp := unsafe.Pointer(&mem[0])
	must(t, ctx.MemHostRegister(hp, hostSize, HostRegisterPortable|HostRegisterDeviceMap))
	defer ctx.MemHostUnregister(hp)
	dp, err := ctx.MemHostGetDevicePointer(hp)
	must(t, err)
	src, err := ctx.MemAlloc(batchBytes)
	must(t, err)
	defer ctx.MemFree(src)
	e0, _ := ctx.NewEvent(EventDefault)
	e1, _ := ctx.NewEvent(EventDefault)
	var table []string
	for _, ps := range []uint64{4 << 10, 64 << 10, 1 << 20} {
		n := int(batchBytes / ps)
		seed := rand.Uint64()
		perm := permFor(seed, n)
		for i := range mem {
			mem[i] = poison
		}
		must(t, cp.Fill(s, src, batchBytes, seed))
		descs := scatterDescs(src, dp, n, ps, ps, 0, 0, perm)
		must(t, cp.Copy(s, descs))
		must(t, s.Synchronize())
		must(t, verifyScatter(mem[:2*uint64(n)*ps], seed, n, ps, ps, 0, 0, perm))
		must(t, e0.Record(s))
		const reps = 3
		for r := 0; r < reps; r++ {
			must(t, cp.Copy(s, descs))
		}
		must(t, e1.Record(s))
		must(t, e1.Synchronize())
		ms, _ := ElapsedMs(e0, e1)
		table = append(table, fmt.Sprintf("page=%-8d %6.1f GB/s", ps, float64(batchBytes)*reps/float64(ms)/1e6))
	}
	// copy engine reference: one 256 MiB DtoH into the same registered memory
	must(t, e0.Record(s))
	must(t, s.MemcpyDtoH(hp, src, batchBytes))
	must(t, e1.Record(s))
	must(t, e1.Synchronize())
	ms, _ := ElapsedMs(e0, e1)
	table = append(table, fmt.Sprintf("cuMemcpyDtoHAsync 256 MiB %6.1f GB/s", float64(batchBytes)/float64(ms)/1e6))
	t.Log("GPU0 -> registered host memory, every byte checked:\n" + strings.Join(table, "\n"))
}

type peerRig struct {
	c0, c1 *Context
	cp     *Copier
	s      *Stream
	src    DevicePtr
	dst    *Pool
	big0   DevicePtr
	big1   DevicePtr
	e0, e1 *Event
}

func newPeerRig(t testing.TB) *peerRig {
	ctxs := gpus(t, 2)
	r := &peerRig{c0: ctxs[0], c1: ctxs[1]}
	ok, err := r.c0.Device().CanAccessPeer(r.c1.Device())
	must(t, err)
	if !ok {
		t.Skip("GPU 0 cannot access GPU 1")
	}
	must(t, r.c0.EnablePeerAccess(r.c1))
	must(t, r.c1.EnablePeerAccess(r.c0))
	r.cp, err = NewCopier(r.c0, kernels(t), CopierConfig{})
	must(t, err)
	r.s, err = r.c0.NewStream(StreamNonBlocking)
	must(t, err)
	r.src, err = r.c0.MemAlloc(batchBytes)
	must(t, err)
	r.dst, err = r.c1.NewPool(PoolConfig{Size: 2 * batchBytes, HandleType: HandlePosixFD, Peers: []Device{r.c0.Device()}})
	must(t, err)
	r.big0, err = r.c0.MemAlloc(1 << 30)
	must(t, err)
	r.big1, err = r.c1.MemAlloc(1 << 30)
	must(t, err)
	r.e0, _ = r.c0.NewEvent(EventDefault)
	r.e1, _ = r.c0.NewEvent(EventDefault)
	must(t, r.cp.Fill(r.s, r.src, batchBytes, 1))
	must(t, r.cp.Fill(r.s, r.big0, 1<<30, 2))
	t.Cleanup(func() {
		r.s.Synchronize()
		r.cp.Close()
		r.dst.Close()
		r.c0.MemFree(r.src)
		r.c0.MemFree(r.big0)
		r.c1.MemFree(r.big1)
		r.s.Destroy()
	})
	return r
}

func (r *peerRig) descs(ps uint64) []CopyDesc {
	n := int(batchBytes / ps)
	return scatterDescs(r.src, r.dst.Ptr(), n, ps, ps, 0, 0, permFor(uint64(ps), n))
}

func (r *peerRig) timeScatter(t testing.TB, ps uint64, reps int) float64 {
	d := r.descs(ps)
	must(t, r.cp.Copy(r.s, d)) // warm-up
	must(t, r.e0.Record(r.s))
	for i := 0; i < reps; i++ {
		must(t, r.cp.Copy(r.s, d))
	}
	must(t, r.e1.Record(r.s))
	must(t, r.e1.Synchronize())
	ms, err := ElapsedMs(r.e0, r.e1)
	must(t, err)
	return float64(batchBytes) * float64(reps) / float64(ms) / 1e6
}

func (r *peerRig) timePeer(t testing.TB, reps int) float64 {
	must(t, r.s.MemcpyPeer(r.big1, r.c1, r.big0, r.c0, 1<<30))
	must(t, r.e0.Record(r.s))
	for i := 0; i < reps; i++ {
		must(t, r.s.MemcpyPeer(r.big1, r.c1, r.big0, r.c0, 1<<30))
	}
	must(t, r.e1.Record(r.s))
	must(t, r.e1.Synchronize())
	ms, err := ElapsedMs(r.e0, r.e1)
	must(t, err)
	return float64(1<<30) * float64(reps) / float64(ms) / 1e6
}

// TestGPUPeerBandwidth prints scattered-page GPU0 -> GPU1 bandwidth at each
// page size against a 1 GiB cuMemcpyPeer measured in the same run.
func TestGPUPeerBandwidth(t *testing.T) {
	r := newPeerRig(t)
	peer := r.timePeer(t, 10)
	lines := []string{fmt.Sprintf("cuMemcpyPeer 1 GiB GPU0->GPU1: %.1f GB/s", peer)}
	for _, ps := range []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20} {
		bw := r.timeScatter(t, ps, 20)
		p := r.cp.Plan(r.descs(ps))
		lines = append(lines, fmt.Sprintf("scatter page=%-8d pages=%-6d chunk=%-6d grid=%d: %6.1f GB/s (%.2f of cuMemcpyPeer)",
			ps, batchBytes/ps, p.ChunkBytes, p.Grid, bw, bw/peer))
	}
	hostCp, err := NewCopier(r.c0, kernels(t), CopierConfig{HostDescriptors: true})
	must(t, err)
	defer hostCp.Close()
	upload := r.cp
	r.cp = hostCp
	for _, ps := range []uint64{4 << 10, 64 << 10, 1 << 20} {
		bw := r.timeScatter(t, ps, 20)
		lines = append(lines, fmt.Sprintf("scatter page=%-8d descriptors read from pinned host memory: %6.1f GB/s (%.2f)", ps, bw, bw/peer))
	}
	r.cp = upload
	// correctness of the host-descriptor mode: one 4 KiB batch into the pool, checked
	{
		ps := uint64(4096)
		n := int(batchBytes / ps)
		must(t, r.s.MemsetD8(r.dst.Ptr(), poison, r.dst.Size()))
		must(t, hostCp.Copy(r.s, r.descs(ps)))
		must(t, r.s.Synchronize())
		got := make([]byte, 2*batchBytes)
		must(t, r.c1.MemcpyDtoH(got, r.dst.Ptr()))
		must(t, verifyScatter(got, 1, n, ps, ps, 0, 0, permFor(ps, n)))
	}
	lines = append(lines, fmt.Sprintf("cuMemcpyPeer 1 GiB GPU0->GPU1 (again): %.1f GB/s", r.timePeer(t, 10)))
	t.Log("in-process GPU0 -> GPU1 (kernel on GPU 0 storing into a GPU 1 pool), 256 MiB per batch:\n" + strings.Join(lines, "\n"))
}

func BenchmarkScatterPeer(b *testing.B) {
	r := newPeerRig(b)
	for _, ps := range []uint64{4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20} {
		b.Run(fmt.Sprintf("page=%dKiB", ps>>10), func(b *testing.B) {
			d := r.descs(ps)
			b.SetBytes(batchBytes)
			b.ReportAllocs()
			for b.Loop() {
				must(b, r.cp.Copy(r.s, d))
				must(b, r.s.Synchronize())
			}
		})
	}
	b.Run("memcpyPeer=1GiB", func(b *testing.B) {
		b.SetBytes(1 << 30)
		for b.Loop() {
			must(b, r.s.MemcpyPeer(r.big1, r.c1, r.big0, r.c0, 1<<30))
			must(b, r.s.Synchronize())
		}
	})
}

// TestGPUGraph captures a memset, a kernel and a copy on a created stream,
// checks that nothing runs during capture, replays the graph, updates it in
// place with other parameters, sees a topology change refused (the exec
// still replays its old work) and a broken capture leave the stream usable.
func TestGPUGraph(t *testing.T) {
	c := gpus(t, 1)[0]
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	m, err := kernels(t).Load(c, "copy_kernels")
	must(t, err)
	defer m.Unload()
	fill, err := m.Function("mc_fill_pattern")
	must(t, err)
	s, err := c.NewStream(StreamNonBlocking)
	must(t, err)
	defer s.Destroy()
	const n = 1 << 20
	a, err := c.MemAlloc(n)
	must(t, err)
	defer c.MemFree(a)
	b, err := c.MemAlloc(n)
	must(t, err)
	defer c.MemFree(b)
	poisonB := func() {
		t.Helper()
		must(t, s.MemsetD8(b, poison, n))
		must(t, s.Synchronize())
	}
	read := func() []byte {
		t.Helper()
		got := make([]byte, n)
		must(t, c.MemcpyDtoH(got, b))
		return got
	}
	capture := func(seed uint64, val byte) *Graph {
		t.Helper()
		must(t, s.BeginCapture(CaptureThreadLocal))
		st, err := s.CaptureStatus()
		must(t, err)
		if st != CaptureActive {
			t.Fatalf("capture status %v after BeginCapture", st)
		}
		must(t, s.MemsetD8(b, val, n/2))
		must(t, s.Launch(fill, D1(64), D1(256), 0, a, uint64(n), seed))
		must(t, s.MemcpyDtoD(b+n/2, a+n/2, n/2))
		g, err := s.EndCapture()
		must(t, err)
		return g
	}
	verify := func(what string, seed uint64, val byte) {
		t.Helper()
		got := read()
		want := make([]byte, n)
		for i := range want[:n/2] {
			want[i] = val
		}
		PatternFill(want[n/2:], n/2, seed)
		if !bytes.Equal(got, want) {
			i := 0
			for got[i] == want[i] {
				i++
			}
			t.Fatalf("%s: byte %d is %#x, want %#x", what, i, got[i], want[i])
		}
	}

	poisonB()
	g1 := capture(7, 0x11)
	for i, x := range read() {
		if x != poison {
			t.Fatalf("byte %d written during capture", i)
		}
	}
	nodes, err := g1.NodeCount()
	must(t, err)
	if nodes != 3 {
		t.Errorf("graph has %d nodes, want 3", nodes)
	}
	e, err := g1.Instantiate()
	must(t, err)
	must(t, g1.Destroy())
	defer e.Destroy()
	must(t, e.Upload(s))
	for rep := range 2 {
		poisonB()
		must(t, e.Launch(s))
		must(t, s.Synchronize())
		verify(fmt.Sprintf("replay %d", rep), 7, 0x11)
	}

	g2 := capture(9, 0x22)
	must(t, e.Update(g2))
	must(t, g2.Destroy())
	poisonB()
	must(t, e.Launch(s))
	must(t, s.Synchronize())
	verify("after update", 9, 0x22)

	must(t, s.BeginCapture(CaptureThreadLocal))
	must(t, s.MemsetD8(b, 1, n))
	g3, err := s.EndCapture()
	must(t, err)
	err = e.Update(g3)
	must(t, g3.Destroy())
	var ue *GraphUpdateError
	if !errors.As(err, &ue) || ue.Reason == GraphUpdateSuccess {
		t.Fatalf("update with another topology: %v, want a *GraphUpdateError", err)
	}
	t.Logf("topology change refused: %v", err)
	poisonB()
	must(t, e.Launch(s))
	must(t, s.Synchronize())
	verify("after a refused update", 9, 0x22)

	must(t, s.BeginCapture(CaptureThreadLocal))
	if err := s.Synchronize(); err == nil {
		t.Error("Synchronize during capture succeeded")
	}
	if g, err := s.EndCapture(); err == nil {
		g.Destroy()
		t.Error("EndCapture of a broken capture succeeded")
	} else {
		t.Logf("broken capture: %v", err)
	}
	if st, err := s.CaptureStatus(); err != nil || st != CaptureNone {
		t.Fatalf("after a broken capture: status %v, %v", st, err)
	}
	poisonB()
	must(t, e.Launch(s))
	must(t, s.Synchronize())
	verify("after a broken capture", 9, 0x22)
}
