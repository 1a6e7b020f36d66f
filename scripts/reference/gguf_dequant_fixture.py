#!/usr/bin/env python3
"""Writes crates/gguf/tests/fixtures/gguf_py_dequant.json: blocks of every
GGML type kvjit dequantizes, with the f32 values gguf-py's
`gguf.quants.dequantize` (the pinned gguf==0.19.0, numpy) gives them, so
kvjit's dequantization is checked bit for bit against an implementation it
shares no code with.

  scripts/reference/run.sh --dequant-fixture      (the reference venv)

Per type: `blocks` random blocks (bytes from a seeded generator), their f16
scale fields overwritten with normal values of random sign and magnitude in
[2^-14, 2^2) — except the last block, left as drawn, so any f16 (subnormal,
infinite, NaN) may land there. Deterministic: a rerun writes the same bytes.
"""

import json
import os

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.normpath(os.path.join(here, "..", "..", "crates", "gguf", "tests", "fixtures", "gguf_py_dequant.json"))

# (type, bytes per block, byte offsets of its f16 scale fields, blocks)
TYPES = [
    (T.Q8_0, 34, [0], 8),
    (T.Q4_0, 18, [0], 8),
    (T.Q4_1, 20, [0, 2], 8),
    (T.Q5_0, 22, [0], 8),
    (T.Q5_1, 24, [0, 2], 8),
    (T.IQ4_NL, 18, [0], 8),
    (T.Q2_K, 84, [80, 82], 3),
    (T.Q3_K, 110, [108], 3),
    (T.Q4_K, 144, [0, 2], 3),
    (T.Q5_K, 176, [0, 2], 3),
    (T.Q6_K, 210, [208], 3),
    (T.IQ4_XS, 136, [0], 3),
]

rng = np.random.default_rng(20261207)
fixture = {
    "generator": "scripts/reference/gguf_dequant_fixture.py",
    "reference": "gguf==0.19.0 gguf.quants.dequantize (numpy)",
    "types": {},
}
for qtype, size, scales, count in TYPES:
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    for b in range(count - 1):
        for at in scales:
            value = np.float16(rng.choice([-1.0, 1.0]) * 2.0 ** rng.uniform(-14.0, 2.0))
            blocks[b, at:at + 2] = np.frombuffer(value.tobytes(), dtype=np.uint8)
    values = dequantize(blocks.reshape(-1), qtype).astype(np.float32)
    fixture["types"][qtype.name] = {
        "blocks": blocks.tobytes().hex(),
        "values": values.astype("<f4").tobytes().hex(),
    }

with open(out, "w", encoding="utf-8") as f:
    json.dump(fixture, f, indent=1)
    f.write("\n")
print(out)
