// blocks_emu.cpp: runs csrc/llama/blocks.cu's kernels on the host through
// cudaemu.h, for TestBlockKernelsEmulated (blocks_emu_test.go writes the
// input and checks the output). Build:
//   g++ -std=c++20 -O0 -ffp-contract=off -DHEAD_DIM=n -DUSE_BF16=0|1 \
//       -DBLOCKS_CU='"path/to/blocks.cu"' blocks_emu.cpp
// Input (little-endian int32 unless said), then output:
//   qk_norm: n, heads, kv heads, has bias, eps (f32), qkv f32 [n][W], bias
//            f32 [W], qw, kw f32 [HEAD_DIM]; out qkv.
//   gather:  rows, tokens, dim, src [rows], xb T [tokens][dim]; out xe T [rows][dim].
//   combine: n, k, dim, has shared, gstride, x f32 [n][dim], ye f32 [n*k][dim],
//            row [n*k], w f32 [n*k], sh f32 [n][dim], gate f32 [n][gstride]; out x.
//   route:   n, stride, E, k, norm, fused, logits f32 [n][stride]; moe_topk
//            then moe_sort, or moe_route when fused; out ids [n*k], w f32 [n*k], rows [n*k], src [n*k],
//            offs [E+1], act [E], nact.
//   gemv:    silu (2: moe_gemv_silu1), E, units, in, rows, tokens, nact, act [E], offs [E+1],
//            src [rows], X T [tokens (silu) or rows][in], W T
//            [E][(2 if silu) units][in]; moe_gemv_silu or moe_gemv_down;
//            out h T or Y f32 [rows][units].
//   down_add: E, out, in, n, k, has shared, gstride, nact, ids [n*k],
//            rows [n*k], act [E], offs [E+1], X T [n*k][in], W T
//            [E][out][in], w f32 [n*k], x f32 [n][out], sh f32 [n][out],
//            gate f32 [n][gstride]; out x after moe_gemv_down_add, then x
//            after moe_gemv_down and moe_combine.
//   route_silu: E, k, norm, units, in, logits f32 [E], X T [in], W T
//            [E][2*units][in]; moe_route (one token) then moe_gemv_silu1,
//            then moe_route_silu1 over buffers filled with -1 bytes; out per
//            run h T [k][units], ids [k], w f32 [k], rows [k], src [k],
//            offs [E+1], act [E], nact.
//   qk_norm_rope: n, heads, kv heads, has bias, interleaved, ntab, cache
//            elements, eps (f32), qkv f32 [n][W], bias f32 [W], qw, kw f32
//            [HEAD_DIM], pos [n], slot int64 [n], tab f32 [ntab][HEAD_DIM/2][2],
//            inv_freq f64 [HEAD_DIM/2]; q, kc, vc start as all-ones bytes;
//            out q T [n][heads*HEAD_DIM], kc T, vc T [cache elements].
#include "cudaemu.h"
#include BLOCKS_CU

#include "emuio.h"

int main(int argc, char **argv) {
	if (!emu_open(argc, argv)) return 2;
	for (;;) {
		int op;
		if (fread(&op, 4, 1, in) != 1) break;
		if (op == 1) {
			int n = rd(), nh = rd(), nkv = rd(), hb = rd();
			float eps;
			if (fread(&eps, 4, 1, in) != 1) return 2;
			size_t W = (size_t)(nh + 2 * nkv) * HEAD_DIM;
			std::vector<float> qkv, bias, qw, kw;
			rdv(qkv, n * W);
			rdv(bias, W);
			rdv(qw, HEAD_DIM);
			rdv(kw, HEAD_DIM);
			emu_launch(qk_norm, {(unsigned)n, (unsigned)(nh + 2 * nkv), 1}, 32, qkv.data(),
				   (const float *)(hb ? bias.data() : nullptr), (const float *)qw.data(), (const float *)kw.data(), nh,
				   nkv, eps);
			wrv(qkv, n * W);
		} else if (op == 2) {
			int rows = rd(), toks = rd(), dim = rd();
			std::vector<int> src;
			std::vector<T> xb, xe((size_t)rows * dim + 1);
			rdv(src, rows);
			rdv(xb, (size_t)toks * dim);
			emu_launch(moe_gather, {(unsigned)rows, 1, 1}, 64, xe.data(), (const T *)xb.data(), (const int *)src.data(), dim);
			wrv(xe, (size_t)rows * dim);
		} else if (op == 3) {
			int n = rd(), k = rd(), dim = rd(), hs = rd(), gs = rd();
			std::vector<float> x, ye, w, sh, gate;
			std::vector<int> row;
			rdv(x, (size_t)n * dim);
			rdv(ye, (size_t)n * k * dim);
			rdv(row, (size_t)n * k);
			rdv(w, (size_t)n * k);
			rdv(sh, (size_t)n * dim);
			rdv(gate, (size_t)n * gs);
			emu_launch(moe_combine, {(unsigned)n, 1, 1}, 64, x.data(), (const float *)ye.data(), (const int *)row.data(),
				   (const float *)w.data(), (const float *)(hs ? sh.data() : nullptr),
				   (const float *)(hs ? gate.data() : nullptr), gs, k, dim);
			wrv(x, (size_t)n * dim);
		} else if (op == 4) {
			int n = rd(), stride = rd(), E = rd(), k = rd(), norm = rd(), fused = rd();
			size_t nk = (size_t)n * k;
			std::vector<float> logits, w(nk + 1);
			std::vector<int> ids(nk + 1), rows(nk + 1), src(nk + 1), offs(E + 2), act(E + 1), nact(1);
			rdv(logits, (size_t)n * stride);
			if (fused)
				emu_launch(moe_route, {1, 1, 1}, MOE_SORT_WARPS * 32, rows.data(), src.data(), offs.data(), act.data(),
					   nact.data(), ids.data(), w.data(), (const float *)logits.data(), n, stride, E, k, norm);
			else {
				emu_launch(moe_topk, {(unsigned)(n + 7) / 8, 1, 1}, 256, ids.data(), w.data(), (const float *)logits.data(),
					   n, stride, E, k, norm);
				emu_launch(moe_sort, {1, 1, 1}, MOE_SORT_WARPS * 32, rows.data(), src.data(), offs.data(), act.data(),
					   nact.data(), (const int *)ids.data(), (int)nk, k, E);
			}
			wrv(ids, nk);
			wrv(w, nk);
			wrv(rows, nk);
			wrv(src, nk);
			wrv(offs, E + 1);
			wrv(act, E);
			wrv(nact, 1);
		} else if (op == 5) {
			int silu = rd(), E = rd(), units = rd(), n = rd(), rows = rd(), toks = rd(), na = rd();
			std::vector<int> act, offs, src, nact(1, na);
			rdv(act, E);
			rdv(offs, E + 1);
			rdv(src, rows);
			std::vector<T> X, W;
			rdv(X, (size_t)(silu ? toks : rows) * n);
			rdv(W, (size_t)E * (silu ? 2 : 1) * units * n);
			unsigned gx = (unsigned)(units + 7) / 8;
			if (silu) {
				std::vector<T> h((size_t)rows * units + 1);
				emu_launch(silu == 2 ? moe_gemv_silu1 : moe_gemv_silu, {gx, (unsigned)E, 1}, 256, h.data(), (const T *)X.data(), (const T *)W.data(),
					   (const int *)src.data(), (const int *)act.data(), (const int *)nact.data(), (const int *)offs.data(),
					   units, n);
				wrv(h, (size_t)rows * units);
			} else {
				std::vector<float> Y((size_t)rows * units + 1);
				emu_launch(moe_gemv_down, {gx, (unsigned)E, 1}, 256, Y.data(), (const T *)X.data(), (const T *)W.data(),
					   (const int *)act.data(), (const int *)nact.data(), (const int *)offs.data(), units, n);
				wrv(Y, (size_t)rows * units);
			}
		} else if (op == 6) {
			int n = rd(), nh = rd(), nkv = rd(), hb = rd(), il = rd(), ntab = rd(), ce = rd();
			float eps;
			if (fread(&eps, 4, 1, in) != 1) return 2;
			size_t W = (size_t)(nh + 2 * nkv) * HEAD_DIM, QD = (size_t)nh * HEAD_DIM;
			std::vector<float> qkv, bias, qw, kw;
			std::vector<int> pos;
			std::vector<long long> slot;
			std::vector<float2> tab;
			std::vector<double> inv;
			rdv(qkv, n * W);
			rdv(bias, W);
			rdv(qw, HEAD_DIM);
			rdv(kw, HEAD_DIM);
			rdv(pos, n);
			rdv(slot, n);
			rdv(tab, (size_t)ntab * (HEAD_DIM / 2));
			rdv(inv, HEAD_DIM / 2);
			std::vector<T> q(n * QD + 1), kc(ce + 1), vc(ce + 1);
			memset(q.data(), 0xff, q.size() * sizeof(T));
			memset(kc.data(), 0xff, kc.size() * sizeof(T));
			memset(vc.data(), 0xff, vc.size() * sizeof(T));
			emu_launch(qk_norm_rope, {(unsigned)n, (unsigned)(nh + 2 * nkv), 1}, 32, q.data(), kc.data(), vc.data(),
				   (const float *)qkv.data(), (const float *)(hb ? bias.data() : nullptr), (const float *)qw.data(),
				   (const float *)kw.data(), (const int *)pos.data(), (const long long *)slot.data(),
				   (const float2 *)tab.data(), (const double *)inv.data(), ntab, nh, nkv, il, eps);
			wrv(q, n * QD);
			wrv(kc, ce);
			wrv(vc, ce);
		} else if (op == 7) {
			int E = rd(), out = rd(), n = rd(), nt = rd(), k = rd(), hs = rd(), gs = rd(), na = rd();
			int nk = nt * k;
			std::vector<int> ids, rows, act, offs, nact(1, na);
			rdv(ids, nk);
			rdv(rows, nk);
			rdv(act, E);
			rdv(offs, E + 1);
			std::vector<T> X, W;
			rdv(X, (size_t)nk * n);
			rdv(W, (size_t)E * out * n);
			std::vector<float> w, x, sh, gate, Y((size_t)nk * out + 1);
			rdv(w, nk);
			rdv(x, (size_t)nt * out);
			rdv(sh, (size_t)nt * out);
			rdv(gate, (size_t)nt * gs);
			const float *shp = hs ? sh.data() : nullptr, *gp = hs ? gate.data() : nullptr;
			std::vector<float> x2 = x;
			emu_launch(moe_gemv_down_add, {(unsigned)(out + 3) / 4, 1, 1}, 128, x.data(), (const T *)X.data(),
				   (const T *)W.data(), (const int *)ids.data(), (const int *)rows.data(), (const float *)w.data(), shp, gp,
				   gs, nk, k, out, n);
			emu_launch(moe_gemv_down, {(unsigned)(out + 7) / 8, (unsigned)E, 1}, 256, Y.data(), (const T *)X.data(),
				   (const T *)W.data(), (const int *)act.data(), (const int *)nact.data(), (const int *)offs.data(), out, n);
			emu_launch(moe_combine, {(unsigned)nt, 1, 1}, 64, x2.data(), (const float *)Y.data(), (const int *)rows.data(),
				   (const float *)w.data(), shp, gp, gs, k, out);
			wrv(x, (size_t)nt * out);
			wrv(x2, (size_t)nt * out);
		} else if (op == 8) {
			int E = rd(), k = rd(), norm = rd(), units = rd(), n = rd();
			std::vector<float> logits;
			std::vector<T> X, W;
			rdv(logits, E);
			rdv(X, n);
			rdv(W, (size_t)E * 2 * units * n);
			for (int fused = 0; fused < 2; fused++) {
				std::vector<T> h((size_t)k * units + 1);
				std::vector<float> w(k + 1);
				std::vector<int> ids(k + 1), rows(k + 1), src(k + 1), offs(E + 2), act(E + 1), nact(1);
				memset(w.data(), 0xff, w.size() * 4);
				for (auto *v : {&ids, &rows, &src, &offs, &act, &nact}) memset(v->data(), 0xff, v->size() * 4);
				unsigned gx = (unsigned)(units + 7) / 8;
				if (fused)
					emu_launch(moe_route_silu1, {gx, (unsigned)k, 1}, 256, h.data(), (const T *)X.data(), (const T *)W.data(),
						   rows.data(), src.data(), offs.data(), act.data(), nact.data(), ids.data(), w.data(),
						   (const float *)logits.data(), E, k, norm, units, n);
				else {
					emu_launch(moe_route, {1, 1, 1}, MOE_SORT_WARPS * 32, rows.data(), src.data(), offs.data(), act.data(),
						   nact.data(), ids.data(), w.data(), (const float *)logits.data(), 1, E, E, k, norm);
					emu_launch(moe_gemv_silu1, {gx, (unsigned)k, 1}, 256, h.data(), (const T *)X.data(), (const T *)W.data(),
						   (const int *)src.data(), (const int *)act.data(), (const int *)nact.data(),
						   (const int *)offs.data(), units, n);
				}
				wrv(h, (size_t)k * units);
				wrv(ids, k);
				wrv(w, k);
				wrv(rows, k);
				wrv(src, k);
				wrv(offs, E + 1);
				wrv(act, E);
				wrv(nact, 1);
			}
		} else {
			return 3;
		}
	}
	fclose(out);
	return 0;
}
