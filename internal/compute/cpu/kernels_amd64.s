#include "textflag.h"

// One dot product's reduction order, shared by every kernel below that
// computes weight x activation dots: two 8-lane accumulators over 16-element
// blocks (even block to acc0, odd to acc1), one more 8-element block into
// acc0, acc0+acc1, the 8 lanes folded (hi128+lo128, then hi64+lo64, then
// lane1+lane0), then the remaining elements one by one with scalar FMA.

// HSUM folds Y register r (scratch t) into lane 0 of X r.
#define HSUM(r, xr, t) \
	VEXTRACTF128 $1, r, t; \
	VADDPS t, xr, xr; \
	VMOVHLPS xr, xr, t; \
	VADDPS t, xr, xr; \
	VMOVSHDUP xr, t; \
	VADDSS t, xr, xr

// func dot1AVX2(a, b *float32, n int) float32
TEXT ·dot1AVX2(SB), NOSPLIT, $0-28
	MOVQ a+0(FP), SI
	MOVQ b+8(FP), DI
	MOVQ n+16(FP), CX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	XORQ BX, BX
	MOVQ CX, DX
	SUBQ $16, DX
d1loop16:
	CMPQ BX, DX
	JGT d1tail8
	VMOVUPS (DI)(BX*4), Y8
	VMOVUPS 32(DI)(BX*4), Y9
	VFMADD231PS (SI)(BX*4), Y8, Y0
	VFMADD231PS 32(SI)(BX*4), Y9, Y1
	ADDQ $16, BX
	JMP d1loop16
d1tail8:
	ADDQ $8, DX
	CMPQ BX, DX
	JGT d1sum
	VMOVUPS (DI)(BX*4), Y8
	VFMADD231PS (SI)(BX*4), Y8, Y0
	ADDQ $8, BX
d1sum:
	VADDPS Y1, Y0, Y0
	HSUM(Y0, X0, X1)
d1tail1:
	CMPQ BX, CX
	JGE d1done
	VMOVSS (DI)(BX*4), X8
	VFMADD231SS (SI)(BX*4), X8, X0
	INCQ BX
	JMP d1tail1
d1done:
	VMOVSS X0, ret+24(FP)
	VZEROUPPER
	RET

// func dotRows4AVX2(w *float32, stride int, x *float32, n int, out *float32)
// out[r] = dot(w[r*stride : r*stride+n], x) for r = 0..3.
TEXT ·dotRows4AVX2(SB), NOSPLIT, $0-40
	MOVQ w+0(FP), SI
	MOVQ stride+8(FP), AX
	MOVQ x+16(FP), DI
	MOVQ n+24(FP), CX
	SHLQ $2, AX
	LEAQ (SI)(AX*1), R8
	LEAQ (R8)(AX*1), R9
	LEAQ (R9)(AX*1), R10
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	XORQ BX, BX
	MOVQ CX, DX
	SUBQ $16, DX
r4loop16:
	CMPQ BX, DX
	JGT r4tail8
	VMOVUPS (DI)(BX*4), Y8
	VMOVUPS 32(DI)(BX*4), Y9
	VFMADD231PS (SI)(BX*4), Y8, Y0
	VFMADD231PS 32(SI)(BX*4), Y9, Y1
	VFMADD231PS (R8)(BX*4), Y8, Y2
	VFMADD231PS 32(R8)(BX*4), Y9, Y3
	VFMADD231PS (R9)(BX*4), Y8, Y4
	VFMADD231PS 32(R9)(BX*4), Y9, Y5
	VFMADD231PS (R10)(BX*4), Y8, Y6
	VFMADD231PS 32(R10)(BX*4), Y9, Y7
	ADDQ $16, BX
	JMP r4loop16
r4tail8:
	ADDQ $8, DX
	CMPQ BX, DX
	JGT r4sum
	VMOVUPS (DI)(BX*4), Y8
	VFMADD231PS (SI)(BX*4), Y8, Y0
	VFMADD231PS (R8)(BX*4), Y8, Y2
	VFMADD231PS (R9)(BX*4), Y8, Y4
	VFMADD231PS (R10)(BX*4), Y8, Y6
	ADDQ $8, BX
r4sum:
	VADDPS Y1, Y0, Y0
	VADDPS Y3, Y2, Y2
	VADDPS Y5, Y4, Y4
	VADDPS Y7, Y6, Y6
	HSUM(Y0, X0, X1)
	HSUM(Y2, X2, X3)
	HSUM(Y4, X4, X5)
	HSUM(Y6, X6, X7)
r4tail1:
	CMPQ BX, CX
	JGE r4done
	VMOVSS (DI)(BX*4), X8
	VFMADD231SS (SI)(BX*4), X8, X0
	VFMADD231SS (R8)(BX*4), X8, X2
	VFMADD231SS (R9)(BX*4), X8, X4
	VFMADD231SS (R10)(BX*4), X8, X6
	INCQ BX
	JMP r4tail1
r4done:
	MOVQ out+32(FP), DI
	VMOVSS X0, (DI)
	VMOVSS X2, 4(DI)
	VMOVSS X4, 8(DI)
	VMOVSS X6, 12(DI)
	VZEROUPPER
	RET

// func attnScoresAVX2(q, k *float32, stride, n, hd int, out *float32)
// out[j] = dot(q[:hd], k[j*stride : j*stride+hd]) for j < n; hd % 8 == 0.
// One accumulator per key over 8-element chunks in order, folded as
// ((l0+l1)+(l2+l3)) + ((l4+l5)+(l6+l7)); keys in blocks of 8 share one
// VHADDPS transpose, the last n%8 keys are folded one by one in the same
// order.
TEXT ·attnScoresAVX2(SB), NOSPLIT, $0-48
	MOVQ q+0(FP), SI
	MOVQ k+8(FP), DI
	MOVQ stride+16(FP), AX
	MOVQ n+24(FP), CX
	MOVQ hd+32(FP), DX
	MOVQ out+40(FP), R11
	SHLQ $2, AX
	SHLQ $2, DX
	MOVQ AX, R12
	SHLQ $3, R12 // 8 keys
scblk:
	CMPQ CX, $8
	JLT sctail
	MOVQ DI, R10
	LEAQ (R10)(AX*2), R8
	ADDQ AX, R8
	LEAQ (R8)(AX*2), R9
	ADDQ AX, R9
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	XORQ BX, BX
scchunk:
	VMOVUPS (SI)(BX*1), Y8
	VFMADD231PS (R10), Y8, Y0
	VFMADD231PS (R10)(AX*1), Y8, Y1
	VFMADD231PS (R10)(AX*2), Y8, Y2
	VFMADD231PS (R8), Y8, Y3
	VFMADD231PS (R10)(AX*4), Y8, Y4
	VFMADD231PS (R8)(AX*2), Y8, Y5
	VFMADD231PS (R9), Y8, Y6
	VFMADD231PS (R9)(AX*1), Y8, Y7
	ADDQ $32, R10
	ADDQ $32, R8
	ADDQ $32, R9
	ADDQ $32, BX
	CMPQ BX, DX
	JLT scchunk
	VHADDPS Y1, Y0, Y0
	VHADDPS Y3, Y2, Y2
	VHADDPS Y2, Y0, Y0
	VHADDPS Y5, Y4, Y4
	VHADDPS Y7, Y6, Y6
	VHADDPS Y6, Y4, Y4
	VPERM2F128 $0x20, Y4, Y0, Y1
	VPERM2F128 $0x31, Y4, Y0, Y2
	VADDPS Y2, Y1, Y1
	VMOVUPS Y1, (R11)
	ADDQ $32, R11
	ADDQ R12, DI
	SUBQ $8, CX
	JMP scblk
sctail:
	TESTQ CX, CX
	JZ scdone
	VXORPS Y0, Y0, Y0
	XORQ BX, BX
sctchunk:
	VMOVUPS (SI)(BX*1), Y8
	VFMADD231PS (DI)(BX*1), Y8, Y0
	ADDQ $32, BX
	CMPQ BX, DX
	JLT sctchunk
	VHADDPS Y0, Y0, Y0
	VHADDPS Y0, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VADDPS X1, X0, X0
	VMOVSS X0, (R11)
	ADDQ $4, R11
	ADDQ AX, DI
	DECQ CX
	JMP sctail
scdone:
	VZEROUPPER
	RET

// func attnAccumAVX2(p, v *float32, stride, n, hd int, out *float32)
// out[:hd] += sum_j p[j] * v[j*stride : j*stride+hd]; hd % 8 == 0. Per
// 8-lane chunk, four accumulators take keys j%4 = 0..3 in order (the last
// n%4 keys go to the first), then (a0+a1)+(a2+a3) is added to out.
TEXT ·attnAccumAVX2(SB), NOSPLIT, $0-48
	MOVQ p+0(FP), SI
	MOVQ v+8(FP), DI
	MOVQ stride+16(FP), AX
	MOVQ n+24(FP), CX
	MOVQ hd+32(FP), DX
	MOVQ out+40(FP), R11
	SHLQ $2, AX
	MOVQ CX, R12
	SUBQ $4, R12
	XORQ BX, BX // element offset of the chunk
acc:
	CMPQ BX, DX
	JGE acdone
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	LEAQ (DI)(BX*4), R9 // v row pointer for this chunk
	XORQ R8, R8
acj4:
	CMPQ R8, R12
	JGT acj1
	VBROADCASTSS (SI)(R8*4), Y4
	VFMADD231PS (R9), Y4, Y0
	ADDQ AX, R9
	VBROADCASTSS 4(SI)(R8*4), Y5
	VFMADD231PS (R9), Y5, Y1
	ADDQ AX, R9
	VBROADCASTSS 8(SI)(R8*4), Y6
	VFMADD231PS (R9), Y6, Y2
	ADDQ AX, R9
	VBROADCASTSS 12(SI)(R8*4), Y7
	VFMADD231PS (R9), Y7, Y3
	ADDQ AX, R9
	ADDQ $4, R8
	JMP acj4
acj1:
	CMPQ R8, CX
	JGE acstore
	VBROADCASTSS (SI)(R8*4), Y4
	VFMADD231PS (R9), Y4, Y0
	ADDQ AX, R9
	INCQ R8
	JMP acj1
acstore:
	VADDPS Y1, Y0, Y0
	VADDPS Y3, Y2, Y2
	VADDPS Y2, Y0, Y0
	VADDPS (R11)(BX*4), Y0, Y0
	VMOVUPS Y0, (R11)(BX*4)
	ADDQ $8, BX
	JMP acc
acdone:
	VZEROUPPER
	RET
