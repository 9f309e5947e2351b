package cuda

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// GPU-free tests of the plan builder, the buckets and the arena sizing.

func testPC(flash bool) planConfig {
	return planConfig{pageSize: 16, split: 32, heads: 4, kvHeads: 2, headDim: 16, dim: 64, hidden: 172, vocab: 320,
		eb: 4, flash: flash, maxSeqLen: 512, partBudget: partBudget}
}

func TestDecodeBuckets(t *testing.T) {
	want := []int{1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256}
	if got := decodeBuckets(256); !slices.Equal(got, want) {
		t.Fatalf("decodeBuckets(256) = %v, want %v", got, want)
	}
	if got := decodeBuckets(100); !slices.Equal(got, append(want[:13:13], 96, 100)) {
		t.Errorf("decodeBuckets(100) = %v", got)
	}
	if got := decodeBuckets(1); !slices.Equal(got, []int{1}) {
		t.Errorf("decodeBuckets(1) = %v", got)
	}
	if got := decodeBuckets(512); got[len(got)-1] != 512 || got[len(got)-2] != 448 {
		t.Errorf("decodeBuckets(512) ends %v", got[len(got)-3:])
	}
	bk := decodeBuckets(256)
	for n := 1; n <= 256; n++ {
		b, ok := bucketFor(bk, n)
		if !ok || b < n {
			t.Fatalf("bucketFor(%d) = %d, %v", n, b, ok)
		}
		// the smallest bucket that holds n
		if i := slices.Index(bk, b); i > 0 && bk[i-1] >= n {
			t.Fatalf("bucketFor(%d) = %d, but %d holds it", n, b, bk[i-1])
		}
		if (n >= 8 && 2*(b-n) >= n) || (n >= 24 && 3*(b-n) > n) {
			t.Errorf("bucket %d pads %d rows by %d", b, n, b-n)
		}
	}
	if _, ok := bucketFor(bk, 257); ok {
		t.Error("257 rows found a bucket of at most 256")
	}
}

func TestSplitBucket(t *testing.T) {
	for _, c := range [][2]int{{1, 1}, {2, 2}, {3, 4}, {5, 8}, {8, 8}, {9, 10}, {11, 12}, {16, 16}, {17, 20}, {21, 24},
		{33, 40}, {65, 80}, {100, 112}, {1000, 1024}} {
		if got := splitBucket(c[0], 1<<20); got != c[1] {
			t.Errorf("splitBucket(%d) = %d, want %d", c[0], got, c[1])
		}
	}
	prev := 0
	for n := 1; n <= 5000; n++ {
		b := splitBucket(n, 1<<20)
		if b < n || b < prev {
			t.Fatalf("splitBucket(%d) = %d (previous %d): not a monotone upper bound", n, b, prev)
		}
		if n > 8 && float64(b-n) > 0.25*float64(n) {
			t.Fatalf("splitBucket(%d) = %d: more than a quarter extra", n, b)
		}
		prev = b
	}
	if got := splitBucket(1000, 900); got != 900 {
		t.Errorf("cap: %d", got)
	}
	bs := splitBuckets(1024)
	if !slices.IsSorted(bs) || bs[0] != 1 || bs[len(bs)-1] != 1024 || len(bs) != 4+4*7 {
		t.Errorf("splitBuckets(1024) = %v", bs)
	}
	if got := splitBuckets(13); !slices.Equal(got, []int{1, 2, 4, 8, 10, 12, 13}) {
		t.Errorf("splitBuckets(13) = %v", got)
	}
}

// seqAt is a seq whose page table is pages base, base+1, ...
func seqAt(toks, pos, base int, logits bool) compute.Seq {
	s := compute.Seq{Pos: pos, Logits: logits}
	for i := range toks {
		s.Tokens = append(s.Tokens, int32(100+i))
	}
	for i := range 40 {
		s.Pages = append(s.Pages, int32(base+i))
	}
	return s
}

func TestBuildPlanMixed(t *testing.T) {
	pc := testPC(true)
	kvd := int64(pc.kvHeads * pc.headDim)
	seqs := []compute.Seq{
		seqAt(20, 10, 100, true), // prefill chunk 10..29: flash
		seqAt(1, 40, 200, true),  // decode at 40
		{},                       // empty: skipped
		seqAt(3, 0, 300, false),  // prefill chunk without logits: flash
		seqAt(1, 99, 400, true),  // decode at 99: 4 splits of 32
	}
	p, err := buildPlan(&pc, seqs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.n != 25 || p.rows != 25 || p.m != 3 || p.np != 2 || p.ng != 2 || p.maxPrefill != 20 || p.nsplit != 4 {
		t.Fatalf("counts: n %d rows %d m %d np %d ng %d maxPrefill %d nsplit %d", p.n, p.rows, p.m, p.np, p.ng, p.maxPrefill, p.nsplit)
	}
	i := p.img
	// rows: seq 0 -> 0..19, seq 1 -> 20, seq 3 -> 21..23, seq 4 -> 24
	for r, want := range []struct{ tok, pos int32 }{{100, 10}, {119, 29}} {
		row := []int{0, 19}[r]
		if i[p.tok+row] != want.tok || i[p.pos+row] != want.pos {
			t.Errorf("row %d: tok %d pos %d", row, i[p.tok+row], i[p.pos+row])
		}
	}
	if i[p.pos+20] != 40 || i[p.pos+24] != 99 || i[p.pos+21] != 0 {
		t.Errorf("positions %d %d %d", i[p.pos+20], i[p.pos+24], i[p.pos+21])
	}
	// KV slot of seq 0 at position 29: page 100+29/16 = 101, offset 13
	if got, want := p.slotAt(19), (101*16+13)*kvd; got != want {
		t.Errorf("slot of row 19: %d, want %d", got, want)
	}
	if got, want := p.slotAt(24), (400+99/16)*16*kvd+int64(99%16)*kvd; got != want {
		t.Errorf("slot of row 24: %d, want %d", got, want)
	}
	// page tables packed per seq: seq 0 has 2 pages, seq 1 3, seq 3 1, seq 4 7
	wantPages := []int32{100, 101, 200, 201, 202, 300, 400, 401, 402, 403, 404, 405, 406}
	if got := i[p.pages : p.pages+len(wantPages)]; !slices.Equal(got, wantPages) || p.lrows-p.pages != len(wantPages) {
		t.Errorf("pages %v (section %d), want %v", got, p.lrows-p.pages, wantPages)
	}
	// flash rows: seq 0 (start 0, len 20, pos0 10, ptoff 0), seq 3 (21, 3, 0, 5)
	for q, w := range [][4]int32{{0, 20, 10, 0}, {21, 3, 0, 5}} {
		got := [4]int32{i[p.pStart+q], i[p.pLen+q], i[p.pPos0+q], i[p.pPtoff+q]}
		if got != w {
			t.Errorf("flash seq %d: %v, want %v", q, got, w)
		}
	}
	// split-K queries: rows 20 and 24 with their page tables at 2 and 6
	for q, w := range [][3]int32{{20, 40, 2}, {24, 99, 6}} {
		got := [3]int32{i[p.gRow+q], i[p.gPos+q], i[p.gPtoff+q]}
		if got != w {
			t.Errorf("split-K query %d: %v, want %v", q, got, w)
		}
	}
	if got := i[p.lrows : p.lrows+3]; !slices.Equal(got, []int32{19, 20, 24}) {
		t.Errorf("logits rows %v", got)
	}
	if p.size != len(p.img)*4 || p.size%8 != 0 || p.slot*2 < p.lrows+p.m {
		t.Errorf("layout: size %d, slot %d, lrows end %d", p.size, p.slot, p.lrows+p.m)
	}
	// Without the flash kernel every token is a split-K query.
	pc.flash = false
	p2, err := buildPlan(&pc, seqs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if p2.np != 0 || p2.ng != 25 || p2.nsplit != 4 || p2.img[p2.gPos+19] != 29 || p2.img[p2.gPtoff+21] != 5 {
		t.Errorf("no flash: np %d ng %d nsplit %d", p2.np, p2.ng, p2.nsplit)
	}
	if pc.scratchFor(p2).part != uint64(p2.qchunk)*pc.perQuery(4) || p2.qchunk != 25 {
		t.Errorf("qchunk %d", p2.qchunk)
	}
	// A small budget splits the queries into launches.
	pc.partBudget = 3 * pc.perQuery(4)
	if p3, _ := buildPlan(&pc, seqs, nil); p3.qchunk != 3 {
		t.Errorf("qchunk under a budget of 3 queries: %d", p3.qchunk)
	}
}

func TestBuildPlanDecodeShape(t *testing.T) {
	pc := testPC(true)
	seqs := []compute.Seq{seqAt(1, 5, 10, true), seqAt(1, 70, 20, true), seqAt(1, 0, 30, true)}
	shape := &decodeShape{bs: 4, splits: 4} // 128 keys: 8 pages of 16 per row
	p, err := buildPlan(&pc, seqs, shape)
	if err != nil {
		t.Fatal(err)
	}
	if p.n != 4 || p.m != 4 || p.ng != 4 || p.rows != 3 || p.nsplit != 4 || p.pageStride != 8 || p.np != 0 {
		t.Fatalf("shape: n %d m %d ng %d rows %d nsplit %d stride %d np %d", p.n, p.m, p.ng, p.rows, p.nsplit, p.pageStride, p.np)
	}
	i := p.img
	if p.lrows-p.pages != 4*8 {
		t.Errorf("page section %d entries, want 32", p.lrows-p.pages)
	}
	// row 1 (pos 70: 5 pages) at 8..12, zero after
	if got := i[p.pages+8 : p.pages+16]; !slices.Equal(got, []int32{20, 21, 22, 23, 24, 0, 0, 0}) {
		t.Errorf("row 1 pages %v", got)
	}
	for r := range 4 {
		if i[p.gRow+r] != int32(r) || i[p.gPtoff+r] != int32(8*r) || i[p.lrows+r] != int32(r) {
			t.Errorf("row %d: gRow %d ptoff %d lrow %d", r, i[p.gRow+r], i[p.gPtoff+r], i[p.lrows+r])
		}
	}
	if i[p.gPos+1] != 70 || i[p.tok+2] != 100 {
		t.Errorf("row 1 pos %d, row 2 token %d", i[p.gPos+1], i[p.tok+2])
	}
	// the padding row: token 0, position 0, no KV write, page 0
	if i[p.tok+3] != 0 || i[p.pos+3] != 0 || i[p.gPos+3] != 0 || p.slotAt(3) != -1 || i[p.pages+24] != 0 {
		t.Errorf("padding row: tok %d pos %d slot %d page %d", i[p.tok+3], i[p.pos+3], p.slotAt(3), i[p.pages+24])
	}
	if p.slotAt(2) != 30*16*int64(pc.kvHeads*pc.headDim) {
		t.Errorf("row 2 slot %d", p.slotAt(2))
	}
	// The same batch packed differs only by the padding.
	e, err := buildPlan(&pc, seqs, nil)
	if err != nil {
		t.Fatal(err)
	}
	for r := range 3 {
		if e.img[e.tok+r] != i[p.tok+r] || e.img[e.pos+r] != i[p.pos+r] || e.slotAt(r) != p.slotAt(r) {
			t.Errorf("row %d differs from the packed plan", r)
		}
	}
	for _, c := range []struct {
		name  string
		seqs  []compute.Seq
		shape decodeShape
	}{
		{"too many seqs", seqs, decodeShape{bs: 2, splits: 4}},
		{"too few splits", seqs, decodeShape{bs: 4, splits: 2}},
		{"a prefill chunk", []compute.Seq{seqAt(2, 0, 0, true)}, decodeShape{bs: 4, splits: 4}},
		{"no logits", []compute.Seq{seqAt(1, 3, 0, false)}, decodeShape{bs: 4, splits: 4}},
	} {
		if _, err := buildPlan(&pc, c.seqs, &c.shape); err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
	if !isDecode(seqs) || isDecode(nil) || isDecode([]compute.Seq{{Tokens: []int32{1}, Logits: true, Layer: func(int, compute.Fence) {}}}) {
		t.Error("isDecode")
	}
}

// TestArenaHoldsEveryDecodePlan: random decode batches of every bucket fit
// the arena sized for the largest.
func TestArenaHoldsEveryDecodePlan(t *testing.T) {
	pc := testPC(false)
	pc.partBudget = graphPartBudget / 1024 // a few queries per launch at long contexts
	const maxBS = 40
	a := pc.arenaFor(maxBS)
	r := rand.New(rand.NewPCG(1, 2))
	for range 300 {
		n := 1 + r.IntN(maxBS)
		seqs := make([]compute.Seq, n)
		need := 1
		for i := range seqs {
			pos := r.IntN(pc.maxSeqLen)
			seqs[i] = seqAt(1, pos, 0, true)
			need = max(need, pc.splitsFor(pos))
		}
		bs, _ := bucketFor(decodeBuckets(maxBS), n)
		p, err := buildPlan(&pc, seqs, &decodeShape{bs: bs, splits: splitBucket(need, pc.maxSplits())})
		if err != nil {
			t.Fatal(err)
		}
		s := pc.scratchFor(p)
		for name, v := range map[string][2]uint64{"x": {s.x, a.x}, "qkv": {s.qkv, a.qkv}, "gu": {s.gu, a.gu},
			"logits": {s.logits, a.logits}, "part": {s.part, a.part}, "meta": {s.meta, a.meta}} {
			if v[0] > v[1] {
				t.Fatalf("%d seqs (bucket %d, splits %d): %s needs %d > arena %d", n, bs, p.nsplit, name, v[0], v[1])
			}
		}
	}
}

// pc8B is the llama3-8b shape's graph plan configuration (bf16, pages of 64).
func pc8B(tb testing.TB) (model.Config, planConfig) {
	c, err := model.RandomConfig("llama3-8b")
	if err != nil {
		tb.Fatal(err)
	}
	return c, planConfig{pageSize: 64, split: defaultAttSplit, heads: c.Heads, kvHeads: c.KVHeads, headDim: c.HeadDim,
		dim: c.Dim, hidden: c.HiddenDim, vocab: c.Vocab, eb: 2, maxSeqLen: c.MaxSeqLen, partBudget: graphPartBudget}
}

// TestArena8B prints (and bounds) the graph buffers of the llama3-8b shape.
func TestArena8B(t *testing.T) {
	c, pc := pc8B(t)
	for _, bs := range []int{64, 256} {
		a := pc.arenaFor(bs)
		t.Logf("8B graph buffers at max batch %d: %.1f MiB (logits %.1f, partials %.1f, metadata %.2f)", bs,
			float64(a.total())/(1<<20), float64(a.logits)/(1<<20), float64(a.part)/(1<<20), float64(a.meta)/(1<<20))
		if a.logits != uint64(bs)*uint64(c.Vocab)*4 || a.part > graphPartBudget || a.total() > 320<<20 {
			t.Errorf("max batch %d: %+v", bs, a)
		}
	}
}

// BenchmarkBuildPlanDecode times the host's plan of a decode step of the 8B
// shape at ctx 1K (page tables, positions, lengths, splits) in a reused
// image, as forwardDecode builds it: part of the gap between two steps.
func BenchmarkBuildPlanDecode(b *testing.B) {
	_, pc := pc8B(b)
	for _, n := range []int{1, 32, 128} {
		seqs := make([]compute.Seq, n)
		for i := range seqs {
			seqs[i] = seqAt(1, 1024, i*17, true)
		}
		bs, _ := bucketFor(decodeBuckets(256), n)
		shape := &decodeShape{bs: bs, splits: splitBucket(pc.splitsFor(1024), pc.maxSplits())}
		b.Run(fmt.Sprintf("batch%d", n), func(b *testing.B) {
			var buf []int32 // reused as forwardDecode reuses it
			for b.Loop() {
				p, err := buildPlanIn(&pc, seqs, shape, buf)
				if err != nil {
					b.Fatal(err)
				}
				buf = p.img
			}
		})
	}
}

// TestBuildPlanReuse checks that a plan built in a used buffer equals one
// built afresh (stale entries cleared), and that a short buffer is not used.
func TestBuildPlanReuse(t *testing.T) {
	pc := testPC(false)
	big := []compute.Seq{seqAt(1, 300, 0, true), seqAt(1, 200, 40, true), seqAt(1, 100, 80, true)}
	small := []compute.Seq{seqAt(1, 5, 7, true)}
	shape := &decodeShape{bs: 4, splits: pc.maxSplits()}
	p0, err := buildPlanIn(&pc, big, shape, nil)
	if err != nil {
		t.Fatal(err)
	}
	buf := p0.img
	want, _ := buildPlan(&pc, small, shape)
	got, err := buildPlanIn(&pc, small, shape, buf)
	if err != nil {
		t.Fatal(err)
	}
	if &got.img[0] != &buf[0] {
		t.Error("the plan did not use the buffer")
	}
	if !slices.Equal(got.img, want.img) {
		t.Error("a plan built in a used buffer differs from a fresh one")
	}
	fresh, _ := buildPlan(&pc, big, shape) // p0's image is got's now
	if p, _ := buildPlanIn(&pc, big, shape, make([]int32, 3)); !slices.Equal(p.img, fresh.img) {
		t.Error("a short buffer changed the plan")
	}
}
