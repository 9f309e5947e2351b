// sample_emu.cpp: runs csrc/llama/sample.cu's kernels on the host through
// cudaemu.h, for TestSampleKernelsEmulated (sample_emu_test.go writes the
// input and checks the output against internal/sampling). Build:
//   g++ -std=c++20 -O0 -ffp-contract=off -DWIN=512 \
//       -DSAMPLE_CU='"path/to/sample.cu"' sample_emu.cpp
// Input (little-endian int32 unless said): V, rows, steps; per row: has a
// state, prompt length and ids, bias count, ids and float values; per step:
// the rows' SampleRow images (state pointers are replaced here), the logits
// (float [rows][V]), the count of accepted tokens and (row, token) pairs.
// Output: per step, the rows' SampleOut records.
#include "cudaemu.h"
#include SAMPLE_CU

#include <cstdio>
#include <cstdlib>

static FILE *in;
static int rd() {
	int v;
	if (fread(&v, 4, 1, in) != 1) {
		fprintf(stderr, "short input\n");
		exit(2);
	}
	return v;
}
static void rdn(void *p, size_t n) {
	if (fread(p, 1, n, in) != n) {
		fprintf(stderr, "short input\n");
		exit(2);
	}
}

int main(int argc, char **argv) {
	if (argc != 3) return 2;
	in = fopen(argv[1], "rb");
	FILE *out = fopen(argv[2], "wb");
	if (!in || !out) return 2;
	int V = rd(), rows = rd(), steps = rd();
	int nch = (V + CH - 1) / CH, nrb = (V + RB - 1) / RB;
	std::vector<std::vector<unsigned>> words(rows);
	std::vector<std::vector<int>> bids(rows);
	std::vector<std::vector<float>> bvals(rows);
	std::vector<int> has(rows);
	for (int r = 0; r < rows; r++) {
		has[r] = rd();
		int np = rd();
		std::vector<int> prompt(np);
		rdn(prompt.data(), 4 * np);
		int nb = rd();
		bids[r].resize(nb + 1);
		bvals[r].resize(nb + 1);
		rdn(bids[r].data(), 4 * nb);
		rdn(bvals[r].data(), 4 * nb);
		words[r].assign(V, 0);
		if (has[r] && np + nb > 0)
			emu_launch(sample_init, {1, 1, 1}, 32, words[r].data(), (const int *)prompt.data(), np,
				   (const int *)bids[r].data(), nb);
	}
	std::vector<SampleRow> params(rows);
	std::vector<float> logits((size_t)rows * V), work((size_t)rows * V);
	std::vector<ChunkStat> cs((size_t)rows * nch);
	std::vector<double> rsum((size_t)rows * nch), bsum((size_t)rows * nrb);
	std::vector<SampleOut> res(rows);
	for (int s = 0; s < steps; s++) {
		rdn(params.data(), sizeof(SampleRow) * rows);
		for (int r = 0; r < rows; r++) {
			params[r].words = has[r] ? (u64)words[r].data() : 0;
			params[r].bias_ids = (u64)bids[r].data();
			params[r].bias_vals = (u64)bvals[r].data();
		}
		rdn(logits.data(), 4 * logits.size());
		int na = rd();
		std::vector<AcceptEntry> acc(na + 1);
		for (int i = 0; i < na; i++) {
			int r = rd(), tok = rd();
			acc[i].words = (u64)words[r].data();
			acc[i].token = tok;
		}
		if (na > 0) emu_launch(sample_accept, {1, 1, 1}, 32, (const AcceptEntry *)acc.data(), na);
		memset(res.data(), 0xff, sizeof(SampleOut) * rows);
		emu_launch(sample_adjust, {(unsigned)nch, (unsigned)rows, 1}, CT, (const SampleRow *)params.data(),
			   (const float *)logits.data(), work.data(), cs.data(), V, nch);
		emu_launch(sample_weights, {(unsigned)nch, (unsigned)rows, 1}, CT, (const SampleRow *)params.data(),
			   (const float *)logits.data(), work.data(), (const ChunkStat *)cs.data(), rsum.data(), bsum.data(), V,
			   nch, nrb);
		emu_launch(sample_finish, {(unsigned)rows, 1, 1}, FT, (const SampleRow *)params.data(), (const float *)logits.data(),
			   (const float *)work.data(), (const ChunkStat *)cs.data(), (const double *)rsum.data(),
			   (const double *)bsum.data(), res.data(), V, nch, nrb);
		fwrite(res.data(), sizeof(SampleOut), rows, out);
	}
	fclose(out);
	return 0;
}
