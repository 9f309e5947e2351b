// llama_emu.cpp: runs csrc/llama/llama.cu's decode GEMVs (gemv_f32out,
// gemv2_plain and _ks, gemv2_norm_ks, gemv2_comb) and attn_combine on the host through
// cudaemu.h, for TestGEMV2Emulated. Build (bf16 only: the gemv2 set is):
//   g++ -std=c++20 -O0 -ffp-contract=off -DHEAD_DIM=64 -DUSE_BF16=1 -DGQA_GROUP=4 \
//       -DATT_SPLIT=128 -DATT_THREADS=128 -DMC_V2=1 -DFA2_WARPS=4 \
//       -DLLAMA_CU='"path/to/llama.cu"' llama_emu.cpp
// Input (little-endian int32 unless said), then output:
//   plain: n, out, in, ks, grid, X bf16 [n][in], W bf16 [out][in], Y f32
//          [n][out] (beta 1); out Y after gemv_f32out, after gemv2_plain,
//          then after gemv2_plain_ks (ks warps a unit).
//   comb:  heads, nsplit, pos, window, out, ks, grid, part_o f32
//          [heads][nsplit][HEAD_DIM], part_ml f32 [heads][nsplit][2], W bf16
//          [out][heads*HEAD_DIM], Y f32 [out] (beta 1); out Y after
//          attn_combine and gemv2_plain_ks over its row, then after gemv2_comb.
//   norm:  n, out, in, ks, grid, vt, eps (f32), x f32 [n][in], normw f32
//          [in], W bf16 [out][in]; out Y f32 [n][out] and xo bf16 [n][in]
//          of gemv2_norm_ks (rows 0..n-1).
//   qkn:   n, heads, kv heads, has bias, interleaved, ntab, cache elements,
//          in, grid, vt, eps (f32), x f32 [n][in], normw f32 [in], W bf16
//          [W][in] (W = (heads + 2 kv heads) HEAD_DIM), bias f32 [W], qw, kw
//          f32 [HEAD_DIM], pos [n], slot int64 [n], tab f32
//          [ntab][HEAD_DIM/2][2], inv_freq f64 [HEAD_DIM/2]; q, kc, vc start
//          as all-ones bytes; out qkv f32 [n][W] of gemv2_norm, then of
//          gemv2_qkn, q bf16 [n][heads HEAD_DIM], kc, vc bf16 [cache
//          elements], the head counters after [heads + 2 kv heads].
#include "cudaemu.h"
#include LLAMA_CU

#include "emuio.h"

int main(int argc, char **argv) {
	if (!emu_open(argc, argv)) return 2;
	for (;;) {
		int op;
		if (fread(&op, 4, 1, in) != 1) break;
		if (op == 1) {
			int n = rd(), out_ = rd(), in_ = rd(), ks = rd(), grid = rd();
			std::vector<bf16_t> X, W;
			std::vector<float> y0;
			rdv(X, (size_t)n * in_);
			rdv(W, (size_t)out_ * in_);
			rdv(y0, (size_t)n * out_);
			std::vector<float> y = y0;
			emu_launch(gemv_f32out, {(unsigned)(out_ + 7) / 8, 1, 1}, 256, y.data(), (const bf16_t *)X.data(),
				   (const bf16_t *)W.data(), n, out_, in_, 1.f);
			wrv(y, (size_t)n * out_);
			y = y0;
			int stage = n * in_ * 2 <= (32 << 10);
			emu_launch(gemv2_plain, {(unsigned)grid, 1, 1}, G2_THREADS, y.data(), (const bf16_t *)X.data(),
				   (const bf16_t *)W.data(), n, out_, in_, 1.f, stage, 1);
			wrv(y, (size_t)n * out_);
			y = y0;
			emu_launch(gemv2_plain_ks, {(unsigned)grid, 1, 1}, G2_THREADS, y.data(), (const bf16_t *)X.data(),
				   (const bf16_t *)W.data(), n, out_, in_, 1.f, stage, ks);
			wrv(y, (size_t)n * out_);
		} else if (op == 2) {
			int nh = rd(), ns = rd(), pos = rd(), window = rd(), out_ = rd(), ks = rd(), grid = rd();
			int qd = nh * HEAD_DIM;
			std::vector<float> po, ml, y0;
			std::vector<bf16_t> W, att(qd + 1);
			rdv(po, (size_t)nh * ns * HEAD_DIM);
			rdv(ml, (size_t)nh * ns * 2);
			rdv(W, (size_t)out_ * qd);
			rdv(y0, out_);
			std::vector<int> qrow(2, 0), qpos(2, pos);
			emu_launch(attn_combine, {(unsigned)nh, 1, 1}, HEAD_DIM, att.data(), (const float *)po.data(),
				   (const float *)ml.data(), (const int *)qrow.data(), (const int *)qpos.data(), ns, nh, 0, window);
			std::vector<float> y = y0;
			emu_launch(gemv2_plain_ks, {(unsigned)grid, 1, 1}, G2_THREADS, y.data(), (const bf16_t *)att.data(),
				   (const bf16_t *)W.data(), 1, out_, qd, 1.f, 1, ks);
			wrv(y, out_);
			y = y0;
			emu_launch(gemv2_comb, {(unsigned)grid, 1, 1}, G2_THREADS, y.data(), (const bf16_t *)W.data(), out_, qd, 1.f,
				   (const float *)po.data(), (const float *)ml.data(), (const int *)qpos.data(), ns, window, ks);
			wrv(y, out_);
		} else if (op == 3) {
			int n = rd(), out_ = rd(), in_ = rd(), ks = rd(), grid = rd(), vt = rd();
			float eps;
			if (fread(&eps, 4, 1, in) != 1) return 2;
			std::vector<float> x, nw, y((size_t)n * out_ + 1);
			std::vector<bf16_t> W, xo((size_t)n * in_ + 1);
			rdv(x, (size_t)n * in_);
			rdv(nw, in_);
			rdv(W, (size_t)out_ * in_);
			emu_launch(gemv2_norm_ks, {(unsigned)grid, 1, 1}, G2_THREADS, y.data(), (const float *)x.data(),
				   (const float *)nw.data(), (const int *)nullptr, (const bf16_t *)W.data(), n, out_, in_, vt, eps,
				   xo.data(), ks);
			wrv(y, (size_t)n * out_);
			wrv(xo, (size_t)n * in_);
		} else if (op == 4) {
			int n = rd(), nh = rd(), nkv = rd(), hb = rd(), il = rd(), ntab = rd(), ce = rd(), in_ = rd(), grid = rd(),
			    vt = rd();
			float eps;
			if (fread(&eps, 4, 1, in) != 1) return 2;
			int W = (nh + 2 * nkv) * HEAD_DIM, QD = nh * HEAD_DIM;
			std::vector<float> x, nw, bias, qw, kw;
			std::vector<bf16_t> Wt;
			std::vector<int> pos;
			std::vector<long long> slot;
			std::vector<float2> tab;
			std::vector<double> inv;
			rdv(x, (size_t)n * in_);
			rdv(nw, in_);
			rdv(Wt, (size_t)W * in_);
			rdv(bias, W);
			rdv(qw, HEAD_DIM);
			rdv(kw, HEAD_DIM);
			rdv(pos, n);
			rdv(slot, n);
			rdv(tab, (size_t)ntab * (HEAD_DIM / 2));
			rdv(inv, HEAD_DIM / 2);
			std::vector<float> y((size_t)n * W + 1), y2((size_t)n * W + 1);
			emu_launch(gemv2_norm, {(unsigned)grid, 1, 1}, G2_THREADS, y.data(), (const float *)x.data(),
				   (const float *)nw.data(), (const int *)nullptr, (const bf16_t *)Wt.data(), n, W, in_, vt, eps,
				   (bf16_t *)nullptr, 1);
			std::vector<bf16_t> q((size_t)n * QD + 1), kc(ce + 1), vc(ce + 1);
			memset(q.data(), 0xff, q.size() * 2);
			memset(kc.data(), 0xff, kc.size() * 2);
			memset(vc.data(), 0xff, vc.size() * 2);
			std::vector<int> cnt(nh + 2 * nkv + 1, 0);
			emu_launch(gemv2_qkn, {(unsigned)grid, 1, 1}, G2_THREADS, y2.data(), (const float *)x.data(),
				   (const float *)nw.data(), (const bf16_t *)Wt.data(), n, in_, vt, eps, q.data(), kc.data(), vc.data(),
				   (const float *)(hb ? bias.data() : nullptr), (const float *)qw.data(), (const float *)kw.data(),
				   (const int *)pos.data(), (const long long *)slot.data(), (const float2 *)tab.data(),
				   (const double *)inv.data(), ntab, nh, nkv, il, cnt.data());
			wrv(y, (size_t)n * W);
			wrv(y2, (size_t)n * W);
			wrv(q, (size_t)n * QD);
			wrv(kc, ce);
			wrv(vc, ce);
			wrv(cnt, nh + 2 * nkv);
		} else {
			return 3;
		}
	}
	fclose(out);
	return 0;
}
