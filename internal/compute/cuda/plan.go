package cuda

import (
	"fmt"
	"math/bits"
	"unsafe"

	"github.com/mooncake-go/mooncake-go/internal/compute"
)

// Plans: what a forward pass launches (rows, page tables, positions, KV
// slots, split counts, query chunks, the metadata image and the scratch it
// needs) is a pure function of the batch and the planConfig, built before
// anything is enqueued. An eager plan packs exactly the batch; a decode
// plan has the fixed shape of a captured graph (decodeShape): bs rows, the
// seqs first and then padding rows, and a fixed split count, so that one
// capture serves every step whose batch and context fit the shape.

// planConfig is what a plan depends on besides the batch; fixed for a
// backend.
type planConfig struct {
	pageSize                int
	split                   int // keys per split-K split (ATT_SPLIT)
	heads, kvHeads, headDim int
	dim, hidden, vocab      int
	lmExtra                 int  // logits row room beyond vocab (rankShard.lmExtra)
	eb                      int  // bytes per element of T
	flash                   bool // multi-token chunks use the flash prefill kernel
	maxSeqLen               int
	// partBudget bounds the split-K partial results of one launch: the
	// queries of a pass are launched in chunks of qchunk.
	partBudget uint64
}

// decodeShape is the shape of a captured decode pass.
type decodeShape struct {
	bs     int // rows: the seqs, then padding rows
	splits int // split-K splits per query (a bound on every seq's own count)
}

// passPlan is one pass's launch plan and metadata image.
type passPlan struct {
	n, m       int // token rows and logits rows, padding rows included
	rows       int // rows that belong to seqs; the rest (n-rows) are padding
	ng, np     int // split-K queries; flash prefill sequences
	nsplit     int // splits per split-K query (the longest query's, or the shape's)
	maxPrefill int // longest flash prefill chunk
	qchunk     int // split-K queries per launch
	pageStride int // decode shape: page-table entries per row (0: packed per seq)
	// section offsets into img, in int32 units
	tok, pos, gRow, gPos, gPtoff, pStart, pLen, pPos0, pPtoff, pages, lrows int
	slot                                                                    int // in int64 units: the KV element offset of each row (-1: padding, no KV write)
	size                                                                    int // bytes of img
	img                                                                     []int32
}

// bytes views the metadata image.
func (p *passPlan) bytes() []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(p.img))), len(p.img)*4)
}

// slotAt is row t's KV element offset.
func (p *passPlan) slotAt(t int) int64 {
	i := 2 * (p.slot + t)
	return int64(uint32(p.img[i])) | int64(p.img[i+1])<<32
}

func (p *passPlan) setSlot(t int, v int64) {
	i := 2 * (p.slot + t)
	p.img[i], p.img[i+1] = int32(uint32(v)), int32(v>>32)
}

func ceilDiv(a, b int) int { return (a + b - 1) / b }

// isDecode reports whether every seq is one decode token asking for logits
// and no layer calls: the passes a decode graph can replay.
func isDecode(seqs []compute.Seq) bool {
	for i := range seqs {
		if s := &seqs[i]; len(s.Tokens) != 1 || !s.Logits || s.Layer != nil {
			return false
		}
	}
	return len(seqs) > 0
}

// splitsFor is the split count of a query at position pos (pos+1 keys).
func (pc *planConfig) splitsFor(pos int) int { return ceilDiv(pos+1, pc.split) }

// maxSplits is the split count of the longest context.
func (pc *planConfig) maxSplits() int { return max(1, ceilDiv(pc.maxSeqLen, pc.split)) }

// perQuery is the bytes of split-K partials one query needs (o and m, l).
func (pc *planConfig) perQuery(nsplit int) uint64 {
	return uint64(pc.heads) * uint64(max(nsplit, 1)) * uint64(pc.headDim+2) * 4
}

func (pc *planConfig) qchunkFor(ng, nsplit int) int {
	return max(1, min(ng, int(pc.partBudget/pc.perQuery(nsplit))))
}

// buildPlan plans a pass over seqs (validated by Backend.check): packed
// when shape is nil, else padded to shape, which must hold the batch (every
// seq a one-token decode with logits, at most shape.bs seqs, none needing
// more than shape.splits splits).
func buildPlan(pc *planConfig, seqs []compute.Seq, shape *decodeShape) (*passPlan, error) {
	return buildPlanIn(pc, seqs, shape, nil)
}

// buildPlanIn is buildPlan with the image in buf when it is large enough
// (cleared first; the plan then shares it, so it lasts until buf's next use).
func buildPlanIn(pc *planConfig, seqs []compute.Seq, shape *decodeShape, buf []int32) (*passPlan, error) {
	ps := pc.pageSize
	p := &passPlan{}
	npages := 0
	for _, s := range seqs {
		if len(s.Tokens) == 0 {
			continue
		}
		end := s.Pos + len(s.Tokens)
		p.n += len(s.Tokens)
		if s.Logits {
			p.m++
		}
		npages += ceilDiv(end, ps)
		if pc.flash && len(s.Tokens) > 1 {
			p.np++
			p.maxPrefill = max(p.maxPrefill, len(s.Tokens))
		} else {
			p.ng += len(s.Tokens)
			p.nsplit = max(p.nsplit, ceilDiv(end, pc.split))
		}
	}
	p.rows = p.n
	if shape != nil {
		if len(seqs) > shape.bs || !isDecode(seqs) {
			return nil, fmt.Errorf("cuda backend: a decode shape of %d rows cannot hold this batch of %d seqs", shape.bs, len(seqs))
		}
		if p.nsplit > shape.splits {
			return nil, fmt.Errorf("cuda backend: a decode shape of %d splits cannot hold a query of %d", shape.splits, p.nsplit)
		}
		p.n, p.m, p.ng, p.nsplit = shape.bs, shape.bs, shape.bs, shape.splits
		p.pageStride = ceilDiv(shape.splits*pc.split, ps)
		npages = shape.bs * p.pageStride
	}
	p.layout(npages)
	if cap(buf) >= p.size/4 {
		p.img = buf[:p.size/4]
		clear(p.img)
	} else {
		p.img = make([]int32, p.size/4)
	}
	p.qchunk = pc.qchunkFor(p.ng, p.nsplit)
	i32 := p.img
	kvd := int64(pc.kvHeads * pc.headDim)
	t, g, q, pg, lr := 0, 0, 0, 0, 0
	for _, s := range seqs {
		if len(s.Tokens) == 0 {
			continue
		}
		end := s.Pos + len(s.Tokens)
		if shape != nil {
			pg = t * p.pageStride
		}
		ptoff := pg
		pg += copy(i32[p.pages+pg:], s.Pages[:ceilDiv(end, ps)])
		flash := shape == nil && pc.flash && len(s.Tokens) > 1
		if flash {
			i32[p.pStart+q], i32[p.pLen+q], i32[p.pPos0+q], i32[p.pPtoff+q] = int32(t), int32(len(s.Tokens)), int32(s.Pos), int32(ptoff)
			q++
		}
		for j, tok := range s.Tokens {
			pos := s.Pos + j
			i32[p.tok+t], i32[p.pos+t] = tok, int32(pos)
			p.setSlot(t, int64(s.Pages[pos/ps])*int64(ps)*kvd+int64(pos%ps)*kvd)
			if !flash {
				i32[p.gRow+g], i32[p.gPos+g], i32[p.gPtoff+g] = int32(t), int32(pos), int32(ptoff)
				g++
			}
			t++
		}
		if s.Logits {
			i32[p.lrows+lr] = int32(t - 1)
			lr++
		}
	}
	// Padding rows: token 0 at position 0, no KV write, attention over key 0
	// of page 0 (any page: the row's outputs are never read), own logits row.
	for ; t < p.n; t++ {
		p.setSlot(t, -1)
		i32[p.gRow+g], i32[p.gPtoff+g] = int32(t), int32(t*p.pageStride)
		g++
		i32[p.lrows+lr] = int32(t)
		lr++
	}
	return p, nil
}

// layout places the image's sections (from n, m, ng, np and the page
// entries) and sets size.
func (p *passPlan) layout(npages int) {
	o := 0
	sec := func(k int) int { r := o; o += k; return r }
	p.tok, p.pos = sec(p.n), sec(p.n)
	p.gRow, p.gPos, p.gPtoff = sec(p.ng), sec(p.ng), sec(p.ng)
	p.pStart, p.pLen, p.pPos0, p.pPtoff = sec(p.np), sec(p.np), sec(p.np), sec(p.np)
	p.pages, p.lrows = sec(npages), sec(p.m)
	o = (o + 1) &^ 1
	p.slot = o / 2
	p.size = (o + 2*p.n) * 4
}

// scratchSizes are the bytes of each device buffer of a pass.
type scratchSizes struct {
	x, xb, qkv, q, att, gu, h, lx, logits, part, meta uint64
}

func (s *scratchSizes) total() uint64 {
	return s.x + s.xb + s.qkv + s.q + s.att + s.gu + s.h + s.lx + s.logits + s.part + s.meta
}

// scratchFor is what plan p needs.
func (pc *planConfig) scratchFor(p *passPlan) scratchSizes {
	n, m, eb := uint64(p.n), uint64(max(p.m, 1)), uint64(pc.eb)
	qd, kvd := uint64(pc.heads*pc.headDim), uint64(pc.kvHeads*pc.headDim)
	return scratchSizes{
		x: n * uint64(pc.dim) * 4, xb: n * uint64(pc.dim) * eb, qkv: n * (qd + 2*kvd) * 4,
		q: n * qd * eb, att: n * qd * eb, gu: n * uint64(2*pc.hidden) * eb, h: n * uint64(pc.hidden) * eb,
		lx: m * uint64(pc.dim) * eb, logits: m * uint64(pc.vocab+pc.lmExtra) * 4,
		part: uint64(p.qchunk) * pc.perQuery(p.nsplit), meta: uint64(p.size),
	}
}

// arenaFor is the scratch that holds every decode plan of at most maxBS
// rows (and any split count): each buffer sized for its largest user.
func (pc *planConfig) arenaFor(maxBS int) scratchSizes {
	var a scratchSizes
	for _, s := range splitBuckets(pc.maxSplits()) {
		p := &passPlan{n: maxBS, m: maxBS, ng: maxBS, nsplit: s, qchunk: pc.qchunkFor(maxBS, s)}
		p.layout(maxBS * ceilDiv(s*pc.split, pc.pageSize))
		n := pc.scratchFor(p)
		a.x, a.xb, a.qkv, a.q, a.att = max(a.x, n.x), max(a.xb, n.xb), max(a.qkv, n.qkv), max(a.q, n.q), max(a.att, n.att)
		a.gu, a.h, a.lx, a.logits = max(a.gu, n.gu), max(a.h, n.h), max(a.lx, n.lx), max(a.logits, n.logits)
		a.part, a.meta = max(a.part, n.part), max(a.meta, n.meta)
	}
	return a
}

// decodeBuckets are the batch sizes decode graphs are captured for, up to
// maxBS: 1, 2, 4, 8, then steps of 4 to 16, of 8 to 64, of 16 to 128, of
// 32 to 256, of 64 beyond; maxBS itself ends the list when it falls between.
// Padding adds fewer than half the rows from 8 rows on (17 -> 24 is the
// worst) and at most a third from 24 on; below 8 a step reads the weights
// whatever its rows, so padding costs little there.
func decodeBuckets(maxBS int) []int {
	var out []int
	for b := 1; b <= maxBS; {
		out = append(out, b)
		switch {
		case b < 8:
			b *= 2
		case b < 16:
			b += 4
		case b < 64:
			b += 8
		case b < 128:
			b += 16
		case b < 256:
			b += 32
		default:
			b += 64
		}
	}
	if len(out) > 0 && out[len(out)-1] != maxBS {
		out = append(out, maxBS)
	}
	return out
}

// bucketFor is the smallest bucket holding n rows; false when n exceeds
// them all.
func bucketFor(buckets []int, n int) (int, bool) {
	for _, b := range buckets {
		if b >= n {
			return b, true
		}
	}
	return 0, false
}

// splitBucket rounds a split count up so that one capture serves a range
// of context lengths: powers of two to 8, then four steps per octave (10,
// 12, 14, 16, 20, 24, ...), at most 25% of splits more than needed (whose
// blocks exit at once); capped at limit (the longest context's count).
func splitBucket(n, limit int) int {
	if n <= 8 {
		b := 1
		for b < n {
			b *= 2
		}
		return min(b, limit)
	}
	step := 1 << (bits.Len(uint(n-1)) - 3)
	return min(ceilDiv(n, step)*step, limit)
}

// splitBuckets lists every value splitBucket returns up to limit.
func splitBuckets(limit int) []int {
	var out []int
	for n := 1; n <= limit; n++ {
		if b := splitBucket(n, limit); len(out) == 0 || out[len(out)-1] != b {
			out = append(out, b)
		}
	}
	return out
}
