// Package cpu is the CPU backend of compute.Model: a batched float32 forward
// pass over a paged KV pool in host memory, with AVX2/FMA kernels and a fixed
// reduction order, so a sequence's result does not depend on the batch it
// runs in, on how its prompt is chunked, or on the thread count. Each layer
// is composed from the model Spec's blocks (blocks.go); weights are read in
// their stored dtype (float32, or bfloat16 / half widened in the kernels).
package cpu

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

var _ compute.Model = (*Backend)(nil)

// LayoutFor is the KV pool layout the CPU backend needs for cfg: float32
// elements, pageSize tokens per page, pages pages.
func LayoutFor(cfg model.Config, pageSize, pages int) kvcache.Layout {
	return cfg.KVLayout(pageSize, pages, 4)
}

// Backend runs a model on the CPU. Forward calls are serialised.
type Backend struct {
	m      *model.Model
	cfg    model.Config
	pool   *kvcache.Pool
	kv     []float32 // the pool's memory as float32
	rope   *rope
	team   *team
	embed  wmat
	norm   []float32
	lmHead wmat
	layers [][]block // per layer, the Spec's blocks in order
	mu     sync.Mutex
	s      scratch
	closed bool
}

// New makes a backend for m whose KV cache lives in pool (float32 elements,
// layers, kv heads and head dim as in m). threads <= 0 means GOMAXPROCS.
// The backend reads m's tensors in place: m must stay open while it runs.
func New(m *model.Model, pool *kvcache.Pool, threads int) (*Backend, error) {
	if m == nil || !m.HasWeights() {
		return nil, fmt.Errorf("cpu: no model weights")
	}
	c := m.Config
	if c.Spec == nil {
		return nil, fmt.Errorf("cpu: model has no architecture")
	}
	if err := c.Validate(); err != nil {
		return nil, err
	}
	if pool == nil {
		return nil, fmt.Errorf("cpu: no KV pool")
	}
	l := pool.Layout
	if err := l.Validate(); err != nil {
		return nil, err
	}
	if want := LayoutFor(c, l.PageSize, l.Pages); l != want {
		return nil, fmt.Errorf("cpu: pool layout %+v does not fit the model (want float32, %d layers, %d kv heads, head dim %d)",
			l, c.Layers, c.KVHeads, c.HeadDim)
	}
	if int64(len(pool.Mem)) != l.TotalBytes() || uintptr(unsafe.Pointer(unsafe.SliceData(pool.Mem)))%4 != 0 {
		return nil, fmt.Errorf("cpu: pool memory is %d bytes or misaligned, layout needs %d", len(pool.Mem), l.TotalBytes())
	}
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	b := &Backend{
		m: m, cfg: c, pool: pool,
		kv:   unsafe.Slice((*float32)(unsafe.Pointer(unsafe.SliceData(pool.Mem))), len(pool.Mem)/4),
		rope: newRope(&c),
	}
	if err := b.build(); err != nil {
		return nil, err
	}
	b.team = newTeam(threads)
	b.s.init(b)
	return b, nil
}

// Config is the model's configuration.
func (b *Backend) Config() model.Config { return b.cfg }

// Layout is the KV pool's layout.
func (b *Backend) Layout() kvcache.Layout { return b.pool.Layout }

// Close stops the worker threads.
func (b *Backend) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.closed {
		b.closed = true
		b.team.close()
	}
	return nil
}

// Forward implements compute.Model.
func (b *Backend) Forward(ctx context.Context, seqs []compute.Seq, out [][]float32) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("cpu: backend closed")
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return b.forward(ctx, seqs, out)
}

// team runs one function on n threads: the caller is thread 0.
type team struct {
	n  int
	ch []chan func(int)
	wg sync.WaitGroup
}

func newTeam(n int) *team {
	t := &team{n: n, ch: make([]chan func(int), n)}
	for k := 1; k < n; k++ {
		t.ch[k] = make(chan func(int))
		go func(k int, ch chan func(int)) {
			for f := range ch {
				f(k)
				t.wg.Done()
			}
		}(k, t.ch[k])
	}
	return t
}

// minWorkPerPart is the smallest job (in multiply-adds) worth a thread.
const minWorkPerPart = 1 << 16

// parts is how many threads a job of work multiply-adds uses.
func (t *team) parts(work int) int { return max(1, min(t.n, work/minWorkPerPart)) }

// run calls f(k) for k = 0..parts-1 concurrently and waits.
func (t *team) run(parts int, f func(int)) {
	if parts <= 1 {
		f(0)
		return
	}
	t.wg.Add(parts - 1)
	for k := 1; k < parts; k++ {
		t.ch[k] <- f
	}
	f(0)
	t.wg.Wait()
}

func (t *team) close() {
	for k := 1; k < t.n; k++ {
		close(t.ch[k])
	}
}

// span is part k's share [lo, hi) of n items split evenly into parts.
func span(k, parts, n int) (int, int) {
	return n * k / parts, n * (k + 1) / parts
}
