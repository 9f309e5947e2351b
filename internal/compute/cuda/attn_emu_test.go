package cuda

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/mooncake-go/mooncake-go/internal/model"
)

// TestAttnTCEmulated runs attn.cu's attn_decode_tc on the host (the mma
// fragments exchanged between the emulated lanes as PTX lays them out)
// against attention in float64 over the same bf16 q, K and V: every split's
// max (natural-log units) within 1e-4, the merged output within 4e-3
// relative (P is rounded to bf16), splits past a query's last key left
// alone. Shapes: 1, 4 and 8 query heads per KV head; splits of 16, 32, 128
// and 256 keys over 1, 2, 4 and 8 warps (1 to 8 chunks a warp; the wide
// kernel's twice the warps among them); pages of 16,
// 32 and 64 in a random order; queries of 1 key to several splits, partial
// chunks among them.
func TestAttnTCEmulated(t *testing.T) {
	src, _ := filepath.Abs("../../../csrc/llama/attn.cu")
	for _, tc := range []struct {
		group, split, warps, nkv, ps int
		wide                         bool
		pos                          []int
	}{
		{4, 128, 4, 2, 16, true, []int{0, 15, 16, 130, 300}},
		{4, 128, 4, 2, 16, false, []int{0, 15, 16, 47, 130, 300}},
		{8, 256, 2, 1, 64, false, []int{5, 255, 400}},
		{1, 32, 1, 3, 32, true, []int{0, 31, 70}},
		{4, 16, 1, 2, 16, false, []int{0, 17, 40}},
	} {
		t.Run(fmt.Sprintf("group%d-split%d-warps%d-wide%v", tc.group, tc.split, tc.warps, tc.wide), func(t *testing.T) {
			bin := emuCompile(t, "attn_emu", "-DHEAD_DIM=128", "-DUSE_BF16=1", fmt.Sprintf("-DGQA_GROUP=%d", tc.group),
				fmt.Sprintf("-DATT_SPLIT=%d", tc.split), fmt.Sprintf("-DTC_WARPS=%d", tc.warps), `-DATTN_CU="`+src+`"`)
			checkAttnTC(t, bin, tc.group, tc.split, tc.nkv, tc.ps, tc.wide, tc.pos)
		})
	}
}

func checkAttnTC(t *testing.T, bin string, group, split, nkv, ps int, wide bool, pos []int) {
	const hd = 128
	r := rand.New(rand.NewPCG(uint64(group), uint64(split)))
	nq, nh := len(pos), group*nkv
	nsplit, per := 0, 0
	for _, p := range pos {
		nsplit = max(nsplit, p/split+1)
		per = max(per, p/ps+1)
	}
	npages := nq * per
	perm := r.Perm(npages)
	qrow, ptoff, pages := make([]int32, nq), make([]int32, nq), make([]int32, nq*per)
	for i := range nq {
		qrow[i], ptoff[i] = int32(nq-1-i), int32(i*per)
		for j := range per {
			pages[i*per+j] = int32(perm[i*per+j])
		}
	}
	bf := func(n int, s float64) []uint16 {
		v := make([]uint16, n)
		for i := range v {
			v[i] = model.F32ToBF16(float32(r.NormFloat64() * s))
		}
		return v
	}
	kvd := nkv * hd
	q, kc, vc := bf(nq*nh*hd, 1), bf(npages*ps*kvd, 1), bf(npages*ps*kvd, 1)
	np := nq * nh * nsplit
	po, pml := make([]float32, np*hd), make([]float32, np*2)
	nan := float32(math.NaN())
	for i := range po {
		po[i] = nan
	}
	for i := range pml {
		pml[i] = nan
	}
	scale := 1 / math.Sqrt(hd)
	var in bytes.Buffer
	put(t, &in, int32(nq), int32(nh), int32(nkv), int32(ps), int32(nsplit), int32(npages), int32(per),
		float32(scale*math.Log2E))
	p32 := make([]int32, nq)
	for i, p := range pos {
		p32[i] = int32(p)
	}
	w := int32(0)
	if wide {
		w = 1
	}
	put(t, &in, p32, qrow, ptoff, pages, q, kc, vc, po, pml, w)
	got := emuCall[float32](t, bin, &in, np*hd+np*2)
	gpo, gml := got[:np*hd], got[np*hd:]
	f := func(h uint16) float64 { return float64(model.BF16ToF32(h)) }
	for z, p := range pos {
		for h := range nh {
			kh := h / group
			qv := q[int(qrow[z])*nh*hd+h*hd:][:hd]
			row := func(key int) int {
				pg := int(pages[int(ptoff[z])+key/ps])
				return (pg*ps+key%ps)*kvd + kh*hd
			}
			s := make([]float64, p+1)
			for j := range s {
				kr := kc[row(j):][:hd]
				for d := range hd {
					s[j] += f(qv[d]) * f(kr[d])
				}
				s[j] *= scale
			}
			ns := p/split + 1
			M, want := math.Inf(-1), make([]float64, hd)
			for _, v := range s {
				M = math.Max(M, v)
			}
			L := 0.0
			for j, v := range s {
				e := math.Exp(v - M)
				L += e
				vr := vc[row(j):][:hd]
				for d := range hd {
					want[d] += e * f(vr[d])
				}
			}
			// merge the kernel's splits as attn_combine does
			base := (z*nh + h) * nsplit
			gm, gl, gotO := math.Inf(-1), 0.0, make([]float64, hd)
			for sp := range nsplit {
				m := float64(gml[(base+sp)*2])
				if sp >= ns {
					if !math.IsNaN(m) || !math.IsNaN(float64(gpo[(base+sp)*hd])) {
						t.Fatalf("query %d head %d: split %d past the last key written", z, h, sp)
					}
					continue
				}
				wm := math.Inf(-1)
				for _, v := range s[sp*split : min(len(s), (sp+1)*split)] {
					wm = math.Max(wm, v)
				}
				if math.Abs(m-wm) > 1e-4 {
					t.Fatalf("query %d head %d split %d: max %g, want %g", z, h, sp, m, wm)
				}
				gm = math.Max(gm, m)
			}
			for sp := range ns {
				e := math.Exp(float64(gml[(base+sp)*2]) - gm)
				gl += float64(gml[(base+sp)*2+1]) * e
				for d := range hd {
					gotO[d] += float64(gpo[(base+sp)*hd+d]) * e
				}
			}
			var num, den float64
			for d := range hd {
				w, g := want[d]/L, gotO[d]/gl
				num += (w - g) * (w - g)
				den += w * w
			}
			if e := math.Sqrt(num / den); !(e <= 4e-3) {
				t.Errorf("query %d (pos %d) head %d: relative error %.3g", z, p, h, e)
			}
		}
	}
}

// TestAttnPrefillEmulated runs attn.cu's attn_prefill3 on the host (ldmatrix
// and mma fragments exchanged between the emulated lanes as PTX lays them
// out; cp.async copies at once) against causal attention in float64 over
// the same bf16 q, K and V: each row's output within 5e-3 relative (P is
// rounded to bf16, the output to bf16), rows outside every chunk left
// alone; the 128-row and the 64-row kernel, and at head dim 128
// attn_prefill4 (wgmma reading the swizzled tiles through their
// descriptors, as TestWgmmaProbe checks them on an H200; its producer and
// consumers ordered by the emulated mbarriers). Shapes: head dims 128 and
// 64, 1, 2 and 4 query heads per KV head, pages of 16, 48 and 64 in a random
// order, chunks of 1 to 300 rows with and without earlier keys in the cache
// (pos0), more key tiles than attn_prefill4 has stages, query tiles partly
// past a chunk's end, warps whose rows all lie past it.
func TestAttnPrefillEmulated(t *testing.T) {
	src, _ := filepath.Abs("../../../csrc/llama/attn.cu")
	for _, tc := range []struct {
		hd, group, nkv, ps int
		qlen, pos0         []int
		grow               bool // keys scaled by 1 + position/16: row maxima that keep moving
	}{
		{128, 4, 1, 16, []int{200, 130, 1, 37}, []int{0, 70, 33, 0}, false},
		{128, 2, 2, 64, []int{300, 64, 129}, []int{0, 200, 64}, false}, // one page a 64-key tile
		{128, 1, 2, 32, []int{260, 70}, []int{0, 190}, true},
		{64, 1, 2, 64, []int{257, 64}, []int{0, 100}, false},
		{64, 2, 1, 48, []int{100, 5}, []int{30, 0}, false}, // pages of no power of two
	} {
		t.Run(fmt.Sprintf("hd%d-group%d-ps%d-grow%v", tc.hd, tc.group, tc.ps, tc.grow), func(t *testing.T) {
			bin := emuCompile(t, "prefill_emu", fmt.Sprintf("-DHEAD_DIM=%d", tc.hd), "-DUSE_BF16=1",
				fmt.Sprintf("-DGQA_GROUP=%d", tc.group), "-DATT_SPLIT=128", "-DEMU_HOPPER=1", `-DATTN_CU="`+src+`"`)
			kernels := []int{0, 1} // attn_prefill3, _64
			if tc.hd == 128 {
				kernels = append(kernels, 2) // attn_prefill4
			}
			for _, k := range kernels {
				checkAttnPrefill(t, bin, tc.hd, tc.group, tc.nkv, tc.ps, tc.qlen, tc.pos0, tc.grow, k)
			}
		})
	}
}

func checkAttnPrefill(t *testing.T, bin string, hd, group, nkv, ps int, qlen, pos0 []int, grow bool, kernel int) {
	r := rand.New(rand.NewPCG(uint64(hd), uint64(group)))
	ns, nh := len(qlen), group*nkv
	per := 0
	qstart := make([]int32, ns)
	rows := 0
	for i := range ns {
		per = max(per, (pos0[i]+qlen[i]+ps-1)/ps)
		rows += 3 // a gap before each chunk: rows no chunk owns
		qstart[i] = int32(rows)
		rows += qlen[i]
	}
	npages := ns * per
	perm := r.Perm(npages)
	ptoff, pages := make([]int32, ns), make([]int32, ns*per)
	for i := range ns {
		ptoff[i] = int32(i * per)
		for j := range per {
			pages[i*per+j] = int32(perm[i*per+j])
		}
	}
	bf := func(n int) []uint16 {
		v := make([]uint16, n)
		for i := range v {
			v[i] = model.F32ToBF16(float32(r.NormFloat64()))
		}
		return v
	}
	qd, kvd := nh*hd, nkv*hd
	q, kc, vc := bf(rows*qd), bf(npages*ps*kvd), bf(npages*ps*kvd)
	if grow {
		for i := range ns {
			for key := range pos0[i] + qlen[i] {
				kr := kc[(int(pages[i*per+key/ps])*ps+key%ps)*kvd:][:kvd]
				for d := range kr {
					kr[d] = model.F32ToBF16(model.BF16ToF32(kr[d]) * float32(1+float64(key)/16))
				}
			}
		}
	}
	const nan = 0x7fc1
	out := make([]uint16, rows*qd)
	for i := range out {
		out[i] = nan
	}
	scale := 1 / math.Sqrt(float64(hd))
	i32 := func(v []int) []int32 {
		o := make([]int32, len(v))
		for i, x := range v {
			o[i] = int32(x)
		}
		return o
	}
	var in bytes.Buffer
	put(t, &in, int32(ns), int32(nh), int32(nkv), int32(ps), int32(npages), int32(per), int32(rows),
		float32(scale*math.Log2E), qstart, i32(qlen), i32(pos0), ptoff, pages, q, kc, vc, out, int32(kernel))
	got := emuCall[uint16](t, bin, &in, rows*qd)
	f := func(h uint16) float64 { return float64(model.BF16ToF32(h)) }
	owned := make([]bool, rows)
	for i := range ns {
		for j := range qlen[i] {
			owned[int(qstart[i])+j] = true
		}
		row := func(key int) int {
			return (int(pages[i*per+key/ps])*ps + key%ps) * kvd
		}
		for j := range qlen[i] {
			qr := int(qstart[i]) + j
			p := pos0[i] + j
			for h := range nh {
				qv := q[qr*qd+h*hd:][:hd]
				kh := h / group
				s := make([]float64, p+1)
				M := math.Inf(-1)
				for k := range s {
					kr := kc[row(k)+kh*hd:][:hd]
					for d := range hd {
						s[k] += f(qv[d]) * f(kr[d])
					}
					s[k] *= scale
					M = math.Max(M, s[k])
				}
				want, L := make([]float64, hd), 0.0
				for k, v := range s {
					e := math.Exp(v - M)
					L += e
					vr := vc[row(k)+kh*hd:][:hd]
					for d := range hd {
						want[d] += e * f(vr[d])
					}
				}
				var num, den float64
				for d := range hd {
					w, g := want[d]/L, f(got[qr*qd+h*hd+d])
					num += (w - g) * (w - g)
					den += w * w
				}
				if e := math.Sqrt(num / den); !(e <= 5e-3) {
					t.Errorf("kernel %d: seq %d row %d (pos %d) head %d: relative error %.3g", kernel, i, j, p, h, e)
				}
			}
		}
	}
	for qr, o := range owned {
		if o {
			continue
		}
		for k := range qd {
			if got[qr*qd+k] != nan {
				t.Fatalf("row %d, owned by no chunk, written", qr)
			}
		}
	}
}
