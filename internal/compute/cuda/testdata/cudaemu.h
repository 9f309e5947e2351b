// cudaemu.h: just enough of CUDA to run csrc/llama/sample.cu on the host,
// for TestSampleKernelsEmulated: every block runs alone, its threads as OS
// threads; blocks must be one warp (32 threads), so __syncthreads and the
// warp intrinsics are one barrier; a thread that returns drops out of it,
// as on a GPU. Float and double operations are the host's IEEE ones
// (compiled with -ffp-contract=off, SSE), rounded to nearest even.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

struct emu_dim3 {
	unsigned x, y, z;
};
inline thread_local emu_dim3 threadIdx;
inline emu_dim3 blockIdx, blockDim, gridDim;
inline std::barrier<> *emu_bar;
inline uint64_t emu_slot[32];

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

inline void __syncthreads() { emu_bar->arrive_and_wait(); }

template <class T> inline T emu_bits(T v, int from) {
	uint64_t u = 0;
	std::memcpy(&u, &v, sizeof v);
	emu_slot[threadIdx.x] = u;
	emu_bar->arrive_and_wait();
	u = emu_slot[from & 31];
	emu_bar->arrive_and_wait();
	T r;
	std::memcpy(&r, &u, sizeof r);
	return r;
}
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu_bits(v, threadIdx.x ^ o); }
inline unsigned __ballot_sync(unsigned, int p) {
	emu_slot[threadIdx.x] = p != 0;
	emu_bar->arrive_and_wait();
	unsigned m = 0;
	for (int i = 0; i < 32; i++) m |= (unsigned)emu_slot[i] << i;
	emu_bar->arrive_and_wait();
	return m;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }

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

// emu_launch runs kernel k over grid with threads (32) per block.
template <class K, class... A> void emu_launch(K k, emu_dim3 grid, unsigned threads, A... args) {
	gridDim = grid;
	blockDim = {threads, 1, 1};
	for (unsigned z = 0; z < grid.z; z++)
		for (unsigned y = 0; y < grid.y; y++)
			for (unsigned x = 0; x < grid.x; x++) {
				blockIdx = {x, y, z};
				std::barrier<> bar(threads);
				emu_bar = &bar;
				std::vector<std::thread> ts;
				for (unsigned t = 0; t < threads; t++)
					ts.emplace_back([&, t] {
						threadIdx = {t, 0, 0};
						k(args...);
						bar.arrive_and_drop();
					});
				for (auto &t : ts) t.join();
			}
}
