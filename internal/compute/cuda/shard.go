package cuda

import (
	"context"
	"errors"
	"fmt"

	"github.com/mooncake-go/mooncake-go/internal/collective"
	cu "github.com/mooncake-go/mooncake-go/internal/cuda"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// A Backend is one tensor-parallel rank of its model (tp 1: all of it),
// sharded as internal/model's shard.go says, except the embedding: every
// rank holds the whole table, so a lookup needs no all-reduce (1 GiB for a
// 128K vocabulary at width 4096 in bf16). The backend's cfg is the rank's
// shape (its query and KV heads, its share of every intermediate
// dimension; the vocabulary whole). In a layer, the output projection and
// the MLP's down projection (the experts' combine) add the residual on rank
// 0 only and overwrite it on the others, then the ranks all-reduce the
// residual stream in place. The LM head computes the rank's vocabulary
// rows, the ranks gather them, and rank 0 lays them out as [rows][Vocab]
// for the host or the sampler.
type rankShard struct {
	tp, rank int
	full     model.Config // the whole model's shape
	qlo, klo int          // first query head, first KV head
	// The LM head's rows [vlo, vlo+vrows); every rank's gathered block
	// holds vshard rows (the last rank's may hold fewer real ones).
	vlo, vrows, vshard int
	comm               collective.Comm // nil at tp 1
}

// shardOf is rank r of tp's shard of c and its shape.
func shardOf(c model.Config, tp, r int) (rankShard, model.Config) {
	sh := rankShard{tp: tp, rank: r, full: c}
	qlo, qhi := c.QHeads(tp, r)
	klo, khi := c.KVHeadsOf(tp, r)
	sh.qlo, sh.klo = qlo, klo
	vlo, vhi := c.VocabRows(tp, r)
	sh.vlo, sh.vrows, sh.vshard = vlo, vhi-vlo, c.VocabShard(tp)
	rc := c
	rc.Heads, rc.KVHeads = qhi-qlo, khi-klo
	part := func(n int) int {
		lo, hi := model.Split(n, tp, r)
		return hi - lo
	}
	rc.HiddenDim, rc.ExpertDim, rc.SharedExpertDim = part(c.HiddenDim), part(c.ExpertDim), part(c.SharedExpertDim)
	return sh, rc
}

// resid is the beta of the GEMMs that end a block: rank 0 adds the
// residual, the others write their partial sums.
func (s *rankShard) resid() float32 {
	if s.rank == 0 {
		return 1
	}
	return 0
}

// lmExtra is the logits buffer's room per row beyond the vocabulary: the
// rank's rows and the gathered blocks (tp > 1).
func (s *rankShard) lmExtra() int {
	if s.tp == 1 {
		return 0
	}
	return (s.tp + 1) * s.vshard
}

// capturable says whether the rank's collectives can be captured in a
// CUDA graph (NCCL's can; a communicator that waits on the host cannot).
func (s *rankShard) capturable() bool {
	if s.comm == nil {
		return true
	}
	c, ok := s.comm.(interface{ Capturable() bool })
	return ok && c.Capturable()
}

var errNoComm = errors.New("cuda backend: tensor-parallel rank without a communicator")

// allReduce sums the residual stream x [n][Dim] (f32) over the ranks, in
// place, on the pass's stream (nothing at tp 1).
func (b *Backend) allReduce(lp *layerPass) {
	r := lp.r
	if b.sh.tp == 1 || r.err != nil {
		return
	}
	if b.sh.comm == nil {
		r.err = errNoComm
		return
	}
	if err := b.sh.comm.AllReduce(lp.cctx, collective.Device(uintptr(lp.d.x), lp.p.n*b.cfg.Dim)); err != nil {
		r.err = fmt.Errorf("all-reduce: %w", err)
	}
}

// gatherLogits gathers the ranks' logits rows (at lshard, m rows of vrows)
// and, on rank 0, lays them out at logits as [m][Vocab].
func (b *Backend) gatherLogits(lp *layerPass, logits, lshard cu.DevicePtr, m int) {
	r, s := lp.r, &b.sh
	if r.err != nil {
		return
	}
	if s.comm == nil {
		r.err = errNoComm
		return
	}
	gathered := lshard + cu.DevicePtr(m*s.vshard*4)
	if err := s.comm.AllGather(lp.cctx, collective.Device(uintptr(lshard), m*s.vshard),
		collective.Device(uintptr(gathered), s.tp*m*s.vshard)); err != nil {
		r.err = fmt.Errorf("all-gather of the logits: %w", err)
		return
	}
	if s.rank != 0 {
		return
	}
	V := s.full.Vocab
	for k := 0; k < s.tp && r.err == nil; k++ {
		lo, hi := s.full.VocabRows(s.tp, k)
		if hi == lo {
			continue
		}
		w := uint64(hi-lo) * 4
		r.err = r.s.Memcpy2D(logits+cu.DevicePtr(lo*4), uint64(V)*4, gathered+cu.DevicePtr(k*m*s.vshard*4), w, w, uint64(m))
	}
}

// rowsOf is rows [lo, hi) of t (its first dimension), sharing t's data;
// nil stays nil.
func rowsOf(t *model.Tensor, lo, hi int) *model.Tensor {
	if t == nil || len(t.Shape) == 0 {
		return t
	}
	if lo == 0 && hi == t.Shape[0] {
		return t
	}
	per := t.Numel() / t.Shape[0] * t.DType.Size()
	sh := append([]int{hi - lo}, t.Shape[1:]...)
	return &model.Tensor{Name: fmt.Sprintf("%s[%d:%d]", t.Name, lo, hi), DType: t.DType, Shape: sh, Data: t.Data[lo*per : hi*per]}
}

// colsOf is columns [lo, hi) of the matrix t, copied; nil stays nil.
func colsOf(t *model.Tensor, lo, hi int) *model.Tensor {
	if t == nil || len(t.Shape) != 2 || lo == 0 && hi == t.Shape[1] {
		return t
	}
	rows, cols, es := t.Shape[0], t.Shape[1], t.DType.Size()
	w := (hi - lo) * es
	data := make([]byte, rows*w)
	for i := range rows {
		copy(data[i*w:(i+1)*w], t.Data[(i*cols+lo)*es:(i*cols+hi)*es])
	}
	return &model.Tensor{Name: fmt.Sprintf("%s[:,%d:%d]", t.Name, lo, hi), DType: t.DType, Shape: []int{rows, hi - lo}, Data: data}
}

// passCtx is ctx, or a background context for a pass enqueued under
// capture (ctx nil: nothing to cancel).
func passCtx(ctx context.Context) context.Context {
	if ctx == nil {
		return context.Background()
	}
	return ctx
}
