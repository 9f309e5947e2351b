// decode.cu: decode attention on bf16 tensor cores (attn_decode_tc). The
// split-K decode attention of llama.cu's attn_decode2 (the same arguments
// up to scale_log2, grid (split, kv head, query), partial-result layout and
// fixed split of the keys, merged by attn_combine), with the dot products
// on mma.sync instead of the CUDA cores, which bound attn_decode2 at 47-63%
// of HBM at batch 8..256 (shuffles and FMAs per key). A kernel set of its
// own, compiled by NVRTC with llama.cu's macros (HEAD_DIM, USE_BF16,
// GQA_GROUP, ATT_SPLIT) and loaded for bf16 models with head dim 128, at
// most 8 query heads per KV head and no sliding window; launched only over
// pages of a multiple of 16 keys. testdata/decode_emu.cpp runs it on the
// host (TestAttnTCEmulated).
//
// Block: TC_WARPS warps (-DTC_WARPS, default 4, a divisor of ATT_SPLIT/16);
// warp w takes the split's 16-key chunks w, w + TC_WARPS, ... (a chunk lies
// in one page), prefetching its next chunk's rows to L2 while it computes.
// attn_decode_tc_wide: the same with 2*TC_WARPS warps, for small grids.
// Per chunk, with mma m16n8k16 (bf16 operands, f32 accumulation), lane
// (r = lane/4, t = lane%4):
//   S[16][16] = Q . K^T: M = the group's query heads (rows GQA_GROUP.. are
//     zero), N = the chunk's keys (two tiles of 8), K = the head dim in an
//     order permuted inside each 32 elements, so that every operand is one
//     16-byte load: lane (r, t) loads head r's and key r's (and r+8's)
//     elements 32p+8t..32p+8t+7; its words x, y are k-step 2p's logical k
//     (2t, 2t+1) and (2t+8, 2t+9), words z, w k-step 2p+1's. The lane gets
//     head r's scores of keys 2t, 2t+1 (tile 0) and 8+2t, 9+2t (tile 1).
//   An online softmax per head in f32 (exp2, S scaled by scale_log2); P is
//     rounded to bf16 (the sum l adds the rounded values) and is, as held,
//     the B operand (keys x head r) of
//   O^T[HEAD_DIM][8] += V^T . P^T: M = the head dim (tile j's row r is
//     element 8r+j, row r+8 element 64+8r+j), N = the heads, K = the keys;
//     lane (r, t) loads keys 2t, 2t+1, 2t+8, 2t+9's elements 8r..8r+7 and
//     64+8r..64+8r+7 (16 bytes each) and pairs two keys' elements by byte
//     permutes. The lane then holds O^T of heads 2t, 2t+1: their rescale
//     factors come from lanes 8t and 8t+4.
// The warps' (m, l, O) merge in shared memory in warp order, as
// attn_decode2's key slots do; m is stored in natural-log units.

typedef unsigned short bf16_t;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)

#ifdef __CUDA_ARCH__
// c += A . B, m16n8k16, A row-major (a0: row r, k 2t..; a1: row r+8; a2:
// row r, k 2t+8..; a3: row r+8, k 2t+8..), B column-major (b0: k 2t..,
// column r; b1: k 2t+8..), c: rows r, r+8, columns 2t, 2t+1.
__device__ __forceinline__ void mma_bf16(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
		     "{%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// pack_bf16 rounds lo and hi to bf16 (nearest even): lo in the low half.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
	u32 r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
}
#endif

__device__ __forceinline__ void tc_pdl_trigger() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// tc_prefetch starts n bytes at p (16-byte aligned) towards L2 (sm_90).
__device__ __forceinline__ void tc_prefetch(const void *p, int n) {
#if __CUDA_ARCH__ >= 900
	asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(n) : "memory");
#endif
}

#ifndef TC_WARPS
#define TC_WARPS 4
#endif
#if USE_BF16 && HEAD_DIM == 128 && GQA_GROUP <= 8 && ATT_SPLIT % (16 * TC_WARPS) == 0

__device__ __forceinline__ u32 tc_word(uint4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

template <int W>
__device__ __forceinline__ void attn_tc(float *part_o, float *part_ml, const bf16_t *q, const bf16_t *kc,
	const bf16_t *vc, const int *qrow, const int *pos, const int *ptoff, const int *pages, int page_size, int nsplit,
	int nheads, int nkv, int qi0, float scale_log2) {
	tc_pdl_trigger();
	__shared__ __align__(16) float os[W][GQA_GROUP][HEAD_DIM];
	__shared__ float ms[W][GQA_GROUP], ls[W][GQA_GROUP];
	int split = blockIdx.x, g = blockIdx.y, z = blockIdx.z, qi = qi0 + z;
	// the query's metadata in one round trip, before the exit that needs pos
	int npos = pos[qi] + 1, poff = ptoff[qi], qr = qrow[qi];
	int k0 = split * ATT_SPLIT;
	if (k0 >= npos) return;
	int len = min(ATT_SPLIT, npos - k0);
	int KVD = nkv * HEAD_DIM;
	int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	int r = lane >> 2, t = lane & 3;
	const int *pt = pages + poff;
	uint4 qa[4];
	{
		const bf16_t *qb = q + (long long)qr * nheads * HEAD_DIM + (long long)(g * GQA_GROUP + r) * HEAD_DIM + 8 * t;
#pragma unroll
		for (int p = 0; p < 4; p++) {
			qa[p].x = qa[p].y = qa[p].z = qa[p].w = 0u;
			if (r < GQA_GROUP) qa[p] = *(const uint4 *)(qb + 32 * p);
		}
	}
	const long long goff = (long long)g * HEAD_DIM;
	float m = NEG_INF, l = 0.f; // head r's running max (log2 units) and this lane's share of the sum
	float o[8][4];
#pragma unroll
	for (int j = 0; j < 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
	for (int c0 = warp * 16; c0 < len; c0 += W * 16) {
		int key0 = k0 + c0;
		int last = len - 1 - c0; // the chunk's last key; later ones load it again and are masked
		long long row0 = (long long)pt[key0 / page_size] * page_size + key0 % page_size;
		const bf16_t *kb = kc + row0 * KVD + goff, *vb = vc + row0 * KVD + goff;
		uint4 ka[2][4], va[4][2];
#pragma unroll
		for (int n = 0; n < 2; n++) {
			const bf16_t *kr = kb + (long long)min(8 * n + r, last) * KVD + 8 * t;
#pragma unroll
			for (int p = 0; p < 4; p++) ka[n][p] = *(const uint4 *)(kr + 32 * p);
		}
#pragma unroll
		for (int i = 0; i < 4; i++) {
			const bf16_t *vr = vb + (long long)min(2 * t + (i & 1) + 8 * (i >> 1), last) * KVD + 8 * r;
			va[i][0] = *(const uint4 *)vr;
			va[i][1] = *(const uint4 *)(vr + 64);
		}
		if (c0 + W * 16 < len) {
			// the warp's next chunk towards L2 while this one computes: lane
			// l < 16 key l's K row, lane 16 + l its V row
			int n0 = c0 + W * 16, nk = k0 + n0;
			long long nrow = (long long)pt[nk / page_size] * page_size + nk % page_size + min(lane & 15, len - 1 - n0);
			tc_prefetch((lane < 16 ? kc : vc) + nrow * KVD + goff, HEAD_DIM * 2);
		}
		float s[2][4];
#pragma unroll
		for (int n = 0; n < 2; n++) {
			s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
			for (int p = 0; p < 4; p++) {
				mma_bf16(s[n], qa[p].x, 0u, qa[p].y, 0u, ka[n][p].x, ka[n][p].y);
				mma_bf16(s[n], qa[p].z, 0u, qa[p].w, 0u, ka[n][p].z, ka[n][p].w);
			}
		}
		// head r's scores of the chunk's keys 2t, 2t+1, 8+2t, 9+2t
		float sv[4] = {s[0][0], s[0][1], s[1][0], s[1][1]};
		float mx = NEG_INF;
#pragma unroll
		for (int i = 0; i < 4; i++) {
			int key = 2 * t + (i & 1) + 8 * (i >> 1);
			sv[i] = key <= last ? sv[i] * scale_log2 : NEG_INF;
			mx = fmaxf(mx, sv[i]);
		}
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
		mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
		float mn = fmaxf(m, mx); // finite: the chunk's first key is valid
		float sc = exp2f(m - mn);
		u32 pb0 = pack_bf16(exp2f(sv[0] - mn), exp2f(sv[1] - mn));
		u32 pb1 = pack_bf16(exp2f(sv[2] - mn), exp2f(sv[3] - mn));
		l = l * sc + ((__uint_as_float(pb0 << 16) + __uint_as_float(pb0 & 0xffff0000u)) +
			(__uint_as_float(pb1 << 16) + __uint_as_float(pb1 & 0xffff0000u)));
		m = mn;
		float sa = __shfl_sync(0xffffffffu, sc, 8 * t), sb = __shfl_sync(0xffffffffu, sc, 8 * t + 4);
#pragma unroll
		for (int j = 0; j < 8; j++) {
			o[j][0] *= sa;
			o[j][1] *= sb;
			o[j][2] *= sa;
			o[j][3] *= sb;
			// element j of each 16-byte row: word j/2, its low half when j is even
			u32 sel = (j & 1) ? 0x7632u : 0x5410u;
			int wi = j >> 1;
			u32 a0 = __byte_perm(tc_word(va[0][0], wi), tc_word(va[1][0], wi), sel);
			u32 a1 = __byte_perm(tc_word(va[0][1], wi), tc_word(va[1][1], wi), sel);
			u32 a2 = __byte_perm(tc_word(va[2][0], wi), tc_word(va[3][0], wi), sel);
			u32 a3 = __byte_perm(tc_word(va[2][1], wi), tc_word(va[3][1], wi), sel);
			mma_bf16(o[j], a0, a1, a2, a3, pb0, pb1);
		}
	}
	l += __shfl_xor_sync(0xffffffffu, l, 1);
	l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
	for (int j = 0; j < 8; j++) {
		if (2 * t < GQA_GROUP) {
			os[warp][2 * t][8 * r + j] = o[j][0];
			os[warp][2 * t][64 + 8 * r + j] = o[j][2];
		}
		if (2 * t + 1 < GQA_GROUP) {
			os[warp][2 * t + 1][8 * r + j] = o[j][1];
			os[warp][2 * t + 1][64 + 8 * r + j] = o[j][3];
		}
	}
	if (t == 0 && r < GQA_GROUP) {
		ms[warp][r] = m;
		ls[warp][r] = l;
	}
	__syncthreads();
	for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += blockDim.x) {
		int h = i / HEAD_DIM, d = i % HEAD_DIM;
		float M = NEG_INF;
#pragma unroll
		for (int w = 0; w < W; w++) M = fmaxf(M, ms[w][h]);
		float a = 0.f, L = 0.f;
#pragma unroll
		for (int w = 0; w < W; w++) {
			float f = exp2f(ms[w][h] - M); // 0 for a warp that saw no key
			a = fmaf(os[w][h][d], f, a);
			L = fmaf(ls[w][h], f, L);
		}
		long long base = ((long long)z * nheads + g * GQA_GROUP + h) * nsplit + split;
		part_o[base * HEAD_DIM + d] = a;
		if (d == 0) {
			part_ml[base * 2] = M * 0.69314718055994531f;
			part_ml[base * 2 + 1] = L;
		}
	}
}
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 16 / TC_WARPS) attn_decode_tc(float *part_o, float *part_ml,
	const bf16_t *q, const bf16_t *kc, const bf16_t *vc, const int *qrow, const int *pos, const int *ptoff,
	const int *pages, int page_size, int nsplit, int nheads, int nkv, int qi0, float scale_log2) {
	attn_tc<TC_WARPS>(part_o, part_ml, q, kc, vc, qrow, pos, ptoff, pages, page_size, nsplit, nheads, nkv, qi0, scale_log2);
}
#if ATT_SPLIT % (32 * TC_WARPS) == 0
// attn_decode_tc_wide: twice the warps, for grids smaller than the GPU (its
// results differ from attn_decode_tc's in the last bits: another merge).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 64, 8 / TC_WARPS) attn_decode_tc_wide(float *part_o,
	float *part_ml, const bf16_t *q, const bf16_t *kc, const bf16_t *vc, const int *qrow, const int *pos,
	const int *ptoff, const int *pages, int page_size, int nsplit, int nheads, int nkv, int qi0, float scale_log2) {
	attn_tc<2 * TC_WARPS>(part_o, part_ml, q, kc, vc, qrow, pos, ptoff, pages, page_size, nsplit, nheads, nkv, qi0,
		scale_log2);
}
#endif
#endif
