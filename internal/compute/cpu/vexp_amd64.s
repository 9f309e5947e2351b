#include "textflag.h"

// Vector exp, softmax and SiLU (AVX2 + FMA). exp uses Cephes' expf
// polynomial on x clamped to [-87.33654, 88]; below the range it is 0.

DATA expc<>+0(SB)/4, $0x42b00000  // 88.0
DATA expc<>+4(SB)/4, $0xc2aeac4f  // -87.33654
DATA expc<>+8(SB)/4, $0x3fb8aa3b  // log2(e)
DATA expc<>+12(SB)/4, $0x3f000000 // 0.5
DATA expc<>+16(SB)/4, $0x3f318000 // ln2 hi
DATA expc<>+20(SB)/4, $0xb95e8083 // ln2 lo
DATA expc<>+24(SB)/4, $0x3f800000 // 1.0
DATA expc<>+28(SB)/4, $0x0000007f // 127
DATA expc<>+32(SB)/4, $0x39506967 // p0
DATA expc<>+36(SB)/4, $0x3ab743ce // p1
DATA expc<>+40(SB)/4, $0x3c088908 // p2
DATA expc<>+44(SB)/4, $0x3d2aa9c1 // p3
DATA expc<>+48(SB)/4, $0x3e2aaaaa // p4
DATA expc<>+52(SB)/4, $0x3f000000 // p5
DATA expc<>+56(SB)/4, $0xff800000 // -inf
GLOBL expc<>(SB), RODATA|NOPTR, $60

// EXPCONST loads the constants EXP8 needs into Y8..Y15.
#define EXPCONST \
	VBROADCASTSS expc<>+0(SB), Y8; \
	VBROADCASTSS expc<>+4(SB), Y9; \
	VBROADCASTSS expc<>+8(SB), Y10; \
	VBROADCASTSS expc<>+12(SB), Y11; \
	VBROADCASTSS expc<>+16(SB), Y12; \
	VBROADCASTSS expc<>+20(SB), Y13; \
	VBROADCASTSS expc<>+24(SB), Y14; \
	VPBROADCASTD expc<>+28(SB), Y15

// EXP8 replaces Y0 by exp(Y0), clobbering Y1..Y4 and Y7.
#define EXP8 \
	VMINPS Y8, Y0, Y0; \
	VCMPPS $1, Y9, Y0, Y7; \
	VMAXPS Y9, Y0, Y0; \
	VMULPS Y10, Y0, Y1; \
	VADDPS Y11, Y1, Y1; \
	VROUNDPS $1, Y1, Y1; \
	VMOVAPS Y0, Y2; \
	VFNMADD231PS Y12, Y1, Y2; \
	VFNMADD231PS Y13, Y1, Y2; \
	VBROADCASTSS expc<>+32(SB), Y3; \
	VBROADCASTSS expc<>+36(SB), Y4; \
	VFMADD213PS Y4, Y2, Y3; \
	VBROADCASTSS expc<>+40(SB), Y4; \
	VFMADD213PS Y4, Y2, Y3; \
	VBROADCASTSS expc<>+44(SB), Y4; \
	VFMADD213PS Y4, Y2, Y3; \
	VBROADCASTSS expc<>+48(SB), Y4; \
	VFMADD213PS Y4, Y2, Y3; \
	VBROADCASTSS expc<>+52(SB), Y4; \
	VFMADD213PS Y4, Y2, Y3; \
	VMULPS Y2, Y2, Y4; \
	VFMADD213PS Y2, Y4, Y3; \
	VADDPS Y14, Y3, Y3; \
	VCVTPS2DQ Y1, Y1; \
	VPADDD Y15, Y1, Y1; \
	VPSLLD $23, Y1, Y1; \
	VMULPS Y1, Y3, Y0; \
	VANDNPS Y0, Y7, Y0

// func softmaxAVX2(x *float32, n8 int, div float32)
// x[:n8] = softmax(x[:n8] * (1/div)); n8 % 8 == 0, n8 > 0; -inf entries give
// 0. The normalisation multiplies by 1/sum.
// Max and sum use one 8-lane accumulator in order, then a fixed fold.
TEXT ·softmaxAVX2(SB), NOSPLIT, $0-20
	MOVQ x+0(FP), SI
	MOVQ n8+8(FP), CX
	VBROADCASTSS div+16(FP), Y0
	VBROADCASTSS expc<>+24(SB), Y1
	VDIVPS Y0, Y1, Y1 // 1/div
	VBROADCASTSS expc<>+56(SB), Y5
	XORQ BX, BX
smmax:
	VMULPS (SI)(BX*4), Y1, Y0
	VMOVUPS Y0, (SI)(BX*4)
	VMAXPS Y0, Y5, Y5
	ADDQ $8, BX
	CMPQ BX, CX
	JLT smmax
	VEXTRACTF128 $1, Y5, X1
	VMAXPS X1, X5, X5
	VMOVHLPS X5, X5, X1
	VMAXPS X1, X5, X5
	VMOVSHDUP X5, X1
	VMAXSS X1, X5, X5
	VBROADCASTSS X5, Y6
	EXPCONST
	VXORPS Y5, Y5, Y5
	XORQ BX, BX
smexp:
	VMOVUPS (SI)(BX*4), Y0
	VSUBPS Y6, Y0, Y0
	EXP8
	VMOVUPS Y0, (SI)(BX*4)
	VADDPS Y0, Y5, Y5
	ADDQ $8, BX
	CMPQ BX, CX
	JLT smexp
	VEXTRACTF128 $1, Y5, X1
	VADDPS X1, X5, X5
	VMOVHLPS X5, X5, X1
	VADDPS X1, X5, X5
	VMOVSHDUP X5, X1
	VADDSS X1, X5, X5
	VBROADCASTSS X5, Y6
	VDIVPS Y6, Y14, Y6 // 1/sum
	XORQ BX, BX
smdiv:
	VMULPS (SI)(BX*4), Y6, Y0
	VMOVUPS Y0, (SI)(BX*4)
	ADDQ $8, BX
	CMPQ BX, CX
	JLT smdiv
	VZEROUPPER
	RET

// func siluMulAVX2(gate, u *float32, n8 int)
// g[i] = g[i] * (1 / (1 + exp(-g[i]))) * u[i] for i < n8; n8 % 8 == 0.
TEXT ·siluMulAVX2(SB), NOSPLIT, $0-24
	MOVQ gate+0(FP), SI
	MOVQ u+8(FP), DI
	MOVQ n8+16(FP), CX
	EXPCONST
	XORQ BX, BX
sloop:
	CMPQ BX, CX
	JGE sdone
	VMOVUPS (SI)(BX*4), Y5
	VXORPS Y0, Y0, Y0
	VSUBPS Y5, Y0, Y0
	EXP8
	VADDPS Y14, Y0, Y0
	VDIVPS Y0, Y14, Y0
	VMULPS Y0, Y5, Y5
	VMULPS (DI)(BX*4), Y5, Y5
	VMOVUPS Y5, (SI)(BX*4)
	ADDQ $8, BX
	JMP sloop
sdone:
	VZEROUPPER
	RET
