package cpu

import "golang.org/x/sys/cpu"

// hasAVX2 selects the assembly kernels (AVX2 + FMA).
var hasAVX2 = cpu.X86.HasAVX2 && cpu.X86.HasFMA

//go:noescape
func dot1AVX2(a, b *float32, n int) float32

//go:noescape
func dotRows4AVX2(w *float32, stride int, x *float32, n int, out *float32)

//go:noescape
func attnScoresAVX2(q, k *float32, stride, n, hd int, out *float32)

//go:noescape
func attnAccumAVX2(p, v *float32, stride, n, hd int, out *float32)

//go:noescape
func softmaxAVX2(x *float32, n8 int, div float32)

//go:noescape
func siluMulAVX2(gate, u *float32, n8 int)
