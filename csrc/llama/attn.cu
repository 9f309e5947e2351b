// attn.cu: attention on bf16 tensor cores, a kernel set of its own compiled
// by NVRTC with llama.cu's macros (HEAD_DIM, USE_BF16, GQA_GROUP, ATT_SPLIT)
// for bf16 models without a sliding window: decode (attn_decode_tc) and
// prefill (attn_prefill3, below; attn_prefill4 on wgmma when built for
// sm_90a). testdata/attn_emu.cpp and prefill_emu.cpp run the first two on
// the host (TestAttnTCEmulated, TestAttnPrefillEmulated); attn_prefill4 is
// checked on the GPU (TestWgmmaProbe, TestFlashPrefillV1V2, the kernel
// benchmark's prefill part against attn_prefill2).
//
// attn_decode_tc. The
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
__device__ __forceinline__ u32 sm_addr(const void *p) {
	u32 a;
	asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
	return a;
}
// ldsm4: ldmatrix.x4 of four 8x8 b16 matrices in shared memory, lanes 8i..
// 8i+7 giving matrix i's row addresses (16 bytes each); r[i] of lane l is
// matrix i's row l/4, elements 2(l%4), 2(l%4)+1 (low half first).
// ldsm4t: the same transposed: r[i] holds rows 2(l%4), 2(l%4)+1 of column
// l/4.
__device__ __forceinline__ void ldsm4(u32 *r, const bf16_t *p) {
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(sm_addr(p)));
}
__device__ __forceinline__ void ldsm4t(u32 *r, const bf16_t *p) {
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(sm_addr(p)));
}
// cp16: 16 bytes from global g to shared s, asynchronously (zeros when !ok);
// cp_commit closes a group of them, cp_wait<N> waits until at most N of
// this thread's groups are pending.
__device__ __forceinline__ void cp16(bf16_t *s, const bf16_t *g, bool ok) {
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sm_addr(s)), "l"(g),
		"r"(ok ? 16 : 0));
}
// ex2: 2^x by the SFU alone (ex2.approx.ftz: denormal results flush to 0).
__device__ __forceinline__ float ex2(float x) {
	float r;
	asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
	return r;
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
extern __shared__ __align__(16) unsigned char dyn_smem[];
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

#if USE_BF16 && HEAD_DIM % 32 == 0 && HEAD_DIM <= 128
// attn_prefill3: causal flash attention over paged KV (the arguments and
// results of llama.cu's attn_prefill2, which it replaces), block (head,
// query tile, seq): heads along x so that the GPU starts every head's
// latest (longest) tile before any shorter one. P3_WARPS warps of MT m16
// tiles of query rows each (attn_prefill3: MT 2, 128 rows a block, so each
// shared-memory byte read feeds twice the tensor-core work of one tile;
// attn_prefill3_64: MT 1, 64 rows, for prefills of under one wave of
// 128-row blocks, which leave the GPU unevenly loaded). The block's Q tile
// is loaded once into shared memory; 32-key K and V tiles stream through
// P3_STAGES stages by cp.async, one barrier a tile; fragments by ldmatrix
// (V transposed by ldmatrix.trans). Per tile and row: S = Q.K^T in f32,
// masked past the row's position on tiles that cross the warp's diagonal;
// an online softmax in exp2 units (p = ex2(s * scale_log2 - m), m the
// running max of s * scale_log2); O rescaled only when some row's max
// moved (the factor is exactly 1 otherwise); P rounded to bf16 for P.V, the
// sum l over the unrounded values. A warp skips tiles whose keys all lie
// past its rows. Dynamic shared memory: P3_SMEM(MT) bytes.
#define P3_WARPS 4
#define P3_BK 32
#define P3_STAGES 3
#define P3_PAD (HEAD_DIM + 8) // row stride in elements: ldmatrix rows land on distinct banks
#define P3_TILE (P3_BK * P3_PAD)
#define P3_SMEM(MT) ((P3_WARPS * 16 * (MT) * P3_PAD + P3_STAGES * 2 * P3_TILE) * 2)
// flash_store writes the 16 rows from r0 of a flash prefill's output (rows
// at or past L not), as the lane (gr, tg) of an m16n8 tile holds them:
// o(nd, i) the accumulator i of column tile nd, l its rows' partial sums.
template <class O>
__device__ __forceinline__ void flash_store(bf16_t *ob, int QD, int r0, int L, const float *l, O o) {
	const int gr = (threadIdx.x & 31) >> 2, tg = threadIdx.x & 3;
#pragma unroll
	for (int hf = 0; hf < 2; hf++) {
		float ls = l[hf];
		ls += __shfl_xor_sync(0xffffffffu, ls, 1);
		ls += __shfl_xor_sync(0xffffffffu, ls, 2);
		const int r = r0 + gr + 8 * hf;
		if (r >= L) continue;
		const float inv = 1.f / ls;
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++)
			*(u32 *)(ob + (long long)r * QD + nd * 8 + 2 * tg) = pack_bf16(o(nd, 2 * hf) * inv, o(nd, 2 * hf + 1) * inv);
	}
}
template <int MT>
__device__ __forceinline__ void prefill3(bf16_t *out, const bf16_t *q, const bf16_t *kc, const bf16_t *vc,
	const int *qstart, const int *qlen, const int *pos0, const int *ptoff, const int *pages, int page_size, int nheads,
	int nkv, float scale_log2) {
	const int BQ = P3_WARPS * 16 * MT, WR = 16 * MT; // rows a block, a warp
	bf16_t *Qs = (bf16_t *)dyn_smem, *KVs = Qs + BQ * P3_PAD; // Q [BQ][P3_PAD]; [stage][K|V][P3_BK][P3_PAD]
	const int b = blockIdx.z, h = blockIdx.x;
	const int L = qlen[b], qt0 = (gridDim.y - 1 - blockIdx.y) * BQ;
	if (qt0 >= L) return;
	const int g = h / GQA_GROUP, QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM, CH = HEAD_DIM / 8, NT = P3_WARPS * 32;
	const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
	const int p0 = pos0[b];
	// pages of a power of two: shifts instead of divisions
	const int psh = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
	const bf16_t *qb = q + (long long)qstart[b] * QD + (long long)h * HEAD_DIM;
	const int *pt = pages + ptoff[b];
	for (int c = tid; c < BQ * CH; c += NT) {
		int r = c / CH, cc = c % CH * 8;
		bool ok = qt0 + r < L;
		cp16(Qs + r * P3_PAD + cc, qb + (long long)(ok ? qt0 + r : 0) * QD + cc, ok);
	}
	const int kend = p0 + min(qt0 + BQ, L), nkt = (kend + P3_BK - 1) / P3_BK;
	// load(kt): tile kt into its stage, one commit group (empty past the
	// last tile, so that every iteration waits for the same count). Thread
	// t copies 16 bytes at column lc of rows lr, lr + RP, ... of the tile.
	// When pages are a power of two of at least P3_BK keys, a tile lies in
	// one page: one lookup a tile (else one a row).
	const int RP = NT / CH, lr = tid / CH, lc = tid % CH * 8;
	const long long goff = (long long)g * HEAD_DIM + lc, rstride = (long long)RP * KVD;
	const bool onepage = psh >= 0 && page_size >= P3_BK;
	auto load = [&](int kt) {
		if (kt < nkt) {
			bf16_t *Ks = KVs + kt % P3_STAGES * 2 * P3_TILE + lr * P3_PAD + lc, *Vs = Ks + P3_TILE;
			const int k0 = kt * P3_BK;
			if (onepage) {
				const long long base =
					((long long)pt[k0 >> psh] * page_size + (k0 & (page_size - 1)) + lr) * KVD + goff;
#pragma unroll
				for (int i = 0; i < P3_BK / RP; i++) {
					bool ok = k0 + lr + i * RP < kend;
					long long off = ok ? base + i * rstride : 0;
					cp16(Ks + i * RP * P3_PAD, kc + off, ok);
					cp16(Vs + i * RP * P3_PAD, vc + off, ok);
				}
			} else {
#pragma unroll
				for (int i = 0; i < P3_BK / RP; i++) {
					int key = k0 + lr + i * RP;
					bool ok = key < kend;
					int pg = psh >= 0 ? key >> psh : key / page_size, in = psh >= 0 ? key & (page_size - 1) : key % page_size;
					long long off = ok ? ((long long)pt[pg] * page_size + in) * KVD + goff : 0;
					cp16(Ks + i * RP * P3_PAD, kc + off, ok);
					cp16(Vs + i * RP * P3_PAD, vc + off, ok);
				}
			}
		}
		cp_commit();
	};
	load(0); // with Q
#pragma unroll
	for (int i = 1; i < P3_STAGES - 1; i++) load(i);
	const int wr0 = qt0 + warp * WR, wmin = p0 + wr0, wmax = wmin + WR - 1; // the warp's rows and positions
	const bf16_t *qs = Qs + (warp * WR + (lane & 7) + (lane >> 3 & 1) * 8) * P3_PAD + (lane >> 4) * 8;
	float o[MT][HEAD_DIM / 8][4], m[MT][2], l[MT][2];
#pragma unroll
	for (int mt = 0; mt < MT; mt++) {
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++) o[mt][nd][0] = o[mt][nd][1] = o[mt][nd][2] = o[mt][nd][3] = 0.f;
		m[mt][0] = m[mt][1] = NEG_INF;
		l[mt][0] = l[mt][1] = 0.f;
	}
	for (int kt = 0; kt < nkt; kt++) {
		cp_wait<P3_STAGES - 2>(); // this thread's copies of tile kt (and Q) landed
		__syncthreads();          // everyone's; and every warp is done with tile kt-1's stage
		const int k0 = kt * P3_BK;
		const bool work = k0 <= wmax && wr0 < L; // not: keys past its rows, or rows past the chunk
		const bf16_t *Ks = KVs + kt % P3_STAGES * 2 * P3_TILE, *Vs = Ks + P3_TILE;
		float s[MT][P3_BK / 8][4];
		if (work) {
#pragma unroll
			for (int mt = 0; mt < MT; mt++)
#pragma unroll
				for (int nb = 0; nb < P3_BK / 8; nb++) s[mt][nb][0] = s[mt][nb][1] = s[mt][nb][2] = s[mt][nb][3] = 0.f;
#pragma unroll
			for (int kk = 0; kk < HEAD_DIM / 32; kk++) {
				u32 kb[P3_BK / 8][4]; // keys nb*8.., dims kk*32 + 8i..: k-step 2kk's b0, b1, then 2kk+1's
#pragma unroll
				for (int nb = 0; nb < P3_BK / 8; nb++)
					ldsm4(kb[nb], Ks + (nb * 8 + (lane & 7)) * P3_PAD + kk * 32 + (lane >> 3) * 8);
#pragma unroll
				for (int hk = 0; hk < 2; hk++) {
					u32 qa[MT][4];
#pragma unroll
					for (int mt = 0; mt < MT; mt++) ldsm4(qa[mt], qs + mt * 16 * P3_PAD + kk * 32 + hk * 16);
#pragma unroll
					for (int mt = 0; mt < MT; mt++)
#pragma unroll
						for (int nb = 0; nb < P3_BK / 8; nb++)
							mma_bf16(s[mt][nb], qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], kb[nb][2 * hk],
								kb[nb][2 * hk + 1]);
				}
			}
		}
		// the next stage's copies (into tile kt-1's, free since the barrier),
		// issued while the tensor cores work on S
		load(kt + P3_STAGES - 1);
		if (!work) continue;
		const bool diag = k0 + P3_BK - 1 > wmin;
		float c[MT][2];
		bool moved = false;
#pragma unroll
		for (int mt = 0; mt < MT; mt++) {
#pragma unroll
			for (int hf = 0; hf < 2; hf++) { // rows gr and gr+8 of m-tile mt
				const int qp = wmin + mt * 16 + gr + 8 * hf;
				float mx = NEG_INF;
#pragma unroll
				for (int nb = 0; nb < P3_BK / 8; nb++)
#pragma unroll
					for (int e = 0; e < 2; e++) {
						float v = s[mt][nb][2 * hf + e];
						if (diag && k0 + nb * 8 + 2 * tg + e > qp) v = s[mt][nb][2 * hf + e] = NEG_INF;
						mx = fmaxf(mx, v);
					}
				mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
				mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
				// finite: every row's first tile holds key 0 <= its position
				const float mn = fmaxf(m[mt][hf], mx * scale_log2);
				c[mt][hf] = ex2(m[mt][hf] - mn);
				moved |= mn != m[mt][hf];
				float sum = 0.f;
#pragma unroll
				for (int nb = 0; nb < P3_BK / 8; nb++)
#pragma unroll
					for (int e = 0; e < 2; e++) {
						float p = ex2(fmaf(s[mt][nb][2 * hf + e], scale_log2, -mn));
						s[mt][nb][2 * hf + e] = p;
						sum += p;
					}
				l[mt][hf] = l[mt][hf] * c[mt][hf] + sum;
				m[mt][hf] = mn;
			}
		}
		if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
			for (int mt = 0; mt < MT; mt++)
#pragma unroll
				for (int nd = 0; nd < HEAD_DIM / 8; nd++) {
					o[mt][nd][0] *= c[mt][0];
					o[mt][nd][1] *= c[mt][0];
					o[mt][nd][2] *= c[mt][1];
					o[mt][nd][3] *= c[mt][1];
				}
		}
#pragma unroll
		for (int kk = 0; kk < P3_BK / 16; kk++) {
			u32 pa[MT][4]; // P's A fragments: keys kk*16.. as held in S's accumulators
#pragma unroll
			for (int mt = 0; mt < MT; mt++) {
				pa[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
				pa[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
				pa[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
				pa[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
			}
#pragma unroll
			for (int nd2 = 0; nd2 < HEAD_DIM / 16; nd2++) {
				u32 vb[4]; // keys kk*16 + 8(i&1).., dims nd2*16 + 8(i>>1)..
				ldsm4t(vb, Vs + (kk * 16 + (lane >> 3 & 1) * 8 + (lane & 7)) * P3_PAD + nd2 * 16 + (lane >> 4) * 8);
#pragma unroll
				for (int mt = 0; mt < MT; mt++) {
					mma_bf16(o[mt][2 * nd2], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[0], vb[1]);
					mma_bf16(o[mt][2 * nd2 + 1], pa[mt][0], pa[mt][1], pa[mt][2], pa[mt][3], vb[2], vb[3]);
				}
			}
		}
	}
	cp_wait<0>(); // no copy outlives the block
	bf16_t *ob = out + (long long)qstart[b] * QD + (long long)h * HEAD_DIM;
#pragma unroll
	for (int mt = 0; mt < MT; mt++)
		flash_store(ob, QD, wr0 + mt * 16, L, l[mt], [&](int nd, int i) { return o[mt][nd][i]; });
}
#define P3_ARGS                                                                                                       \
	bf16_t *out, const bf16_t *q, const bf16_t *kc, const bf16_t *vc, const int *qstart, const int *qlen,         \
		const int *pos0, const int *ptoff, const int *pages, int page_size, int nheads, int nkv, float scale_log2
// grid (heads, ceil(longest chunk / 128), seqs), P3_WARPS * 32 threads
extern "C" __global__ void __launch_bounds__(P3_WARPS * 32, 2) attn_prefill3(P3_ARGS) {
	prefill3<2>(out, q, kc, vc, qstart, qlen, pos0, ptoff, pages, page_size, nheads, nkv, scale_log2);
}
// grid (heads, ceil(longest chunk / 64), seqs), P3_WARPS * 32 threads
extern "C" __global__ void __launch_bounds__(P3_WARPS * 32, 3) attn_prefill3_64(P3_ARGS) {
	prefill3<1>(out, q, kc, vc, qstart, qlen, pos0, ptoff, pages, page_size, nheads, nkv, scale_log2);
}
#endif

#if USE_BF16 && (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(EMU_HOPPER))
// Hopper (sm_90a, compiled so on a compute capability 9.0 device; on the
// host, testdata/cudaemu.h's emulation under EMU_HOPPER): warpgroup
// MMAs (wgmma) over shared memory in wgmma's 128-byte swizzled layout: a
// [R][HEAD_DIM] tile as HEAD_DIM/64 column halves of R rows of 128 bytes, the
// 16-byte chunks of row r permuted by XOR with r%8 (the tile 1024-byte
// aligned: the hardware XORs address bits 4-6 with 7-9), element (r, d) at
// sw_off(R, r, d). Without the swizzle (8x8 core matrices) ncu counted 64%
// of the shared wavefronts as bank conflicts. As a K-major operand (rows = M
// or N, d = K) a k-step of 16 starts 32 bytes on inside a half, SBO 1024 (8
// rows); read N-major (rows = K, d = N: V in P.V) a k-step is 16 rows on,
// LBO the half's size (the next 64 of N), SBO 1024 (the next 8 of K).
__device__ __forceinline__ int sw_off(int R, int r, int d) {
	return (d >> 6) * R * 64 + r * 64 + ((((d >> 3) & 7) ^ (r & 7)) << 3) + (d & 7);
}
// wg_desc: the matrix descriptor of a 128-byte swizzled tile at p.
__device__ __forceinline__ unsigned long long wg_desc(const void *p, int lbo, int sbo) {
	return (unsigned long long)((sm_addr(p) & 0x3FFFF) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
	       (unsigned long long)(sbo >> 4) << 32 | 1ull << 62;
}
// sw_base: dynamic shared memory from its first 1024-byte boundary (1 KiB
// more is asked at launch).
__device__ __forceinline__ bf16_t *sw_base() {
	return (bf16_t *)(dyn_smem + ((1024 - (sm_addr(dyn_smem) & 1023)) & 1023));
}
#ifdef __CUDA_ARCH__ // (cudaemu.h has the host's)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wg_wait() {
	asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// wg_hold keeps the compiler from moving accesses of d across a wait.
template <int N> __device__ __forceinline__ void wg_hold(float (&d)[N]) {
#pragma unroll
	for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// fence_async: this thread's shared-memory writes (cp.async landed) become
// visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#define WG8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
// wg_ss<N>: d[64xN] (+)= A[64x16] . B[Nx16]^T, both K-major in shared
// memory; d as the m16n8 accumulators of warp w's rows 16w.. (d[4j..4j+3]:
// columns 8j + 2t, +1 of rows r, r+8), zeroed first when !acc.
template <int N> __device__ __forceinline__ void wg_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int acc);
template <> __device__ __forceinline__ void wg_ss<16>(float (&d)[8], unsigned long long a, unsigned long long b, int acc) {
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0;\n}\n"
		     : WG8(0)
		     : "l"(a), "l"(b), "r"(acc));
}
template <> __device__ __forceinline__ void wg_ss<32>(float (&d)[16], unsigned long long a, unsigned long long b, int acc) {
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0;\n}\n"
		     : WG8(0), WG8(8)
		     : "l"(a), "l"(b), "r"(acc));
}
template <> __device__ __forceinline__ void wg_ss<64>(float (&d)[32], unsigned long long a, unsigned long long b, int acc) {
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
		     : WG8(0), WG8(8), WG8(16), WG8(24)
		     : "l"(a), "l"(b), "r"(acc));
}
template <> __device__ __forceinline__ void wg_ss<128>(float (&d)[64], unsigned long long a, unsigned long long b, int acc) {
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
		     : WG8(0), WG8(8), WG8(16), WG8(24), WG8(32), WG8(40), WG8(48), WG8(56)
		     : "l"(a), "l"(b), "r"(acc));
}
// wg_rs128: d[64x128] += A[64x16] . B[16x128], A in registers (mma.sync's
// m16n8k16 A fragments, warp w's rows 16w..), B N-major in shared memory.
__device__ __forceinline__ void wg_rs128(float (&d)[64], const u32 *a, unsigned long long b) {
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
		     : WG8(0), WG8(8), WG8(16), WG8(24), WG8(32), WG8(40), WG8(48), WG8(56)
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// mbarriers (shared::cta): mb_init with the arrivals a phase takes, mb_arrive
// one of them, mb_cp_arrive one that lands when this thread's cp.async
// copies so far have, mb_wait until the phase of parity ph has completed.
__device__ __forceinline__ void mb_init(unsigned long long *b, int n) {
	asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(sm_addr(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mb_arrive(unsigned long long *b) {
	unsigned long long st;
	asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];\n" : "=l"(st) : "r"(sm_addr(b)) : "memory");
}
__device__ __forceinline__ void mb_cp_arrive(unsigned long long *b) {
	asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(sm_addr(b)) : "memory");
}
__device__ __forceinline__ void mb_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mb_wait(unsigned long long *b, int ph) {
	u32 ok = 0;
	while (!ok)
		asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
			     : "=r"(ok)
			     : "r"(sm_addr(b)), "r"(ph)
			     : "memory");
}
// wg_sync: a barrier of this thread's warpgroup alone (named barrier 1 + wg).
__device__ __forceinline__ void wg_sync(int wg) { asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory"); }
__device__ __forceinline__ float ld_cg(const float *p) {
	float v;
	asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
	return v;
}
#endif

// gemm_wg: the decode GEMMs of 5..128 token rows (Y = X . W^T, X [n][in]
// bf16, W [out][in] bf16, Y [n][out] f32 (+ beta*Y) or bf16), streaming the
// weights once through a ring of shared-memory stages at HBM speed, on
// wgmma with the weights as A (64 rows a consumer warpgroup) and the tokens
// as N (NT: n padded to 16, 32, 64 or 128). Work is split stream-K: the
// units (128-row block r, 64-k chunk c), r-major, are cut into gridDim.x
// (one block an SM, persistent) equal ranges, so every SM streams the same
// bytes and the producer runs on from one row block into the next without
// draining the ring. A block's range covers some row blocks whole (stored
// at once) and at most two in part (its first: slot 0, its last: slot 1);
// a part goes to part[block][slot][half] as each thread holds it, and the
// last of a row block's blocks to arrive (a counter a half, reset after)
// sums them in block order, so results do not depend on timing. Block:
// consumer warpgroups 0 and 1 (rows 0..63, 64..127 of a row block) and a
// producer warpgroup (threads 256..383) copying W's 128 x 64 and X's NT x 64
// tile of each unit by cp.async into 128-byte swizzled stages, with full
// and empty mbarriers as attn_prefill4's. in % 64 == 0.
// ring_init: the block's n full mbarriers (the producer warpgroup's 128
// arrivals) and n empty ones (both consumer warpgroups' 256), then a barrier.
__device__ __forceinline__ void ring_init(unsigned long long *full, unsigned long long *empty, int n) {
	if (threadIdx.x == 0) {
		for (int i = 0; i < n; i++) {
			mb_init(full + i, 128);
			mb_init(empty + i, 256);
		}
		mb_fence_init();
	}
	__syncthreads();
}
#define GW_BM 128
#define GW_BK 64
#define GW_STAGES(NT) ((NT) <= 64 ? 8 : 6)
#define GW_STAGE(NT) ((GW_BM + (NT)) * GW_BK) // elements
#define GW_SMEM(NT) (GW_STAGES(NT) * GW_STAGE(NT) * 2 + 2 * GW_STAGES(NT) * 8 + 16 + 1024)
template <int NT>
__device__ __forceinline__ void gemm_wg(void *Y, const bf16_t *X, const bf16_t *W, int n, int out, int in, float beta,
	int yf32, float *part, int *cnt) {
	constexpr int S = GW_STAGES(NT), STG = GW_STAGE(NT);
	bf16_t *sm = sw_base();
	unsigned long long *full = (unsigned long long *)(sm + S * STG), *empty = full + S;
	int *lastf = (int *)(empty + S);
	const int tid = threadIdx.x, wg = tid >> 7, tw = tid & 127;
	const int nc = in / GW_BK, G = gridDim.x, g = blockIdx.x;
	const long long U = (long long)((out + GW_BM - 1) / GW_BM) * nc;
	const long long u0 = (long long)g * U / G, u1 = (long long)(g + 1) * U / G;
	ring_init(full, empty, S);
	if (wg == 2) { // the producer: thread tw copies 16-byte chunk tw%8 of rows tw/8 + 16j
		const int c8 = (tw & 7) * 8, r0 = tw >> 3;
		long long i = 0;
		for (long long u = u0; u < u1; u++, i++) {
			const int st = (int)(i % S), rb = (int)(u / nc), k = (int)(u % nc) * GW_BK + c8;
			mb_wait(empty + st, (int)(i / S & 1) ^ 1);
			bf16_t *Ws = sm + st * STG, *Xs = Ws + GW_BM * GW_BK;
#pragma unroll
			for (int j = 0; j < GW_BM / 16; j++) {
				const int row = r0 + 16 * j, gr = rb * GW_BM + row;
				const bool ok = gr < out;
				cp16(Ws + sw_off(GW_BM, row, c8), W + (long long)(ok ? gr : 0) * in + k, ok);
			}
#pragma unroll
			for (int j = 0; j < NT / 16; j++) {
				const int t = r0 + 16 * j;
				const bool ok = t < n;
				cp16(Xs + sw_off(NT, t, c8), X + (long long)(ok ? t : 0) * in + k, ok);
			}
			mb_cp_arrive(full + st);
		}
		cp_wait<0>(); // no copy outlives the block
		return;
	}
	const int wq = tw >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
	float d[NT / 2];
	// store: rows of row block rb from v (as d is held) into Y
	auto store = [&](int rb, const float *v) {
#pragma unroll
		for (int j = 0; j < NT / 8; j++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int row = rb * GW_BM + wg * 64 + 16 * wq + gr + 8 * (e >> 1), t = 8 * j + 2 * tg + (e & 1);
				if (row >= out || t >= n) continue;
				const long long idx = (long long)t * out + row;
				if (yf32) {
					float *y = (float *)Y, x = v[4 * j + e];
					if (beta != 0.f) x += beta * y[idx];
					y[idx] = x;
				} else
					((bf16_t *)Y)[idx] = (bf16_t)(pack_bf16(v[4 * j + e], 0.f) & 0xffffu);
			}
	};
	long long i = 0;
	for (long long u = u0; u < u1;) {
		const int rb = (int)(u / nc);
		const long long us = u, ue = min(u1, (long long)(rb + 1) * nc); // this segment: units us..ue-1
		for (; u < ue; u++, i++) {
			const int st = (int)(i % S);
			mb_wait(full + st, (int)(i / S & 1));
			fence_async();
			const bf16_t *Ws = sm + st * STG + wg * 64 * GW_BK, *Xs = sm + st * STG + GW_BM * GW_BK;
			wg_fence();
#pragma unroll
			for (int kk = 0; kk < GW_BK / 16; kk++)
				wg_ss<NT>(d, wg_desc(Ws + kk * 16, 16, 1024), wg_desc(Xs + kk * 16, 16, 1024), kk > 0 || u > us);
			wg_commit();
			wg_wait<0>();
			wg_hold(d);
			mb_arrive(empty + st);
		}
		const long long x0 = (long long)rb * nc, x1 = x0 + nc - 1;
		if (us == x0 && ue == x0 + nc) {
			store(rb, d);
			continue;
		}
		float *P = part + (((long long)g * 2 + (rb == u0 / nc ? 0 : 1)) * 2 + wg) * 64 * NT;
#pragma unroll
		for (int j = 0; j < NT / 2; j++) P[j * 128 + tw] = d[j];
		__threadfence();
		wg_sync(wg);
		// the blocks holding units x0 and x1: block b holds x when b*U/G <= x < (b+1)*U/G
		const int gf = (int)(((x0 + 1) * G + U - 1) / U) - 1, gl = (int)(((x1 + 1) * G + U - 1) / U) - 1;
		if (tw == 0) lastf[wg] = atomicAdd(cnt + 2 * rb + wg, 1) == gl - gf;
		wg_sync(wg);
		if (!lastf[wg]) continue;
		__threadfence();
		float v[NT / 2];
#pragma unroll
		for (int j = 0; j < NT / 2; j++) v[j] = 0.f;
		for (int b = gf; b <= gl; b++) {
			const float *Q = part + (((long long)b * 2 + (rb == (long long)b * U / G / nc ? 0 : 1)) * 2 + wg) * 64 * NT;
#pragma unroll
			for (int j = 0; j < NT / 2; j++) v[j] += ld_cg(Q + j * 128 + tw);
		}
		store(rb, v);
		if (tw == 0) cnt[2 * rb + wg] = 0;
	}
}
#define GW_KERNEL(NT)                                                                                                   \
	extern "C" __global__ void __launch_bounds__(384, 1) gemm_wg##NT(void *Y, const bf16_t *X, const bf16_t *W, int n, \
		int out, int in, float beta, int yf32, float *part, int *cnt) {                                             \
		gemm_wg<NT>(Y, X, W, n, out, in, beta, yf32, part, cnt);                                                    \
	}
GW_KERNEL(16)
GW_KERNEL(32)
GW_KERNEL(64)
GW_KERNEL(128)
#endif

#if USE_BF16 && HEAD_DIM == 128 && (defined(__CUDA_ARCH_FEAT_SM90_ALL) || defined(EMU_HOPPER))

#define P4_BQ 128
#define P4_BK 64
#define P4_STAGES 4
#define P4_TILE (P4_BK * HEAD_DIM) // elements
#define P4_SMEM ((P4_BQ * HEAD_DIM + P4_STAGES * 2 * P4_TILE) * 2 + 2 * P4_STAGES * 8 + 1024)

// attn_prefill4: attn_prefill3's arguments, results and grid order (heads,
// query tiles of 128 rows, seqs) on wgmma, FlashAttention-3's design without
// TMA (the pages are gathered). Block: two consumer warpgroups of 64 query
// rows and a producer warpgroup (threads 256..383) that copies Q and the
// 64-key K and V tiles by cp.async through P4_STAGES stages, each with a
// full mbarrier (landed with the copies) and an empty one (both consumers'
// P.V of it landed), so no block-wide barrier couples the consumers (a
// barrier a tile measured 10% slower; taking turns to issue the MMAs, as
// FA3's ping-pong does, gained nothing on top).
// Per tile, a consumer issues S = Q.K^T (8 wgmma, async) and the previous
// tile's O += P.V (4 wgmma, A = P from registers), then runs the online
// softmax of S while that P.V still runs on the tensor cores; O is rescaled
// after it lands. The softmax is attn_prefill3's (exp2 units, P rounded to
// bf16 for P.V, l summed over the unrounded values), O rescaled every tile.
// No branch around a wgmma or its registers (ptxas serialises wgmma in
// divergent code): every consumer runs every tile, keys past a row's
// position masked (a tile wholly past a warpgroup's rows costs it work, not
// correctness: every row's max is finite from tile 0 on).
// grid (heads, ceil(longest chunk / 128), seqs), 384 threads, P4_SMEM bytes.
extern "C" __global__ void __launch_bounds__(384, 1) attn_prefill4(P3_ARGS) {
	bf16_t *Qs = sw_base(), *KVs = Qs + P4_BQ * HEAD_DIM; // Q; [stage][K|V][P4_TILE]
	unsigned long long *full = (unsigned long long *)(KVs + P4_STAGES * 2 * P4_TILE), *empty = full + P4_STAGES;
	const int b = blockIdx.z, h = blockIdx.x;
	const int L = qlen[b], qt0 = (gridDim.y - 1 - blockIdx.y) * P4_BQ;
	if (qt0 >= L) return;
	const int g = h / GQA_GROUP, QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM, CH = HEAD_DIM / 8;
	const int tid = threadIdx.x, wg = tid >> 7, wq = tid >> 5 & 3, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
	const int p0 = pos0[b];
	const int kend = p0 + min(qt0 + P4_BQ, L), nkt = (kend + P4_BK - 1) / P4_BK;
	ring_init(full, empty, P4_STAGES);
	if (wg == 2) { // the producer
		const int t = tid - 256;
		const int psh = (page_size & (page_size - 1)) == 0 ? __ffs(page_size) - 1 : -1;
		const bf16_t *qb = q + (long long)qstart[b] * QD + (long long)h * HEAD_DIM;
		const int *pt = pages + ptoff[b];
		for (int c = t; c < P4_BQ * CH; c += 128) {
			int r = c / CH, cc = c % CH * 8;
			bool ok = qt0 + r < L;
			cp16(Qs + sw_off(P4_BQ, r, cc), qb + (long long)(ok ? qt0 + r : 0) * QD + cc, ok);
		}
		const int lrow = t / CH, lc = t % CH * 8; // rows lrow + 8i
		const long long goff = (long long)g * HEAD_DIM + lc;
		const int soff = sw_off(P4_BK, lrow, lc), RS = 8 * 64;
		const bool onepage = psh >= 0 && page_size >= P4_BK;
		for (int kt = 0; kt < nkt; kt++) {
			const int st = kt % P4_STAGES, k0 = kt * P4_BK;
			mb_wait(empty + st, (kt / P4_STAGES & 1) ^ 1); // its tile kt-P4_STAGES consumed (passes at once at first)
			bf16_t *Ks = KVs + st * 2 * P4_TILE + soff, *Vs = Ks + P4_TILE;
			const long long base =
				onepage ? ((long long)pt[k0 >> psh] * page_size + (k0 & (page_size - 1)) + lrow) * KVD + goff : 0;
#pragma unroll
			for (int i = 0; i < P4_BK / 8; i++) {
				int key = k0 + lrow + 8 * i;
				bool ok = key < kend;
				long long off;
				if (onepage)
					off = base + (long long)(8 * i) * KVD;
				else {
					int pg = psh >= 0 ? key >> psh : key / page_size, in = psh >= 0 ? key & (page_size - 1) : key % page_size;
					off = ((long long)pt[ok ? pg : 0] * page_size + in) * KVD + goff;
				}
				off = ok ? off : 0; // past the keys: zeros, from a valid address
				cp16(Ks + i * RS, kc + off, ok);
				cp16(Vs + i * RS, vc + off, ok);
			}
			mb_cp_arrive(full + st);
		}
		cp_wait<0>(); // no copy outlives the block
		return;
	}
	const int wr0 = qt0 + wg * 64, wmin = p0 + wr0 + wq * 16;
	const bf16_t *Qw = Qs + wg * 64 * 64;
	float o[64], s[32], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f}, c[2];
	u32 pa[16];
#pragma unroll
	for (int i = 0; i < 64; i++) o[i] = 0.f;
	auto tile = [&](int kt) { // tile kt landed; its stage's K
		mb_wait(full + kt % P4_STAGES, kt / P4_STAGES & 1);
		fence_async();
		return KVs + (kt % P4_STAGES) * 2 * P4_TILE;
	};
	auto qk = [&](const bf16_t *Ks) {
#pragma unroll
		for (int kk = 0; kk < HEAD_DIM / 16; kk++)
			wg_ss<64>(s, wg_desc(Qw + (kk >> 2) * P4_BQ * 64 + (kk & 3) * 16, 16, 1024),
				wg_desc(Ks + (kk >> 2) * P4_BK * 64 + (kk & 3) * 16, 16, 1024), kk);
		wg_commit();
	};
	auto pv = [&](const bf16_t *Ks) {
#pragma unroll
		for (int kk = 0; kk < P4_BK / 16; kk++) wg_rs128(o, pa + 4 * kk, wg_desc(Ks + P4_TILE + kk * 16 * 64, P4_BK * 128, 1024));
		wg_commit();
	};
	auto softmax = [&](int k0) {
#pragma unroll
		for (int hf = 0; hf < 2; hf++) {
			const int lim = wmin + gr + 8 * hf - k0 - 2 * tg;
			float mx = NEG_INF;
#pragma unroll
			for (int nb = 0; nb < P4_BK / 8; nb++)
#pragma unroll
				for (int e = 0; e < 2; e++) {
					float &v = s[4 * nb + 2 * hf + e];
					v = 8 * nb + e > lim ? NEG_INF : v;
					mx = fmaxf(mx, v);
				}
			mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
			mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
			const float mn = fmaxf(m[hf], mx * scale_log2);
			c[hf] = ex2(m[hf] - mn);
			float sum = 0.f;
#pragma unroll
			for (int i = 0; i < P4_BK / 4; i++) {
				const int j = 4 * (i >> 1) + 2 * hf + (i & 1);
				float p = ex2(fmaf(s[j], scale_log2, -mn));
				s[j] = p;
				sum += p;
			}
			l[hf] = l[hf] * c[hf] + sum;
			m[hf] = mn;
		}
	};
	auto pack = [&]() {
#pragma unroll
		for (int kk = 0; kk < P4_BK / 16; kk++) {
			pa[4 * kk] = pack_bf16(s[8 * kk], s[8 * kk + 1]);
			pa[4 * kk + 1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
			pa[4 * kk + 2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
			pa[4 * kk + 3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
		}
	};
	const bf16_t *Kp = tile(0);
	wg_fence();
	qk(Kp);
	wg_wait<0>();
	wg_hold(s);
	softmax(0);
	pack();
	for (int kt = 1; kt < nkt; kt++) {
		const bf16_t *Ks = tile(kt);
		wg_fence();
		qk(Ks);
		pv(Kp);
		wg_wait<1>();
		wg_hold(s);
		softmax(kt * P4_BK);
		wg_wait<0>();
		wg_hold(o);
		mb_arrive(empty + (kt - 1) % P4_STAGES); // tile kt-1 read
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++) {
			o[4 * nd] *= c[0];
			o[4 * nd + 1] *= c[0];
			o[4 * nd + 2] *= c[1];
			o[4 * nd + 3] *= c[1];
		}
		pack();
		Kp = Ks;
	}
	wg_fence();
	pv(Kp); // the last tile's
	wg_wait<0>();
	wg_hold(o);
	bf16_t *ob = out + (long long)qstart[b] * QD + (long long)h * HEAD_DIM;
	flash_store(ob, QD, wr0 + wq * 16, L, l, [&](int nd, int i) { return o[4 * nd + i]; });
}

// wgmma_probe (TestWgmmaProbe): one warpgroup, a and bm [64][HEAD_DIM] bf16
// row-major, copied into the core-matrix layout. mode 0: d [64][64] = a .
// bm^T as attn_prefill4's S (both K-major); mode 1: d [64][HEAD_DIM] =
// a[:, :64] . bm as its P.V (A from registers, bm N-major).
extern "C" __global__ void __launch_bounds__(128) wgmma_probe(float *d, const bf16_t *a, const bf16_t *bm, int mode) {
	bf16_t *As = sw_base(), *Bs = As + 64 * HEAD_DIM;
	const int tid = threadIdx.x, wq = tid >> 5, lane = tid & 31, gr = lane >> 2, tg = lane & 3;
	for (int i = tid; i < 64 * HEAD_DIM; i += 128) {
		As[sw_off(64, i / HEAD_DIM, i % HEAD_DIM)] = a[i];
		Bs[sw_off(64, i / HEAD_DIM, i % HEAD_DIM)] = bm[i];
	}
	fence_async();
	__syncthreads();
	if (mode == 0) {
		float s[32];
		wg_fence();
#pragma unroll
		for (int kk = 0; kk < HEAD_DIM / 16; kk++)
			wg_ss<64>(s, wg_desc(As + (kk >> 2) * 64 * 64 + (kk & 3) * 16, 16, 1024),
				wg_desc(Bs + (kk >> 2) * 64 * 64 + (kk & 3) * 16, 16, 1024), kk);
		wg_commit();
		wg_wait<0>();
		wg_hold(s);
		for (int j = 0; j < 8; j++)
			for (int i = 0; i < 4; i++)
				d[(wq * 16 + gr + 8 * (i >> 1)) * 64 + j * 8 + 2 * tg + (i & 1)] = s[4 * j + i];
		return;
	}
	float o[64];
	u32 pa[16];
	for (int i = 0; i < 64; i++) o[i] = 0.f;
	const bf16_t *ar = a + (wq * 16 + gr) * HEAD_DIM;
	for (int kk = 0; kk < 4; kk++)
		for (int i = 0; i < 4; i++) { // rows gr, gr+8; keys 16kk + 2tg (+8)
			const bf16_t *x = ar + (i & 1) * 8 * HEAD_DIM + 16 * kk + 2 * tg + (i >> 1) * 8;
			pa[4 * kk + i] = (u32)x[0] | (u32)x[1] << 16;
		}
	wg_fence();
#pragma unroll
	for (int kk = 0; kk < 4; kk++) {
		wg_rs128(o, pa + 4 * kk, wg_desc(Bs + kk * 16 * 64, 64 * 128, 1024));
	}
	wg_commit();
	wg_wait<0>();
	wg_hold(o);
	for (int j = 0; j < 16; j++)
		for (int i = 0; i < 4; i++)
			d[(wq * 16 + gr + 8 * (i >> 1)) * HEAD_DIM + j * 8 + 2 * tg + (i & 1)] = o[4 * j + i];
}
#endif
