// sample.cu: sampling on the GPU by internal/sampling's rule (its package
// doc states it; rule.go is the CPU side), for the CUDA model backend
// (internal/compute/cuda/sample.go). Compiled at run time by NVRTC with no
// headers and --fmad=false: every float32 and float64 operation below is one
// IEEE operation rounded to nearest even (the rule's weights and sums are
// bit for bit those of the CPU); denormals are kept (NVRTC's default).
//
// Per pass, over R rows (one per seq with logits; padding rows inactive),
// all parameters read from device buffers written before the launch, so the
// three launches can be captured in a CUDA graph:
//   sample_adjust  grid (chunks, R): z = the adjusted logits (logit_bias,
//                  repetition, frequency and presence penalties from the
//                  request's per-token state words), written to the work row;
//                  per chunk: the argmax of z, a NaN flag, the raw max.
//   sample_weights grid (chunks, R): m = max z; w = E((z - m) / T) over the
//                  work row; the blocked sums' block totals (blocks of 256
//                  ids, each summed left to right); per chunk the sum of
//                  exp(l - raw max) for the raw logprobs.
//   sample_finish  grid (R), 1024 threads: the total S, the candidates, the
//                  Philox uniform, the draw, the raw logprobs, the count of
//                  the sampled token; one SampleOut per row.
// Candidates in weight order (top_k, top_p) are never sorted whole: they are
// taken in windows of up to 4096, each the next 4096 in weight order found
// by a radix select over the weights' bits (ties by id through a second
// select over the ids) and sorted in shared memory; the nucleus, min_p and
// the draw walk the windows in order and stop at the first that decides.
// The raw top-N logprobs use the same select over the raw logits.

typedef unsigned int u32;
typedef unsigned long long u64;

// The thread counts and the window are macros so that a host emulation of
// the kernels (internal/compute/cuda/testdata/sample_emu.cpp) runs the same
// code with one warp per block and small windows.
#define RB 256      // the rule's block
#define CH 4096     // ids per block of sample_adjust and sample_weights (16 rule blocks)
#ifndef CT
#define CT 256      // their threads
#endif
#ifndef WIN
#define WIN 4096    // candidates per window of sample_finish (a multiple of RB)
#endif
#ifndef FT
#define FT 1024     // sample_finish's threads
#endif
#define MAX_RB 1024 // rule blocks per row: vocabularies up to 262144
#define MAX_WIN (MAX_RB * RB / WIN)
#define MAX_TOP 20

#define F_ACTIVE 1
#define F_GREEDY 2
#define F_LOGPROB 4 // the sampled token's raw logprob
#define F_PEN 8     // frequency or presence penalty
#define F_REP 16    // repetition penalty

// A request's state word per token: the count of its accepted output
// tokens, and marks for "in the prompt" and "has a logit bias".
#define W_PROMPT 0x80000000u
#define W_BIAS 0x40000000u
#define W_COUNT 0x3fffffffu

#define NEG_INF __int_as_float(0xff800000)

// SampleRow is one row's parameters (internal/compute/cuda/sample.go
// writes them: sampleRowBytes and the offsets there).
struct SampleRow {
	u64 words;     // u32 [V] state words, 0: none (no bias, no penalty)
	u64 bias_ids;  // int [n_bias], ascending
	u64 bias_vals; // float [n_bias]
	u64 seed, step;
	double top_p;  // in (0, 1), or 0: off
	double min_p;  // > 0, or 0: off
	double freq, pres;
	int flags;
	int top_k;     // in (1, V), or 0: off
	int n_top;     // top logprobs, 0..MAX_TOP
	int n_bias;
	float inv_t;   // float32(1 / temperature)
	float rep;     // float32(repetition penalty)
	int pad0, pad1;
};
static_assert(sizeof(SampleRow) == 104, "SampleRow layout");

struct SampleOut {
	int token;
	float logprob;
	int n_top;
	int pad;
	int top_id[MAX_TOP];
	float top_lp[MAX_TOP];
};
static_assert(sizeof(SampleOut) == 176, "SampleOut layout");

struct ChunkStat {
	float best;   // max non-NaN z of the chunk
	int best_id;  // its lowest id, -1 if every z is NaN
	float rawmax; // max raw logit
	int nan;      // some z is NaN
};

struct AcceptEntry {
	u64 words;
	int token;
	int pad;
};

// rule_exp is the rule's E(d) (sampling.weight), one rounding per operation.
__device__ __forceinline__ float rule_exp(float d) {
	if (!(d >= -86.0f)) return 0.0f;
	const float log2e = __int_as_float(0x3fb8aa3b), shifter = __int_as_float(0x4b400000);
	const float ln2hi = __int_as_float(0x3f317200), ln2lo = __int_as_float(0x35bfbe8e);
	float k = __fsub_rn(__fadd_rn(__fmul_rn(d, log2e), shifter), shifter);
	float r = __fsub_rn(__fsub_rn(d, __fmul_rn(k, ln2hi)), __fmul_rn(k, ln2lo));
	float q = __int_as_float(0x39500d01);                 // 1/5040
	q = __fadd_rn(__fmul_rn(q, r), __int_as_float(0x3ab60b61)); // 1/720
	q = __fadd_rn(__fmul_rn(q, r), __int_as_float(0x3c088889)); // 1/120
	q = __fadd_rn(__fmul_rn(q, r), __int_as_float(0x3d2aaaab)); // 1/24
	q = __fadd_rn(__fmul_rn(q, r), __int_as_float(0x3e2aaaab)); // 1/6
	q = __fadd_rn(__fmul_rn(q, r), 0.5f);
	q = __fadd_rn(__fmul_rn(q, r), 1.0f);
	q = __fadd_rn(__fmul_rn(q, r), 1.0f);
	return __fmul_rn(q, __int_as_float(((int)k + 127) << 23));
}

// philox_uniform is sampling.Uniform(seed, step): Philox4x32-10 of counter
// {step, step>>32, 0, 0} under key {seed, seed>>32}, 53 bits.
__device__ double philox_uniform(u64 seed, u64 step) {
	u32 c0 = (u32)step, c1 = (u32)(step >> 32), c2 = 0, c3 = 0;
	u32 k0 = (u32)seed, k1 = (u32)(seed >> 32);
	for (int i = 0; i < 10; i++) {
		if (i > 0) {
			k0 += 0x9E3779B9u;
			k1 += 0xBB67AE85u;
		}
		u64 p0 = (u64)0xD2511F53u * c0, p1 = (u64)0xCD9E8D57u * c2;
		u32 n0 = (u32)(p1 >> 32) ^ c1 ^ k0, n1 = (u32)p1, n2 = (u32)(p0 >> 32) ^ c3 ^ k1, n3 = (u32)p0;
		c0 = n0; c1 = n1; c2 = n2; c3 = n3;
	}
	u64 x = ((u64)c0 << 21) | (u64)(c1 >> 11);
	return __dmul_rn((double)x, __longlong_as_double(0x3CA0000000000000LL)); // 2^-53
}

// bias_of is the bias of token id (present: its word has W_BIAS).
__device__ float bias_of(const SampleRow &row, int id) {
	const int *ids = (const int *)row.bias_ids;
	int lo = 0, hi = row.n_bias - 1;
	while (lo <= hi) {
		int mid = (lo + hi) >> 1;
		int v = ids[mid];
		if (v == id) return ((const float *)row.bias_vals)[mid];
		if (v < id) lo = mid + 1;
		else hi = mid - 1;
	}
	return 0.0f;
}

// adjust is steps 1-3 of the rule for token id: bias, repetition penalty,
// frequency and presence penalties.
__device__ __forceinline__ float adjust(const SampleRow &row, float x, int id) {
	if (!row.words) return x;
	u32 wd = ((const u32 *)row.words)[id];
	if (!wd) return x;
	float z = x;
	if (wd & W_BIAS) z = __fadd_rn(z, bias_of(row, id));
	u32 n = wd & W_COUNT;
	if ((row.flags & F_REP) && ((wd & W_PROMPT) || n)) z = z > 0.0f ? __fdiv_rn(z, row.rep) : __fmul_rn(z, row.rep);
	if ((row.flags & F_PEN) && n) z = __fsub_rn(z, (float)__dadd_rn(__dmul_rn(row.freq, (double)n), row.pres));
	return z;
}

__device__ __forceinline__ bool better(float v, int id, float bv, int bid) {
	return bid < 0 || (id >= 0 && (v > bv || (v == bv && id < bid)));
}

extern "C" __global__ void __launch_bounds__(CT) sample_adjust(const SampleRow *rows, const float *logits, float *work,
		ChunkStat *cs, int V, int nch) {
	const SampleRow &row = rows[blockIdx.y];
	if (!(row.flags & F_ACTIVE)) return;
	const float *l = logits + (long long)blockIdx.y * V;
	float *z = work + (long long)blockIdx.y * V;
	int base = blockIdx.x * CH, end = min(base + CH, V);
	float bv = NEG_INF, rawmax = NEG_INF;
	int bid = -1, nan = 0;
	for (int i = base + threadIdx.x; i < end; i += CT) {
		float x = l[i];
		rawmax = fmaxf(rawmax, x);
		float v = adjust(row, x, i);
		z[i] = v;
		if (v != v) nan = 1;
		else if (bid < 0 || v > bv) bv = v, bid = i; // ids rise: ties keep the lowest
	}
	for (int o = 16; o > 0; o >>= 1) {
		float ov = __shfl_xor_sync(0xffffffffu, bv, o);
		int oid = __shfl_xor_sync(0xffffffffu, bid, o);
		if (better(ov, oid, bv, bid)) bv = ov, bid = oid;
		rawmax = fmaxf(rawmax, __shfl_xor_sync(0xffffffffu, rawmax, o));
		nan |= __shfl_xor_sync(0xffffffffu, nan, o);
	}
	__shared__ float sv[CT / 32], sr[CT / 32];
	__shared__ int sid[CT / 32], sn[CT / 32];
	int w = threadIdx.x >> 5;
	if ((threadIdx.x & 31) == 0) sv[w] = bv, sid[w] = bid, sr[w] = rawmax, sn[w] = nan;
	__syncthreads();
	if (threadIdx.x == 0) {
		for (int j = 1; j < CT / 32; j++) {
			if (better(sv[j], sid[j], bv, bid)) bv = sv[j], bid = sid[j];
			rawmax = fmaxf(rawmax, sr[j]);
			nan |= sn[j];
		}
		ChunkStat s;
		s.best = bv;
		s.best_id = bid;
		s.rawmax = rawmax;
		s.nan = nan;
		cs[blockIdx.y * nch + blockIdx.x] = s;
	}
}

// row_max is m (NaN if some z is NaN) and the raw max, from the chunks.
__device__ void row_max(const ChunkStat *cs, int nch, float *m, float *rawmax) {
	float mx = NEG_INF, rm = NEG_INF;
	int nan = 0;
	for (int c = 0; c < nch; c++) {
		ChunkStat s = cs[c];
		if (s.best_id >= 0) mx = fmaxf(mx, s.best);
		rm = fmaxf(rm, s.rawmax);
		nan |= s.nan;
	}
	*m = nan ? __int_as_float(0x7fc00000) : mx;
	*rawmax = rm;
}

__device__ __forceinline__ bool degenerate(float m) { return m != m || m == NEG_INF || m == -NEG_INF; }

__device__ __forceinline__ bool wants_lp(const SampleRow &row) { return (row.flags & F_LOGPROB) || row.n_top > 0; }

extern "C" __global__ void __launch_bounds__(CT) sample_weights(const SampleRow *rows, const float *logits, float *work,
		const ChunkStat *cs, double *rsum, double *bsum, int V, int nch, int nrb) {
	const SampleRow &row = rows[blockIdx.y];
	if (!(row.flags & F_ACTIVE)) return;
	bool greedy = row.flags & F_GREEDY, lp = wants_lp(row);
	if (greedy && !lp) return;
	__shared__ float sm_m, sm_raw;
	if (threadIdx.x == 0) row_max(cs + blockIdx.y * nch, nch, &sm_m, &sm_raw);
	__syncthreads();
	float m = sm_m, rawmax = sm_raw;
	int base = blockIdx.x * CH;
	if (lp) {
		const float *l = logits + (long long)blockIdx.y * V;
		double s = 0;
		for (int i = base + threadIdx.x; i < min(base + CH, V); i += CT) s += exp((double)__fsub_rn(l[i], rawmax));
		for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
		__shared__ double ss[CT / 32];
		if ((threadIdx.x & 31) == 0) ss[threadIdx.x >> 5] = s;
		__syncthreads();
		if (threadIdx.x == 0) {
			for (int j = 1; j < CT / 32; j++) s += ss[j];
			rsum[blockIdx.y * nch + blockIdx.x] = s;
		}
	}
	if (greedy || degenerate(m)) return;
	// Weights, and the 16 rule blocks of this chunk, each summed left to right.
	__shared__ float sw[CH / RB][RB + 1];
	float *w = work + (long long)blockIdx.y * V;
	for (int j = 0; j < CH / RB; j++) {
		for (int t = threadIdx.x; t < RB; t += CT) {
			int i = base + j * RB + t;
			float e = 0.0f;
			if (i < V) {
				e = rule_exp(__fmul_rn(__fsub_rn(w[i], m), row.inv_t));
				w[i] = e;
			}
			sw[j][t] = e;
		}
	}
	__syncthreads();
	for (int j = threadIdx.x; j < CH / RB; j += CT) {
		int b = blockIdx.x * (CH / RB) + j;
		if (b < nrb) {
			int n = min(RB, V - b * RB);
			double s = 0;
			for (int q = 0; q < n; q++) s = __dadd_rn(s, (double)sw[j][q]);
			bsum[(long long)blockIdx.y * nrb + b] = s;
		}
	}
}

// Keys: a candidate's order key, larger first; the composite ~key<<32 | id
// sorts ascending in the rule's order (key descending, then id ascending).
__device__ __forceinline__ u32 key_of(const float *src, int raw, int i) {
	u32 u = __float_as_uint(src[i]);
	if (!raw) return u; // weights: >= 0, so their bits order them
	if ((u & 0x7fffffffu) > 0x7f800000u) return 0; // NaN last
	return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 comp(u32 key, int id) { return ((u64)(~key) << 32) | (u32)id; }
__device__ __forceinline__ int comp_id(u64 c) { return (int)(u32)c; }
__device__ __forceinline__ float comp_w(u64 c) { return __uint_as_float(~(u32)(c >> 32)); }

struct Fin {
	int d, cum, cnt, first, next, bstar, tok;
	double P, W, target, Pstar;
	int wsum[33];
	double Pw[WIN / RB];
};

// block_scan is the exclusive prefix count of flag over the block's
// threads, in thread order; *total the count.
__device__ int block_scan(Fin &f, int flag, int *total) {
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	u32 m = __ballot_sync(0xffffffffu, flag);
	int rank = __popc(m & ((1u << lane) - 1u));
	if (lane == 0) f.wsum[warp] = __popc(m);
	__syncthreads();
	if (threadIdx.x == 0) {
		int s = 0;
		for (int w = 0; w < FT / 32; w++) {
			int t = f.wsum[w];
			f.wsum[w] = s;
			s += t;
		}
		f.wsum[32] = s;
	}
	__syncthreads();
	rank += f.wsum[warp];
	*total = f.wsum[32];
	__syncthreads();
	return rank;
}

// bitonic sorts keys[0, n) ascending.
__device__ void bitonic(u64 *keys, int n) {
	int sz = 2;
	while (sz < n) sz <<= 1;
	for (int i = n + threadIdx.x; i < sz; i += FT) keys[i] = ~0ull;
	__syncthreads();
	if (n < 2) return;
	for (int k = 2; k <= sz; k <<= 1) {
		for (int j = k >> 1; j > 0; j >>= 1) {
			for (int i = threadIdx.x; i < sz; i += FT) {
				int ixj = i ^ j;
				if (ixj > i) {
					u64 a = keys[i], b = keys[ixj];
					if ((a > b) == ((i & k) == 0)) keys[i] = b, keys[ixj] = a;
				}
			}
			__syncthreads();
		}
	}
}

// digit_pick: with hist[] counted, the digit (scanning from 255 down when
// desc, else from 0 up) whose bucket holds the rem-th entry; f.cum: the
// entries in the buckets scanned before it.
__device__ void digit_pick(Fin &f, const u32 *hist, int rem, bool desc) {
	if (threadIdx.x == 0) {
		int cum = 0, d = desc ? 0 : 255;
		for (int s = 0; s < 256; s++) {
			int dd = desc ? 255 - s : s;
			if (cum + (int)hist[dd] >= rem) {
				d = dd;
				break;
			}
			cum += hist[dd];
		}
		f.d = d;
		f.cum = cum;
	}
	__syncthreads();
}

// fill_sorted puts into keys[], sorted, the first cnt >= need entries of
// src (weights, or raw logits when raw) in the rule's order that come after
// the composite bnd (all when !hasb): the need-th largest key T among them
// by radix select, then every one with a key >= T if that fits a window,
// else those above T and the first ties at T by id (a select over the ids).
// At least need entries must come after bnd. Returns cnt <= WIN.
__device__ int fill_sorted(Fin &f, u64 *keys, u32 *hist, const float *src, int raw, int V, bool hasb, u64 bnd,
		int need) {
	u32 prefix = 0, pmask = 0;
	int rem = need, above = 0, eq = 0;
	for (int shift = 24; shift >= 0; shift -= 8) {
		for (int i = threadIdx.x; i < 256; i += FT) hist[i] = 0;
		__syncthreads();
		for (int i = threadIdx.x; i < V; i += FT) {
			u32 k = key_of(src, raw, i);
			if ((k & pmask) != prefix || (hasb && comp(k, i) <= bnd)) continue;
			atomicAdd(&hist[(k >> shift) & 255u], 1u);
		}
		__syncthreads();
		digit_pick(f, hist, rem, true);
		int d = f.d;
		rem -= f.cum;
		above += f.cum;
		eq = hist[d];
		prefix |= (u32)d << shift;
		pmask |= 255u << shift;
		__syncthreads();
	}
	u32 T = prefix;
	int idmax = 0x7fffffff; // ties at T taken: ids <= idmax
	if (above + eq > WIN) {
		int iprefix = 0, imask = 0;
		for (int shift = 16; shift >= 0; shift -= 8) {
			for (int i = threadIdx.x; i < 256; i += FT) hist[i] = 0;
			__syncthreads();
			for (int i = threadIdx.x; i < V; i += FT) {
				if ((i & imask) != iprefix || key_of(src, raw, i) != T || (hasb && comp(T, i) <= bnd)) continue;
				atomicAdd(&hist[(i >> shift) & 255], 1u);
			}
			__syncthreads();
			digit_pick(f, hist, rem, false);
			rem -= f.cum;
			iprefix |= f.d << shift;
			imask |= 255 << shift;
			__syncthreads();
		}
		idmax = iprefix;
	}
	if (threadIdx.x == 0) f.cnt = 0;
	__syncthreads();
	for (int i = threadIdx.x; i < V; i += FT) {
		u32 k = key_of(src, raw, i);
		if (k < T || (k == T && i > idmax)) continue;
		u64 c = comp(k, i);
		if (hasb && c <= bnd) continue;
		int slot = atomicAdd(&f.cnt, 1);
		if (slot < WIN) keys[slot] = c;
	}
	__syncthreads();
	int cnt = min(f.cnt, WIN);
	bitonic(keys, cnt);
	return cnt;
}

// fill_ids puts into keys[] the next up to need ids from start on whose
// weight is at least min_p, in id order; f.next: where the next window
// starts. Returns the count.
__device__ int fill_ids(Fin &f, u64 *keys, const float *w, int V, int start, int need, double min_p) {
	int cnt = 0;
	if (threadIdx.x == 0) f.next = V;
	for (int base = start; base < V && cnt < need; base += FT) {
		int i = base + threadIdx.x;
		float x = i < V ? w[i] : 0.0f;
		int flag = i < V && (double)x >= min_p;
		int total;
		int rank = block_scan(f, flag, &total);
		if (flag && cnt + rank < need) {
			keys[cnt + rank] = comp(__float_as_uint(x), i);
			if (cnt + rank == need - 1) f.next = i + 1;
		}
		cnt = min(cnt + total, need);
	}
	__syncthreads();
	return cnt;
}

// count_at_least counts the weights >= min_p.
__device__ int count_at_least(Fin &f, const float *w, int V, double min_p) {
	int c = 0;
	for (int i = threadIdx.x; i < V; i += FT) c += (double)w[i] >= min_p;
	for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
	if (threadIdx.x == 0) f.cnt = 0;
	__syncthreads();
	if ((threadIdx.x & 31) == 0) atomicAdd(&f.cnt, c);
	__syncthreads();
	return f.cnt;
}

// draw_list is steps 6-9 of the rule over candidates taken in windows: in
// weight order (top_k, top_p) or in id order (min_p alone). S: the blocked
// total of every weight in id order.
__device__ int draw_list(Fin &f, u64 *keys, u32 *hist, double *Rs, u64 *wb, int *wp, const SampleRow &row,
		const float *w, int V, double S, double u) {
	bool byid = row.top_k == 0 && row.top_p == 0;
	bool byp = row.top_p > 0;
	int ncap = row.top_k > 0 ? row.top_k : V;
	if (row.min_p > 0) ncap = min(ncap, count_at_least(f, w, V, row.min_p));
	double limit = __dmul_rn(row.top_p, S);
	int pos = 0, wi = 0, n = -1, cnt = 0;
	bool hasb = false;
	u64 bnd = 0;
	int next = 0;
	while (pos < ncap) {
		int need = min(WIN, ncap - pos);
		if (threadIdx.x == 0) wp[wi] = pos, wb[wi] = byid ? (u64)next : (hasb ? bnd : ~0ull);
		cnt = byid ? fill_ids(f, keys, w, V, next, need, row.min_p) : fill_sorted(f, keys, hist, w, 0, V, hasb, bnd, need);
		int nh = min(cnt, ncap - pos);
		int nb = (nh + RB - 1) / RB;
		for (int j = threadIdx.x; j < nb; j += FT) {
			int q0 = j * RB, q1 = min(nh, q0 + RB);
			double s = 0;
			for (int q = q0; q < q1; q++) s = __dadd_rn(s, (double)comp_w(keys[q]));
			Rs[pos / RB + j] = s;
		}
		if (threadIdx.x == 0) f.first = 0x7fffffff;
		__syncthreads();
		if (byp) {
			if (threadIdx.x == 0) {
				double p = f.P;
				if (pos == 0) p = 0;
				for (int j = 0; j < nb; j++) f.Pw[j] = p, p = __dadd_rn(p, Rs[pos / RB + j]);
			}
			__syncthreads();
			for (int j = threadIdx.x; j < nb; j += FT) {
				int q0 = j * RB, q1 = min(nh, q0 + RB);
				double P = f.Pw[j], r = 0;
				for (int q = q0; q < q1; q++) {
					r = __dadd_rn(r, (double)comp_w(keys[q]));
					if (__dadd_rn(P, r) > limit) {
						atomicMin(&f.first, pos + q);
						break;
					}
				}
			}
			__syncthreads();
			if (f.first != 0x7fffffff) {
				n = f.first + 1;
				break;
			}
		}
		if (threadIdx.x == 0) {
			double p = pos == 0 ? 0 : f.P;
			for (int j = 0; j < nb; j++) p = __dadd_rn(p, Rs[pos / RB + j]);
			f.P = p;
		}
		bnd = keys[nh - 1];
		hasb = true;
		next = f.next;
		pos += nh;
		wi++;
		__syncthreads();
		if (nh < need) break; // unreachable: the candidates ran out
	}
	int cur = n < 0 ? wi - 1 : wi; // the window in keys[]
	if (n < 0) n = pos;
	// W, the target, and the block where C first exceeds it.
	if (threadIdx.x == 0) {
		int blast = (n - 1) / RB;
		double P = 0;
		for (int b = 0; b < blast; b++) P = __dadd_rn(P, Rs[b]);
		double r = 0;
		for (int q = blast * RB - wp[cur]; q < n - wp[cur]; q++) r = __dadd_rn(r, (double)comp_w(keys[q]));
		double W = __dadd_rn(P, r);
		double target = __dmul_rn(u, W);
		double Pb = 0;
		int bs = blast;
		for (int b = 0; b < blast; b++) {
			double nx = __dadd_rn(Pb, Rs[b]);
			if (nx > target) {
				bs = b;
				break;
			}
			Pb = nx;
		}
		f.bstar = bs;
		f.Pstar = Pb;
		f.target = target;
	}
	__syncthreads();
	int bs = f.bstar;
	int wbs = bs * RB / WIN;
	if (wbs != cur) { // walk an earlier window again: select it anew
		int p0 = wp[wbs];
		u64 b0 = wb[wbs];
		int need = min(WIN, n - p0);
		if (byid) fill_ids(f, keys, w, V, (int)b0, need, row.min_p);
		else fill_sorted(f, keys, hist, w, 0, V, b0 != ~0ull, b0, need);
	}
	if (threadIdx.x == 0) {
		int p0 = wp[wbs];
		int q0 = bs * RB - p0, q1 = min(n - p0, q0 + RB);
		double r = 0;
		int tok = comp_id(keys[q1 - 1]);
		for (int q = q0; q < q1; q++) {
			r = __dadd_rn(r, (double)comp_w(keys[q]));
			if (__dadd_rn(f.Pstar, r) > f.target) {
				tok = comp_id(keys[q]);
				break;
			}
		}
		f.tok = tok;
	}
	__syncthreads();
	return f.tok;
}

extern "C" __global__ void __launch_bounds__(FT) sample_finish(const SampleRow *rows, const float *logits, const float *work,
		const ChunkStat *cs, const double *rsum, const double *bsum, SampleOut *out, int V, int nch, int nrb) {
	__shared__ u64 keys[WIN];
	__shared__ double Rs[MAX_RB];
	__shared__ u64 wb[MAX_WIN];
	__shared__ int wp[MAX_WIN];
	__shared__ u32 hist[256];
	__shared__ Fin f;
	const SampleRow &row = rows[blockIdx.x];
	if (!(row.flags & F_ACTIVE)) return;
	const ChunkStat *c = cs + blockIdx.x * nch;
	const float *l = logits + (long long)blockIdx.x * V;
	const float *w = work + (long long)blockIdx.x * V;
	__shared__ float sm_m, sm_raw;
	__shared__ int sm_tok;
	if (threadIdx.x == 0) {
		row_max(c, nch, &sm_m, &sm_raw);
		// The argmax of z: the lowest id of the largest non-NaN, 0 if none.
		float bv = NEG_INF;
		int bid = -1;
		for (int j = 0; j < nch; j++)
			if (better(c[j].best, c[j].best_id, bv, bid)) bv = c[j].best, bid = c[j].best_id;
		sm_tok = bid < 0 ? 0 : bid;
	}
	__syncthreads();
	int tok = sm_tok;
	if (!(row.flags & F_GREEDY) && !degenerate(sm_m)) {
		double u = philox_uniform(row.seed, row.step);
		const double *bs = bsum + (long long)blockIdx.x * nrb;
		if (threadIdx.x == 0) {
			double S = 0;
			for (int b = 0; b < nrb; b++) S = __dadd_rn(S, bs[b]);
			f.W = S;
			if (row.top_k == 0 && row.top_p == 0 && row.min_p == 0) {
				// Every id in id order: only the block where P passes u*S is walked.
				double target = __dmul_rn(u, S), P = 0;
				int t = V - 1;
				for (int b = 0; b < nrb; b++) {
					double nx = __dadd_rn(P, bs[b]);
					if (nx <= target) {
						P = nx;
						continue;
					}
					int lo = b * RB, hi = min(V, lo + RB);
					double r = 0;
					t = hi - 1;
					for (int i = lo; i < hi; i++) {
						r = __dadd_rn(r, (double)w[i]);
						if (__dadd_rn(P, r) > target) {
							t = i;
							break;
						}
					}
					break;
				}
				sm_tok = t;
			}
		}
		__syncthreads();
		if (row.top_k == 0 && row.top_p == 0 && row.min_p == 0) tok = sm_tok;
		else tok = draw_list(f, keys, hist, Rs, wb, wp, row, w, V, f.W, u);
	}
	SampleOut *o = out + blockIdx.x;
	if (threadIdx.x == 0) {
		o->token = tok;
		o->logprob = 0.0f;
		o->n_top = row.n_top;
	}
	if (wants_lp(row)) {
		__shared__ double lse;
		if (threadIdx.x == 0) {
			double s = 0;
			for (int j = 0; j < nch; j++) s += rsum[blockIdx.x * nch + j];
			lse = log(s);
			if (row.flags & F_LOGPROB) o->logprob = (float)((double)__fsub_rn(l[tok], sm_raw) - lse);
		}
		__syncthreads();
		if (row.n_top > 0) {
			fill_sorted(f, keys, hist, l, 1, V, false, 0, row.n_top);
			for (int t = threadIdx.x; t < row.n_top; t += FT) {
				int id = comp_id(keys[t]);
				o->top_id[t] = id;
				o->top_lp[t] = (float)((double)__fsub_rn(l[id], sm_raw) - lse);
			}
		}
	}
	if (threadIdx.x == 0 && row.words) {
		u32 *wd = (u32 *)row.words;
		if ((wd[tok] & W_COUNT) != W_COUNT) wd[tok] += 1;
	}
}

// sample_accept counts accepted tokens into their requests' state words.
extern "C" __global__ void sample_accept(const AcceptEntry *e, int n) {
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
		atomicAdd((u32 *)e[i].words + e[i].token, 1u);
}

// sample_take gives the n token rows of a pass whose token is -1 - r the
// token the previous pass sampled in its row r (queued passes: the host
// has not seen it yet).
extern "C" __global__ void sample_take(int *tok, const SampleOut *prev, int n) {
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
		int t = tok[i];
		if (t < 0) tok[i] = prev[-1 - t].token;
	}
}

// sample_init marks a new state's words (zeroed before): the prompt's
// tokens (for the repetition penalty) and the biased ones.
extern "C" __global__ void sample_init(u32 *words, const int *prompt, int np, const int *bias_ids, int nb) {
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < np + nb; i += gridDim.x * blockDim.x) {
		if (i < np) atomicOr(words + prompt[i], W_PROMPT);
		else atomicOr(words + bias_ids[i - np], W_BIAS);
	}
}

// sample_philox writes sampling.Uniform(seeds[i], steps[i]) (tests).
extern "C" __global__ void sample_philox(double *out, const u64 *seeds, const u64 *steps, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) out[i] = philox_uniform(seeds[i], steps[i]);
}

// sample_exp writes the rule's E(d) (tests).
extern "C" __global__ void sample_exp(float *out, const float *d, int n) {
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i < n) out[i] = rule_exp(d[i]);
}
