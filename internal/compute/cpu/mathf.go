package cpu

import "math"

// expf is a float32 exp accurate to about 1 ulp (Cephes' expf polynomial).
func expf(x float32) float32 {
	if x > 88.72283 {
		return float32(math.Inf(1))
	}
	if x < -87.33654 {
		return 0
	}
	if x != x {
		return x
	}
	const log2e = 1.44269504088896341
	const ln2hi = 0.693359375
	const ln2lo = -2.12194440e-4
	fn := float32(math.Floor(float64(x*log2e + 0.5)))
	r := x - fn*ln2hi
	r -= fn * ln2lo
	p := float32(1.9875691500e-4)
	p = p*r + 1.3981999507e-3
	p = p*r + 8.3334519073e-3
	p = p*r + 4.1665795894e-2
	p = p*r + 1.6666665459e-1
	p = p*r + 5.0000001201e-1
	y := p*r*r + r + 1
	n := int32(fn)
	// y * 2^n, in two steps so n = 128 or n = -127 stay representable.
	h := n / 2
	return y * math.Float32frombits(uint32(h+127)<<23) * math.Float32frombits(uint32(n-h+127)<<23)
}

// silu is x * sigmoid(x).
func silu(x float32) float32 { return x * (1 / (1 + expf(-x))) }
