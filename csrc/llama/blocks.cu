// blocks.cu: the kernels of the architecture blocks beyond Llama's, which
// the CUDA backend (internal/compute/cuda/blocks.go) composes from the
// model's Spec: per-head q/k RMSNorm (Qwen3) and the mixture-of-experts
// gather and weighted sum. A kernel set of its own, compiled by NVRTC with
// llama.cu's macros (HEAD_DIM, USE_BF16 are used) only for models that need
// it, so a Llama model never depends on it. Every reduction has a fixed
// order that depends only on the token itself, never on the batch.

typedef unsigned short bf16_t;
typedef unsigned int u32;

#if USE_BF16
typedef bf16_t T;
#else
typedef float T;
#endif

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ bf16_t f2bf(float f) {
	u32 u = __float_as_uint(f);
	if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
	u += 0x7fffu + ((u >> 16) & 1u);
	return (bf16_t)(u >> 16);
}
// rt rounds to T (a no-op for float); ld8 reads 8 consecutive T (16 bytes
// of bf16 or 32 of float, aligned) as floats.
__device__ __forceinline__ float rt(float v) {
#if USE_BF16
	return bf2f(f2bf(v));
#else
	return v;
#endif
}
// w8_t is 8 consecutive T as loaded (16 bytes of bf16, 32 of float), kept
// so until used: weights in flight then take 4 registers a chunk in bf16,
// not 8. ldw8 loads one (aligned), cvt8 widens it.
#if USE_BF16
typedef uint4 w8_t;
__device__ __forceinline__ w8_t ldw8(const T *p) { return *(const uint4 *)p; }
__device__ __forceinline__ w8_t zw8() {
	uint4 z;
	z.x = z.y = z.z = z.w = 0u;
	return z;
}
__device__ __forceinline__ void cvt8(w8_t a, float *o) {
	u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
	for (int i = 0; i < 4; i++) {
		o[2 * i] = __uint_as_float(w[i] << 16);
		o[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
	}
}
#else
struct w8_t {
	float4 a, b;
};
__device__ __forceinline__ w8_t ldw8(const T *p) {
	w8_t r;
	r.a = *(const float4 *)p;
	r.b = *(const float4 *)(p + 4);
	return r;
}
__device__ __forceinline__ w8_t zw8() {
	w8_t r;
	r.a.x = r.a.y = r.a.z = r.a.w = r.b.x = r.b.y = r.b.z = r.b.w = 0.f;
	return r;
}
__device__ __forceinline__ void cvt8(w8_t r, float *o) {
	o[0] = r.a.x, o[1] = r.a.y, o[2] = r.a.z, o[3] = r.a.w, o[4] = r.b.x, o[5] = r.b.y, o[6] = r.b.z, o[7] = r.b.w;
}
#endif
__device__ __forceinline__ void ld8(const T *p, float *o) { cvt8(ldw8(p), o); }

// blk_pdl_trigger and blk_pdl_wait: llama.cu's pdl_trigger and pdl_wait
// (programmatic dependent launch, sm_90; no-ops elsewhere) for the kernels
// here that the backend launches with launchDep.
__device__ __forceinline__ void blk_pdl_trigger() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void blk_pdl_wait() {
#if __CUDA_ARCH__ >= 900
	asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

#include "qkn.cuh"

// qk_norm: for token t (grid x) and head h (grid y) of a row of qkv (fp32:
// nheads q heads, nkv k heads, nkv v heads of HEAD_DIM each), adds the
// bias when there is one and, for q and k heads, applies RMSNorm over the
// head with weights qw (q) or kw (k), in place; v heads get the bias only.
// Block 32 threads (one warp). rope_kv then runs without a bias.
extern "C" __global__ void __launch_bounds__(32) qk_norm(float *qkv, const float *bias, const float *qw,
	const float *kw, int nheads, int nkv, float eps) {
	int t = blockIdx.x, h = blockIdx.y;
	long long W = (long long)(nheads + 2 * nkv) * HEAD_DIM;
	float *row = qkv + (long long)t * W + (long long)h * HEAD_DIM;
	const float *b = bias ? bias + (long long)h * HEAD_DIM : 0;
	float v[QKN_PER];
	float ss = qkn_load(row, b, v);
	if (h >= nheads + nkv) {
		if (b) {
#pragma unroll
			for (int k = 0; k < QKN_PER; k++) {
				int i = threadIdx.x + 32 * k;
				if (i < HEAD_DIM) row[i] = v[k];
			}
		}
		return;
	}
	float sc = qkn_scale(ss, eps);
	const float *w = h < nheads ? qw : kw;
#pragma unroll
	for (int k = 0; k < QKN_PER; k++) {
		int i = threadIdx.x + 32 * k;
		if (i < HEAD_DIM) row[i] = w[i] * (sc * v[k]);
	}
}

// qk_norm_rope: qk_norm then rope_kv (llama.cu, bias 0) in one launch, with
// their arithmetic: for token t (grid x) and head h (grid y: nheads + 2*nkv)
// of qkv (fp32, read only), the bias, then for q and k heads qk_norm's
// RMSNorm and rope_kv's rotation at pos[t] (cos/sin from the f32 table tab
// below ntab, else in double as rope_table); q heads to q[t] (T), k and v
// heads into kc, vc at element offset slot[t] plus the head's (none when
// slot < 0). Block 32 threads (one warp).
extern "C" __global__ void __launch_bounds__(32) qk_norm_rope(T *q, T *kc, T *vc, const float *qkv, const float *bias,
	const float *qw, const float *kw, const int *pos, const long long *slot, const float2 *tab,
	const double *inv_freq, int ntab, int nheads, int nkv, int interleaved, float eps) {
	__shared__ float hs[HEAD_DIM];
	blk_pdl_trigger();
	blk_pdl_wait();
	int t = blockIdx.x, h = blockIdx.y;
	long long W = (long long)(nheads + 2 * nkv) * HEAD_DIM;
	qkn_rope_head<false>(q, kc, vc, qkv + (long long)t * W + (long long)h * HEAD_DIM, bias, qw, kw, pos[t], slot[t], tab,
		inv_freq, ntab, nheads, nkv, interleaved, eps, t, h, hs);
}

// moe_gather: xe[r] = xb[src[r]], rows of dim T: the routed tokens'
// normalised inputs sorted by expert. Grid rows, any block.
extern "C" __global__ void moe_gather(T *xe, const T *xb, const int *src, int dim) {
	int r = blockIdx.x;
	const T *s = xb + (long long)src[r] * dim;
	T *d = xe + (long long)r * dim;
	for (int i = threadIdx.x; i < dim; i += blockDim.x) d[i] = s[i];
}

// moe_combine: x[t] += sum over j < k, in order, of w[t*k+j] *
// ye[row[t*k+j]] (the chosen experts' outputs, fp32 rows of dim), plus
// sigmoid(gate[t*gstride]) * sh[t] when sh is set (the shared expert).
// Grid (n tokens, any: the row's slices), any block.
extern "C" __global__ void moe_combine(float *x, const float *ye, const int *row, const float *w, const float *sh,
	const float *gate, int gstride, int k, int dim) {
	int t = blockIdx.x;
	float g = 0.f;
	if (sh) g = 1.0f / (1.0f + expf(-gate[(long long)t * gstride]));
	const int *rt = row + (long long)t * k;
	const float *wt = w + (long long)t * k;
	for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < dim; i += blockDim.x * gridDim.y) {
		float o = 0.f;
		for (int j = 0; j < k; j++) o += wt[j] * ye[(long long)rt[j] * dim + i];
		if (sh) o += g * sh[(long long)t * dim + i];
		x[(long long)t * dim + i] += o;
	}
}

// topk_token: token t's routing by one warp: the top k of the softmax
// over the first E (<= 32*TOPK_PER) of its stride router logits, as the
// CPU backend picks them: experts by logit, the lowest id on ties; the
// probabilities exp(l-max)/sum in double, rounded to float, renormalised
// in float (in rank order) when norm is set. Writes ids[t*k+j] and
// w[t*k+j], j in rank order.
#define TOPK_PER 16
#define MOE_NEG_INF __int_as_float(0xff800000)
// softmax_stats: a warp's lanes load logits l[lane + 32*i] (i <
// TOPK_PER; -inf past E) into v and return the max and the softmax's sum
// of exp(l-max) in double (each lane's terms in order, then a fixed tree).
__device__ __forceinline__ void softmax_stats(const float *l, int E, float *v, float &mx, double &s) {
	int lane = threadIdx.x & 31;
	mx = MOE_NEG_INF;
#pragma unroll
	for (int i = 0; i < TOPK_PER; i++) {
		int e = lane + 32 * i;
		v[i] = e < E ? l[e] : MOE_NEG_INF;
		mx = fmaxf(mx, v[i]);
	}
	for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
	s = 0.0;
#pragma unroll
	for (int i = 0; i < TOPK_PER; i++) s += lane + 32 * i < E ? exp((double)(v[i] - mx)) : 0.0;
	for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
}
__device__ __forceinline__ void topk_token(int t, int *ids, float *w, const float *logits, int stride, int E, int k,
	int norm) {
	int lane = threadIdx.x & 31;
	float v[TOPK_PER], mx;
	double s;
	softmax_stats(logits + (long long)t * stride, E, v, mx, s);
	unsigned taken = 0;
	float sum = 0.f;
	for (int j = 0; j < k; j++) {
		float bv = MOE_NEG_INF;
		int bi = 0x7fffffff;
#pragma unroll
		for (int i = 0; i < TOPK_PER; i++) {
			int e = lane + 32 * i;
			if (e < E && !(taken >> i & 1u) && (bi == 0x7fffffff || v[i] > bv)) {
				bv = v[i];
				bi = e;
			}
		}
		for (int o = 16; o > 0; o >>= 1) {
			float ov = __shfl_xor_sync(0xffffffffu, bv, o);
			int oi = __shfl_xor_sync(0xffffffffu, bi, o);
			if (oi != 0x7fffffff && (bi == 0x7fffffff || ov > bv || (ov == bv && oi < bi))) {
				bv = ov;
				bi = oi;
			}
		}
		if ((bi & 31) == lane) taken |= 1u << (bi >> 5);
		float p = (float)(exp((double)(bv - mx)) / s);
		sum += p;
		if (lane == 0) {
			ids[(long long)t * k + j] = bi;
			w[(long long)t * k + j] = p;
		}
	}
	if (norm && lane == 0)
		for (int j = 0; j < k; j++) w[(long long)t * k + j] /= sum;
}

// moe_topk: topk_token for n tokens, a warp each (any multiple of 32
// threads).
extern "C" __global__ void moe_topk(int *ids, float *w, const float *logits, int n, int stride, int E, int k, int norm) {
	int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
	if (t < n) topk_token(t, ids, w, logits, stride, E, k, norm);
}

// moe_sort: the nk (token, rank) pairs of moe_topk sorted by expert,
// stably (pair order within an expert): rows[p] is pair p's sorted row,
// src[row] its token (p / k), offs[e] .. offs[e+1] expert e's rows
// (E+1 entries), act[0 .. *nact) the experts with rows, in id order. One
// block of MOE_SORT_WARPS*32 threads, E <= MOE_MAXE (one thread per
// expert), nk < 2^21: each warp counts a contiguous range of the pairs;
// per expert, the ranges' bases inside the expert; one exclusive scan over
// the experts of (rows << 10 | has rows) gives the offsets and the active
// list; then each warp places its pairs 32 at a time (a pair's rank among
// the equal ids before it in its group from shuffles). Deterministic: no
// result depends on timing.
#define MOE_SORT_WARPS 16
#define MOE_MAXE (MOE_SORT_WARPS * 32)
__device__ __forceinline__ void sort_pairs(int *rows, int *src, int *offs, int *act, int *nact, const int *ids, int nk,
	int k, int E) {
	__shared__ int hist[MOE_SORT_WARPS][MOE_MAXE];
	__shared__ int wsum[MOE_SORT_WARPS];
	int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
	for (int w = 0; w < MOE_SORT_WARPS; w++)
		if (tid < E) hist[w][tid] = 0;
	__syncthreads();
	int per = (nk + MOE_SORT_WARPS - 1) / MOE_SORT_WARPS;
	int p0 = warp * per, p1 = min(nk, p0 + per);
	for (int p = p0 + lane; p < p1; p += 32) atomicAdd(&hist[warp][ids[p]], 1);
	__syncthreads();
	int e = tid, tot = 0;
	if (e < E)
		for (int w = 0; w < MOE_SORT_WARPS; w++) {
			int h = hist[w][e];
			hist[w][e] = tot;
			tot += h;
		}
	int v = e < E ? (tot << 10) | (tot > 0) : 0, inc = v;
	for (int d = 1; d < 32; d <<= 1) {
		int o = __shfl_up_sync(0xffffffffu, inc, d);
		if (lane >= d) inc += o;
	}
	if (lane == 31) wsum[warp] = inc;
	__syncthreads();
	if (warp == 0) {
		int x = lane < MOE_SORT_WARPS ? wsum[lane] : 0, y = x;
		for (int d = 1; d < 32; d <<= 1) {
			int o = __shfl_up_sync(0xffffffffu, y, d);
			if (lane >= d) y += o;
		}
		if (lane < MOE_SORT_WARPS) wsum[lane] = y - x;
	}
	__syncthreads();
	int ex = inc - v + wsum[warp];
	if (e < E) {
		offs[e] = ex >> 10;
		if (tot > 0) act[ex & 1023] = e;
		for (int w = 0; w < MOE_SORT_WARPS; w++) hist[w][e] += ex >> 10;
	}
	if (e == E - 1) {
		offs[E] = (ex + v) >> 10;
		*nact = (ex + v) & 1023;
	}
	__syncthreads();
	for (int g = p0; g < p1; g += 32) {
		int p = g + lane;
		int id = p < p1 ? ids[p] : -1;
		unsigned peers = 0;
		for (int j = 0; j < 32; j++)
			if (__shfl_sync(0xffffffffu, id, j) == id) peers |= 1u << j;
		int row = 0;
		if (id >= 0) row = hist[warp][id] + __popc(peers & ((1u << lane) - 1u));
		__syncwarp();
		if (id >= 0 && (peers & ((1u << lane) - 1u)) == 0) hist[warp][id] += __popc(peers);
		__syncwarp();
		if (id >= 0) {
			rows[p] = row;
			src[row] = p / k;
		}
	}
}
extern "C" __global__ void __launch_bounds__(MOE_SORT_WARPS * 32) moe_sort(int *rows, int *src, int *offs, int *act,
	int *nact, const int *ids, int nk, int k, int E) {
	sort_pairs(rows, src, offs, act, nact, ids, nk, k, E);
}

// route_one: moe_route's results for a pass of one token by the whole
// block, bit for bit: thread e ranks expert e among the E logits (greater
// first, the lower id on ties, NaN as -inf: topk_token's order, and always
// a permutation), the k first take topk_token's probabilities and write
// ids and w in rank order, and each chosen expert's one row is its place
// among the chosen by id (moe_sort's order). Only with write are the
// results written (block-uniform); picked (shared, or 0) receives the
// chosen expert whose place is slot, valid after the call for every thread.
__device__ __forceinline__ void route_one(int *rows, int *src, int *offs, int *act, int *nact, int *ids, float *w,
	const float *logits, int E, int k, int norm, bool write = true, int slot = -1, int *picked = 0) {
	__shared__ float sv[MOE_MAXE], sp[32];
	__shared__ int wcnt[MOE_SORT_WARPS];
	__shared__ float smx;
	__shared__ double ssum;
	int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
	float v = tid < E ? logits[tid] : MOE_NEG_INF;
	if (v != v) v = MOE_NEG_INF;
	if (tid < E) sv[tid] = v;
	if (write && warp == 0) {
		float lv[TOPK_PER], mx;
		double s;
		softmax_stats(logits, E, lv, mx, s);
		if (lane == 0) smx = mx, ssum = s;
	}
	__syncthreads();
	int rank = 0;
	if (tid < E)
		for (int x = 0; x < E; x++) {
			float u = sv[x];
			rank += u > v || (u == v && x < tid);
		}
	bool chosen = tid < E && rank < k;
	unsigned b = __ballot_sync(0xffffffffu, chosen);
	if (lane == 0) wcnt[warp] = __popc(b);
	__syncthreads();
	int before = __popc(b & ((1u << lane) - 1u));
	for (int i = 0; i < warp; i++) before += wcnt[i];
	if (chosen && before == slot) *picked = tid;
	if (write && tid < E) offs[tid] = before;
	if (write && chosen) {
		float p = (float)(exp((double)(logits[tid] - smx)) / ssum);
		ids[rank] = tid;
		sp[rank] = p;
		rows[rank] = before;
		src[before] = 0;
		act[before] = tid;
	}
	__syncthreads();
	if (write && tid == 0) {
		offs[E] = k;
		*nact = k;
		float sum = 0.f;
		for (int j = 0; j < k; j++) sum += sp[j];
		for (int j = 0; j < k; j++) w[j] = norm ? sp[j] / sum : sp[j];
	}
}

// moe_route: moe_topk then moe_sort in one block of MOE_SORT_WARPS warps
// (warp w routes tokens w, w+MOE_SORT_WARPS, ...; route_one for one
// token): one launch for the few tokens of a decode step. Same arguments
// and results as the two.
extern "C" __global__ void __launch_bounds__(MOE_SORT_WARPS * 32) moe_route(int *rows, int *src, int *offs, int *act,
	int *nact, int *ids, float *w, const float *logits, int n, int stride, int E, int k, int norm) {
	blk_pdl_trigger();
	blk_pdl_wait();
	if (n == 1) {
		route_one(rows, src, offs, act, nact, ids, w, logits, E, k, norm);
		return;
	}
	for (int t = threadIdx.x >> 5; t < n; t += MOE_SORT_WARPS) topk_token(t, ids, w, logits, stride, E, k, norm);
	__syncthreads();
	sort_pairs(rows, src, offs, act, nact, ids, n * k, k, E);
}

// moe_gemv: the grouped GEMVs of experts with few rows each (decode), for
// any T: block (x, s) takes the s-th expert with rows (e = act[s], s <
// *nact, as moe_sk), each of its 8 warps one unit of outputs, the weight
// rows read once per GT of the expert's rows (16-byte loads, CH chunks in
// flight per row and lane; with PRE the rows' X chunks too, else X is read
// after the weights). Each lane sums its chunks in order, then the warp's
// lanes by a fixed tree: a row's result depends on nothing else in the
// pass (nor on GT, CH or PRE). in % 8 == 0.
//   SILU  unit o < hidden: rows o and hidden+o of W ([E][2*hidden][in]);
//         h[r][o] = silu(g) * u (g, u rounded to T first), x = X[src[r]]
//   DOWN  unit o < out: row o of W ([E][out][in]); Y[r][o] (f32) = X[r] . W[o]
// moe_gemv_rows is the body: expert e's rows r0 .. r0+rows, x of row r
// X[tok] when tok >= 0, else X[src[r]] (X[r] without src).
template <bool SILU, int GT, int CH, bool PRE>
__device__ __forceinline__ void moe_gemv_rows(float *Y, T *h, const T *X, const T *W, const int *src, int tok, int e,
	int r0, int rows, int units, int in) {
	int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
	if (o >= units) return;
	const int nrow = SILU ? 2 : 1;
	const T *w0 = W + ((long long)e * nrow * units + o) * in;
	const T *w1 = w0 + (long long)units * in;
	for (int t0 = 0; t0 < rows; t0 += GT) {
		int nt = min(GT, rows - t0);
		const T *xr[GT];
#pragma unroll
		for (int j = 0; j < GT; j++) {
			int r = r0 + t0 + min(j, nt - 1);
			xr[j] = X + (long long)(tok >= 0 ? tok : src ? src[r] : r) * in;
		}
		float acc[2][GT];
#pragma unroll
		for (int j = 0; j < GT; j++) acc[0][j] = acc[1][j] = 0.f;
		for (int base = 0; base < in; base += CH * 256) {
			w8_t wv[2][CH], xw[PRE ? GT : 1][CH];
#pragma unroll
			for (int u = 0; u < CH; u++) {
				int c = base + u * 256 + lane * 8;
#pragma unroll
				for (int q = 0; q < nrow; q++) wv[q][u] = c < in ? ldw8((q ? w1 : w0) + c) : zw8();
				if (PRE) {
#pragma unroll
					for (int j = 0; j < GT; j++) xw[j][u] = c < in && j < nt ? ldw8(xr[j] + c) : zw8();
				}
			}
#pragma unroll
			for (int u = 0; u < CH; u++) {
				int c = base + u * 256 + lane * 8;
				if (c >= in) break;
				float wf[2][8];
#pragma unroll
				for (int q = 0; q < nrow; q++) cvt8(wv[q][u], wf[q]);
#pragma unroll
				for (int j = 0; j < GT; j++) {
					if (j < nt) {
						float xv[8];
						if (PRE)
							cvt8(xw[PRE ? j : 0][u], xv);
						else
							ld8(xr[j] + c, xv);
#pragma unroll
						for (int q = 0; q < nrow; q++)
#pragma unroll
							for (int i = 0; i < 8; i++) acc[q][j] = fmaf(wf[q][i], xv[i], acc[q][j]);
					}
				}
			}
		}
#pragma unroll
		for (int j = 0; j < GT; j++)
#pragma unroll
			for (int q = 0; q < nrow; q++)
				for (int d = 16; d > 0; d >>= 1) acc[q][j] += __shfl_xor_sync(0xffffffffu, acc[q][j], d);
		if (lane == 0) {
#pragma unroll
			for (int j = 0; j < GT; j++) {
				if (j >= nt) break;
				long long r = r0 + t0 + j;
				if (SILU) {
					float g = rt(acc[0][j]), u = rt(acc[1][j]);
#if USE_BF16
					h[r * units + o] = f2bf(g * (1.0f / (1.0f + expf(-g))) * u);
#else
					h[r * units + o] = g * (1.0f / (1.0f + expf(-g))) * u;
#endif
				} else {
					Y[r * units + o] = acc[0][j];
				}
			}
		}
	}
}
template <bool SILU, int GT, int CH, bool PRE>
__device__ __forceinline__ void moe_gemv(float *Y, T *h, const T *X, const T *W, const int *src, const int *act,
	const int *nact, const int *offs, int units, int in) {
	blk_pdl_trigger();
	blk_pdl_wait();
	int s = blockIdx.y;
	if (s >= *nact) return;
	int e = act[s], r0 = offs[e];
	moe_gemv_rows<SILU, GT, CH, PRE>(Y, h, X, W, src, -1, e, r0, offs[e + 1] - r0, units, in);
}
// moe_gemv_silu: grid (ceil(hidden/8), slots), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_gemv_silu(T *h, const T *X, const T *W, const int *src,
	const int *act, const int *nact, const int *offs, int hidden, int in) {
	moe_gemv<true, 4, 4, false>(0, h, X, W, src, act, nact, offs, hidden, in);
}
// moe_gemv_silu1: moe_gemv_silu (the same bits) for passes whose experts
// have one row each (a pass of one token), X prefetched with the weights
// (S1_OFF: moe_gemv_silu's form, for comparisons; S1_MINB: blocks an SM
// the registers must allow).
#ifndef S1_CH
#define S1_CH 4
#endif
#ifndef S1_MINB
#define S1_MINB 1
#endif
extern "C" __global__ void __launch_bounds__(256, S1_MINB) moe_gemv_silu1(T *h, const T *X, const T *W, const int *src,
	const int *act, const int *nact, const int *offs, int hidden, int in) {
#if S1_OFF
	moe_gemv<true, 4, 4, false>(0, h, X, W, src, act, nact, offs, hidden, in);
#else
	moe_gemv<true, 1, S1_CH, true>(0, h, X, W, src, act, nact, offs, hidden, in);
#endif
}
// moe_route_silu1: moe_route and moe_gemv_silu1 in one launch for a pass of
// one token (E <= 256): every block ranks the logits as route_one does and
// takes the chosen expert whose place is blockIdx.y (its row); block (0, 0)
// writes the routing for the kernels after. The same bits as the two.
// Grid (ceil(hidden/8), k), 256 threads.
extern "C" __global__ void __launch_bounds__(256, S1_MINB) moe_route_silu1(T *h, const T *X, const T *W, int *rows,
	int *src, int *offs, int *act, int *nact, int *ids, float *w, const float *logits, int E, int k, int norm,
	int hidden, int in) {
	__shared__ int picked;
	blk_pdl_trigger();
	blk_pdl_wait();
	int s = blockIdx.y;
	route_one(rows, src, offs, act, nact, ids, w, logits, E, k, norm, blockIdx.x == 0 && s == 0, s, &picked);
	moe_gemv_rows<true, 1, S1_CH, true>(0, h, X, W, 0, 0, picked, s, 1, hidden, in);
}
// moe_gemv_down: grid (ceil(out/8), slots), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_gemv_down(float *Y, const T *X, const T *W, const int *act,
	const int *nact, const int *offs, int out, int in) {
	moe_gemv<false, 4, 4, false>(Y, 0, X, W, 0, act, nact, offs, out, in);
}

// moe_gemv_down_add: moe_gemv_down and moe_combine in one launch, for
// passes of few (token, expert) pairs: warp o of the grid takes output o
// of every token, the pairs p = t*k+j in order, DA_P at a time with all
// their weight chunks in flight: d = W[ids[p]][o] . X[rows[p]] in
// moe_gemv's chunk order and lane tree, then per token moe_combine's sum
// over j in order, the shared expert's term and the add to x[t][o]. Equal
// to the two kernels bit for bit; a weight row is read once a pair (pairs
// sharing an expert find it in L2). Grid ceil(out/4), 128 threads. DA_PRE:
// X's chunks are loaded with the weights' rather than after them (at
// qwen3-30b-a3b batch 1 DA_P 4 with DA_PRE took 3.51 ms a step, DA_P 8
// without 3.72: docs/BENCHMARKS.md).
#ifndef DA_P
#define DA_P 4
#endif
#ifndef DA_CH
#define DA_CH 2
#endif
#ifndef DA_PRE
#define DA_PRE 1
#endif
extern "C" __global__ void __launch_bounds__(128) moe_gemv_down_add(float *x, const T *X, const T *W, const int *ids,
	const int *rows, const float *w, const float *sh, const float *gate, int gstride, int nk, int k, int out, int in) {
	blk_pdl_trigger();
	blk_pdl_wait();
	int o = blockIdx.x * 4 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
	if (o >= out) return;
	float acc = 0.f; // moe_combine's o of the token of pair p0
	for (int p0 = 0; p0 < nk; p0 += DA_P) {
		const T *wr[DA_P], *xr[DA_P];
#pragma unroll
		for (int q = 0; q < DA_P; q++) {
			int p = min(p0 + q, nk - 1);
			wr[q] = W + ((long long)ids[p] * out + o) * in;
			xr[q] = X + (long long)rows[p] * in;
		}
		float d[DA_P];
#pragma unroll
		for (int q = 0; q < DA_P; q++) d[q] = 0.f;
		for (int base = 0; base < in; base += DA_CH * 256) {
			w8_t wv[DA_P][DA_CH];
#if DA_PRE
			w8_t xw[DA_P][DA_CH];
#endif
#pragma unroll
			for (int u = 0; u < DA_CH; u++) {
				int c = base + u * 256 + lane * 8;
#pragma unroll
				for (int q = 0; q < DA_P; q++) {
					bool ok = c < in && p0 + q < nk;
					wv[q][u] = ok ? ldw8(wr[q] + c) : zw8();
#if DA_PRE
					xw[q][u] = ok ? ldw8(xr[q] + c) : zw8();
#endif
				}
			}
#pragma unroll
			for (int u = 0; u < DA_CH; u++) {
				int c = base + u * 256 + lane * 8;
				if (c >= in) break;
#pragma unroll
				for (int q = 0; q < DA_P; q++) {
					if (p0 + q < nk) {
						float wf[8], xv[8];
						cvt8(wv[q][u], wf);
#if DA_PRE
						cvt8(xw[q][u], xv);
#else
						ld8(xr[q] + c, xv);
#endif
#pragma unroll
						for (int i = 0; i < 8; i++) d[q] = fmaf(wf[i], xv[i], d[q]);
					}
				}
			}
		}
#pragma unroll
		for (int q = 0; q < DA_P; q++)
			for (int s = 16; s > 0; s >>= 1) d[q] += __shfl_xor_sync(0xffffffffu, d[q], s);
#pragma unroll
		for (int q = 0; q < DA_P; q++) {
			int p = p0 + q;
			if (p >= nk) break;
			acc += w[p] * d[q];
			if (p % k == k - 1) {
				long long t = p / k;
				if (sh) {
					float g = 1.0f / (1.0f + expf(-gate[t * gstride]));
					acc += g * sh[t * out + o];
				}
				if (lane == 0) x[t * out + o] += acc;
				acc = 0.f;
			}
		}
	}
}
