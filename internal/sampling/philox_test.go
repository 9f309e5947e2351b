package sampling

import (
	"math"
	"testing"
)

// TestPhiloxKnownAnswers checks the three philox4x32 10 lines of Random123's
// known-answer file, tests/kat_vectors (github.com/DEShawResearch/random123;
// columns: counter[4], key[2], expected[4], hex): counter and key all zeros,
// all ones, and the digits of pi.
func TestPhiloxKnownAnswers(t *testing.T) {
	for _, tc := range []struct {
		name string
		ctr  [4]uint32
		key  [2]uint32
		want [4]uint32
	}{
		{"zeros", [4]uint32{0, 0, 0, 0}, [2]uint32{0, 0},
			[4]uint32{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
		{"ones", [4]uint32{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, [2]uint32{0xffffffff, 0xffffffff},
			[4]uint32{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
		{"pi", [4]uint32{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, [2]uint32{0xa4093822, 0x299f31d0},
			[4]uint32{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
	} {
		if got := Philox4x32(tc.ctr, tc.key); got != tc.want {
			t.Errorf("%s: Philox4x32(%08x, %08x) = %08x, want %08x", tc.name, tc.ctr, tc.key, got, tc.want)
		}
	}
}

// TestUniformMapping pins Uniform to its documented mapping: the counter
// and key words, and the 53 bits taken from x[0] and x[1].
func TestUniformMapping(t *testing.T) {
	for _, tc := range []struct{ seed, step uint64 }{
		{0, 0}, {42, 0}, {42, 1}, {0xa4093822299f31d0, 7}, {1, 1 << 33}, {math.MaxUint64, math.MaxUint64},
	} {
		x := Philox4x32([4]uint32{uint32(tc.step), uint32(tc.step >> 32), 0, 0}, [2]uint32{uint32(tc.seed), uint32(tc.seed >> 32)})
		want := float64(uint64(x[0])<<21|uint64(x[1]>>11)) / (1 << 53)
		u := Uniform(tc.seed, tc.step)
		if u != want || u < 0 || u >= 1 {
			t.Errorf("Uniform(%#x, %d) = %v, want %v", tc.seed, tc.step, u, want)
		}
	}
	// Seed 0, step 0 is the all-zeros vector: x[0] = 0x6627e8d5, the top
	// 21 bits of x[1] = 0xe169c58d are 0x1c2d38.
	if u, want := Uniform(0, 0), float64(0x6627e8d5<<21|0xe169c58d>>11)*0x1p-53; u != want {
		t.Fatalf("Uniform(0, 0) = %v, want %v", u, want)
	}
	// The high words of the seed and the step matter.
	if Uniform(1, 0) == Uniform(1|1<<32, 0) || Uniform(1, 0) == Uniform(1, 1<<32) {
		t.Fatal("a high word of the seed or the step is ignored")
	}
}

// TestUniformDistribution: the draws of consecutive steps are uniform
// (a chi-square test over 64 buckets, far from any threshold for a good
// generator) and consecutive draws are uncorrelated.
func TestUniformDistribution(t *testing.T) {
	const n, buckets = 200000, 64
	var h [buckets]int
	var sumXY, sum float64
	prev := Uniform(99, 0)
	for k := range uint64(n) {
		u := Uniform(99, k)
		h[int(u*buckets)]++
		sum += u
		if k > 0 {
			sumXY += (u - 0.5) * (prev - 0.5)
		}
		prev = u
	}
	var chi2 float64
	exp := float64(n) / buckets
	for _, c := range h {
		chi2 += (float64(c) - exp) * (float64(c) - exp) / exp
	}
	if chi2 > 120 { // 63 degrees of freedom: p < 1e-5
		t.Fatalf("chi-square %v over %d buckets: %v", chi2, buckets, h)
	}
	if m := sum / n; math.Abs(m-0.5) > 0.005 {
		t.Fatalf("mean %v", m)
	}
	if c := sumXY / n * 12; math.Abs(c) > 0.02 {
		t.Fatalf("lag-1 correlation %v", c)
	}
}

func BenchmarkUniform(b *testing.B) {
	var s float64
	k := uint64(0)
	for b.Loop() {
		s += Uniform(42, k)
		k++
	}
	_ = s
}
