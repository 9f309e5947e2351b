// copy_kernels.cu: gather/scatter copy of a batch of (src, dst, len) blocks
// in one launch, for the nvlink transport. Compiled at run time by NVRTC
// (no includes: NVRTC has no system headers here).
//
// The host splits every block into chunks of chunk_bytes and records, per
// descriptor, the index of its first chunk (a prefix sum). Each warp takes
// chunks in grid-stride order, finds the chunk's descriptor by binary search
// and copies it: 16-byte loads and stores where source and destination share
// their alignment mod 16, bytes for the unaligned head and tail (and for the
// whole chunk when they do not). A large block is thus spread over many warps
// of many CTAs; a small one is one warp's work.

struct McCopyDesc {
	unsigned long long src;
	unsigned long long dst;
	unsigned long long len;
	unsigned long long first_chunk; // index of this block's first chunk
};

#define MC_UNROLL 8

__device__ __forceinline__ void mc_copy_bytes(const unsigned char *s, unsigned char *d,
                                              unsigned long long n, unsigned int lane) {
	for (unsigned long long i = lane; i < n; i += 32) d[i] = s[i];
}

__device__ __forceinline__ void mc_copy_chunk(const unsigned char *s, unsigned char *d,
                                              unsigned long long n, unsigned int lane) {
	unsigned long long sa = (unsigned long long)s;
	unsigned long long da = (unsigned long long)d;
	if (((sa ^ da) & 15ull) != 0) {
		mc_copy_bytes(s, d, n, lane);
		return;
	}
	unsigned long long head = (16ull - (sa & 15ull)) & 15ull;
	if (head > n) head = n;
	mc_copy_bytes(s, d, head, lane);
	s += head;
	d += head;
	n -= head;
	unsigned long long nv = n >> 4;
	const uint4 *vs = (const uint4 *)s;
	uint4 *vd = (uint4 *)d;
	unsigned long long i = lane;
	for (; i + (MC_UNROLL - 1) * 32 < nv; i += MC_UNROLL * 32) {
		uint4 r[MC_UNROLL];
#pragma unroll
		for (int k = 0; k < MC_UNROLL; k++) r[k] = vs[i + k * 32];
#pragma unroll
		for (int k = 0; k < MC_UNROLL; k++) vd[i + k * 32] = r[k];
	}
	for (; i < nv; i += 32) vd[i] = vs[i];
	unsigned long long done = nv << 4;
	mc_copy_bytes(s + done, d + done, n - done, lane);
}

// chunks_per_desc: when every descriptor spans the same number of chunks
// (equal-sized pages, the common case) the host passes it and the lookup is
// a division; 0 means sizes vary and the kernel searches first_chunk.
extern "C" __global__ void mc_scatter_copy(const McCopyDesc *__restrict__ descs, unsigned int n,
                                           unsigned long long chunk_bytes,
                                           unsigned long long total_chunks,
                                           unsigned long long chunks_per_desc) {
	const unsigned int lane = threadIdx.x & 31u;
	const unsigned long long warp = ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
	const unsigned long long nwarps = ((unsigned long long)gridDim.x * blockDim.x) >> 5;
	unsigned int lo = 0; // chunks only move forward, so the search range shrinks
	for (unsigned long long c = warp; c < total_chunks; c += nwarps) {
		unsigned int a;
		if (chunks_per_desc) {
			a = (unsigned int)(c / chunks_per_desc);
		} else {
			// last descriptor whose first_chunk <= c
			unsigned int b = n;
			a = lo;
			while (b - a > 1) {
				unsigned int m = a + ((b - a) >> 1);
				if (descs[m].first_chunk <= c) a = m; else b = m;
			}
			lo = a;
		}
		const McCopyDesc dd = descs[a];
		unsigned long long off = (c - dd.first_chunk) * chunk_bytes;
		if (off >= dd.len) continue; // zero-length descriptor
		unsigned long long len = dd.len - off;
		if (len > chunk_bytes) len = chunk_bytes;
		mc_copy_chunk((const unsigned char *)(dd.src + off), (unsigned char *)(dd.dst + off), len, lane);
	}
}

// mc_scatter_pages copies n equal pages of page_vecs 16-byte words each,
// every source and destination 16-byte aligned (the KV-cache case). The
// descriptors are compact (src, dst) pairs. The batch is one flat range of
// 16-byte words spread over every thread of the grid: word g is word
// g % page_vecs of page g / page_vecs (a shift when page_vecs is a power of
// two). Each thread issues MC_PAGES_UNROLL independent loads (from up to as
// many pages) before their stores, so small pages keep as many bytes in
// flight as large ones; neighbouring lanes touch neighbouring words of one
// page, so accesses stay coalesced and the warp's descriptor reads are one
// broadcast.
#ifndef MC_PAGES_UNROLL
#define MC_PAGES_UNROLL 4
#endif

extern "C" __global__ void mc_scatter_pages(const ulonglong2 *__restrict__ descs,
                                            unsigned long long page_vecs, int page_shift,
                                            unsigned long long total_vecs) {
	const unsigned long long nthreads = (unsigned long long)gridDim.x * blockDim.x;
	unsigned long long g = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
	for (; g + (MC_PAGES_UNROLL - 1) * nthreads < total_vecs; g += MC_PAGES_UNROLL * nthreads) {
		uint4 r[MC_PAGES_UNROLL];
		uint4 *d[MC_PAGES_UNROLL];
#pragma unroll
		for (int k = 0; k < MC_PAGES_UNROLL; k++) {
			unsigned long long idx = g + k * nthreads;
			unsigned long long p = page_shift >= 0 ? idx >> page_shift : idx / page_vecs;
			unsigned long long o = idx - p * page_vecs;
			ulonglong2 dd = descs[p];
			r[k] = ((const uint4 *)dd.x)[o];
			d[k] = ((uint4 *)dd.y) + o;
		}
#pragma unroll
		for (int k = 0; k < MC_PAGES_UNROLL; k++) *d[k] = r[k];
	}
	for (; g < total_vecs; g += nthreads) {
		unsigned long long p = page_shift >= 0 ? g >> page_shift : g / page_vecs;
		unsigned long long o = g - p * page_vecs;
		ulonglong2 dd = descs[p];
		((uint4 *)dd.y)[o] = ((const uint4 *)dd.x)[o];
	}
}

// mc_fill_pattern writes a reproducible pseudo-random pattern (a hash of the
// byte index and seed) into n bytes: used by tests to fill buffers quickly.
extern "C" __global__ void mc_fill_pattern(unsigned char *dst, unsigned long long n,
                                           unsigned long long seed) {
	unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
	for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i * 8 < n; i += stride) {
		unsigned long long x = (i + seed * 0x9E3779B97F4A7C15ull) ^ (seed >> 7);
		x ^= x >> 33; x *= 0xff51afd7ed558ccdull;
		x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull;
		x ^= x >> 33;
		unsigned long long base = i * 8;
		if (base + 8 <= n && (((unsigned long long)dst + base) & 7ull) == 0) {
			*(unsigned long long *)(dst + base) = x;
		} else {
			for (int k = 0; k < 8 && base + k < n; k++) dst[base + k] = (unsigned char)(x >> (8 * k));
		}
	}
}
