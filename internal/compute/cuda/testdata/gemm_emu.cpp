// gemm_emu.cpp: runs csrc/llama/attn.cu's gemm_wg<NT> on the host through
// cudaemu.h (EMU_HOPPER), for TestGemmWGEmulated. Build:
//   g++ -std=c++20 -O0 -ffp-contract=off -DHEAD_DIM=128 -DUSE_BF16=1 -DGQA_GROUP=1 \
//       -DATT_SPLIT=128 -DEMU_HOPPER=1 -DATTN_CU='"path/to/attn.cu"' gemm_emu.cpp
// Input (little-endian int32 unless said): NT, n, out, in, blocks, yf32,
// beta (f32), X bf16 [n][in], W bf16 [out][in], Y [n*out + 16] (f32 when
// yf32, else bf16: the initial contents). The kernel runs twice over the
// same initial Y. Output: Y after each run, then the counters [2 * row
// blocks] (int32).
#include "cudaemu.h"
#include ATTN_CU

#include "emuio.h"

int main(int argc, char **argv) {
	if (!emu_open(argc, argv)) return 2;
	int NT = rd(), n = rd(), out_ = rd(), in_ = rd(), G = rd(), yf32 = rd();
	float beta;
	if (fread(&beta, 4, 1, in) != 1) return 2;
	std::vector<bf16_t> X, W;
	rdv(X, (size_t)n * in_);
	rdv(W, (size_t)out_ * in_);
	size_t ny = (size_t)n * out_ + 16, esz = yf32 ? 4 : 2;
	std::vector<unsigned char> y0;
	rdv(y0, ny * esz);
	int rb = (out_ + GW_BM - 1) / GW_BM;
	std::vector<float> part((size_t)G * 4 * 64 * NT + 1);
	std::vector<int> cnt(2 * rb + 1, 0);
	auto k = NT == 16 ? gemm_wg16 : NT == 32 ? gemm_wg32 : NT == 64 ? gemm_wg64 : gemm_wg128;
	for (int run = 0; run < 2; run++) {
		std::vector<unsigned char> y = y0;
		emu_launch(k, {(unsigned)G, 1, 1}, 384, (void *)y.data(), (const bf16_t *)X.data(), (const bf16_t *)W.data(),
			   n, out_, in_, beta, yf32, part.data(), cnt.data());
		wrv(y, ny * esz);
	}
	wrv(cnt, 2 * rb);
	return 0;
}
