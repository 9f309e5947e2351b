// emuio.h: the input and output of the kernel emulations (blocks_emu.cpp,
// attn_emu.cpp, prefill_emu.cpp): emu_open(argc, argv) opens argv[1] for reading and
// argv[2] for writing; rd reads an int32, rdv n values (plus one spare, so
// data() is never null), wrv writes n values. A short input exits 2.
#include <cstdio>
#include <cstdlib>
#include <vector>

static FILE *in, *out;
static bool emu_open(int argc, char **argv) {
	if (argc != 3) return false;
	in = fopen(argv[1], "rb");
	out = fopen(argv[2], "wb");
	return in && out;
}
static int rd() {
	int v;
	if (fread(&v, 4, 1, in) != 1) exit(2);
	return v;
}
template <class V> static void rdv(std::vector<V> &v, size_t n) {
	v.resize(n + 1);
	if (n && fread(v.data(), sizeof(V), n, in) != n) exit(2);
}
template <class V> static void wrv(const std::vector<V> &v, size_t n) { fwrite(v.data(), sizeof(V), n, out); }
