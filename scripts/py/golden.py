#!/usr/bin/env python3
"""Golden references from transformers for the tiny random architectures.

For each HF directory given (written by `mooncake-go convert --random
--config NAME`), loads it with transformers' AutoModelForCausalLM in float32
(on the CPU by default: no TF32, a fixed reduction order) and in bfloat16 (on
the GPU when there is one), and writes OUT/NAME.json: the token ids of a few
seeded prompts and, per dtype, the top-k last-position logits, the sum and
sum of squares of all of them, and the greedy continuation (argmax of a full
forward pass per step, so no KV-cache code is involved). The fixture also
records the sha256 of the weights, so the Go test can tell a stale fixture
from a numerics bug. Read by TestGolden (internal/compute/cpu).

usage: golden.py [--out DIR] [--steps N] [--top K] HF_DIR...
"""
import argparse
import hashlib
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM


def sha256_weights(d):
    h = hashlib.sha256()
    for name in sorted(os.listdir(d)):
        if name.endswith(".safetensors"):
            with open(os.path.join(d, name), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def load(d, dtype, device):
    loaded = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation="eager",
                                                  output_loading_info=True)
    model, info = loaded if isinstance(loaded, tuple) else (loaded, {})
    if not isinstance(info, dict):
        info = vars(info)
    bad = {k: sorted(map(str, v)) for k, v in info.items()
           if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        sys.exit(f"{d}: transformers did not load every tensor as written: {bad}")
    return model.to(device).eval()


@torch.inference_mode()
def run(model, prompts, steps, top, device):
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        last = model(input_ids=ids, use_cache=False).logits[0, -1].float().cpu()
        greedy = []
        seq = list(p)
        for _ in range(steps):
            lg = model(input_ids=torch.tensor([seq], device=device), use_cache=False).logits[0, -1]
            nxt = int(lg.float().argmax())
            greedy.append(nxt)
            seq.append(nxt)
        v, i = last.topk(top)
        out.append({
            "top": [[int(a), float(b)] for a, b in zip(i, v)],
            "sum": float(last.double().sum()),
            "sumsq": float((last.double() ** 2).sum()),
            "greedy": greedy,
        })
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8, help="greedy tokens after each prompt")
    ap.add_argument("--top", type=int, default=24, help="top logits kept per prompt (float32)")
    ap.add_argument("--lens", default="5,21,64", help="prompt lengths (the last beyond the tiny sliding windows)")
    ap.add_argument("--f32-device", default="cpu")
    ap.add_argument("--bf16-device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for d in a.dirs:
        name = os.path.basename(os.path.normpath(d))
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        V = cfg["vocab_size"]
        g = torch.Generator().manual_seed(20261201)
        prompts = [torch.randint(0, min(V, 256), (int(n),), generator=g).tolist() for n in a.lens.split(",")]
        f32 = run(load(d, torch.float32, a.f32_device), prompts, a.steps, a.top, a.f32_device)
        bf16 = run(load(d, torch.bfloat16, a.bf16_device), prompts, a.steps, 8, a.bf16_device)
        fixture = {
            "shape": name,
            "architecture": cfg["architectures"][0],
            "weights_sha256": sha256_weights(d),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "devices": {"float32": a.f32_device, "bfloat16": a.bf16_device},
            "prompts": [{"ids": p, "float32": x, "bfloat16": y} for p, x, y in zip(prompts, f32, bf16)],
        }
        path = os.path.join(a.out, name + ".json")
        with open(path, "w") as f:
            json.dump(fixture, f, indent=1)
            f.write("\n")
        agree = sum(x["greedy"] == y["greedy"] for x, y in zip(f32, bf16))
        print(f"{name}: {path} ({os.path.getsize(path)} bytes); bf16 greedy equals f32 on {agree}/{len(prompts)}",
              flush=True)


if __name__ == "__main__":
    main()
