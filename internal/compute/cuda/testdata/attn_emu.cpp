// attn_emu.cpp: runs csrc/llama/attn.cu's attn_decode_tc(_wide) on the host
// through cudaemu.h, for TestAttnTCEmulated. Build:
//   g++ -std=c++20 -O0 -ffp-contract=off -DHEAD_DIM=128 -DUSE_BF16=1 \
//       -DGQA_GROUP=g -DATT_SPLIT=s -DATTN_CU='"path/to/attn.cu"' attn_emu.cpp
// Input (little-endian int32 unless said): nq, nheads, nkv, page_size,
// nsplit, npages, pages per query, scale_log2 (f32), pos [nq], qrow [nq],
// ptoff [nq], pages [nq * pages per query], q bf16 [nq][nheads][HEAD_DIM],
// kc, vc bf16 [npages][page_size][nkv][HEAD_DIM], part_o f32
// [nq][nheads][nsplit][HEAD_DIM], part_ml f32 [nq][nheads][nsplit][2] (the
// initial contents), wide (attn_decode_tc_wide). Output: part_o, part_ml.
#include "cudaemu.h"
#include ATTN_CU

#include "emuio.h"

int main(int argc, char **argv) {
	if (!emu_open(argc, argv)) return 2;
	int nq = rd(), nh = rd(), nkv = rd(), ps = rd(), nsplit = rd(), npages = rd(), per = rd();
	float scale;
	if (fread(&scale, 4, 1, in) != 1) return 2;
	std::vector<int> pos, qrow, ptoff, pages;
	rdv(pos, nq);
	rdv(qrow, nq);
	rdv(ptoff, nq);
	rdv(pages, (size_t)nq * per);
	std::vector<bf16_t> q, kc, vc;
	size_t kv = (size_t)npages * ps * nkv * HEAD_DIM;
	rdv(q, (size_t)nq * nh * HEAD_DIM);
	rdv(kc, kv);
	rdv(vc, kv);
	std::vector<float> po, pml;
	size_t np = (size_t)nq * nh * nsplit;
	rdv(po, np * HEAD_DIM);
	rdv(pml, np * 2);
	int wide = rd();
	auto k = attn_decode_tc;
#if ATT_SPLIT % (32 * TC_WARPS) == 0
	if (wide) k = attn_decode_tc_wide;
#else
	if (wide) return 3;
#endif
	emu_launch(k, {(unsigned)nsplit, (unsigned)nkv, (unsigned)nq}, (wide ? 64 : 32) * TC_WARPS, po.data(), pml.data(),
		   (const bf16_t *)q.data(), (const bf16_t *)kc.data(), (const bf16_t *)vc.data(), (const int *)qrow.data(),
		   (const int *)pos.data(), (const int *)ptoff.data(), (const int *)pages.data(), ps, nsplit, nh, nkv, 0, scale);
	wrv(po, np * HEAD_DIM);
	wrv(pml, np * 2);
	return 0;
}
