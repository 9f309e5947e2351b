package sampling

// Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As
// Easy as 1, 2, 3", SC11; the Random123 library): a counter-based generator,
// a pure function of a 128-bit counter and a 64-bit key. The sampler keys it
// by the request's seed and counts by the output step, so the draw of any
// step can be made anywhere (a prefill server, a decode server, a GPU kernel)
// without replaying a stream.
const (
	philoxM0 = 0xD2511F53 // multipliers
	philoxM1 = 0xCD9E8D57
	philoxW0 = 0x9E3779B9 // key increments (golden ratio, sqrt(3)-1)
	philoxW1 = 0xBB67AE85
)

// Philox4x32 is Philox4x32-10 of ctr under key: ten rounds, the key bumped
// by (W0, W1) before each round but the first. A round maps
// (c0, c1, c2, c3) with hi/lo the halves of the 64-bit products
// M0*c0 = (hi0, lo0) and M1*c2 = (hi1, lo1) to
// (hi1^c1^k0, lo1, hi0^c3^k1, lo0).
func Philox4x32(ctr [4]uint32, key [2]uint32) [4]uint32 {
	c0, c1, c2, c3 := ctr[0], ctr[1], ctr[2], ctr[3]
	k0, k1 := key[0], key[1]
	for i := range 10 {
		if i > 0 {
			k0 += philoxW0
			k1 += philoxW1
		}
		p0 := uint64(philoxM0) * uint64(c0)
		p1 := uint64(philoxM1) * uint64(c2)
		c0, c1, c2, c3 = uint32(p1>>32)^c1^k0, uint32(p1), uint32(p0>>32)^c3^k1, uint32(p0)
	}
	return [4]uint32{c0, c1, c2, c3}
}

// Uniform is the uniform draw in [0, 1) of output step step (0 for a
// request's first token) of a request with seed seed:
//
//	x = Philox4x32(ctr = {uint32(step), uint32(step>>32), 0, 0},
//	               key = {uint32(seed), uint32(seed>>32)})
//	u = float64(uint64(x[0])<<21 | uint64(x[1]>>11)) * 2^-53
//
// 53 bits: x[0] is the high 32 and the top 21 bits of x[1] the low 21 of
// an integer below 2^53, which float64 holds exactly, so u is exact and
// at most 1-2^-53. Counter words 2 and 3 are 0 (the token draw; other
// uses of a request's randomness take other values there). x[2] and x[3]
// are unused.
func Uniform(seed, step uint64) float64 {
	x := Philox4x32([4]uint32{uint32(step), uint32(step >> 32), 0, 0}, [2]uint32{uint32(seed), uint32(seed >> 32)})
	return float64(uint64(x[0])<<21|uint64(x[1]>>11)) * 0x1p-53
}
