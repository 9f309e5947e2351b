//go:build !amd64

package cpu

var (
	hasAVX2 = false
	hasF16C = false
)

func dot1AVX2(a, b *float32, n int) float32                                { panic("unreachable") }
func dotRows4AVX2(w *float32, stride int, x *float32, n int, out *float32) { panic("unreachable") }
func attnScoresAVX2(q, k *float32, stride, n, hd int, out *float32)        { panic("unreachable") }
func attnAccumAVX2(p, v *float32, stride, n, hd int, out *float32)         { panic("unreachable") }

func softmaxAVX2(x *float32, n8 int, div float32) { panic("unreachable") }
func siluMulAVX2(gate, u *float32, n8 int)        { panic("unreachable") }

func gemm4x3(w *float32, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x2(w *float32, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x1(w *float32, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm8x1(w *float32, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm1x1(w *float32, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x3bf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x2bf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x1bf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm8x1bf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm1x1bf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x3hf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x2hf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm4x1hf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm8x1hf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
func gemm1x1hf(w *uint16, ldw int, x *float32, ldx int, n int, out *float32, ldo int) {
	panic("unreachable")
}
