#!/usr/bin/env python3
"""PyTorch + transformers peer for the CUDA backend (issue 6).

Loads an HF directory (e.g. written by `mooncake-go convert --random --config
llama3-8b`, or qwen3-32b-8l, ...) with transformers' AutoModelForCausalLM in
bf16 (SDPA, eager), then
(a) writes the last-position logits of several seeded random prompts
    (token ids) to OUT/torch_logits.f32 (float32 LE, [prompts][vocab]) and
    OUT/torch_ref.json (prompts, vocab, timings), read by the Go test
    TestHFvsTorch (internal/compute/cuda);
(b) times prefill of 1K/4K/8K tokens and decode steps at batch 1 and 32 with
    ~1K tokens of context (median of CUDA-event timings after warm-up).
"""
import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def timed(fn, warm=1, reps=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lens", default="5,64,300,1000")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--decode-steps", type=int, default=10)
    ap.add_argument("--f32-ref", action="store_true",
                    help="also write torch_logits_f32.f32: the same prompts with the model in float32 (no TF32), "
                         "to tell bf16 rounding in either stack from a real disagreement")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, attn_implementation="sdpa",
                                             device_map="cuda")
    model.eval()
    torch.cuda.synchronize()
    load_s = time.time() - t0
    V = model.config.vocab_size
    print(f"loaded {a.model} in {load_s:.1f} s: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"attn {model.config._attn_implementation}", flush=True)
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist() for n in a.lens.split(",")]
    rows = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            lg = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
            rows.append(lg)
        torch.stack(rows).numpy().astype("<f4").tofile(os.path.join(a.out, "torch_logits.f32"))
        timings = {}
        if a.bench:
            for L in (1024, 4096, 8192):
                ids = torch.randint(0, V, (1, L), device="cuda")
                timings[f"prefill_{L}"] = timed(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1))
                print(f"prefill {L}: {timings[f'prefill_{L}']:.2f} ms", flush=True)
            for bs in (1, 32):
                ids = torch.randint(0, V, (bs, 1024), device="cuda")
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                ts = []
                for i in range(3 + a.decode_steps):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    out = model(input_ids=nxt, past_key_values=pkv, use_cache=True, logits_to_keep=1)
                    pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    e1.record()
                    e1.synchronize()
                    if i >= 3:
                        ts.append(e0.elapsed_time(e1))
                timings[f"decode_b{bs}_ctx1024"] = statistics.median(ts)
                print(f"decode batch {bs} ctx 1024: {timings[f'decode_b{bs}_ctx1024']:.2f} ms/step", flush=True)
                del pkv, out
                torch.cuda.empty_cache()
    if a.f32_ref:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        model = model.float()
        with torch.inference_mode():
            rows = [model(input_ids=torch.tensor([p], device="cuda"), use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
                    for p in prompts]
        torch.stack(rows).numpy().astype("<f4").tofile(os.path.join(a.out, "torch_logits_f32.f32"))
    ref = {"prompts": prompts, "vocab": V, "logits_file": "torch_logits.f32",
           "logits_f32_file": "torch_logits_f32.f32" if a.f32_ref else "", "timings_ms": timings, "load_s": load_s,
           "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with open(os.path.join(a.out, "torch_ref.json"), "w") as f:
        json.dump(ref, f)
    print(json.dumps({k: v for k, v in ref.items() if k != "prompts"}), flush=True)


if __name__ == "__main__":
    main()
