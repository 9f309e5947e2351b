package cuda_test

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/cuda/cudatest"
	"github.com/mooncake-go/mooncake-go/pkg/transfer/rdma"
)

// A Pool is what the rdma transport registers with ibv_reg_dmabuf_mr.
var _ rdma.DMABufMemory = (*cuda.Pool)(nil)

// TestPoolDMABuf exports dma-bufs of pool ranges (skips without a GPU, or
// where the device reports no dma-buf support, after checking that the
// refusal is ErrNoDMABuf): the fd is a dma-buf covering the range widened
// to host pages, off locates the address in it, and ranges outside the
// pool are refused.
func TestPoolDMABuf(t *testing.T) {
	m := cudatest.NewPool(t, 8<<20)
	defer m.(cudatest.Pool).Close()
	p := m.(cudatest.Pool).Pool
	pg := uint64(os.Getpagesize())
	base := p.Base()
	fd, off, err := p.DMABuf(base, p.Size())
	if errors.Is(err, cuda.ErrNoDMABuf) {
		t.Skipf("no dma-buf here: %v", err)
	}
	if err != nil {
		t.Fatalf("dma-buf of the whole pool: %v", err)
	}
	checkDMABuf(t, fd, off, 0, p.Size())
	for _, c := range []struct{ addr, n uint64 }{
		{base + 12345, 100000},     // unaligned both ends
		{base + pg, 3 * pg},        // aligned
		{base + p.Size() - 10, 10}, // the pool's last bytes
		{base + 2*pg - 1, 2},       // straddles a page boundary
	} {
		t.Run(fmt.Sprintf("%#x+%d", c.addr-base, c.n), func(t *testing.T) {
			fd, off, err := p.DMABuf(c.addr, c.n)
			if err != nil {
				t.Fatal(err)
			}
			want := c.addr - c.addr&^(pg-1)
			if off != want {
				t.Errorf("offset %d, want %d", off, want)
			}
			checkDMABuf(t, fd, off, want, c.n)
		})
	}
	for _, c := range []struct{ addr, n uint64 }{{base - pg, pg}, {base + p.Size() - 10, 20}, {base, 0}} {
		if fd, _, err := p.DMABuf(c.addr, c.n); err == nil || !strings.Contains(err.Error(), "outside the GPU") {
			unix.Close(fd)
			t.Errorf("[%#x, +%d): %v, want a refusal naming the pool", c.addr, c.n, err)
		}
	}
}

// checkDMABuf checks fd is an open dma-buf of at least off+n bytes (when
// the kernel reports its size) and closes it.
func checkDMABuf(t *testing.T, fd int, off, wantOff, n uint64) {
	t.Helper()
	defer unix.Close(fd)
	if fd < 0 {
		t.Fatalf("fd %d", fd)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatalf("fstat of the dma-buf fd %d: %v", fd, err)
	}
	link, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", fd))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(link, "dmabuf") {
		t.Errorf("fd %d is %q, not a dma-buf", fd, link)
	}
	if off != wantOff {
		t.Errorf("offset %d, want %d", off, wantOff)
	}
	if st.Size != 0 && uint64(st.Size) < off+n {
		t.Errorf("dma-buf of %d bytes holds no [%d, +%d)", st.Size, off, n)
	}
	t.Logf("fd %d: %s, %d bytes, offset %d", fd, link, st.Size, off)
}
