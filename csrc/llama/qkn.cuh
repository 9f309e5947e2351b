// qkn.cuh: RoPE's cos/sin, and a Qwen3 head's q/k RMSNorm with RoPE and
// the KV write by one warp, shared by blocks.cu (qk_norm, qk_norm_rope) and
// llama.cu (rope_kv, gemv2_qkv, gemm_sk_qkv, gemv2_qkn). csrc.LlamaKernel
// inlines it where a kernel set includes it (NVRTC gets no headers); the
// includer defines T, HEAD_DIM, f2bf.

// rope_cs: the cos and sin of rotated pair i at position p, from the f32
// table tab below ntab positions, else in double (as rope_table makes it).
__device__ __forceinline__ void rope_cs(int p, int i, const float2 *tab, const double *inv_freq, int ntab, float &c,
	float &sv) {
	if (p < ntab) {
		float2 cs = tab[(long long)p * (HEAD_DIM / 2) + i];
		c = cs.x;
		sv = cs.y;
	} else {
		double a = (double)p * inv_freq[i];
		c = (float)cos(a);
		sv = (float)sin(a);
	}
}

// qkn_ld reads one f32: plainly, or with CG from L2 (another SM's writes
// of this kernel, after a fence).
template <bool CG> __device__ __forceinline__ float qkn_ld(const float *p) {
#ifdef __CUDA_ARCH__
	if (CG) {
		float v;
		asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
		return v;
	}
#endif
	return *p;
}

// qkn_load reads lane's elements of a head (row, plus bias b unless 0) into
// v and returns the sum of their squares; qkn_scale sums it over the warp
// and returns the RMSNorm scale.
#define QKN_PER ((HEAD_DIM + 31) / 32)
template <bool CG = false> __device__ __forceinline__ float qkn_load(const float *row, const float *b, float *v) {
	int lane = threadIdx.x & 31;
	float ss = 0.f;
#pragma unroll
	for (int k = 0; k < QKN_PER; k++) {
		int i = lane + 32 * k;
		float x = 0.f;
		if (i < HEAD_DIM) {
			x = qkn_ld<CG>(row + i);
			if (b) x += b[i];
		}
		v[k] = x;
		ss += x * x;
	}
	return ss;
}
__device__ __forceinline__ float qkn_scale(float ss, float eps) {
	for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
	return 1.0f / sqrtf(ss / (float)HEAD_DIM + eps);
}

// stT stores v as T (bf16: rounded as llama.cu's st).
__device__ __forceinline__ void stT(T *p, long long i, float v) {
#if USE_BF16
	p[i] = f2bf(v);
#else
	p[i] = v;
#endif
}

// qkn_rope_head: qk_norm then rope_kv (llama.cu, bias 0) for token t and
// head h (of nheads q heads, nkv k heads, nkv v heads) of a qkv row (f32,
// row: the head's HEAD_DIM values): the bias, then for q and k heads the
// RMSNorm with qw (q) or kw (k) and the rotation at pos p (cos/sin from the
// f32 table tab below ntab, else in double as rope_table); q heads to q[t]
// (T), k and v heads into kc, vc at element offset s plus the head's (none
// when s < 0). One warp; hs is its HEAD_DIM floats of shared memory.
template <bool CG>
__device__ __forceinline__ void qkn_rope_head(T *q, T *kc, T *vc, const float *row, const float *bias, const float *qw,
	const float *kw, int p, long long s, const float2 *tab, const double *inv_freq, int ntab, int nheads, int nkv,
	int interleaved, float eps, int t, int h, float *hs) {
	const int half = HEAD_DIM / 2;
	int lane = threadIdx.x & 31;
	int QD = nheads * HEAD_DIM;
	const float *b = bias ? bias + (long long)h * HEAD_DIM : 0;
	float v[QKN_PER];
	float ss = qkn_load<CG>(row, b, v);
	if (h >= nheads + nkv) {
		if (s >= 0) {
			long long o = s + (long long)(h - nheads - nkv) * HEAD_DIM;
#pragma unroll
			for (int k = 0; k < QKN_PER; k++) {
				int i = lane + 32 * k;
				if (i < HEAD_DIM) stT(vc, o + i, v[k]);
			}
		}
		return;
	}
	float sc = qkn_scale(ss, eps);
	const float *w = h < nheads ? qw : kw;
#pragma unroll
	for (int k = 0; k < QKN_PER; k++) {
		int i = lane + 32 * k;
		if (i < HEAD_DIM) hs[i] = w[i] * (sc * v[k]);
	}
	__syncwarp();
	for (int i = lane; i < half; i += 32) {
		int ia, ib;
		if (interleaved) {
			ia = 2 * i;
			ib = ia + 1;
		} else {
			ia = i;
			ib = i + half;
		}
		float c, sv;
		rope_cs(p, i, tab, inv_freq, ntab, c, sv);
		float a = hs[ia], bb = hs[ib];
		float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(bb, sv));
		float rb = __fadd_rn(__fmul_rn(a, sv), __fmul_rn(bb, c));
		if (h < nheads) {
			long long o = (long long)t * QD + (long long)h * HEAD_DIM;
			stT(q, o + ia, ra);
			stT(q, o + ib, rb);
		} else if (s >= 0) {
			long long o = s + (long long)(h - nheads) * HEAD_DIM;
			stT(kc, o + ia, ra);
			stT(kc, o + ib, rb);
		}
	}
	__syncwarp(); // hs is read before the warp's next head writes it
}
