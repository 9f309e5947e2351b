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

// qk_norm: for token t (grid x) and head h (grid y) of a row of qkv (fp32:
// nheads q heads, nkv k heads, nkv v heads of HEAD_DIM each), adds the
// bias when there is one and, for q and k heads, applies RMSNorm over the
// head with weights qw (q) or kw (k), in place; v heads get the bias only.
// Block 32 threads (one warp). rope_kv then runs without a bias.
#define QKN_PER ((HEAD_DIM + 31) / 32)
extern "C" __global__ void __launch_bounds__(32) qk_norm(float *qkv, const float *bias, const float *qw,
	const float *kw, int nheads, int nkv, float eps) {
	int t = blockIdx.x, h = blockIdx.y;
	long long W = (long long)(nheads + 2 * nkv) * HEAD_DIM;
	float *row = qkv + (long long)t * W + (long long)h * HEAD_DIM;
	const float *b = bias ? bias + (long long)h * HEAD_DIM : 0;
	float v[QKN_PER];
	float ss = 0.f;
#pragma unroll
	for (int k = 0; k < QKN_PER; k++) {
		int i = threadIdx.x + 32 * k;
		float x = 0.f;
		if (i < HEAD_DIM) {
			x = row[i];
			if (b) x += b[i];
		}
		v[k] = x;
		ss += x * x;
	}
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
	for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
	float sc = 1.0f / sqrtf(ss / (float)HEAD_DIM + eps);
	const float *w = h < nheads ? qw : kw;
#pragma unroll
	for (int k = 0; k < QKN_PER; k++) {
		int i = threadIdx.x + 32 * k;
		if (i < HEAD_DIM) row[i] = w[i] * (sc * v[k]);
	}
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
// Grid n tokens, any block.
extern "C" __global__ void moe_combine(float *x, const float *ye, const int *row, const float *w, const float *sh,
	const float *gate, int gstride, int k, int dim) {
	int t = blockIdx.x;
	float g = 0.f;
	if (sh) g = 1.0f / (1.0f + expf(-gate[(long long)t * gstride]));
	const int *rt = row + (long long)t * k;
	const float *wt = w + (long long)t * k;
	for (int i = threadIdx.x; i < dim; i += blockDim.x) {
		float o = 0.f;
		for (int j = 0; j < k; j++) o += wt[j] * ye[(long long)rt[j] * dim + i];
		if (sh) o += g * sh[(long long)t * dim + i];
		x[(long long)t * dim + i] += o;
	}
}
