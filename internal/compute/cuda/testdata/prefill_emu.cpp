// prefill_emu.cpp: runs csrc/llama/attn.cu's attn_prefill3 (or _64, or,
// with -DEMU_HOPPER=1 and head dim 128, attn_prefill4) on the host through
// cudaemu.h, for TestAttnPrefillEmulated. Build:
//   g++ -std=c++20 -O0 -ffp-contract=off -DHEAD_DIM=d -DUSE_BF16=1 \
//       -DGQA_GROUP=g -DATTN_CU='"path/to/attn.cu"' prefill_emu.cpp
// Input (little-endian int32 unless said): nseq, nheads, nkv, page_size,
// npages, pages per seq, rows (the chunks' query rows in all), scale_log2
// (f32), qstart [nseq], qlen [nseq], pos0 [nseq], ptoff [nseq], pages
// [nseq * pages per seq], q bf16 [rows][nheads][HEAD_DIM], kc, vc bf16
// [npages][page_size][nkv][HEAD_DIM], out bf16 [rows][nheads][HEAD_DIM] (the
// initial contents), kernel (0 attn_prefill3, 1 attn_prefill3_64, 2
// attn_prefill4). Output: out.
#include "cudaemu.h"
#include ATTN_CU

#include "emuio.h"

int main(int argc, char **argv) {
	if (!emu_open(argc, argv)) return 2;
	int nseq = rd(), nh = rd(), nkv = rd(), ps = rd(), npages = rd(), per = rd(), rows = rd();
	float scale;
	if (fread(&scale, 4, 1, in) != 1) return 2;
	std::vector<int> qstart, qlen, pos0, ptoff, pages;
	rdv(qstart, nseq);
	rdv(qlen, nseq);
	rdv(pos0, nseq);
	rdv(ptoff, nseq);
	rdv(pages, (size_t)nseq * per);
	std::vector<bf16_t> q, kc, vc, ob;
	size_t kv = (size_t)npages * ps * nkv * HEAD_DIM, qn = (size_t)rows * nh * HEAD_DIM;
	rdv(q, qn);
	rdv(kc, kv);
	rdv(vc, kv);
	rdv(ob, qn);
	int kernel = rd(), bq = kernel == 1 ? 64 : 128, maxL = 0;
	for (int l : qlen) maxL = max(maxL, l);
	auto k = kernel == 1 ? attn_prefill3_64 : attn_prefill3;
	unsigned threads = P3_WARPS * 32;
#if defined(EMU_HOPPER) && HEAD_DIM == 128
	if (kernel == 2) k = attn_prefill4, threads = 384;
#else
	if (kernel == 2) return 3;
#endif
	emu_launch(k, {(unsigned)nh, (unsigned)((maxL + bq - 1) / bq), (unsigned)nseq}, threads, ob.data(), (const bf16_t *)q.data(), (const bf16_t *)kc.data(), (const bf16_t *)vc.data(),
		   (const int *)qstart.data(), (const int *)qlen.data(), (const int *)pos0.data(), (const int *)ptoff.data(),
		   (const int *)pages.data(), ps, nh, nkv, scale);
	wrv(ob, qn);
	return 0;
}
