package computetest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/compute"
	"github.com/mooncake-go/mooncake-go/internal/kvcache"
	"github.com/mooncake-go/mooncake-go/internal/model"
)

// Backend is a backend under test, with a way to read its KV pool.
type Backend struct {
	compute.Model
	// KV returns the K or V of page p of layer l as float32 values
	// (widened from the pool's element type), token by token: PageSize
	// tokens of KVHeads x HeadDim (the model's KV heads).
	KV func(l int, kind kvcache.Kind, p int) []float32
}

// NewFunc makes a backend for m whose KV pool has pages pages of pageSize
// tokens. It closes what it makes through tb.Cleanup.
type NewFunc func(tb testing.TB, m *model.Model, pageSize, pages int) Backend

// Option changes what Run checks.
type Option func(*options)

type options struct {
	ref    NewFunc
	tol    map[model.DType]float64
	dtypes []model.DType
	skip   func(model.Config) string
}

// WithReference compares the backend under test against ref (the CPU
// backend) run on the same weights widened to float32. Without it the
// backend is its own reference (its 16-bit weights against their float32
// widening).
func WithReference(ref NewFunc) Option { return func(o *options) { o.ref = ref } }

// WithTolerance allows a relative logits (and KV) error of rel against the
// reference for weights stored in dt; the default 0 asks for equal bits.
func WithTolerance(dt model.DType, rel float64) Option { return func(o *options) { o.tol[dt] = rel } }

// WithDTypes sets the stored weight dtypes to run (default F32, BF16, F16).
func WithDTypes(dts ...model.DType) Option { return func(o *options) { o.dtypes = dts } }

// WithSkip skips, with the reason it returns, the architectures a backend
// does not run yet ("" runs it).
func WithSkip(why func(model.Config) string) Option { return func(o *options) { o.skip = why } }

// naiveTol bounds the float32 reference's relative error against Naive.
const naiveTol = 1e-5

// Run is the conformance suite: every registered architecture, at its tiny
// random shape written to disk in each dtype and loaded as a server loads
// it, through the backend newBackend makes. It checks
//   - the reference's logits against Naive (a float64 implementation);
//   - the backend's logits and greedy tokens against the reference, within
//     the dtype's tolerance;
//   - that a sequence's logits do not depend on how its prompt is chunked
//     or on the other sequences of its batches (bit for bit);
//   - the KV layout: Layout() is the Spec's (Config.KVLayout, in the
//     backend's page order) and each position's K and V sit at its page
//     table's page and slot.
func Run(t *testing.T, newBackend NewFunc, opts ...Option) {
	o := options{tol: map[model.DType]float64{}, dtypes: []model.DType{model.F32, model.BF16, model.F16}}
	for _, f := range opts {
		f(&o)
	}
	if o.ref == nil {
		o.ref = newBackend
	}
	shapes := model.TinyShapes()
	covered := map[string]bool{}
	var names []string
	for name, arch := range shapes {
		names = append(names, name)
		covered[arch] = true
	}
	sort.Strings(names)
	for _, arch := range model.Architectures().Names() {
		if !covered[arch] {
			t.Errorf("architecture %s has no tiny shape: add one to model's random shapes", arch)
		}
	}
	for _, name := range names {
		for _, dt := range o.dtypes {
			t.Run(fmt.Sprintf("%s/%v", name, dt), func(t *testing.T) {
				runShape(t, name, dt, newBackend, &o)
			})
		}
	}
}

const (
	pageSize = 4
	perSeq   = 24 // pages per sequence: 96 positions
)

func runShape(t *testing.T, name string, dt model.DType, newBackend NewFunc, o *options) {
	dir := t.TempDir()
	if err := model.WriteRandom(name, dir, 1, dt.TorchName()); err != nil {
		t.Fatal(err)
	}
	m, err := model.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if o.skip != nil {
		if why := o.skip(m.Config); why != "" {
			t.Skipf("%s: %s", m.Config.ArchName(), why)
		}
	}
	wide, err := m.AsFloat32()
	if err != nil {
		t.Fatal(err)
	}
	c := m.Config
	r := rand.New(rand.NewPCG(uint64(len(name)), uint64(dt)))
	prompts := make([][]int32, 5)
	for i := range prompts {
		n := []int{1, 6, 17, 40, 70}[i] // the last two beyond the tiny sliding windows
		prompts[i] = make([]int32, n)
		for j := range prompts[i] {
			prompts[i][j] = int32(r.IntN(c.Vocab))
		}
	}
	const steps = 6
	pages := perSeq * len(prompts)
	tol := o.tol[dt]

	ref := o.ref(t, wide, pageSize, pages)
	be := newBackend(t, m, pageSize, pages)
	want := c.KVLayout(pageSize, pages, be.Layout().ElemBytes)
	want.Order = be.Layout().Order
	if got := be.Layout(); got != want {
		t.Fatalf("layout %+v, want the Spec's %+v", got, want)
	}

	// The reference against the float64 implementation.
	refAlone := make([][][]float32, len(prompts))
	var naive *NaiveResult
	for i, p := range prompts {
		refAlone[i] = runSeqs(t, ref, [][]int32{p}, []int{0}, steps, interleaved(len(prompts)))[0]
		naive, err = Naive(wide, p)
		if err != nil {
			t.Fatal(err)
		}
		if e := RelErr(refAlone[i][0], naive.Logits); !(e <= naiveTol) {
			t.Errorf("prompt %d (%d tokens): reference logits off the float64 implementation by %.3g (relative)", i, len(p), e)
		}
	}

	// The backend against the reference, alone, one prompt at a time.
	alone := make([][][]float32, len(prompts))
	for i, p := range prompts {
		alone[i] = runSeqs(t, be, [][]int32{p}, []int{0}, steps, interleaved(len(prompts)))[0]
		compareToRef(t, fmt.Sprintf("prompt %d", i), alone[i], refAlone[i], tol)
	}
	// KV layout: after the last run (prompt 4 alone, pages 0, 5, 10, ...),
	// every prompt position's K and V sit where the layout and the page
	// table say, equal to the float64 implementation's.
	checkKV(t, be, naive, max(naiveTol, tol))

	// Batch invariance and chunking, bit for bit against the backend alone.
	ones := []int{1, 1, 1, 1, 1}
	for _, v := range []struct {
		name   string
		chunks []int
	}{
		{"batched", []int{0, 0, 0, 0, 0}},
		{"chunked", []int{1, 2, 3, 7, 16}},
		{"token by token", ones},
	} {
		got := runSeqs(t, be, prompts, v.chunks, steps, interleaved(len(prompts)))
		for i := range prompts {
			for s := range alone[i] {
				if !sameBits(alone[i][s], got[i][s]) {
					t.Errorf("%s: prompt %d step %d: logits differ from the prompt run alone (max diff %g)",
						v.name, i, s, MaxAbsDiff(alone[i][s], got[i][s]))
					break
				}
			}
		}
	}
}

// interleaved is the page table maker of n sequences whose pages alternate
// in the pool: sequence i has pages i, i+n, i+2n, ...
func interleaved(n int) func(i int) []int32 {
	return func(i int) []int32 {
		p := make([]int32, perSeq)
		for j := range p {
			p[j] = int32(i + j*n)
		}
		return p
	}
}

// runSeqs is RunBatch with a page table function.
func runSeqs(tb testing.TB, b compute.Model, prompts [][]int32, chunks []int, steps int, pages func(int) []int32) [][][]float32 {
	tb.Helper()
	return runBatch(tb, b, prompts, chunks, steps, pages)
}

func compareToRef(t *testing.T, what string, got, want [][]float32, tol float64) {
	t.Helper()
	for s := range want {
		if tol == 0 {
			if !sameBits(got[s], want[s]) {
				t.Errorf("%s step %d: logits differ from the reference (max diff %g)", what, s, MaxAbsDiff(got[s], want[s]))
				return
			}
			continue
		}
		if e := RelErr(got[s], want[s]); !(e <= tol) {
			t.Errorf("%s step %d: relative logits error %.3g > %.3g", what, s, e, tol)
			return
		}
		// The greedy token, unless the reference's top two are too close
		// to call at this tolerance.
		if a, b := Argmax(got[s]), Argmax(want[s]); a != b && margin(want[s]) > 4*tol*norm(want[s]) {
			t.Errorf("%s step %d: greedy token %d, reference %d", what, s, a, b)
			return
		}
		if Argmax(got[s]) != Argmax(want[s]) {
			return // the sequences part here: later steps are not comparable
		}
	}
}

// checkKV compares the K and V of every position of want (the prompt run
// last, with sequence 0's interleaved page table) in b's pool with want's.
func checkKV(t *testing.T, b Backend, want *NaiveResult, tol float64) {
	t.Helper()
	l := b.Layout()
	pt := interleaved(5)(0)
	tokElems := l.KVHeads * l.HeadDim
	for layer := 0; layer < l.Layers; layer++ {
		for kind, w := range [][][]float32{want.K[layer], want.V[layer]} {
			for pos := range w {
				pg := int(pt[pos/l.PageSize])
				g := b.KV(layer, kvcache.Kind(kind), pg)[(pos%l.PageSize)*tokElems:][:tokElems]
				if e := RelErr(g, w[pos]); !(e <= tol) {
					t.Fatalf("layer %d %s position %d (page %d slot %d): KV off the float64 implementation's by %.3g (relative)",
						layer, []string{"K", "V"}[kind], pos, pg, pos%l.PageSize, e)
				}
			}
		}
	}
}

func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// margin is the gap between the two largest values of x.
func margin(x []float32) float64 {
	a, b := math.Inf(-1), math.Inf(-1)
	for _, v := range x {
		f := float64(v)
		if f > a {
			a, b = f, a
		} else if f > b {
			b = f
		}
	}
	return a - b
}

func norm(x []float32) float64 {
	s := 0.0
	for _, v := range x {
		s += float64(v) * float64(v)
	}
	return math.Sqrt(s)
}
