#!/usr/bin/env python3
"""Optional cross-check of the committed SmolLM2 fixtures against llama.cpp
itself (llama-cpp-python on the same GGUF): its tokenizer on every string of
smollm2_tokens.json and every prompt, its greedy continuation of every
prompt, and its logits at the recorded steps. Not part of run.sh: building
llama-cpp-python from source takes 6-15 minutes; see README.md.

  python llama_cpp_check.py [--model GGUF] [--fixtures DIR]

Exits 1 if a token id list or a greedy token differs. The logit difference
is printed, not checked: llama.cpp multiplies Q4_1 weights by activations
quantized to 8 bits (Q8_1), which moves logits by several tenths.
"""

import argparse
import json
import os
import sys

import numpy as np
from llama_cpp import Llama

here = os.path.dirname(os.path.abspath(__file__))
root = os.path.normpath(os.path.join(here, "..", ".."))
ap = argparse.ArgumentParser()
ap.add_argument("--model", default=os.path.join(root, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
ap.add_argument("--fixtures", default=os.path.join(root, "tests", "fixtures"))
args = ap.parse_args()

ref = json.load(open(os.path.join(args.fixtures, "smollm2_reference.json"), encoding="utf-8"))
toks = json.load(open(os.path.join(args.fixtures, "smollm2_tokens.json"), encoding="utf-8"))
llm = Llama(model_path=args.model, n_ctx=256, n_batch=256, n_threads=1, logits_all=True, verbose=False)

failures = 0
bad = [c for c in toks["cases"]
       if llm.tokenize(c["text"].encode(), add_bos=False, special=True) != c["ids"]]
for c in bad:
    print(f"token ids differ for {c['text']!r}: llama.cpp "
          f"{llm.tokenize(c['text'].encode(), add_bos=False, special=True)}, fixture {c['ids']}")
print(f"tokens: {len(toks['cases']) - len(bad)}/{len(toks['cases'])} strings agree with llama.cpp")
failures += len(bad)

eos = ref["model"].get("eos_id", 2)
for p in ref["prompts"]:
    ids = llm.tokenize(p["prompt"].encode(), add_bos=False, special=True)
    if ids != p["prompt_ids"]:
        print(f"[{p['name']}] prompt ids differ: llama.cpp {ids}")
        failures += 1
    llm.reset()
    llm.eval(p["prompt_ids"])
    gen, rows = [], []
    for _ in range(len(p["generated_ids"])):
        z = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        rows.append(z)
        t = int(np.argmax(z))
        gen.append(t)
        if t == eos:
            break
        llm.eval([t])
    first = next((i for i, (a, b) in enumerate(zip(gen, p["generated_ids"])) if a != b), None)
    if first is None and len(gen) != len(p["generated_ids"]):
        first = min(len(gen), len(p["generated_ids"]))
    worst = max(float(np.abs(rows[s["step"]][s["top_ids"]] - np.array(s["top_logits"])).max())
                for s in p["steps"] if first is None or s["step"] <= first)
    print(f"[{p['name']}] greedy: {'identical' if first is None else f'first difference at token {first}'} "
          f"({len(gen)} tokens); max |top-20 logit - reference| {worst:.3f}")
    failures += first is not None
sys.exit(1 if failures else 0)
