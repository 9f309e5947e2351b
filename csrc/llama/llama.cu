// llama.cu: the Llama forward kernels of the CUDA model backend
// (internal/compute/cuda). Compiled at run time by NVRTC with no headers:
//   -DHEAD_DIM=n     elements per attention head (a multiple of 8)
//   -DUSE_BF16=0|1   storage type T of weights, KV cache and GEMM inputs
//   -DGQA_GROUP=n    query heads per KV head
//   -DATT_SPLIT=n    keys per split of the split-K attention kernel
//   -DATT_THREADS=n  threads of that kernel (a multiple of HEAD_DIM)
// The residual stream and all reductions are fp32. Every reduction has a
// fixed order that depends only on the sequence itself, never on the batch.
// testdata/llama_emu.cpp runs the decode GEMVs on the host
// (TestGEMV2Emulated); the parts in inline PTX build only for the GPU.

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

#if USE_BF16
typedef bf16_t T;
#else
typedef float T;
#endif

#define NEG_INF __int_as_float(0xff800000)
#define SC_LEN (ATT_SPLIT > ATT_THREADS ? ATT_SPLIT : ATT_THREADS)

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ bf16_t f2bf(float f) {
	u32 u = __float_as_uint(f);
	if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (bf16_t)(u >> 16);
}
__device__ __forceinline__ float ld(const float *p, long long i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t *p, long long i) { return bf2f(p[i]); }
__device__ __forceinline__ void st(float *p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t *p, long long i, float v) { p[i] = f2bf(v); }

#include "qkn.cuh"

// load8 reads 8 consecutive elements (16-byte aligned for bf16, 32 for f32).
__device__ __forceinline__ void load8(const float *p, float *o) {
	float4 a = *(const float4 *)p, b = *(const float4 *)(p + 4);
	o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
	o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void load8(const bf16_t *p, float *o) {
	uint4 a = *(const uint4 *)p;
	o[0] = __uint_as_float(a.x << 16); o[1] = __uint_as_float(a.x & 0xffff0000u);
	o[2] = __uint_as_float(a.y << 16); o[3] = __uint_as_float(a.y & 0xffff0000u);
	o[4] = __uint_as_float(a.z << 16); o[5] = __uint_as_float(a.z & 0xffff0000u);
	o[6] = __uint_as_float(a.w << 16); o[7] = __uint_as_float(a.w & 0xffff0000u);
}

// store8 writes 8 consecutive elements (16-byte aligned for bf16, 32 for f32);
// bf16 rounds as st() does. store2: 2 elements (4- / 8-byte aligned).
__device__ __forceinline__ void store8(float *p, const float *v) {
	float4 a, b;
	a.x = v[0]; a.y = v[1]; a.z = v[2]; a.w = v[3];
	b.x = v[4]; b.y = v[5]; b.z = v[6]; b.w = v[7];
	*(float4 *)p = a;
	*(float4 *)(p + 4) = b;
}
__device__ __forceinline__ void store8(bf16_t *p, const float *v) {
	uint4 a;
	a.x = (u32)f2bf(v[0]) | ((u32)f2bf(v[1]) << 16);
	a.y = (u32)f2bf(v[2]) | ((u32)f2bf(v[3]) << 16);
	a.z = (u32)f2bf(v[4]) | ((u32)f2bf(v[5]) << 16);
	a.w = (u32)f2bf(v[6]) | ((u32)f2bf(v[7]) << 16);
	*(uint4 *)p = a;
}
__device__ __forceinline__ void store2(float *p, float a, float b) {
	float2 v;
	v.x = a;
	v.y = b;
	*(float2 *)p = v;
}
__device__ __forceinline__ void store2(bf16_t *p, float a, float b) {
	*(u32 *)p = (u32)f2bf(a) | ((u32)f2bf(b) << 16);
}

// block_sum and block_max: every thread gets the result; fixed order.
// blockDim.x must be a multiple of 32; red holds 32 floats.
__device__ float block_sum(float v, float *red) {
	for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
	int w = threadIdx.x >> 5, l = threadIdx.x & 31;
	__syncthreads();
	if (l == 0) red[w] = v;
	__syncthreads();
	v = l < (int)(blockDim.x >> 5) ? red[l] : 0.f;
	for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}
__device__ float block_max(float v, float *red) {
	for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	int w = threadIdx.x >> 5, l = threadIdx.x & 31;
	__syncthreads();
	if (l == 0) red[w] = v;
	__syncthreads();
	v = l < (int)(blockDim.x >> 5) ? red[l] : NEG_INF;
	for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
	return v;
}

// Programmatic dependent launch (sm_90): pdl_trigger lets the next kernel
// on the stream, when launched with programmatic serialization
// (Stream.LaunchPDL), start once every block of this one has triggered;
// pdl_wait, in a kernel so launched, waits for the kernels ahead of it to
// finish and their writes to be visible (a no-op otherwise). A kernel
// launched that way touches nothing the kernels ahead of it use before
// pdl_wait, and every one of its blocks runs pdl_wait.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// embed: x[t] = table[tok[t]] (fp32 residual stream). grid n, any block.
extern "C" __global__ void embed(float *x, const T *table, const int *tok, int dim) {
	pdl_trigger();
	int t = blockIdx.x;
	const T *row = table + (long long)tok[t] * dim;
	for (int i = threadIdx.x; i < dim; i += blockDim.x) x[(long long)t * dim + i] = ld(row, i);
}

// rmsnorm: out[r] = w * (x[src] / rms(x[src])), src = rows ? rows[r] : r.
// grid rows, block a multiple of 32 (at most 1024) that the Go side picks
// from dim alone (rmsThreads), so a row's reduction order never depends on
// the batch. With dim % 8 == 0 each thread holds up to RMS_CHUNKS 8-element
// chunks of x and w in registers, all loads issued before the reduction (one
// memory round trip per row), and stores 16-byte (bf16) / 32-byte (f32)
// chunks; chunks beyond RMS_CHUNKS * blockDim (dim > 16384 at 1024 threads)
// are read again. Other dims take the scalar path.
#define RMS_CHUNKS 2
extern "C" __global__ void __launch_bounds__(1024) rmsnorm(T *out, const float *x, const float *w, const int *rows,
	int dim, float eps) {
	__shared__ float red[32];
	pdl_trigger();
	int r = blockIdx.x;
	int src = rows ? rows[r] : r;
	const float *xr = x + (long long)src * dim;
	T *orow = out + (long long)r * dim;
	if ((dim & 7) != 0) {
		float ss = 0.f;
		for (int i = threadIdx.x; i < dim; i += blockDim.x) {
			float v = xr[i];
			ss += v * v;
		}
		ss = block_sum(ss, red);
		float sc = 1.0f / sqrtf(ss / (float)dim + eps);
		for (int i = threadIdx.x; i < dim; i += blockDim.x) st(orow, i, w[i] * (sc * xr[i]));
		return;
	}
	int nc = dim >> 3, nt = blockDim.x;
	float xv[RMS_CHUNKS][8], wv[RMS_CHUNKS][8];
#pragma unroll
	for (int k = 0; k < RMS_CHUNKS; k++) {
		int c = threadIdx.x + k * nt;
		if (c < nc) {
			load8(xr + c * 8, xv[k]);
			load8(w + c * 8, wv[k]);
		}
	}
	float ss = 0.f;
#pragma unroll
	for (int k = 0; k < RMS_CHUNKS; k++) {
		int c = threadIdx.x + k * nt;
		if (c < nc) {
#pragma unroll
			for (int e = 0; e < 8; e++) ss += xv[k][e] * xv[k][e];
		}
	}
	for (int c = threadIdx.x + RMS_CHUNKS * nt; c < nc; c += nt) {
		float v[8];
		load8(xr + c * 8, v);
#pragma unroll
		for (int e = 0; e < 8; e++) ss += v[e] * v[e];
	}
	ss = block_sum(ss, red);
	float sc = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma unroll
	for (int k = 0; k < RMS_CHUNKS; k++) {
		int c = threadIdx.x + k * nt;
		if (c < nc) {
			float o[8];
#pragma unroll
			for (int e = 0; e < 8; e++) o[e] = wv[k][e] * (sc * xv[k][e]);
			store8(orow + c * 8, o);
		}
	}
	for (int c = threadIdx.x + RMS_CHUNKS * nt; c < nc; c += nt) {
		float v[8], ww[8], o[8];
		load8(xr + c * 8, v);
		load8(w + c * 8, ww);
#pragma unroll
		for (int e = 0; e < 8; e++) o[e] = ww[e] * (sc * v[e]);
		store8(orow + c * 8, o);
	}
}

// rope_table: tab[p][i] = (cos, sin)(p * inv_freq[i]) for p < npos, computed
// in double and rounded to f32 (as the CPU backend's tables): run once at
// load time. Any grid, any block.
extern "C" __global__ void rope_table(float2 *tab, const double *inv_freq, int npos) {
	const int half = HEAD_DIM / 2;
	long long total = (long long)npos * half;
	for (long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x; k < total;
	     k += (long long)gridDim.x * blockDim.x) {
		int p = (int)(k / half), i = (int)(k % half);
		double a = (double)p * inv_freq[i];
		float2 v;
		v.x = (float)cos(a);
		v.y = (float)sin(a);
		tab[k] = v;
	}
}

// rope_kv: for token t, adds the bias to its q, k, v (row of qkv, fp32),
// rotates q and k at position pos[t], writes q to q[t] and k, v into the
// layer's K and V buffers at element offset slot[t]. cos/sin come from the
// f32 table tab (rope_table) for positions below ntab, else are computed as
// rope_table does. Grid (n tokens, ceil(items/blockDim)); one thread per item
// of a token: (nheads+nkv)*HEAD_DIM/2 rotated pairs, then nkv*HEAD_DIM/2
// pairs of v elements. A token with slot < 0 (a padding row of a captured
// decode batch) writes its q but no KV.
extern "C" __global__ void rope_kv(T *q, T *kc, T *vc, const float *qkv, const float *bias, const int *pos,
	const long long *slot, const float2 *tab, const double *inv_freq, int ntab, int nheads, int nkv,
	int interleaved) {
	const int half = HEAD_DIM / 2;
	int t = blockIdx.x;
	int j = blockIdx.y * blockDim.x + threadIdx.x;
	int QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM, W = QD + 2 * KVD;
	int npairs = (nheads + nkv) * half;
	const float *row = qkv + (long long)t * W;
	if (j < npairs) {
		int h = j / half, i = j - h * half;
		int base = h * HEAD_DIM, ia, ib;
		if (interleaved) {
			ia = base + 2 * i;
			ib = ia + 1;
		} else {
			ia = base + i;
			ib = base + i + half;
		}
		float c, sv;
		rope_cs(pos[t], i, tab, inv_freq, ntab, c, sv);
		float a = row[ia], b = row[ib];
		if (bias) {
			a += bias[ia];
			b += bias[ib];
		}
		float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sv));
		float rb = __fadd_rn(__fmul_rn(a, sv), __fmul_rn(b, c));
		if (h < nheads) {
			st(q, (long long)t * QD + ia, ra);
			st(q, (long long)t * QD + ib, rb);
		} else {
			long long s = slot[t];
			if (s >= 0) {
				st(kc, s + (ia - QD), ra);
				st(kc, s + (ib - QD), rb);
			}
		}
	} else if (j < npairs + KVD / 2 && slot[t] >= 0) {
		int e = 2 * (j - npairs);
		float2 v = *(const float2 *)(row + QD + KVD + e);
		if (bias) {
			float2 bb = *(const float2 *)(bias + QD + KVD + e);
			v.x += bb.x;
			v.y += bb.y;
		}
		store2(vc + slot[t] + e, v.x, v.y);
	}
}

// attn_split: split-K attention for single query tokens (decode) and, in
// fp32 mode, for every token. Block (split, kv head, query qi0+z) computes,
// for the GQA_GROUP query heads of that kv head, the softmax-weighted sum of
// values over keys [split*ATT_SPLIT, min(+ATT_SPLIT, pos+1)) with its max m
// and sum l, into part_o[z][head][split][d] and part_ml[z][head][split][2].
// Queries: q row qrow[qi], position pos[qi], page table pages[ptoff[qi]..].
// A sliding window (window > 0) keeps the keys [pos+1-window, pos]: splits
// wholly before it write nothing (attn_combine, given the same window,
// skips them).
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_split(float *part_o, float *part_ml, const T *q,
	const T *kc, const T *vc, const int *qrow, const int *pos, const int *ptoff, const int *pages, int page_size,
	int nsplit, int nheads, int nkv, int qi0, float div, int window) {
	__shared__ float qs[GQA_GROUP][HEAD_DIM];
	__shared__ float sc[GQA_GROUP][SC_LEN];
	__shared__ float red[32];
	int split = blockIdx.x, g = blockIdx.y, z = blockIdx.z, qi = qi0 + z;
	int npos = pos[qi] + 1;
	int k0 = split * ATT_SPLIT;
	if (k0 >= npos) return;
	int k1 = min(k0 + ATT_SPLIT, npos);
	if (window > 0) k0 = max(k0, npos - window);
	if (k0 >= k1) return;
	int len = k1 - k0;
	int QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM;
	const int *pt = pages + ptoff[qi];
	const T *qb = q + (long long)qrow[qi] * QD + (long long)g * GQA_GROUP * HEAD_DIM;
	for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += blockDim.x) qs[i / HEAD_DIM][i % HEAD_DIM] = ld(qb, i);
	__syncthreads();
	for (int j = threadIdx.x; j < len; j += blockDim.x) {
		int key = k0 + j;
		const T *kr = kc + (long long)pt[key / page_size] * page_size * KVD + (long long)(key % page_size) * KVD +
			g * HEAD_DIM;
		float acc[GQA_GROUP];
#pragma unroll
		for (int h = 0; h < GQA_GROUP; h++) acc[h] = 0.f;
#pragma unroll 4
		for (int d = 0; d < HEAD_DIM; d += 8) {
			float kv[8];
			load8(kr + d, kv);
#pragma unroll
			for (int h = 0; h < GQA_GROUP; h++)
#pragma unroll
				for (int e = 0; e < 8; e++) acc[h] += qs[h][d + e] * kv[e];
		}
#pragma unroll
		for (int h = 0; h < GQA_GROUP; h++) sc[h][j] = acc[h] / div;
	}
	__syncthreads();
	float mh[GQA_GROUP];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) {
		float mx = NEG_INF;
		for (int j = threadIdx.x; j < len; j += blockDim.x) mx = fmaxf(mx, sc[h][j]);
		mh[h] = block_max(mx, red);
	}
	float lh[GQA_GROUP];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) {
		float s = 0.f;
		for (int j = threadIdx.x; j < len; j += blockDim.x) {
			float e = expf(sc[h][j] - mh[h]);
			sc[h][j] = e;
			s += e;
		}
		lh[h] = block_sum(s, red);
	}
	__syncthreads();
	const int nsub = ATT_THREADS / HEAD_DIM;
	int d = threadIdx.x % HEAD_DIM, sub = threadIdx.x / HEAD_DIM;
	float o[GQA_GROUP];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) o[h] = 0.f;
	for (int j = sub; j < len; j += nsub) {
		int key = k0 + j;
		float v = ld(vc, (long long)pt[key / page_size] * page_size * KVD + (long long)(key % page_size) * KVD +
			g * HEAD_DIM + d);
#pragma unroll
		for (int h = 0; h < GQA_GROUP; h++) o[h] += sc[h][j] * v;
	}
	int nh = nheads;
	if (nsub > 1) {
		__syncthreads();
		float *os = &sc[0][0]; // [nsub][GQA_GROUP][HEAD_DIM] = ATT_THREADS*GQA_GROUP <= GQA_GROUP*SC_LEN floats
#pragma unroll
		for (int h = 0; h < GQA_GROUP; h++) os[(sub * GQA_GROUP + h) * HEAD_DIM + d] = o[h];
		__syncthreads();
		if (sub == 0) {
#pragma unroll
			for (int h = 0; h < GQA_GROUP; h++) {
				float a = os[h * HEAD_DIM + d];
				for (int s2 = 1; s2 < nsub; s2++) a += os[(s2 * GQA_GROUP + h) * HEAD_DIM + d];
				o[h] = a;
			}
		}
	}
	if (sub == 0) {
#pragma unroll
		for (int h = 0; h < GQA_GROUP; h++) {
			long long base = ((long long)z * nh + g * GQA_GROUP + h) * nsplit + split;
			part_o[base * HEAD_DIM + d] = o[h];
			if (d == 0) {
				part_ml[base * 2] = mh[h];
				part_ml[base * 2 + 1] = lh[h];
			}
		}
	}
}

// comb_range is the splits s0 .. ns-1 that attn_combine merges for a
// query at position p (those the sliding window reaches when window > 0).
__device__ __forceinline__ void comb_range(int p, int window, int &s0, int &ns) {
	ns = (p + ATT_SPLIT) / ATT_SPLIT;
	s0 = window > 0 ? max(0, p + 1 - window) / ATT_SPLIT : 0;
}
// comb_stats: over splits s0 .. ns-1 of one head (ml its (m, l) pairs), M
// the largest m and L the l rescaled to M, summed in split order.
__device__ __forceinline__ void comb_stats(const float *ml, int s0, int ns, float &M, float &L) {
	M = NEG_INF;
	for (int s = s0; s < ns; s++) M = fmaxf(M, ml[s * 2]);
	L = 0.f;
	for (int s = s0; s < ns; s++) L += ml[s * 2 + 1] * expf(ml[s * 2] - M);
}

// attn_combine merges the splits of attn_split into out[qrow[qi]][head]
// (those the sliding window reaches when window > 0). grid (heads, queries
// of this launch), block HEAD_DIM (or fewer) threads.
extern "C" __global__ void attn_combine(T *out, const float *part_o, const float *part_ml, const int *qrow,
	const int *pos, int nsplit, int nheads, int qi0, int window) {
	pdl_trigger();
	int h = blockIdx.x, z = blockIdx.y, qi = qi0 + z, s0, ns;
	comb_range(pos[qi], window, s0, ns);
	long long base = ((long long)z * nheads + h) * nsplit;
	float M, L;
	comb_stats(part_ml + base * 2, s0, ns, M, L);
	T *o = out + (long long)qrow[qi] * nheads * HEAD_DIM + h * HEAD_DIM;
	for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
		float a = 0.f;
		for (int s = s0; s < ns; s++) a += part_o[(base + s) * HEAD_DIM + d] * expf(part_ml[(base + s) * 2] - M);
		st(o, d, a / L);
	}
}

#if USE_BF16 && (HEAD_DIM % 16 == 0) && (HEAD_DIM <= 128) && defined(__CUDA_ARCH__) // (inline PTX: not emulated)
// attn_prefill: causal flash attention with bf16 tensor cores
// (mma.sync m16n8k16, fp32 accumulation) over the paged pool, for prefill
// chunks. Block (q tile, head, seq): 4 warps, 16 query rows each; keys in
// tiles of 64 aligned to position 0, so a row's arithmetic does not depend on
// how its prompt was chunked or batched.
#define FA_BQ 64
#define FA_BK 64
#define KPAD (HEAD_DIM + 8)
#define VPAD (FA_BK + 8)

__device__ __forceinline__ void mma16816(float *c, const u32 *a, const u32 *b) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
		     "{%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
	u32 r;
	asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
	return r;
}

extern "C" __global__ void __launch_bounds__(128) attn_prefill(bf16_t *out, const bf16_t *q, const bf16_t *kc,
	const bf16_t *vc, const int *qstart, const int *qlen, const int *pos0, const int *ptoff, const int *pages,
	int page_size, int nheads, int nkv, float scale_log2) {
	__shared__ __align__(16) bf16_t Ks[FA_BK * KPAD];
	__shared__ __align__(16) bf16_t Vt[HEAD_DIM * VPAD];
	int b = blockIdx.z, h = blockIdx.y;
	int L = qlen[b], qt0 = blockIdx.x * FA_BQ;
	if (qt0 >= L) return;
	int g = h / GQA_GROUP;
	int QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM;
	int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
	int p0 = pos0[b];
	int r0 = qt0 + warp * 16 + gid, r1 = r0 + 8;
	const bf16_t *qb = q + (long long)qstart[b] * QD + h * HEAD_DIM;
	int rr0 = min(r0, L - 1), rr1 = min(r1, L - 1);
	u32 qf[HEAD_DIM / 16][4];
#pragma unroll
	for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
		qf[kk][0] = *(const u32 *)(qb + (long long)rr0 * QD + kk * 16 + tig * 2);
		qf[kk][1] = *(const u32 *)(qb + (long long)rr1 * QD + kk * 16 + tig * 2);
		qf[kk][2] = *(const u32 *)(qb + (long long)rr0 * QD + kk * 16 + 8 + tig * 2);
		qf[kk][3] = *(const u32 *)(qb + (long long)rr1 * QD + kk * 16 + 8 + tig * 2);
	}
	float o[HEAD_DIM / 8][4];
#pragma unroll
	for (int nd = 0; nd < HEAD_DIM / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
	float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
	int qp0 = p0 + r0, qp1 = p0 + r1;
	int kend = p0 + min(qt0 + FA_BQ, L);
	const int *pt = pages + ptoff[b];
	const int CH = HEAD_DIM / 8;
	for (int k0 = 0; k0 < kend; k0 += FA_BK) {
		__syncthreads();
		// K: 16 threads per key row (coalesced loads, conflict-free 16-byte
		// stores). V is transposed into Vt with the key fastest across a warp,
		// so the 2-byte stores of a warp fill consecutive words (no conflicts).
		for (int c = threadIdx.x; c < FA_BK * CH; c += 128) {
			int r = c / CH, cc = (c % CH) * 8;
			int key = k0 + r;
			uint4 kv4;
			kv4.x = kv4.y = kv4.z = kv4.w = 0u;
			if (key < kend)
				kv4 = *(const uint4 *)(kc + (long long)pt[key / page_size] * page_size * KVD +
					(long long)(key % page_size) * KVD + g * HEAD_DIM + cc);
			*(uint4 *)(Ks + r * KPAD + cc) = kv4;
		}
		for (int c = threadIdx.x; c < FA_BK * CH; c += 128) {
			int r = c % FA_BK, cc = (c / FA_BK) * 8;
			int key = k0 + r;
			uint4 vv4;
			vv4.x = vv4.y = vv4.z = vv4.w = 0u;
			if (key < kend) {
				long long off = (long long)pt[key / page_size] * page_size * KVD +
					(long long)(key % page_size) * KVD + g * HEAD_DIM + cc;
				vv4 = *(const uint4 *)(vc + off);
			}
			Vt[(cc + 0) * VPAD + r] = (bf16_t)(vv4.x & 0xffffu);
			Vt[(cc + 1) * VPAD + r] = (bf16_t)(vv4.x >> 16);
			Vt[(cc + 2) * VPAD + r] = (bf16_t)(vv4.y & 0xffffu);
			Vt[(cc + 3) * VPAD + r] = (bf16_t)(vv4.y >> 16);
			Vt[(cc + 4) * VPAD + r] = (bf16_t)(vv4.z & 0xffffu);
			Vt[(cc + 5) * VPAD + r] = (bf16_t)(vv4.z >> 16);
			Vt[(cc + 6) * VPAD + r] = (bf16_t)(vv4.w & 0xffffu);
			Vt[(cc + 7) * VPAD + r] = (bf16_t)(vv4.w >> 16);
		}
		__syncthreads();
		float s[FA_BK / 8][4];
#pragma unroll
		for (int nb = 0; nb < FA_BK / 8; nb++) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
		for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
#pragma unroll
			for (int nb = 0; nb < FA_BK / 8; nb++) {
				const bf16_t *kp = Ks + (nb * 8 + gid) * KPAD + kk * 16 + tig * 2;
				u32 bf[2];
				bf[0] = *(const u32 *)kp;
				bf[1] = *(const u32 *)(kp + 8);
				mma16816(s[nb], qf[kk], bf);
			}
		}
		float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
		for (int nb = 0; nb < FA_BK / 8; nb++) {
#pragma unroll
			for (int e = 0; e < 2; e++) {
				int key = k0 + nb * 8 + tig * 2 + e;
				float v0 = s[nb][e] * scale_log2, v1 = s[nb][2 + e] * scale_log2;
				if (key > qp0) v0 = NEG_INF;
				if (key > qp1) v1 = NEG_INF;
				s[nb][e] = v0;
				s[nb][2 + e] = v1;
				mx0 = fmaxf(mx0, v0);
				mx1 = fmaxf(mx1, v1);
			}
		}
		mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
		mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
		mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
		mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
		float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
		float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
		l0 *= c0;
		l1 *= c1;
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++) {
			o[nd][0] *= c0;
			o[nd][1] *= c0;
			o[nd][2] *= c1;
			o[nd][3] *= c1;
		}
#pragma unroll
		for (int nb = 0; nb < FA_BK / 8; nb++) {
			s[nb][0] = exp2f(s[nb][0] - mn0);
			s[nb][1] = exp2f(s[nb][1] - mn0);
			s[nb][2] = exp2f(s[nb][2] - mn1);
			s[nb][3] = exp2f(s[nb][3] - mn1);
			l0 += s[nb][0] + s[nb][1];
			l1 += s[nb][2] + s[nb][3];
		}
		m0 = mn0;
		m1 = mn1;
#pragma unroll
		for (int kk = 0; kk < FA_BK / 16; kk++) {
			u32 pa[4];
			pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
			pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
			pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
			pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
			for (int nd = 0; nd < HEAD_DIM / 8; nd++) {
				const bf16_t *vp = Vt + (nd * 8 + gid) * VPAD + kk * 16 + tig * 2;
				u32 bf[2];
				bf[0] = *(const u32 *)vp;
				bf[1] = *(const u32 *)(vp + 8);
				mma16816(o[nd], pa, bf);
			}
		}
	}
	l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
	l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
	l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
	l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
	float i0 = 1.f / l0, i1 = 1.f / l1;
	bf16_t *ob = out + (long long)qstart[b] * QD + h * HEAD_DIM;
	if (r0 < L) {
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++)
			*(u32 *)(ob + (long long)r0 * QD + nd * 8 + tig * 2) = pack_bf16(o[nd][0] * i0, o[nd][1] * i0);
	}
	if (r1 < L) {
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++)
			*(u32 *)(ob + (long long)r1 * QD + nd * 8 + tig * 2) = pack_bf16(o[nd][2] * i1, o[nd][3] * i1);
	}
}
#endif

// silu_mul: h[t][i] = silu(gu[t][i]) * gu[t][hidden+i]. Grid (n tokens,
// ceil(hidden/(8*blockDim))) when hidden % 8 == 0: 8 elements per thread,
// 16-byte bf16 (32-byte f32) loads and stores; else (n, ceil(hidden/blockDim)),
// one element per thread. No 64-bit index arithmetic per element.
extern "C" __global__ void silu_mul(T *h, const T *gu, int hidden) {
	int t = blockIdx.x;
	int j = blockIdx.y * blockDim.x + threadIdx.x;
	const T *g = gu + (long long)t * 2 * hidden;
	T *o = h + (long long)t * hidden;
	if ((hidden & 7) == 0) {
		int i = j * 8;
		if (i >= hidden) return;
		float gv[8], uv[8], r[8];
		load8(g + i, gv);
		load8(g + hidden + i, uv);
#pragma unroll
		for (int e = 0; e < 8; e++) r[e] = gv[e] * (1.0f / (1.0f + expf(-gv[e]))) * uv[e];
		store8(o + i, r);
		return;
	}
	if (j >= hidden) return;
	float gg = ld(g, j), u = ld(g, hidden + j);
	st(o, j, gg * (1.0f / (1.0f + expf(-gg))) * u);
}

// gemm_*: Y[n][out] = X[n][in] . W[out][in]^T (+ beta*Y), fp32 accumulation
// in plain k order: an output's arithmetic depends only on its own row and
// column, never on n (the batch-invariant path). Block 256 threads, a 64x64
// tile of (tokens x outputs), 4x4 per thread.
template <typename TO>
__device__ __forceinline__ void gemm_tile(TO *Y, const T *X, const T *W, int n, int out, int in, float beta) {
	__shared__ float Xs[16][65], Ws[16][65];
	int bo = blockIdx.x * 64, bn = blockIdx.y * 64;
	int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
	float acc[4][4];
#pragma unroll
	for (int i = 0; i < 4; i++)
#pragma unroll
		for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
	for (int k0 = 0; k0 < in; k0 += 16) {
		for (int i = threadIdx.x; i < 1024; i += 256) {
			int r = i / 16, kk = i % 16, k = k0 + kk;
			Xs[kk][r] = (bn + r < n && k < in) ? ld(X, (long long)(bn + r) * in + k) : 0.f;
			Ws[kk][r] = (bo + r < out && k < in) ? ld(W, (long long)(bo + r) * in + k) : 0.f;
		}
		__syncthreads();
#pragma unroll
		for (int kk = 0; kk < 16; kk++) {
			float xv[4], wv[4];
#pragma unroll
			for (int i = 0; i < 4; i++) {
				xv[i] = Xs[kk][ty * 4 + i];
				wv[i] = Ws[kk][tx * 4 + i];
			}
#pragma unroll
			for (int i = 0; i < 4; i++)
#pragma unroll
				for (int j = 0; j < 4; j++) acc[i][j] = fmaf(xv[i], wv[j], acc[i][j]);
		}
		__syncthreads();
	}
#pragma unroll
	for (int i = 0; i < 4; i++) {
		int r = bn + ty * 4 + i;
		if (r >= n) continue;
#pragma unroll
		for (int j = 0; j < 4; j++) {
			int c = bo + tx * 4 + j;
			if (c >= out) continue;
			long long idx = (long long)r * out + c;
			float v = acc[i][j];
			if (beta != 0.f) v = v + beta * ld(Y, idx);
			st(Y, idx, v);
		}
	}
}
extern "C" __global__ void __launch_bounds__(256) gemm_f32out(float *Y, const T *X, const T *W, int n, int out,
	int in, float beta) {
	gemm_tile<float>(Y, X, W, n, out, in, beta);
}
extern "C" __global__ void __launch_bounds__(256) gemm_tout(T *Y, const T *X, const T *W, int n, int out, int in,
	float beta) {
	gemm_tile<T>(Y, X, W, n, out, in, beta);
}

__device__ __forceinline__ float rand_uniform(u64 seed, long long i) {
	u64 z = seed + (u64)i * 0x9E3779B97F4A7C15ull;
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
	z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
	z ^= z >> 31;
	return (float)(z >> 40) * (1.0f / 16777216.0f);
}

// fill_random_t / fill_random_f: p[i] = offset + scale*(2u-1), u uniform in
// [0,1) from a hash of (seed, i): random weights made on the GPU.
extern "C" __global__ void fill_random_t(T *p, long long n, u64 seed, float scale, float offset) {
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
		st(p, i, offset + scale * (2.f * rand_uniform(seed, i) - 1.f));
}
extern "C" __global__ void fill_random_f(float *p, long long n, u64 seed, float scale, float offset) {
	for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
		p[i] = offset + scale * (2.f * rand_uniform(seed, i) - 1.f);
}

// read_bw reads n16 16-byte words (4 loads in flight per thread) and writes
// a value nothing expects, so the loads stay: an HBM read-bandwidth probe.
extern "C" __global__ void read_bw(const uint4 *p, long long n16, u32 *sink) {
	u32 acc = 0;
	long long stride = (long long)gridDim.x * blockDim.x;
	long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
	for (; i + 3 * stride < n16; i += 4 * stride) {
		uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
		acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
	}
	for (; i < n16; i += stride) {
		uint4 a = p[i];
		acc ^= a.x ^ a.y ^ a.z ^ a.w;
	}
	if (acc == 0x9e3779b9u) sink[0] = acc;
}

// ---------------------------------------------------------------------------
// Second-generation kernels (compiled only with -DMC_V2=1; the backend falls
// back to a build without them if NVRTC rejects them).
#if MC_V2
#ifdef __CUDA_ARCH__ // (cudaemu.h has the host's)
extern __shared__ __align__(16) unsigned char dyn_smem[];
#endif
__device__ __forceinline__ u32 smem_u32(const void *p) {
	u32 a;
	asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }\n" : "=r"(a) : "l"(p));
	return a;
}
// ldg_stream: a 16-byte load that does not allocate in L1 (weights streamed once).
__device__ __forceinline__ uint4 ldg_stream(const void *p) {
#ifdef __CUDA_ARCH__
	uint4 r;
	asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
		     : "l"(p));
	return r;
#else
	return *(const uint4 *)p;
#endif
}
// l2_prefetch starts a line towards L2 (nothing on the host).
__device__ __forceinline__ void l2_prefetch(const void *p) {
#ifdef __CUDA_ARCH__
	asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#endif
}
__device__ __forceinline__ void unpack8(uint4 a, float *o) {
	o[0] = __uint_as_float(a.x << 16); o[1] = __uint_as_float(a.x & 0xffff0000u);
	o[2] = __uint_as_float(a.y << 16); o[3] = __uint_as_float(a.y & 0xffff0000u);
	o[4] = __uint_as_float(a.z << 16); o[5] = __uint_as_float(a.z & 0xffff0000u);
	o[6] = __uint_as_float(a.w << 16); o[7] = __uint_as_float(a.w & 0xffff0000u);
}

#if USE_BF16
// gemv_*: Y[t][o] = X[t][:] . W[o][:] (+ beta*Y) for n <= 4 tokens (decode):
// one warp per output row, 16-byte weight loads, 4 in flight per lane, so the
// weights stream at HBM speed from every SM. in % 8 == 0. Block 256 threads.
#define GEMV_MAXN 4
template <typename TO>
__device__ __forceinline__ void gemv_rows(TO *Y, const bf16_t *X, const bf16_t *W, int n, int out, int in, float beta) {
	int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
	if (row >= out) return;
	const bf16_t *w = W + (long long)row * in;
	int nc = in >> 3;
	float acc[GEMV_MAXN];
#pragma unroll
	for (int t = 0; t < GEMV_MAXN; t++) acc[t] = 0.f;
	int c = lane;
	for (; c + 96 < nc; c += 128) {
		uint4 wr[4];
#pragma unroll
		for (int u = 0; u < 4; u++) wr[u] = ldg_stream(w + (c + 32 * u) * 8);
#pragma unroll
		for (int u = 0; u < 4; u++) {
			float wf[8];
			unpack8(wr[u], wf);
#pragma unroll
			for (int t = 0; t < GEMV_MAXN; t++) {
				if (t < n) {
					float xf[8];
					load8(X + (long long)t * in + (c + 32 * u) * 8, xf);
#pragma unroll
					for (int e = 0; e < 8; e++) acc[t] = fmaf(wf[e], xf[e], acc[t]);
				}
			}
		}
	}
	for (; c < nc; c += 32) {
		float wf[8];
		unpack8(ldg_stream(w + c * 8), wf);
#pragma unroll
		for (int t = 0; t < GEMV_MAXN; t++) {
			if (t < n) {
				float xf[8];
				load8(X + (long long)t * in + c * 8, xf);
#pragma unroll
				for (int e = 0; e < 8; e++) acc[t] = fmaf(wf[e], xf[e], acc[t]);
			}
		}
	}
#pragma unroll
	for (int t = 0; t < GEMV_MAXN; t++)
		for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
	if (lane == 0) {
#pragma unroll
		for (int t = 0; t < GEMV_MAXN; t++) {
			if (t < n) {
				long long idx = (long long)t * out + row;
				float v = acc[t];
				if (beta != 0.f) v = v + beta * ld(Y, idx);
				st(Y, idx, v);
			}
		}
	}
}
extern "C" __global__ void __launch_bounds__(256) gemv_f32out(float *Y, const bf16_t *X, const bf16_t *W, int n,
	int out, int in, float beta) {
	gemv_rows<float>(Y, X, W, n, out, in, beta);
}
extern "C" __global__ void __launch_bounds__(256) gemv_tout(bf16_t *Y, const bf16_t *X, const bf16_t *W, int n,
	int out, int in, float beta) {
	gemv_rows<bf16_t>(Y, X, W, n, out, in, beta);
}

// gemv2_*: the decode GEMVs of the fused layer (n <= GEMV_MAXN tokens). Each
// warp computes a unit of two weight rows (16-byte streaming loads, 8 in
// flight per lane), units spread over a grid of any size (grid-stride), and
// finishes the unit in its epilogue:
//   G2_PLAIN  Y[t][r] = dot (+ beta*Y), rows (2u, 2u+1), f32 out
//   G2_ROPE   rows (ia, ib) of one rotated pair of a q or k head, or two
//             adjacent v rows: bias, RoPE at pos[t], q to q[t], k and v into
//             the KV cache at slot[t] (none when slot < 0): rope_kv fused
//   G2_SILU   rows (i, hidden+i) of the gate/up matrix: h[t][i] =
//             silu(g)*u with g, u rounded to T first: silu_mul fused
// With NORM the block first writes rmsnorm(x[rows[t]]) * normw as T into
// shared memory ([n][in], n*in*2 bytes dynamic) and the GEMV reads X there:
// rmsnorm fused. Its sum of squares runs over the first vt threads in the
// order rmsnorm uses with vt threads, so with vt == rmsThreads(in) every
// output equals rmsnorm + gemv_* (+ rope_kv / silu_mul) bit for bit. Each
// lane sums its chunks lane, lane+32, ... in order, as gemv_rows does.
// Block G2_THREADS threads; in % 8 == 0.
#define G2_THREADS 256
#define G2_PLAIN 0
#define G2_ROPE 1
#define G2_SILU 2
struct g2_args {
	const bf16_t *W;
	const bf16_t *X;      // !NORM: [n][in] in global memory
	const float *x;       // NORM: f32 rows, gathered by rows (or 0: row t)
	const float *normw;   // NORM: [in]
	const int *rows;
	float *Y;             // G2_PLAIN
	bf16_t *q, *kc, *vc;  // G2_ROPE
	const float *bias;    // G2_ROPE, may be 0
	const int *pos;
	const long long *slot;
	const float2 *tab;
	const double *inv_freq;
	bf16_t *h;            // G2_SILU
	bf16_t *xo;           // NORM: block 0 also writes the normalised rows here, or 0
	int n, out, in, vt, ntab, nheads, nkv, interleaved;
	int stage; // !NORM: X is first copied to shared memory ([n][in], n*in*2 bytes dynamic)
	int ks;    // warps a unit (1, 2, 4 or 8; (in/8) % ks == 0), each over its ks-th of the chunks
	// gemv2_comb (n 1, with stage): X is attn_combine's output for the
	// pass's one query, merged into shared memory from the splits' partials
	const float *part_o, *part_ml;
	int nsplit, window;
	// gemv2_qkn: the q/k norm weights, and a counter a head (zero between
	// launches) of the units written
	const float *qw, *kw;
	int *hcnt;
	float beta, eps;
};

// g2_rows maps unit u to its two weight rows (r1 < 0: none).
template <int MODE>
__device__ __forceinline__ void g2_rows(const g2_args &a, int u, int &r0, int &r1) {
	if (MODE == G2_PLAIN) {
		r0 = 2 * u;
		r1 = r0 + 1 < a.out ? r0 + 1 : -1;
	} else if (MODE == G2_SILU) {
		r0 = u;
		r1 = a.out + u;
	} else {
		const int half = HEAD_DIM / 2;
		int npairs = (a.nheads + a.nkv) * half;
		if (u < npairs) {
			int hh = u / half, i = u - hh * half, base = hh * HEAD_DIM;
			if (a.interleaved) {
				r0 = base + 2 * i;
				r1 = r0 + 1;
			} else {
				r0 = base + i;
				r1 = base + i + half;
			}
		} else {
			r0 = (a.nheads + a.nkv) * HEAD_DIM + 2 * (u - npairs);
			r1 = r0 + 1;
		}
	}
}

template <int MODE>
__device__ __forceinline__ void g2_epilogue(const g2_args &a, int u, int r0, int r1, int t, float v0, float v1) {
	if (MODE == G2_PLAIN) {
		long long i0 = (long long)t * a.out + r0;
		if (a.beta != 0.f) v0 = v0 + a.beta * a.Y[i0];
		a.Y[i0] = v0;
		if (r1 >= 0) {
			if (a.beta != 0.f) v1 = v1 + a.beta * a.Y[i0 + 1];
			a.Y[i0 + 1] = v1;
		}
	} else if (MODE == G2_SILU) {
		float g = bf2f(f2bf(v0)), up = bf2f(f2bf(v1));
		a.h[(long long)t * a.out + u] = f2bf(g * (1.0f / (1.0f + expf(-g))) * up);
	} else {
		const int half = HEAD_DIM / 2;
		int QD = a.nheads * HEAD_DIM, KVD = a.nkv * HEAD_DIM;
		int npairs = (a.nheads + a.nkv) * half;
		if (a.bias) {
			v0 += a.bias[r0];
			v1 += a.bias[r1];
		}
		long long s = a.slot[t];
		if (u >= npairs) {
			if (s >= 0) {
				st(a.vc, s + (r0 - QD - KVD), v0);
				st(a.vc, s + (r1 - QD - KVD), v1);
			}
			return;
		}
		float c, sv;
		rope_cs(a.pos[t], u % half, a.tab, a.inv_freq, a.ntab, c, sv);
		float ra = __fsub_rn(__fmul_rn(v0, c), __fmul_rn(v1, sv));
		float rb = __fadd_rn(__fmul_rn(v0, sv), __fmul_rn(v1, c));
		if (r0 < QD) {
			st(a.q, (long long)t * QD + r0, ra);
			st(a.q, (long long)t * QD + r1, rb);
		} else if (s >= 0) {
			st(a.kc, s + (r0 - QD), ra);
			st(a.kc, s + (r1 - QD), rb);
		}
	}
}

// g2_norm writes rmsnorm(x[rows[t]]) * normw for t < n into xs as T (and,
// in block 0, into a.xo when set: rmsnorm's output).
__device__ __forceinline__ void g2_norm(const g2_args &a, bf16_t *xs, float *red) {
	int nc = a.in >> 3;
	for (int t = 0; t < a.n; t++) {
		int src = a.rows ? a.rows[t] : t;
		const float *xr = a.x + (long long)src * a.in;
		float ss = 0.f;
		if ((int)threadIdx.x < a.vt) {
			for (int c = threadIdx.x; c < nc; c += a.vt) {
				float v[8];
				load8(xr + c * 8, v);
#pragma unroll
				for (int e = 0; e < 8; e++) ss += v[e] * v[e];
			}
		}
		ss = block_sum(ss, red);
		float sc = 1.0f / sqrtf(ss / (float)a.in + a.eps);
		for (int c = threadIdx.x; c < nc; c += blockDim.x) {
			float v[8], w[8], o[8];
			load8(xr + c * 8, v);
			load8(a.normw + c * 8, w);
#pragma unroll
			for (int e = 0; e < 8; e++) o[e] = w[e] * (sc * v[e]);
			store8(xs + (long long)t * a.in + c * 8, o);
			if (a.xo && blockIdx.x == 0) store8(a.xo + (long long)t * a.in + c * 8, o);
		}
	}
	__syncthreads();
}

// g2_comb writes attn_combine's output for a pass of one query (at a.pos[0],
// in / HEAD_DIM heads, a.nsplit splits a head, at most G2_COMB_S merged;
// in at most G2_COMB_I * 1024) into xs as T, with
// attn_combine's arithmetic: the same bits. The splits' (m, l) pairs are
// loaded once into shared memory and each head's factors exp(m - M)
// computed once; each thread then merges 4 elements of each of its (up to
// G2_COMB_I) groups, two splits' partials in flight.
#define G2_COMB_S 16
#define G2_COMB_H 64
#define G2_COMB_I 4
__device__ __forceinline__ void g2_comb(const g2_args &a, bf16_t *xs) {
	__shared__ float2 cml[G2_COMB_H][G2_COMB_S];
	__shared__ float cf[G2_COMB_H][G2_COMB_S], cl[G2_COMB_H];
	int nh = a.in / HEAD_DIM, s0, ns;
	comb_range(a.pos[0], a.window, s0, ns);
	int m = ns - s0;
	for (int i = threadIdx.x; i < nh * m; i += blockDim.x) {
		int h = i / m, s = i % m;
		cml[h][s] = *(const float2 *)(a.part_ml + ((long long)h * a.nsplit + s0 + s) * 2);
	}
	__syncthreads();
	for (int h = threadIdx.x; h < nh; h += blockDim.x) {
		float M, L;
		comb_stats(&cml[h][0].x, 0, m, M, L);
		cl[h] = L;
		for (int s = 0; s < m; s++) cf[h][s] = expf(cml[h][s].x - M);
	}
	__syncthreads();
	const int tid = threadIdx.x;
	float v[G2_COMB_I][4];
	const float *po[G2_COMB_I];
#pragma unroll
	for (int j = 0; j < G2_COMB_I; j++) {
		int i = min((tid + G2_THREADS * j) * 4, a.in - 4), h = i / HEAD_DIM; // past in: a valid address, unused
		po[j] = a.part_o + ((long long)h * a.nsplit + s0) * HEAD_DIM + i % HEAD_DIM;
		v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
	}
	int jn = 0; // this thread's groups inside in
#pragma unroll
	for (int j = 0; j < G2_COMB_I; j++) jn += (tid + G2_THREADS * j) * 4 < a.in;
	for (int s = 0; s < m; s += 2) {
		float4 p[2][G2_COMB_I];
#pragma unroll
		for (int j = 0; j < G2_COMB_I; j++) {
			if (j < jn) {
				p[0][j] = *(const float4 *)(po[j] + (long long)s * HEAD_DIM);
				if (s + 1 < m) p[1][j] = *(const float4 *)(po[j] + (long long)(s + 1) * HEAD_DIM);
			}
		}
#pragma unroll
		for (int k = 0; k < 2; k++) {
			if (s + k < m) {
#pragma unroll
				for (int j = 0; j < G2_COMB_I; j++) {
					if (j < jn) {
						float f = cf[(tid + G2_THREADS * j) * 4 / HEAD_DIM][s + k];
						v[j][0] += p[k][j].x * f;
						v[j][1] += p[k][j].y * f;
						v[j][2] += p[k][j].z * f;
						v[j][3] += p[k][j].w * f;
					}
				}
			}
		}
	}
#pragma unroll
	for (int j = 0; j < G2_COMB_I; j++) {
		if (j < jn) {
			int i = (tid + G2_THREADS * j) * 4;
			float L = cl[i / HEAD_DIM];
			uint2 o;
			o.x = (u32)f2bf(v[j][0] / L) | (u32)f2bf(v[j][1] / L) << 16;
			o.y = (u32)f2bf(v[j][2] / L) | (u32)f2bf(v[j][3] / L) << 16;
			*(uint2 *)(xs + i) = o;
		}
	}
	__syncthreads();
}

// g2_qkn_done runs after a warp has written unit (rows r0, r0 + 1) of a
// q/k-norm model's QKV rows: the warp that writes a head's last unit (a
// counter a head, reset by it) runs qk_norm_rope's arithmetic
// (qkn_rope_head) over the head for every token, reading the rows from L2.
__device__ __forceinline__ void g2_qkn_done(const g2_args &a, int r0, float *hs) {
	int lane = threadIdx.x & 31, h = r0 / HEAD_DIM;
	__threadfence();
	__syncwarp();
	int last = 0;
	if (lane == 0) last = atomicAdd(&a.hcnt[h], 1) == HEAD_DIM / 2 - 1;
	if (!__shfl_sync(0xffffffffu, last, 0)) return;
	__threadfence();
	for (int t = 0; t < a.n; t++)
		qkn_rope_head<true>(a.q, a.kc, a.vc, a.Y + (long long)t * a.out + (long long)h * HEAD_DIM, a.bias, a.qw, a.kw,
			a.pos[t], a.slot[t], a.tab, a.inv_freq, a.ntab, a.nheads, a.nkv, a.interleaved, a.eps, t, h, hs);
	if (lane == 0) a.hcnt[h] = 0;
}

// g2_fma accumulates one 8-element chunk of two rows against X's chunk.
template <bool NORM>
__device__ __forceinline__ void g2_fma(const g2_args &a, const bf16_t *xs, int c, uint4 wa, uint4 wb, float *acc0,
	float *acc1) {
	float fa[8], fb[8];
	unpack8(wa, fa);
	unpack8(wb, fb);
#pragma unroll
	for (int t = 0; t < GEMV_MAXN; t++) {
		if (t < a.n) {
			float xf[8];
			if (NORM || a.stage)
				unpack8(*(const uint4 *)(xs + (long long)t * a.in + c * 8), xf);
			else
				load8(a.X + (long long)t * a.in + c * 8, xf);
#pragma unroll
			for (int e = 0; e < 8; e++) acc0[t] = fmaf(fa[e], xf[e], acc0[t]);
#pragma unroll
			for (int e = 0; e < 8; e++) acc1[t] = fmaf(fb[e], xf[e], acc1[t]);
		}
	}
}


// g2_dot sums a unit's two rows over chunks c0 .. c1-1 (lane, lane+32, ...
// in order, 4 a row in flight), then the warp's lanes by a butterfly: every
// lane gets every sum.
template <bool NORM>
__device__ __forceinline__ void g2_dot(const g2_args &a, const bf16_t *xs, const bf16_t *w0, const bf16_t *w1, int c0,
	int c1, float *acc0, float *acc1) {
	int lane = threadIdx.x & 31;
#pragma unroll
	for (int t = 0; t < GEMV_MAXN; t++) acc0[t] = acc1[t] = 0.f;
	int c = c0 + lane;
	for (; c + 96 < c1; c += 128) {
		uint4 wa[4], wb[4];
#pragma unroll
		for (int u4 = 0; u4 < 4; u4++) {
			wa[u4] = ldg_stream(w0 + (c + 32 * u4) * 8);
			wb[u4] = ldg_stream(w1 + (c + 32 * u4) * 8);
		}
#pragma unroll
		for (int u4 = 0; u4 < 4; u4++) g2_fma<NORM>(a, xs, c + 32 * u4, wa[u4], wb[u4], acc0, acc1);
	}
	for (; c < c1; c += 32) g2_fma<NORM>(a, xs, c, ldg_stream(w0 + c * 8), ldg_stream(w1 + c * 8), acc0, acc1);
#pragma unroll
	for (int t = 0; t < GEMV_MAXN; t++) {
		for (int o = 16; o > 0; o >>= 1) {
			acc0[t] += __shfl_xor_sync(0xffffffffu, acc0[t], o);
			acc1[t] += __shfl_xor_sync(0xffffffffu, acc1[t], o);
		}
	}
}

// gemv2 over units of work (row pairs, or MODE's units). With SPLIT and
// a.ks > 1 the ks warps of a group share each unit, warp q of the group over
// chunks [q*nc/ks, (q+1)*nc/ks); their sums meet in shared memory and the
// group's first warp adds them in q order and finishes the unit: a unit's
// result depends on ks (fixed by the shape), not on the pass. COMB: X is
// g2_comb's merge (!NORM). QKN (G2_PLAIN, !SPLIT): each head's rows then
// get g2_qkn_done. Without any, the kernel is the plain one.
template <int MODE, bool NORM, bool SPLIT = false, bool COMB = false, bool QKN = false>
__device__ __forceinline__ void gemv2(const g2_args &a, int units) {
	__shared__ float red[32];
	bf16_t *xs = (bf16_t *)dyn_smem;
	const int ks = SPLIT ? a.ks : 1, per = (G2_THREADS / 32) / ks; // units a block takes at once
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, q = warp % ks;
	int nc = a.in >> 3, cq = nc / ks, c0 = q * cq;
	int gw = blockIdx.x * per + warp / ks, nw = gridDim.x * per;
	pdl_trigger();
	// Start the first unit's weights towards L2 while the kernel ahead
	// finishes (launched programmatically) and the block normalises x.
	if (gw < units) {
		int r0, r1;
		g2_rows<MODE>(a, gw, r0, r1);
		const bf16_t *w0 = a.W + (long long)r0 * a.in, *w1 = a.W + (long long)(r1 < 0 ? r0 : r1) * a.in;
#pragma unroll
		for (int u4 = 0; u4 < 4; u4++) {
			int c = c0 + lane + 32 * u4;
			if (c < c0 + cq) {
				l2_prefetch(w0 + c * 8);
				l2_prefetch(w1 + c * 8);
			}
		}
	}
	pdl_wait();
	if (NORM) g2_norm(a, xs, red);
	if (!NORM && COMB) {
		g2_comb(a, xs);
	} else if (!NORM && a.stage) {
		// X read from shared memory, not as an L2 round trip that each
		// chunk's FMAs wait for after its weights arrive.
		for (int i = threadIdx.x; i < a.n * nc; i += G2_THREADS) ((uint4 *)xs)[i] = ((const uint4 *)a.X)[i];
		__syncthreads();
	}
	float acc0[GEMV_MAXN], acc1[GEMV_MAXN];
	if (ks == 1) {
		for (int u = gw; u < units; u += nw) {
			int r0, r1;
			g2_rows<MODE>(a, u, r0, r1);
			const bf16_t *w0 = a.W + (long long)r0 * a.in, *w1 = a.W + (long long)(r1 < 0 ? r0 : r1) * a.in;
			g2_dot<NORM>(a, xs, w0, w1, 0, nc, acc0, acc1);
			// lane t finishes token t
#pragma unroll
			for (int t = 0; t < GEMV_MAXN; t++)
				if (t < a.n && lane == t) g2_epilogue<MODE>(a, u, r0, r1, t, acc0[t], acc1[t]);
			if (QKN) {
				__shared__ float qhs[G2_THREADS / 32][HEAD_DIM];
				g2_qkn_done(a, r0, qhs[warp]);
			}
		}
		return;
	}
	// The loop runs alike in every warp of the block (its barriers).
	__shared__ float kpart[G2_THREADS / 32][GEMV_MAXN][2];
	for (int ub = blockIdx.x * per; ub < units; ub += nw) {
		int u = ub + warp / ks, r0 = 0, r1 = -1;
		if (u < units) {
			g2_rows<MODE>(a, u, r0, r1);
			const bf16_t *w0 = a.W + (long long)r0 * a.in, *w1 = a.W + (long long)(r1 < 0 ? r0 : r1) * a.in;
			g2_dot<NORM>(a, xs, w0, w1, c0, c0 + cq, acc0, acc1);
#pragma unroll
			for (int t = 0; t < GEMV_MAXN; t++)
				if (t < a.n && lane == t) kpart[warp][t][0] = acc0[t], kpart[warp][t][1] = acc1[t];
		}
		__syncthreads();
		if (u < units && q == 0) {
#pragma unroll
			for (int t = 0; t < GEMV_MAXN; t++) {
				if (t < a.n && lane == t) {
					float v0 = kpart[warp][t][0], v1 = kpart[warp][t][1];
					for (int j = 1; j < ks; j++) v0 += kpart[warp + j][t][0], v1 += kpart[warp + j][t][1];
					g2_epilogue<MODE>(a, u, r0, r1, t, v0, v1);
				}
			}
		}
		__syncthreads();
	}
}

// gemv2_plain: Y[t] (f32) = X[t] . W^T + beta*Y[t], X in global memory (wo,
// w2), copied to shared memory first when stage (n*in*2 bytes dynamic); ks
// is ignored. gemv2_plain_ks: the same with each unit over ks warps.
template <bool SPLIT>
__device__ __forceinline__ void g2_plain(float *Y, const bf16_t *X, const bf16_t *W, int n, int out, int in, float beta,
	int stage, int ks) {
	g2_args a = {};
	a.W = W, a.X = X, a.Y = Y, a.n = n, a.out = out, a.in = in, a.beta = beta, a.stage = stage, a.ks = ks;
	gemv2<G2_PLAIN, false, SPLIT>(a, (out + 1) / 2);
}
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_plain(float *Y, const bf16_t *X, const bf16_t *W,
	int n, int out, int in, float beta, int stage, int ks) {
	g2_plain<false>(Y, X, W, n, out, in, beta, stage, ks);
}
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_plain_ks(float *Y, const bf16_t *X, const bf16_t *W,
	int n, int out, int in, float beta, int stage, int ks) {
	g2_plain<true>(Y, X, W, n, out, in, beta, stage, ks);
}
// gemv2_comb: gemv2_plain (n 1, X staged) over attn_combine's output for
// the pass's one query, merged from the attention's partials (part_o,
// part_ml of nsplit splits a head, pos its position, window as
// attn_combine's): no attn_combine launch. Dynamic shared memory in*2 bytes.
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_comb(float *Y, const bf16_t *W, int out, int in, float beta,
	const float *part_o, const float *part_ml, const int *pos, int nsplit, int window, int ks) {
	g2_args a = {};
	a.W = W, a.Y = Y, a.n = 1, a.out = out, a.in = in, a.beta = beta, a.ks = ks;
	a.part_o = part_o, a.part_ml = part_ml, a.pos = pos, a.nsplit = nsplit, a.window = window;
	a.stage = 1; // X read from xs, where g2_comb writes it
	gemv2<G2_PLAIN, false, true, true>(a, (out + 1) / 2);
}
// gemv2_norm: Y[t] (f32) = rmsnorm(x[rows[t]]) * normw . W^T (the logits, a
// q/k-norm model's QKV, the MoE router); xo (or 0) gets the normalised rows;
// ks is ignored. gemv2_norm_ks: the same with each unit over ks warps.
template <bool SPLIT>
__device__ __forceinline__ void g2_normed(float *Y, const float *x, const float *normw, const int *rows, const bf16_t *W,
	int n, int out, int in, int vt, float eps, bf16_t *xo, int ks) {
	g2_args a = {};
	a.W = W, a.x = x, a.normw = normw, a.rows = rows, a.Y = Y, a.n = n, a.out = out, a.in = in, a.vt = vt, a.eps = eps;
	a.xo = xo, a.ks = ks;
	gemv2<G2_PLAIN, true, SPLIT>(a, (out + 1) / 2);
}
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_norm(float *Y, const float *x, const float *normw,
	const int *rows, const bf16_t *W, int n, int out, int in, int vt, float eps, bf16_t *xo, int ks) {
	g2_normed<false>(Y, x, normw, rows, W, n, out, in, vt, eps, xo, ks);
}
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_norm_ks(float *Y, const float *x, const float *normw,
	const int *rows, const bf16_t *W, int n, int out, int in, int vt, float eps, bf16_t *xo, int ks) {
	g2_normed<true>(Y, x, normw, rows, W, n, out, in, vt, eps, xo, ks);
}
// gemv2_qkn: a q/k-norm model's QKV projection (gemv2_norm, rows null, into
// qkv f32) and qk_norm_rope's work on each head as soon as its rows are
// written (its arguments; hcnt: a zeroed counter a head): no qk_norm_rope
// launch, the same bits.
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_qkn(float *qkv, const float *x, const float *normw,
	const bf16_t *W, int n, int in, int vt, float eps, bf16_t *q, bf16_t *kc, bf16_t *vc, const float *bias,
	const float *qw, const float *kw, const int *pos, const long long *slot, const float2 *tab, const double *inv_freq,
	int ntab, int nheads, int nkv, int interleaved, int *hcnt) {
	g2_args a = {};
	a.W = W, a.x = x, a.normw = normw, a.Y = qkv, a.n = n, a.out = (nheads + 2 * nkv) * HEAD_DIM, a.in = in, a.vt = vt;
	a.eps = eps, a.q = q, a.kc = kc, a.vc = vc, a.bias = bias, a.qw = qw, a.kw = kw, a.pos = pos, a.slot = slot;
	a.tab = tab, a.inv_freq = inv_freq, a.ntab = ntab, a.nheads = nheads, a.nkv = nkv, a.interleaved = interleaved;
	a.hcnt = hcnt, a.ks = 1;
	gemv2<G2_PLAIN, true, false, false, true>(a, a.out / 2);
}
// gemv2_qkv: the attention block's rmsnorm, QKV GEMV, bias, RoPE and KV
// write (rope_kv's arguments, in = dim).
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_qkv(bf16_t *q, bf16_t *kc, bf16_t *vc, const float *x,
	const float *normw, const bf16_t *W, const float *bias, const int *pos, const long long *slot, const float2 *tab,
	const double *inv_freq, int ntab, int n, int in, int vt, float eps, int nheads, int nkv, int interleaved) {
	g2_args a = {};
	a.W = W, a.x = x, a.normw = normw, a.q = q, a.kc = kc, a.vc = vc, a.bias = bias, a.pos = pos, a.slot = slot;
	a.tab = tab, a.inv_freq = inv_freq, a.ntab = ntab, a.n = n, a.in = in, a.vt = vt, a.eps = eps;
	a.nheads = nheads, a.nkv = nkv, a.interleaved = interleaved, a.ks = 1;
	gemv2<G2_ROPE, true>(a, (nheads + nkv) * (HEAD_DIM / 2) + nkv * HEAD_DIM / 2);
}
// gemv2_silu: the MLP's rmsnorm, gate/up GEMV and SiLU-multiply: h[t] (T,
// [hidden]) from W = [gate; up] ([2*hidden][in]).
extern "C" __global__ void __launch_bounds__(G2_THREADS) gemv2_silu(bf16_t *h, const float *x, const float *normw,
	const bf16_t *W, int n, int hidden, int in, int vt, float eps) {
	g2_args a = {};
	a.W = W, a.x = x, a.normw = normw, a.h = h, a.n = n, a.out = hidden, a.in = in, a.vt = vt, a.eps = eps, a.ks = 1;
	gemv2<G2_SILU, true>(a, hidden);
}

#ifdef __CUDA_ARCH__ // gemm_sk and moe_sk (inline PTX: not emulated)
// gemm_sk_*: the decode GEMMs of 5..32 tokens (skinny: Y = X . W^T with X
// [n][in] bf16 in global memory), streaming the weights once at HBM speed
// through bf16 tensor cores (mma.sync m16n8k16, f32 accumulation). A block
// of 8 warps owns 128 weight rows (16 per warp: the m16 tile) and a range of
// k; each lane loads 16-byte runs of its two rows straight into A fragments
// (the k order inside a 32-wide group is permuted, the same way for A and
// B, which a dot product allows), the next 128-k chunk in flight while the
// current one computes; the X chunk ([32 tokens][128 k]) is staged in shared
// memory by cp.async, double-buffered. Grid (row blocks, S k-splits): each
// split's partial tile goes to part, and the last split of a row block (a
// counter, reset after) adds them in split order, so results do not depend
// on timing. Epilogues as gemv2's: SK_PLAIN Y (f32) = . + beta*Y; SK_ROPE
// bias, RoPE, q and the KV write (128 % HEAD_DIM == 0: a head never spans
// two row blocks); SK_SILU h = silu(g)*u (block rb: gate rows 64rb.. and up
// rows hidden+64rb..; hidden % 64 == 0). in % 8 == 0, n <= 32.
#define SK_ROWS 128
#define SK_KC 128
#define SK_NT 4
#define SK_XS (SK_KC + 32)
#define SK_CS (SK_NT * 8 + 1)
#define SK_PLAIN 0
#define SK_ROPE 1
#define SK_SILU 2
__device__ __forceinline__ void sk_mma(float *c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
		     "{%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float ld_cg(const float *p) {
	float v;
	asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
	return v;
}
struct sk_args {
	const bf16_t *W, *X;
	float *Y;
	bf16_t *q, *kc, *vc, *h;
	const float *bias;
	const int *pos;
	const long long *slot;
	const float2 *tab;
	const double *inv_freq;
	float *part;
	int *cnt;
	int n, out, in, cps, ntab, nheads, nkv, interleaved;
	float beta;
	// grouped (moe_sk_*): the tile's first sorted row, and the token of
	// each sorted row (0: X's rows are the sorted rows)
	const int *src;
	int r0;
};

// gemm_sk: the skinny GEMM of up to SK_NT*8 token rows. G: a tile of one
// expert's sorted rows (moe_sk), X row i being X[src[r0+i]] (or X[r0+i])
// and output row i the sorted row r0+i.
template <int MODE, bool G = false>
__device__ __forceinline__ void gemm_sk(const sk_args &a) {
	__shared__ __align__(16) bf16_t xs[2][SK_NT * 8][SK_XS];
	__shared__ float cs[SK_ROWS][SK_CS];
	__shared__ int last;
	int rb = blockIdx.x, ks = blockIdx.y, S = gridDim.y;
	int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
	int nt = (a.n + 7) >> 3;
	int nchunk = (a.in + SK_KC - 1) / SK_KC;
	int c0 = ks * a.cps, c1 = min(c0 + a.cps, nchunk);
	int wr = MODE == SK_SILU ? (warp < 4 ? rb * 64 + 16 * warp : a.out + rb * 64 + 16 * (warp - 4)) : rb * SK_ROWS + 16 * warp;
	// rows below lim are valid: a gate warp's stop at hidden, an up warp's at 2*hidden
	int lim = MODE == SK_SILU && warp >= 4 ? 2 * a.out : a.out;
	bool va = wr + gid < lim, vb = wr + gid + 8 < lim;
	const bf16_t *wa = a.W + (long long)(va ? wr + gid : 0) * a.in;
	const bf16_t *wb = a.W + (long long)(vb ? wr + gid + 8 : 0) * a.in;
	float acc[SK_NT][4];
#pragma unroll
	for (int t = 0; t < SK_NT; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
	// stage: chunk c of X into xs[st] (tokens past n and k past in: zeros).
	auto stage = [&](int c, int st) {
		int k0 = c * SK_KC;
		for (int i = tid; i < nt * 8 * (SK_KC / 8); i += blockDim.x) {
			int tok = i / (SK_KC / 8), piece = i % (SK_KC / 8), k = k0 + piece * 8;
			bool ok = tok < a.n && k < a.in;
			long long xr = tok;
			if (G && ok) xr = a.src ? a.src[a.r0 + tok] : a.r0 + tok;
			const bf16_t *src = a.X + (ok ? xr * a.in + k : 0);
			asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(&xs[st][tok][piece * 8])),
				"l"(src), "r"(ok ? 16 : 0));
		}
		asm volatile("cp.async.commit_group;\n" ::);
	};
	auto loadw = [&](int c, uint4 *w) {
		int k0 = c * SK_KC;
#pragma unroll
		for (int j = 0; j < 4; j++) {
			int k = k0 + 32 * j + 8 * tig;
			uint4 z;
			z.x = z.y = z.z = z.w = 0u;
			w[2 * j] = va && k < a.in ? ldg_stream(wa + k) : z;
			w[2 * j + 1] = vb && k < a.in ? ldg_stream(wb + k) : z;
		}
	};
	// compute: A = rows (gid, gid+8) x 16 k, B = X^T; per 32-k group j the
	// lane's 16-byte runs hold k pairs (0,1) (2,3) (4,5) (6,7) of its 8:
	// mma 0 takes pairs 0 and 1 as its k pairs tig and tig+4, mma 1 pairs 2, 3.
	auto compute = [&](int st, const uint4 *w) {
#pragma unroll
		for (int j = 0; j < 4; j++) {
			uint4 p = w[2 * j], q = w[2 * j + 1];
#pragma unroll
			for (int t = 0; t < SK_NT; t++) {
				if (t < nt) {
					uint4 x = *(const uint4 *)&xs[st][8 * t + gid][32 * j + 8 * tig];
					sk_mma(acc[t], p.x, q.x, p.y, q.y, x.x, x.y);
					sk_mma(acc[t], p.z, q.z, p.w, q.w, x.z, x.w);
				}
			}
		}
	};
	uint4 w0[8], w1[8];
	pdl_trigger();
	if (c0 < c1) loadw(c0, w0); // weights: nothing ahead writes them
	pdl_wait();
	if (c0 < c1) stage(c0, 0);
	for (int c = c0; c < c1; c += 2) {
		bool has1 = c + 1 < c1;
		if (has1) {
			stage(c + 1, 1);
			loadw(c + 1, w1);
			asm volatile("cp.async.wait_group 1;\n" ::);
		} else {
			asm volatile("cp.async.wait_group 0;\n" ::);
		}
		__syncthreads();
		compute(0, w0);
		__syncthreads();
		if (!has1) break;
		bool has2 = c + 2 < c1;
		if (has2) {
			stage(c + 2, 0);
			loadw(c + 2, w0);
			asm volatile("cp.async.wait_group 1;\n" ::);
		} else {
			asm volatile("cp.async.wait_group 0;\n" ::);
		}
		__syncthreads();
		compute(1, w1);
		__syncthreads();
	}
	int rl = warp * 16 + gid;
#pragma unroll
	for (int t = 0; t < SK_NT; t++) {
		if (t < nt) {
			cs[rl][8 * t + 2 * tig] = acc[t][0];
			cs[rl][8 * t + 2 * tig + 1] = acc[t][1];
			cs[rl + 8][8 * t + 2 * tig] = acc[t][2];
			cs[rl + 8][8 * t + 2 * tig + 1] = acc[t][3];
		}
	}
	__syncthreads();
	if (S > 1) {
		float *P = a.part + ((long long)rb * S + ks) * SK_ROWS * 32;
		for (int i = tid; i < SK_ROWS * a.n; i += blockDim.x) P[(i / a.n) * 32 + i % a.n] = cs[i / a.n][i % a.n];
		__threadfence();
		__syncthreads();
		if (tid == 0) last = atomicAdd(&a.cnt[rb], 1) == S - 1;
		__syncthreads();
		if (!last) return;
		__threadfence();
		for (int i = tid; i < SK_ROWS * a.n; i += blockDim.x) {
			int r = i / a.n, t = i % a.n;
			float v = 0.f;
			for (int s2 = 0; s2 < S; s2++) v += ld_cg(a.part + ((long long)rb * S + s2) * SK_ROWS * 32 + r * 32 + t);
			cs[r][t] = v;
		}
		if (tid == 0) a.cnt[rb] = 0;
		__syncthreads();
	}
	if (MODE == SK_PLAIN) {
		for (int i = tid; i < SK_ROWS * a.n; i += blockDim.x) {
			int r = i % SK_ROWS, t = i / SK_ROWS, row = rb * SK_ROWS + r;
			if (row < a.out) {
				long long idx = (long long)(G ? a.r0 + t : t) * a.out + row;
				float v = cs[r][t];
				if (a.beta != 0.f) v = v + a.beta * a.Y[idx];
				a.Y[idx] = v;
			}
		}
	} else if (MODE == SK_SILU) {
		for (int i = tid; i < 64 * a.n; i += blockDim.x) {
			int ii = i % 64, t = i / 64;
			if (rb * 64 + ii >= a.out) continue;
			float g = bf2f(f2bf(cs[ii][t])), up = bf2f(f2bf(cs[64 + ii][t]));
			a.h[(long long)(G ? a.r0 + t : t) * a.out + rb * 64 + ii] = f2bf(g * (1.0f / (1.0f + expf(-g))) * up);
		}
	} else {
		const int half = HEAD_DIM / 2;
		int QD = a.nheads * HEAD_DIM, KVD = a.nkv * HEAD_DIM, rot = (a.nheads + a.nkv) * HEAD_DIM;
		for (int i = tid; i < 64 * a.n; i += blockDim.x) {
			int pi = i % 64, t = i / 64;
			int hl = pi / half, ii = pi % half;
			int ra = hl * HEAD_DIM + (a.interleaved ? 2 * ii : ii), rbl = ra + (a.interleaved ? 1 : half);
			int rowA = rb * SK_ROWS + ra, rowB = rb * SK_ROWS + rbl;
			if (rowA >= a.out) continue;
			float v0 = cs[ra][t], v1 = cs[rbl][t];
			if (a.bias) {
				v0 += a.bias[rowA];
				v1 += a.bias[rowB];
			}
			long long s = a.slot[t];
			if (rowA >= rot) {
				if (s >= 0) {
					st(a.vc, s + (rowA - QD - KVD), v0);
					st(a.vc, s + (rowB - QD - KVD), v1);
				}
				continue;
			}
			float c, sv;
			rope_cs(a.pos[t], ii, a.tab, a.inv_freq, a.ntab, c, sv);
			float r0 = __fsub_rn(__fmul_rn(v0, c), __fmul_rn(v1, sv));
			float r1 = __fadd_rn(__fmul_rn(v0, sv), __fmul_rn(v1, c));
			if (rowA < QD) {
				st(a.q, (long long)t * QD + rowA, r0);
				st(a.q, (long long)t * QD + rowB, r1);
			} else if (s >= 0) {
				st(a.kc, s + (rowA - QD), r0);
				st(a.kc, s + (rowB - QD), r1);
			}
		}
	}
}

// gemm_sk_plain: Y (f32, [n][out]) = X . W^T + beta*Y. Grid (ceil(out/128),
// S), 256 threads; cps = 128-k chunks per split.
extern "C" __global__ void __launch_bounds__(256) gemm_sk_plain(float *Y, const bf16_t *X, const bf16_t *W, int n,
	int out, int in, float beta, int cps, float *part, int *cnt) {
	sk_args a = {};
	a.W = W, a.X = X, a.Y = Y, a.n = n, a.out = out, a.in = in, a.beta = beta, a.cps = cps, a.part = part, a.cnt = cnt;
	gemm_sk<SK_PLAIN>(a);
}
// gemm_sk_silu: h (T, [n][hidden]) = silu(X . Wg^T) * (X . Wu^T), W = [gate;
// up]. Grid (hidden/64, S).
extern "C" __global__ void __launch_bounds__(256) gemm_sk_silu(bf16_t *h, const bf16_t *X, const bf16_t *W, int n,
	int hidden, int in, int cps, float *part, int *cnt) {
	sk_args a = {};
	a.W = W, a.X = X, a.h = h, a.n = n, a.out = hidden, a.in = in, a.cps = cps, a.part = part, a.cnt = cnt;
	gemm_sk<SK_SILU>(a);
}
// moe_sk: the grouped skinny GEMM of a mixture-of-experts block. Block
// (x, y, s) takes the s-th expert with rows (e = act[s], s < *nact; the
// others return), its weights W + e*wstride and its sorted rows offs[e] ..
// offs[e+1], in tiles of SK_NT*8 rows; k split gridDim.y ways (cps chunks
// each), the splits' partials in part and cnt from slot s's share (split
// only when no expert has more than one tile: at most SK_NT*8 tokens).
// moe_sort's output is read on the device, so the launch does not depend
// on the routing and can be captured.
template <int MODE>
__device__ __forceinline__ void moe_sk(sk_args a, const int *act, const int *nact, const int *offs, long long wstride) {
	int s = blockIdx.z;
	if (s >= *nact) return;
	int e = act[s], r0 = offs[e], rows = offs[e + 1] - r0;
	a.W += (long long)e * wstride;
	a.part += (long long)s * gridDim.x * gridDim.y * SK_ROWS * 32;
	a.cnt += (long long)s * gridDim.x;
	for (int t0 = 0; t0 < rows; t0 += SK_NT * 8) {
		a.r0 = r0 + t0;
		a.n = min(SK_NT * 8, rows - t0);
		gemm_sk<MODE, true>(a);
		__syncthreads();
	}
}
// moe_sk_silu: h[row] (T, [rows][hidden]) = silu(x . Wg^T) * (x . Wu^T),
// x = X[src[row]], for each expert's W = [gate; up] ([E][2*hidden][in]).
// Grid (ceil(hidden/64), splits, slots).
extern "C" __global__ void __launch_bounds__(256) moe_sk_silu(bf16_t *h, const bf16_t *X, const bf16_t *W,
	const int *src, const int *act, const int *nact, const int *offs, int hidden, int in, int cps, float *part, int *cnt) {
	sk_args a = {};
	a.W = W, a.X = X, a.h = h, a.src = src, a.out = hidden, a.in = in, a.cps = cps, a.part = part, a.cnt = cnt;
	moe_sk<SK_SILU>(a, act, nact, offs, 2LL * hidden * in);
}
// moe_sk_down: Y[row] (f32, [rows][out]) = X[row] . W^T for each expert's
// W ([E][out][in]). Grid (ceil(out/128), splits, slots).
extern "C" __global__ void __launch_bounds__(256) moe_sk_down(float *Y, const bf16_t *X, const bf16_t *W,
	const int *act, const int *nact, const int *offs, int out, int in, int cps, float *part, int *cnt) {
	sk_args a = {};
	a.W = W, a.X = X, a.Y = Y, a.out = out, a.in = in, a.cps = cps, a.part = part, a.cnt = cnt;
	moe_sk<SK_PLAIN>(a, act, nact, offs, (long long)out * in);
}

#if SK_ROWS % HEAD_DIM == 0
// gemm_sk_qkv: X . Wqkv^T, then rope_kv's work (its arguments). Grid
// (ceil((QD+2KVD)/128), S).
extern "C" __global__ void __launch_bounds__(256) gemm_sk_qkv(bf16_t *q, bf16_t *kc, bf16_t *vc, const bf16_t *X,
	const bf16_t *W, const float *bias, const int *pos, const long long *slot, const float2 *tab, const double *inv_freq,
	int ntab, int n, int in, int nheads, int nkv, int interleaved, int cps, float *part, int *cnt) {
	sk_args a = {};
	a.W = W, a.X = X, a.q = q, a.kc = kc, a.vc = vc, a.bias = bias, a.pos = pos, a.slot = slot, a.tab = tab;
	a.inv_freq = inv_freq, a.ntab = ntab, a.n = n, a.out = (nheads + 2 * nkv) * HEAD_DIM, a.in = in, a.nheads = nheads;
	a.nkv = nkv, a.interleaved = interleaved, a.cps = cps, a.part = part, a.cnt = cnt;
	gemm_sk<SK_ROPE>(a);
}
#endif
#endif // __CUDA_ARCH__
#endif // USE_BF16

#if USE_BF16 && (32 % (HEAD_DIM / 8) == 0)
// attn_decode: the split-K attention of attn_split (same arguments, same
// partial-result layout, same fixed split of the keys) laid out for memory
// parallelism: DK_L = HEAD_DIM/8 lanes read one key's 16-byte chunks, so a
// warp reads 32/DK_L whole rows per load and each lane keeps 4 loads in
// flight; the GQA_GROUP query heads share every K and V load.
#define DK_L (HEAD_DIM / 8)
#define DK_KPW (32 / DK_L)
#define DEC_WARPS 4
#define DEC_SLOTS (DEC_WARPS * DK_KPW)
extern "C" __global__ void __launch_bounds__(128) attn_decode(float *part_o, float *part_ml, const T *q,
	const T *kc, const T *vc, const int *qrow, const int *pos, const int *ptoff, const int *pages, int page_size,
	int nsplit, int nheads, int nkv, int qi0, float div) {
	__shared__ float sc[GQA_GROUP][ATT_SPLIT];
	__shared__ float os[DEC_SLOTS][GQA_GROUP][HEAD_DIM];
	__shared__ float mls[GQA_GROUP][2];
	int split = blockIdx.x, g = blockIdx.y, z = blockIdx.z, qi = qi0 + z;
	int npos = pos[qi] + 1;
	int k0 = split * ATT_SPLIT;
	if (k0 >= npos) return;
	int len = min(ATT_SPLIT, npos - k0);
	int QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM;
	int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	int sub = lane / DK_L, c = lane % DK_L;
	const int *pt = pages + ptoff[qi];
	const T *qb = q + (long long)qrow[qi] * QD + (long long)g * GQA_GROUP * HEAD_DIM + c * 8;
	float qv[GQA_GROUP][8];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) load8(qb + h * HEAD_DIM, qv[h]);
	const long long goff = (long long)g * HEAD_DIM + c * 8;
	for (int jb = warp * DK_KPW; jb < len; jb += 4 * DEC_SLOTS) {
		uint4 kr[4];
#pragma unroll
		for (int u = 0; u < 4; u++) {
			int j = jb + u * DEC_SLOTS + sub;
			kr[u].x = kr[u].y = kr[u].z = kr[u].w = 0u;
			if (j < len) {
				int key = k0 + j;
				kr[u] = *(const uint4 *)(kc + (long long)pt[key / page_size] * page_size * KVD +
					(long long)(key % page_size) * KVD + goff);
			}
		}
#pragma unroll
		for (int u = 0; u < 4; u++) {
			float kf[8];
			unpack8(kr[u], kf);
			float a[GQA_GROUP];
#pragma unroll
			for (int h = 0; h < GQA_GROUP; h++) {
				float s = 0.f;
#pragma unroll
				for (int e = 0; e < 8; e++) s = fmaf(qv[h][e], kf[e], s);
#pragma unroll
				for (int o = DK_L / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
				a[h] = s;
			}
			int j = jb + u * DEC_SLOTS + sub;
			if (c == 0 && j < len) {
#pragma unroll
				for (int h = 0; h < GQA_GROUP; h++) sc[h][j] = a[h] / div;
			}
		}
	}
	__syncthreads();
	for (int h = warp; h < GQA_GROUP; h += DEC_WARPS) {
		float mx = NEG_INF;
		for (int j = lane; j < len; j += 32) mx = fmaxf(mx, sc[h][j]);
		for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
		float s = 0.f;
		for (int j = lane; j < len; j += 32) {
			float e = expf(sc[h][j] - mx);
			sc[h][j] = e;
			s += e;
		}
		for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
		if (lane == 0) {
			mls[h][0] = mx;
			mls[h][1] = s;
		}
	}
	__syncthreads();
	float o[GQA_GROUP][8];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++)
#pragma unroll
		for (int e = 0; e < 8; e++) o[h][e] = 0.f;
	int slot = warp * DK_KPW + sub;
	for (int jb = warp * DK_KPW; jb < len; jb += 4 * DEC_SLOTS) {
		uint4 vr[4];
#pragma unroll
		for (int u = 0; u < 4; u++) {
			int j = jb + u * DEC_SLOTS + sub;
			vr[u].x = vr[u].y = vr[u].z = vr[u].w = 0u;
			if (j < len) {
				int key = k0 + j;
				vr[u] = *(const uint4 *)(vc + (long long)pt[key / page_size] * page_size * KVD +
					(long long)(key % page_size) * KVD + goff);
			}
		}
#pragma unroll
		for (int u = 0; u < 4; u++) {
			int j = jb + u * DEC_SLOTS + sub;
			if (j < len) {
				float vf[8];
				unpack8(vr[u], vf);
#pragma unroll
				for (int h = 0; h < GQA_GROUP; h++) {
					float p = sc[h][j];
#pragma unroll
					for (int e = 0; e < 8; e++) o[h][e] = fmaf(p, vf[e], o[h][e]);
				}
			}
		}
	}
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++)
#pragma unroll
		for (int e = 0; e < 8; e++) os[slot][h][c * 8 + e] = o[h][e];
	__syncthreads();
	for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += blockDim.x) {
		int h = i / HEAD_DIM, d = i % HEAD_DIM;
		float a = 0.f;
		for (int s2 = 0; s2 < DEC_SLOTS; s2++) a += os[s2][h][d];
		long long base = ((long long)z * nheads + g * GQA_GROUP + h) * nsplit + split;
		part_o[base * HEAD_DIM + d] = a;
		if (d == 0) {
			part_ml[base * 2] = mls[h][0];
			part_ml[base * 2 + 1] = mls[h][1];
		}
	}
}
#endif

#if USE_BF16 && (32 % (HEAD_DIM / 8) == 0)
// attn_decode2: attn_decode's split-K decode attention in one pass over the
// split's keys (same arguments, but scale_log2 = log2(e)/sqrt(HEAD_DIM) in
// place of div; same partial layout and fixed split). D2_L lanes read one
// key's 16-byte chunks; each of the key slots of the block (a group of D2_L
// lanes) streams keys slot, slot + slots, ... with an online softmax,
// loading D2_U keys' K and V rows at once (2*D2_U 16-byte loads in flight
// per lane); the GQA_GROUP query heads share every load. The slots' states
// merge in shared memory in slot order, so the result depends only on the
// sequence. part_ml holds m in natural-log units, as attn_combine reads.
// With out != 0 the last split block of a (query, kv head) to finish (a
// counter in cnt[z*nkv + g], reset after) merges the splits into out as
// attn_combine would, with the same arithmetic: no combine launch.
// attn_decode2: 4 warps; attn_decode2_w8: 8 (twice the loads in flight per
// block, for grids smaller than the GPU; GQA_GROUP <= 4).
#define D2_L (HEAD_DIM / 8)
#define D2_KPW (32 / D2_L)
#define D2_U 4
template <int WARPS>
__device__ __forceinline__ void attn_decode2_body(float *part_o, float *part_ml, const T *q, const T *kc, const T *vc,
	const int *qrow, const int *pos, const int *ptoff, const int *pages, int page_size, int nsplit, int nheads, int nkv,
	int qi0, float scale_log2, T *out, int *cnt) {
	const int D2_SLOTS = WARPS * D2_KPW;
	pdl_trigger();
	__shared__ __align__(16) float os[WARPS * D2_KPW][GQA_GROUP][HEAD_DIM];
	__shared__ float ms[WARPS * D2_KPW][GQA_GROUP], ls[WARPS * D2_KPW][GQA_GROUP];
	__shared__ int lastb;
	int split = blockIdx.x, g = blockIdx.y, z = blockIdx.z, qi = qi0 + z;
	int npos = pos[qi] + 1;
	int k0 = split * ATT_SPLIT;
	if (k0 >= npos) return;
	int len = min(ATT_SPLIT, npos - k0);
	int QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM;
	int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	int sub = lane / D2_L, c = lane % D2_L, slot = warp * D2_KPW + sub;
	// Powers of two (the usual page sizes) index pages by shift and mask.
	int pshift = -1;
	if ((page_size & (page_size - 1)) == 0)
		for (pshift = 0; (1 << pshift) < page_size; pshift++) {
		}
	const int *pt = pages + ptoff[qi];
	const T *qb = q + (long long)qrow[qi] * QD + (long long)g * GQA_GROUP * HEAD_DIM + c * 8;
	float qv[GQA_GROUP][8];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) {
		load8(qb + h * HEAD_DIM, qv[h]);
#pragma unroll
		for (int e = 0; e < 8; e++) qv[h][e] *= scale_log2;
	}
	const long long goff = (long long)g * HEAD_DIM + c * 8;
	float m[GQA_GROUP], l[GQA_GROUP], o[GQA_GROUP][8];
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) {
		m[h] = NEG_INF;
		l[h] = 0.f;
#pragma unroll
		for (int e = 0; e < 8; e++) o[h][e] = 0.f;
	}
	for (int jb = 0; jb < len; jb += D2_U * D2_SLOTS) {
		// Keys past the split's end load its last key again (no branch, so
		// every load is in flight at once) and are masked below.
		int key[D2_U], pp[D2_U];
#pragma unroll
		for (int u = 0; u < D2_U; u++) {
			key[u] = k0 + min(jb + u * D2_SLOTS + slot, len - 1);
			pp[u] = pt[pshift >= 0 ? key[u] >> pshift : key[u] / page_size];
		}
		uint4 kr[D2_U], vr[D2_U];
#pragma unroll
		for (int u = 0; u < D2_U; u++) {
			int in = pshift >= 0 ? key[u] & (page_size - 1) : key[u] % page_size;
			long long off = ((long long)pp[u] * page_size + in) * KVD + goff;
			kr[u] = *(const uint4 *)(kc + off);
			vr[u] = *(const uint4 *)(vc + off);
		}
		float s[D2_U][GQA_GROUP];
#pragma unroll
		for (int u = 0; u < D2_U; u++) {
			float kf[8];
			unpack8(kr[u], kf);
			bool ok = jb + u * D2_SLOTS + slot < len;
#pragma unroll
			for (int h = 0; h < GQA_GROUP; h++) {
				float a = 0.f;
#pragma unroll
				for (int e = 0; e < 8; e++) a = fmaf(qv[h][e], kf[e], a);
#pragma unroll
				for (int x = D2_L / 2; x > 0; x >>= 1) a += __shfl_xor_sync(0xffffffffu, a, x);
				s[u][h] = ok ? a : NEG_INF;
			}
		}
#pragma unroll
		for (int h = 0; h < GQA_GROUP; h++) {
			float mx = m[h];
#pragma unroll
			for (int u = 0; u < D2_U; u++) mx = fmaxf(mx, s[u][h]);
			if (mx == NEG_INF) continue; // no key of this slot yet
			float sc = exp2f(m[h] - mx);
			l[h] *= sc;
#pragma unroll
			for (int e = 0; e < 8; e++) o[h][e] *= sc;
#pragma unroll
			for (int u = 0; u < D2_U; u++) {
				float p = exp2f(s[u][h] - mx), vf[8];
				unpack8(vr[u], vf);
				l[h] += p;
#pragma unroll
				for (int e = 0; e < 8; e++) o[h][e] = fmaf(p, vf[e], o[h][e]);
			}
			m[h] = mx;
		}
	}
#pragma unroll
	for (int h = 0; h < GQA_GROUP; h++) {
		float4 lo, hi;
		lo.x = o[h][0], lo.y = o[h][1], lo.z = o[h][2], lo.w = o[h][3];
		hi.x = o[h][4], hi.y = o[h][5], hi.z = o[h][6], hi.w = o[h][7];
		float4 *dst = (float4 *)&os[slot][h][c * 8];
		dst[0] = lo;
		dst[1] = hi;
		if (c == 0) {
			ms[slot][h] = m[h];
			ls[slot][h] = l[h];
		}
	}
	__syncthreads();
	for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += blockDim.x) {
		int h = i / HEAD_DIM, d = i % HEAD_DIM;
		float M = NEG_INF;
#pragma unroll
		for (int s2 = 0; s2 < D2_SLOTS; s2++) M = fmaxf(M, ms[s2][h]);
		float a = 0.f, L = 0.f;
#pragma unroll
		for (int s2 = 0; s2 < D2_SLOTS; s2++) {
			float f = exp2f(ms[s2][h] - M); // 0 for a slot that saw no key
			a = fmaf(os[s2][h][d], f, a);
			L = fmaf(ls[s2][h], f, L);
		}
		long long base = ((long long)z * nheads + g * GQA_GROUP + h) * nsplit + split;
		part_o[base * HEAD_DIM + d] = a;
		if (d == 0) {
			part_ml[base * 2] = M * 0.69314718055994531f;
			part_ml[base * 2 + 1] = L;
		}
	}
	if (!out) return;
	int ns = (pos[qi] + ATT_SPLIT) / ATT_SPLIT;
	__threadfence();
	__syncthreads();
	if (threadIdx.x == 0) lastb = atomicAdd(&cnt[z * nkv + g], 1) == ns - 1;
	__syncthreads();
	if (!lastb) return;
	__threadfence();
	for (int i = threadIdx.x; i < GQA_GROUP * HEAD_DIM; i += blockDim.x) {
		int hh = g * GQA_GROUP + i / HEAD_DIM, d = i % HEAD_DIM;
		long long base = ((long long)z * nheads + hh) * nsplit;
		float M = NEG_INF;
		for (int s2 = 0; s2 < ns; s2++) M = fmaxf(M, ld_cg(part_ml + (base + s2) * 2));
		float L = 0.f;
		for (int s2 = 0; s2 < ns; s2++) L += ld_cg(part_ml + (base + s2) * 2 + 1) * expf(ld_cg(part_ml + (base + s2) * 2) - M);
		float a = 0.f;
		for (int s2 = 0; s2 < ns; s2++) a += ld_cg(part_o + (base + s2) * HEAD_DIM + d) * expf(ld_cg(part_ml + (base + s2) * 2) - M);
		st(out, (long long)qrow[qi] * nheads * HEAD_DIM + (long long)hh * HEAD_DIM + d, a / L);
	}
	if (threadIdx.x == 0) cnt[z * nkv + g] = 0;
}
extern "C" __global__ void __launch_bounds__(128) attn_decode2(float *part_o, float *part_ml, const T *q, const T *kc,
	const T *vc, const int *qrow, const int *pos, const int *ptoff, const int *pages, int page_size, int nsplit, int nheads,
	int nkv, int qi0, float scale_log2, T *out, int *cnt) {
	attn_decode2_body<4>(part_o, part_ml, q, kc, vc, qrow, pos, ptoff, pages, page_size, nsplit, nheads, nkv, qi0,
		scale_log2, out, cnt);
}
#if GQA_GROUP <= 4 // shared memory: 8 KiB per warp and query head
extern "C" __global__ void __launch_bounds__(256) attn_decode2_w8(float *part_o, float *part_ml, const T *q,
	const T *kc, const T *vc, const int *qrow, const int *pos, const int *ptoff, const int *pages, int page_size,
	int nsplit, int nheads, int nkv, int qi0, float scale_log2, T *out, int *cnt) {
	attn_decode2_body<8>(part_o, part_ml, q, kc, vc, qrow, pos, ptoff, pages, page_size, nsplit, nheads, nkv, qi0,
		scale_log2, out, cnt);
}
#endif
#endif

#if USE_BF16 && (HEAD_DIM % 32 == 0) && (HEAD_DIM <= 128) && defined(__CUDA_ARCH__) // (inline PTX: not emulated)
// attn_prefill2: causal flash attention, second version. Block (q tile,
// head, seq) of FA2_WARPS warps, 16 query rows each; longest (latest) query
// tiles launch first; 64-key K and V tiles stream through shared memory by
// cp.async, two stages deep, both row-major; B fragments come from ldmatrix
// (K) and ldmatrix.trans (V); warps skip key tiles entirely above their rows
// and mask only diagonal tiles. Keys in tiles of 64 aligned to position 0, as
// in attn_prefill. Dynamic shared memory: 2 * 2 * 64 * (HEAD_DIM+8) * 2 bytes.
#ifndef FA2_WARPS
#define FA2_WARPS 8
#endif
#define F2_BQ (FA2_WARPS * 16)
#define F2_BK 64
#define F2_PAD (HEAD_DIM + 8)
#define F2_TILE (F2_BK * F2_PAD)
extern "C" __global__ void __launch_bounds__(FA2_WARPS * 32, 1) attn_prefill2(bf16_t *out, const bf16_t *q,
	const bf16_t *kc, const bf16_t *vc, const int *qstart, const int *qlen, const int *pos0, const int *ptoff,
	const int *pages, int page_size, int nheads, int nkv, float scale_log2) {
	bf16_t *sm = (bf16_t *)dyn_smem; // [stage][K|V][F2_BK][F2_PAD]
	int b = blockIdx.z, h = blockIdx.y;
	int L = qlen[b];
	int qt0 = (gridDim.x - 1 - blockIdx.x) * F2_BQ;
	if (qt0 >= L) return;
	int g = h / GQA_GROUP;
	int QD = nheads * HEAD_DIM, KVD = nkv * HEAD_DIM;
	int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
	int p0 = pos0[b];
	int r0 = qt0 + warp * 16 + gid, r1 = r0 + 8;
	const bf16_t *qb = q + (long long)qstart[b] * QD + h * HEAD_DIM;
	int rr0 = min(r0, L - 1), rr1 = min(r1, L - 1);
	u32 qf[HEAD_DIM / 16][4];
#pragma unroll
	for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
		qf[kk][0] = *(const u32 *)(qb + (long long)rr0 * QD + kk * 16 + tig * 2);
		qf[kk][1] = *(const u32 *)(qb + (long long)rr1 * QD + kk * 16 + tig * 2);
		qf[kk][2] = *(const u32 *)(qb + (long long)rr0 * QD + kk * 16 + 8 + tig * 2);
		qf[kk][3] = *(const u32 *)(qb + (long long)rr1 * QD + kk * 16 + 8 + tig * 2);
	}
	float o[HEAD_DIM / 8][4];
#pragma unroll
	for (int nd = 0; nd < HEAD_DIM / 8; nd++) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
	float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
	int qp0 = p0 + r0, qp1 = p0 + r1;
	int wmin = p0 + qt0 + warp * 16, wmax = wmin + 15;
	int kend = p0 + min(qt0 + F2_BQ, L);
	int nkt = (kend + F2_BK - 1) / F2_BK;
	const int *pt = pages + ptoff[b];
	const int CH = HEAD_DIM / 8;
	const int NT = FA2_WARPS * 32;
	auto load_tile = [&](int kt, int stage) {
		bf16_t *Ks = sm + stage * 2 * F2_TILE, *Vs = Ks + F2_TILE;
		int k0 = kt * F2_BK;
#pragma unroll
		for (int i = 0; i < (F2_BK * CH + NT - 1) / NT; i++) {
			int cidx = threadIdx.x + i * NT;
			if (cidx < F2_BK * CH) {
				int r = cidx / CH, cc = (cidx % CH) * 8;
				int key = k0 + r;
				int ok = key < kend;
				long long off = ok ? (long long)pt[key / page_size] * page_size * KVD +
						(long long)(key % page_size) * KVD + g * HEAD_DIM + cc
						   : 0;
				int nbytes = ok ? 16 : 0;
				asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(Ks + r * F2_PAD + cc)),
					"l"(kc + off), "r"(nbytes));
				asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(Vs + r * F2_PAD + cc)),
					"l"(vc + off), "r"(nbytes));
			}
		}
		asm volatile("cp.async.commit_group;\n" ::);
	};
	load_tile(0, 0);
	for (int kt = 0; kt < nkt; kt++) {
		if (kt + 1 < nkt) {
			load_tile(kt + 1, (kt + 1) & 1);
			asm volatile("cp.async.wait_group 1;\n" ::);
		} else {
			asm volatile("cp.async.wait_group 0;\n" ::);
		}
		__syncthreads();
		int k0 = kt * F2_BK;
		if (k0 <= wmax) {
			const bf16_t *Ks = sm + (kt & 1) * 2 * F2_TILE, *Vs = Ks + F2_TILE;
			float s[F2_BK / 8][4];
#pragma unroll
			for (int nb = 0; nb < F2_BK / 8; nb++) s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.f;
#pragma unroll
			for (int kk2 = 0; kk2 < HEAD_DIM / 32; kk2++) {
#pragma unroll
				for (int nb = 0; nb < F2_BK / 8; nb++) {
					u32 kb[4];
					u32 a = smem_u32(Ks + (nb * 8 + (lane & 7)) * F2_PAD + kk2 * 32 + (lane >> 3) * 8);
					asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
						     : "=r"(kb[0]), "=r"(kb[1]), "=r"(kb[2]), "=r"(kb[3])
						     : "r"(a));
					mma16816(s[nb], qf[2 * kk2], kb);
					mma16816(s[nb], qf[2 * kk2 + 1], kb + 2);
				}
			}
			bool diag = k0 + F2_BK - 1 > wmin;
			float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
			for (int nb = 0; nb < F2_BK / 8; nb++) {
#pragma unroll
				for (int e = 0; e < 2; e++) {
					int key = k0 + nb * 8 + tig * 2 + e;
					float v0 = s[nb][e] * scale_log2, v1 = s[nb][2 + e] * scale_log2;
					if (diag) {
						if (key > qp0) v0 = NEG_INF;
						if (key > qp1) v1 = NEG_INF;
					}
					s[nb][e] = v0;
					s[nb][2 + e] = v1;
					mx0 = fmaxf(mx0, v0);
					mx1 = fmaxf(mx1, v1);
				}
			}
			mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
			mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
			mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
			mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
			float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
			float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
			l0 *= c0;
			l1 *= c1;
#pragma unroll
			for (int nd = 0; nd < HEAD_DIM / 8; nd++) {
				o[nd][0] *= c0;
				o[nd][1] *= c0;
				o[nd][2] *= c1;
				o[nd][3] *= c1;
			}
#pragma unroll
			for (int nb = 0; nb < F2_BK / 8; nb++) {
				s[nb][0] = exp2f(s[nb][0] - mn0);
				s[nb][1] = exp2f(s[nb][1] - mn0);
				s[nb][2] = exp2f(s[nb][2] - mn1);
				s[nb][3] = exp2f(s[nb][3] - mn1);
				l0 += s[nb][0] + s[nb][1];
				l1 += s[nb][2] + s[nb][3];
			}
			m0 = mn0;
			m1 = mn1;
#pragma unroll
			for (int kk = 0; kk < F2_BK / 16; kk++) {
				u32 pa[4];
				pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
				pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
				pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
				pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
				for (int nd2 = 0; nd2 < HEAD_DIM / 16; nd2++) {
					u32 vb[4];
					u32 a = smem_u32(Vs + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * F2_PAD + nd2 * 16 +
						(lane >> 4) * 8);
					asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
						     : "=r"(vb[0]), "=r"(vb[1]), "=r"(vb[2]), "=r"(vb[3])
						     : "r"(a));
					mma16816(o[2 * nd2], pa, vb);
					mma16816(o[2 * nd2 + 1], pa, vb + 2);
				}
			}
		}
		__syncthreads();
	}
	l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
	l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
	l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
	l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
	float i0 = 1.f / l0, i1 = 1.f / l1;
	bf16_t *ob = out + (long long)qstart[b] * QD + h * HEAD_DIM;
	if (r0 < L) {
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++)
			*(u32 *)(ob + (long long)r0 * QD + nd * 8 + tig * 2) = pack_bf16(o[nd][0] * i0, o[nd][1] * i0);
	}
	if (r1 < L) {
#pragma unroll
		for (int nd = 0; nd < HEAD_DIM / 8; nd++)
			*(u32 *)(ob + (long long)r1 * QD + nd * 8 + tig * 2) = pack_bf16(o[nd][2] * i1, o[nd][3] * i1);
	}
}
#endif
#endif // MC_V2
