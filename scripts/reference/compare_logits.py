#!/usr/bin/env python3
"""Compare the logits `kvjit generate --logits` wrote in two runs (same
prompt, same greedy tokens expected), and optionally llama.cpp's on the
same GGUF file and the same tokens.

  python compare_logits.py A.safetensors B.safetensors [--gguf FILE] [--tolerance T]

Prints per run pair the largest normalized logit error over the generated
steps (max |a − b| / max |b| per step), and with --gguf at how many steps
llama.cpp's greedy token is kvjit's; exits 1 if the token ids differ or
the kvjit pair's error exceeds the tolerance (default 0.01). llama.cpp's
difference is printed, not checked: it multiplies quantized weights by
activations quantized to 8 bits, which moves logits by far more.
"""

import argparse
import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    body = data[8 + size :]
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        dtype = {"F32": np.float32, "U32": np.uint32}[entry["dtype"]]
        out[name] = np.frombuffer(body[begin:end], dtype=dtype).reshape(entry["shape"])
    return out


def error(a, b):
    return max(float(np.max(np.abs(x - y)) / np.max(np.abs(y))) for x, y in zip(a, b))


ap = argparse.ArgumentParser()
ap.add_argument("a")
ap.add_argument("b")
ap.add_argument("--gguf")
ap.add_argument("--tolerance", type=float, default=0.01)
args = ap.parse_args()
a, b = read_safetensors(args.a), read_safetensors(args.b)
tokens = a["tokens"]
if not np.array_equal(tokens, b["tokens"]):
    print(f"token ids differ: {tokens.tolist()} vs {b['tokens'].tolist()}")
    sys.exit(1)
logits_a, logits_b = a["logits"].astype(np.float64), b["logits"].astype(np.float64)
steps = logits_a.shape[0]
err = error(logits_a, logits_b)
print(f"{args.a} vs {args.b}: {steps} steps, same tokens, largest normalized logit error {err:.2e}")
if args.gguf:
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, n_ctx=512, n_batch=512, n_threads=2, logits_all=True, verbose=False)
    llm.eval(tokens.tolist())
    prompt = len(tokens) - steps
    ours = np.array([llm.scores[prompt - 1 + s] for s in range(steps)], dtype=np.float64)
    agree = sum(int(np.argmax(ours[s])) == int(tokens[prompt + s]) for s in range(steps))
    print(f"llama.cpp: its greedy token agrees at {agree}/{steps} steps; largest normalized logit error "
          f"{error(ours, logits_a):.2e} against {args.a}, {error(ours, logits_b):.2e} against {args.b}")
sys.exit(0 if err <= args.tolerance else 1)
