// cudaemu.h: just enough of CUDA to run csrc/llama's kernels on the host
// (sample.cu, blocks.cu, attn.cu, llama.cu's decode GEMVs) for the
// *Emulated tests: every block runs alone, its threads (a
// multiple of 32) as coroutines on one OS thread, switched at the barriers:
// __syncthreads waits for the block, the warp intrinsics (full masks only)
// for the warp; a thread that returns drops out of both, as on a GPU; a
// barrier that cannot complete, or a __syncthreads that the block's threads
// reach at different calls, aborts. The warpgroup MMAs (wgmma) meet their
// warpgroup's 128 threads the same way; an mbarrier wait yields until the
// phase completes (or aborts after too many turns). Float and double operations are the
// host's IEEE ones (compiled with -ffp-contract=off, SSE), rounded to
// nearest even. x86-64 only.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

struct uint4 {
	unsigned x, y, z, w;
};
struct uint2 {
	unsigned x, y;
};
struct float4 {
	float x, y, z, w;
};
struct float2 {
	float x, y;
};
struct emu_dim3 {
	unsigned x, y, z;
};
inline emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
inline uint64_t emu_slot[1024];

// The threads of a block are coroutines on one OS thread, switched by
// emu_switch (x86-64 SysV: the callee-saved registers on the stack).
extern "C" void emu_switch(void **save_sp, void *new_sp);
asm(R"(
	.text
	.globl emu_switch
	.type emu_switch,@function
emu_switch:
	pushq %rbp
	pushq %rbx
	pushq %r12
	pushq %r13
	pushq %r14
	pushq %r15
	movq %rsp, (%rdi)
	movq %rsi, %rsp
	popq %r15
	popq %r14
	popq %r13
	popq %r12
	popq %rbx
	popq %rbp
	ret
)");

enum { EMU_RUN, EMU_WARP, EMU_BLOCK, EMU_DONE, EMU_WG, EMU_SPIN };
inline void *emu_sched_sp;
inline std::vector<void *> emu_sp;
inline std::vector<int> emu_state;
inline std::vector<void *> emu_site; // where each waiting thread called the barrier
inline unsigned emu_cur;
inline std::function<void()> emu_body;

inline void emu_yield(int st) {
	emu_state[emu_cur] = st;
	emu_switch(&emu_sp[emu_cur], emu_sched_sp);
}
extern "C" inline void emu_entry() {
	emu_body();
	emu_yield(EMU_DONE);
	abort(); // never resumed
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

__attribute__((noinline)) inline void __syncthreads() {
	emu_site[emu_cur] = __builtin_return_address(0);
	emu_yield(EMU_BLOCK);
}

template <class T> inline T emu_bits(T v, int lane) {
	uint64_t u = 0;
	std::memcpy(&u, &v, sizeof v);
	emu_slot[threadIdx.x] = u;
	emu_yield(EMU_WARP);
	u = emu_slot[(threadIdx.x & ~31u) | (lane & 31)];
	emu_yield(EMU_WARP);
	T r;
	std::memcpy(&r, &u, sizeof r);
	return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_bits(v, (threadIdx.x & 31) ^ o); }
template <class T> inline T __shfl_sync(unsigned, T v, int lane) { return emu_bits(v, lane); }
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) {
	unsigned l = threadIdx.x & 31;
	return emu_bits(v, l >= d ? l - d : l);
}
__attribute__((noinline)) inline void __syncwarp() { emu_yield(EMU_WARP); }
inline unsigned __ballot_sync(unsigned, int p) {
	emu_slot[threadIdx.x] = p != 0;
	emu_yield(EMU_WARP);
	unsigned m = 0;
	for (int i = 0; i < 32; i++) m |= (unsigned)emu_slot[(threadIdx.x & ~31u) | i] << i;
	emu_yield(EMU_WARP);
	return m;
}
inline int __any_sync(unsigned m, int p) { return __ballot_sync(m, p) != 0; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
	uint64_t v = (uint64_t)y << 32 | x;
	unsigned r = 0;
	for (int i = 0; i < 4; i++) r |= (unsigned)(v >> (8 * ((s >> (4 * i)) & 7)) & 0xff) << (8 * i);
	return r;
}

inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline double __longlong_as_double(long long x) { double d; std::memcpy(&d, &x, 8); return d; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

inline unsigned atomicAdd(unsigned *p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned atomicOr(unsigned *p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline int atomicMin(int *p, int v) {
	int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
	while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
	}
	return old;
}

// emu_launch runs kernel k over grid with threads (a multiple of 32, at
// most 1024) per block. A barrier some live thread of the block (or warp)
// never reaches is a deadlock: reported, and the process aborts.
template <class K, class... A> void emu_launch(K k, emu_dim3 grid, unsigned threads, A... args) {
	const size_t stack = 256 << 10;
	static std::vector<char *> stacks;
	while (stacks.size() < threads) stacks.push_back((char *)aligned_alloc(64, stack));
	gridDim = grid;
	blockDim = {threads, 1, 1};
	emu_body = [&] { k(args...); };
	emu_sp.assign(threads, nullptr);
	emu_state.assign(threads, EMU_RUN);
	emu_site.assign(threads, nullptr);
	for (unsigned z = 0; z < grid.z; z++)
		for (unsigned y = 0; y < grid.y; y++)
			for (unsigned x = 0; x < grid.x; x++) {
				blockIdx = {x, y, z};
				for (unsigned t = 0; t < threads; t++) {
					uintptr_t top = ((uintptr_t)stacks[t] + stack) & ~(uintptr_t)15;
					void **sp = (void **)top;
					*--sp = nullptr;             // the entry's return address
					*--sp = (void *)&emu_entry; // emu_switch returns here
					for (int r = 0; r < 6; r++) *--sp = nullptr;
					emu_sp[t] = sp;
					emu_state[t] = EMU_RUN;
				}
				for (;;) {
					for (unsigned t = 0; t < threads; t++) {
						if (emu_state[t] != EMU_RUN) continue;
						emu_cur = t;
						threadIdx = {t, 0, 0};
						emu_switch(&emu_sched_sp, emu_sp[t]);
					}
					bool run = false, done = true, block = true;
					// a warp (32 threads) or warpgroup (128) all of whose live
					// threads wait at its barrier goes on
					auto group = [&](unsigned n, int st) {
						for (unsigned w = 0; w < threads / n; w++) {
							bool live = false, all = true;
							for (unsigned t = n * w; t < n * w + n; t++) {
								if (emu_state[t] == EMU_DONE) continue;
								live = true;
								all = all && emu_state[t] == st;
							}
							if (live && all) {
								for (unsigned t = n * w; t < n * w + n; t++)
									if (emu_state[t] == st) emu_state[t] = EMU_RUN, run = true;
							}
						}
					};
					group(32, EMU_WARP);
					group(128, EMU_WG);
					for (unsigned t = 0; t < threads; t++)
						if (emu_state[t] == EMU_SPIN) emu_state[t] = EMU_RUN, run = true;
					for (unsigned t = 0; t < threads; t++) {
						if (emu_state[t] == EMU_DONE) continue;
						done = false;
						block = block && emu_state[t] == EMU_BLOCK;
					}
					if (done) break;
					if (block) {
						void *site = nullptr;
						for (unsigned t = 0; t < threads; t++) {
							if (emu_state[t] == EMU_DONE) continue;
							if (site && emu_site[t] != site) {
								fprintf(stderr, "emulation: divergent __syncthreads in block (%u,%u,%u)\n", x, y, z);
								abort();
							}
							site = emu_site[t];
							emu_state[t] = EMU_RUN;
						}
						run = true;
					}
					if (!run) {
						fprintf(stderr, "emulation: deadlock in block (%u,%u,%u): threads wait at different barriers\n", x, y, z);
						abort();
					}
				}
			}
}

// Tensor-core operations, as PTX defines them (for csrc/llama/attn.cu).
// pack_bf16: cvt.rn.bf16x2.f32 (lo in the low half, nearest even).
inline unsigned emu_bf16(float f) {
	unsigned u;
	std::memcpy(&u, &f, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
	u += 0x7fffu + ((u >> 16) & 1u);
	return u >> 16;
}
inline unsigned pack_bf16(float lo, float hi) { return emu_bf16(lo) | emu_bf16(hi) << 16; }
// mma_bf16: mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32, c += A . B, a
// warp-wide operation over the lanes' fragments (sums in double, rounded
// to f32 once: the hardware's order of f32 additions is not specified).
inline unsigned emu_frag[1024][6];
inline void mma_bf16(float *c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
	unsigned me = threadIdx.x, w = me & ~31u;
	unsigned *f = emu_frag[me];
	f[0] = a0, f[1] = a1, f[2] = a2, f[3] = a3, f[4] = b0, f[5] = b1;
	emu_yield(EMU_WARP);
	auto half = [](unsigned v, int hi) { return __uint_as_float(hi ? v & 0xffff0000u : v << 16); };
	auto A = [&](int i, int k) { return half(emu_frag[w + (i % 8) * 4 + (k % 8) / 2][(i >= 8) + 2 * (k >= 8)], k & 1); };
	auto B = [&](int k, int n) { return half(emu_frag[w + n * 4 + (k % 8) / 2][4 + (k >= 8)], k & 1); };
	int g = (me & 31) / 4, t = me & 3;
	float r[4];
	for (int e = 0; e < 4; e++) {
		int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
		double acc = c[e];
		for (int k = 0; k < 16; k++) acc += (double)A(row, k) * B(k, col);
		r[e] = (float)acc;
	}
	emu_yield(EMU_WARP);
	for (int e = 0; e < 4; e++) c[e] = r[e];
}
// ldsm4 / ldsm4t: ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16; lanes
// 8i..8i+7 give matrix i's row addresses. Plain: r[i] of lane l is row l/4,
// elements 2(l%4) (low half) and 2(l%4)+1; .trans: elements l/4 of rows
// 2(l%4) (low half) and 2(l%4)+1.
inline const unsigned short *emu_rowp[1024];
inline void emu_ldsm(unsigned *r, const unsigned short *p, bool trans) {
	unsigned me = threadIdx.x, w = me & ~31u, l = me & 31;
	emu_rowp[me] = p;
	emu_yield(EMU_WARP);
	unsigned v[4];
	for (int i = 0; i < 4; i++) {
		if (trans) {
			const unsigned short *a = emu_rowp[w + 8 * i + 2 * (l % 4)], *b = emu_rowp[w + 8 * i + 2 * (l % 4) + 1];
			v[i] = a[l / 4] | (unsigned)b[l / 4] << 16;
		} else {
			const unsigned short *a = emu_rowp[w + 8 * i + l / 4];
			v[i] = a[2 * (l % 4)] | (unsigned)a[2 * (l % 4) + 1] << 16;
		}
	}
	emu_yield(EMU_WARP);
	for (int i = 0; i < 4; i++) r[i] = v[i];
}
inline void ldsm4(unsigned *r, const unsigned short *p) { emu_ldsm(r, p, false); }
inline void ldsm4t(unsigned *r, const unsigned short *p) { emu_ldsm(r, p, true); }
// cp.async: the copy happens at once (the emulation cannot show a missing
// wait, only a stage overwritten while another warp still reads it).
inline void cp16(unsigned short *s, const unsigned short *g, bool ok) {
	if (ok)
		std::memcpy(s, g, 16);
	else
		std::memset(s, 0, 16);
}
inline float ex2(float x) { return std::exp2(x); } // ex2.approx.ftz.f32, within its 2 ulp
inline void cp_commit() {}
template <int N> inline void cp_wait() {}
alignas(1024) inline unsigned char dyn_smem[256 << 10]; // extern __shared__: blocks run one at a time
// sm_addr: a shared-memory address (dynamic shared memory only).
inline unsigned sm_addr(const void *p) { return (unsigned)((const unsigned char *)p - dyn_smem); }

// Hopper (EMU_HOPPER, for attn.cu's attn_prefill4). wgmma runs when all of
// its warpgroup has issued it (the async group operations are no-ops: a
// missing wait cannot show, a tile overwritten while read can); its shared
// operands are read through their descriptors as PTX defines the 128-byte
// swizzled layouts (mode 1 only): K-major element (row i, k) at start +
// (i%8)*128 + (i/8)*SBO + 2k, N-major (k, n) at start + 2(n%64) +
// (n/64)*LBO + (k%8)*128 + (k/8)*SBO, each address's bits 4-6 XORed with
// bits 7-9. A from registers and D as the m16n8k16 fragments of warp w's
// rows 16w..; sums in double, rounded to f32 once.
inline uint64_t emu_wgdesc[1024][2];
inline unsigned emu_wga[1024][4];
inline float emu_sw(uint64_t desc, unsigned off) {
	if (desc >> 62 != 1) {
		fprintf(stderr, "emulation: wgmma descriptor without the 128-byte swizzle\n");
		abort();
	}
	unsigned a = (unsigned)(desc & 0x3fff) * 16 + off;
	a ^= (a >> 7 & 7) << 4;
	unsigned short h;
	std::memcpy(&h, dyn_smem + a, 2);
	return __uint_as_float((unsigned)h << 16);
}
template <int N> inline void emu_wgmma(float *d, const unsigned *a, uint64_t da, uint64_t db, bool acc, bool nmajorB) {
	unsigned me = threadIdx.x, wg = me & ~127u;
	emu_wgdesc[me][0] = da, emu_wgdesc[me][1] = db;
	if (a)
		for (int i = 0; i < 4; i++) emu_wga[me][i] = a[i];
	emu_yield(EMU_WG);
	const uint64_t lbo = (db >> 16 & 0x3fff) * 16, sbo = (db >> 32 & 0x3fff) * 16, asbo = (da >> 32 & 0x3fff) * 16;
	auto A = [&](int i, int k) -> float {
		if (!a) return emu_sw(da, (i % 8) * 128 + (i / 8) * asbo + 2 * k);
		int w = i / 16, r = i % 16;
		unsigned v = emu_wga[wg + 32 * w + (r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)];
		return __uint_as_float(k & 1 ? v & 0xffff0000u : v << 16);
	};
	auto B = [&](int k, int n) -> float {
		if (nmajorB) return emu_sw(db, 2 * (n % 64) + (n / 64) * lbo + (k % 8) * 128 + (k / 8) * sbo);
		return emu_sw(db, (n % 8) * 128 + (n / 8) * sbo + 2 * k);
	};
	int w = (me & 127) / 32, g = (me & 31) / 4, t = me & 3;
	float r[N / 2];
	for (int j = 0; j < N / 8; j++)
		for (int e = 0; e < 4; e++) {
			int row = 16 * w + g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
			double s = acc ? d[4 * j + e] : 0.0;
			for (int k = 0; k < 16; k++) s += (double)A(row, k) * B(k, col);
			r[4 * j + e] = (float)s;
		}
	emu_yield(EMU_WG);
	for (int i = 0; i < N / 2; i++) d[i] = r[i];
}
template <int N> inline void wg_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int acc) {
	emu_wgmma<N>(d, nullptr, a, b, acc != 0, false);
}
inline void wg_rs128(float (&d)[64], const unsigned *a, unsigned long long b) { emu_wgmma<128>(d, a, 0, b, true, true); }
inline void wg_fence() {}
inline void wg_commit() {}
template <int N> inline void wg_wait() {}
template <int N> inline void wg_hold(float (&)[N]) {}
inline void fence_async() {}
inline void wg_sync(int) { emu_yield(EMU_WG); } // bar.sync of the warpgroup's 128 threads
inline float ld_cg(const float *p) { return *p; }
inline void __threadfence() {}
// mbarriers: arrivals left (low 32 bits), arrivals a phase takes (bits
// 32-61), the current phase's parity (bit 63). cp.async copies land at
// once, so mb_cp_arrive is an arrival.
inline void mb_init(unsigned long long *b, int n) { *b = (unsigned long long)n | (unsigned long long)n << 32; }
inline void mb_fence_init() {}
inline void mb_arrive(unsigned long long *b) {
	unsigned long long v = *b - 1;
	if ((unsigned)v == 0) v = (v & ~0xffffffffull) ^ 1ull << 63 | (v >> 32 & 0x3fffffff);
	*b = v;
}
inline void mb_cp_arrive(unsigned long long *b) { mb_arrive(b); }
inline void mb_wait(unsigned long long *b, int ph) {
	for (long spins = 0; (int)(*b >> 63) == ph; spins++) {
		if (spins > 1000000) {
			fprintf(stderr, "emulation: mbarrier wait that never completes (thread %u)\n", threadIdx.x);
			abort();
		}
		emu_yield(EMU_SPIN);
	}
}
