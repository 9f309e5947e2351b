"""Load an HF directory written by `mooncake-go convert --from llama2c --to hf`
with transformers' LlamaForCausalLM (CPU, float32) and check that it gives
llama2.c's greedy tokens for every case of the reference file, so the
conversion is checked by an implementation that is not ours.

usage: python3 check_hf_greedy.py HF_DIR stories260K-greedy.json
"""
import json
import sys

import torch
from transformers import LlamaForCausalLM


def main():
    hf_dir, ref_path = sys.argv[1], sys.argv[2]
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    with open(ref_path) as f:
        ref = json.load(f)
    cases = ref["cases"] if isinstance(ref, dict) and "cases" in ref else ref
    bad = 0
    for i, c in enumerate(cases):
        ids = torch.tensor([c["prompt_ids"]])
        want = c["greedy_next_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
            out = model.generate(ids, max_new_tokens=len(want), do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        got = out[0, ids.shape[1]:].tolist()
        maxdiff = (logits - torch.tensor(c["last_prompt_logits"])).abs().max().item()
        ok = got == want and maxdiff < 1e-4
        bad += not ok
        print(f"case {i}: greedy {'equal' if got == want else 'DIFFERENT'} ({len(want)} tokens), "
              f"last-prompt logits max |diff| {maxdiff:.2e}")
    print(f"transformers check: {len(cases) - bad} of {len(cases)} cases match")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
