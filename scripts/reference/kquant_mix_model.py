#!/usr/bin/env python3
"""Write a Llama-shaped model whose rows are multiples of 256 as an F32
GGUF, for llama.cpp to quantize into a K-quant mix (Q4_K_M stores a layer's
attn_v in Q6_K beside Q4_K attn_q and attn_k on some layers, and ffn_down in
Q6_K on some): what SmolLM2's 576-wide rows cannot give, since llama.cpp
stores those in 32-blocks fallback types.

The weights are random (seeded): N(0, 1/fan_in) matrices, norms near 1. The
tokenizer, chat template and special tokens are copied from the SmolLM2
GGUF given, so `kvjit generate` and llama.cpp tokenize as they do for it.

  python kquant_mix_model.py SMOLLM2.gguf OUT.gguf
"""

import sys

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 768, 12, 4, 2048, 8
HEAD = HIDDEN // HEADS

source, out = sys.argv[1:]
reader = GGUFReader(source)
vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
writer = GGUFWriter(out, "llama")
writer.add_name("kvjit synthetic K-quant mix")
writer.add_context_length(2048)
writer.add_embedding_length(HIDDEN)
writer.add_block_count(LAYERS)
writer.add_feed_forward_length(FFN)
writer.add_head_count(HEADS)
writer.add_head_count_kv(KV_HEADS)
writer.add_rope_dimension_count(HEAD)
writer.add_rope_freq_base(10000.0)
writer.add_layer_norm_rms_eps(1e-5)
writer.add_file_type(0)  # all F32

# The tokenizer's keys, as the source stores them.
for name, field in reader.fields.items():
    if not name.startswith("tokenizer."):
        continue
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        item = field.types[1]
        values = [field.parts[i] for i in field.data]
        if item == GGUFValueType.STRING:
            writer.add_array(name, [bytes(v).decode("utf-8") for v in values])
        else:
            writer.add_array(name, [v.tolist()[0] for v in values])
    elif kind == GGUFValueType.STRING:
        writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8"))
    elif kind == GGUFValueType.BOOL:
        writer.add_bool(name, bool(field.parts[field.data[0]][0]))
    else:
        writer.add_uint32(name, int(field.parts[field.data[0]][0]))

rng = np.random.default_rng(2026)


def matrix(rows, cols, gain=1.0):
    return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)


def norm():
    return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)


writer.add_tensor("token_embd.weight", (rng.standard_normal((vocab, HIDDEN)) * 0.5).astype(np.float32))
for layer in range(LAYERS):
    p = f"blk.{layer}."
    writer.add_tensor(p + "attn_norm.weight", norm())
    writer.add_tensor(p + "attn_q.weight", matrix(HIDDEN, HIDDEN, 2.0))
    writer.add_tensor(p + "attn_k.weight", matrix(KV_HEADS * HEAD, HIDDEN, 2.0))
    writer.add_tensor(p + "attn_v.weight", matrix(KV_HEADS * HEAD, HIDDEN))
    writer.add_tensor(p + "attn_output.weight", matrix(HIDDEN, HIDDEN))
    writer.add_tensor(p + "ffn_norm.weight", norm())
    writer.add_tensor(p + "ffn_gate.weight", matrix(FFN, HIDDEN))
    writer.add_tensor(p + "ffn_up.weight", matrix(FFN, HIDDEN))
    writer.add_tensor(p + "ffn_down.weight", matrix(HIDDEN, FFN))
writer.add_tensor("output_norm.weight", norm())
writer.add_tensor("output.weight", matrix(vocab, HIDDEN, 4.0))
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
print(f"wrote {out}: {LAYERS} layers, hidden {HIDDEN}, {HEADS}/{KV_HEADS} heads of {HEAD}, FFN {FFN}, vocab {vocab}")
