#!/usr/bin/env bash
# Checks kvjit on llama.cpp's K-quant mixes of a model whose rows are
# multiples of 256, where llama.cpp mixes K-quants within a layer (Q4_K_M:
# Q6_K attn_v beside Q4_K attn_q/attn_k on some layers; Q5_K_M: Q6_K beside
# Q5_K) — SmolLM2's 576-wide rows give 32-blocks fallback types instead.
# The model is synthetic (scripts/reference/kquant_mix_model.py: random
# seeded weights, SmolLM2's tokenizer), written as F32 and quantized by
# llama.cpp (llama-cpp-python's llama_model_quantize).
#
# For each mix: `kvjit generate --logits` with the weights kept in their
# blocks (mixed fused QKV weights held as q8_kmin) and with --dequantize
# (f32), compared by scripts/reference/compare_logits.py: the same greedy
# tokens and logits within 0.01 (normalized), else exit 1; llama.cpp's
# logits on the same tokens are printed beside them. The F32 file itself is
# checked against llama.cpp the same way (same greedy tokens; its logit
# difference printed).
#
#   scripts/reference/kquant-mix.sh [DIR]     (default target/kquant-mix)
#
# Needs the Q4_1 SmolLM2 file (scripts/get-smollm2.sh; its tokenizer), the
# reference venv (scripts/reference/run.sh makes it; gguf-py and numpy) and
# llama-cpp-python (scripts/install-llama-cpp.sh). About a minute.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() {
    echo "error: kquant-mix: $*" >&2
    exit 1
}

dir="${1:-$root/target/kquant-mix}"
source="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "$source" ]] || die "no $source (run scripts/get-smollm2.sh)"
reference_python="$(ls -d "${XDG_CACHE_HOME:-$HOME/.cache}"/kvjit/reference-venv-*/bin/python 2>/dev/null | head -n 1)"
[[ -x "$reference_python" ]] || die "no reference venv (run scripts/reference/run.sh once)"
llama_python="${KVJIT_LLAMA_CPP:-python:$HOME/.cache/kvjit/llama-cpp-venv/bin/python}"
llama_python="${llama_python#python:}"
"$llama_python" -c "import llama_cpp" 2>/dev/null || die "no llama-cpp-python at $llama_python (run scripts/install-llama-cpp.sh)"
cargo build --quiet --release --bin kvjit --manifest-path "$root/Cargo.toml"
kvjit="$root/target/release/kvjit"
mkdir -p -- "$dir"

f32="$dir/synthetic-f32.gguf"
[[ -f "$f32" ]] || "$reference_python" "$root/scripts/reference/kquant_mix_model.py" "$source" "$f32"
prompt="The capital of France is"
run() { # MODEL OUT [kvjit options]
    local model="$1" out="$2"
    shift 2
    "$kvjit" generate "$model" --prompt "$prompt" --max-tokens 16 --logits "$out" "$@" 2>&1 | grep -E "^note:" || true
}

run "$f32" "$dir/f32.safetensors"
echo "F32 file (llama.cpp against kvjit):"
"$llama_python" "$root/scripts/reference/compare_logits.py" "$dir/f32.safetensors" "$dir/f32.safetensors" --gguf "$f32"

failed=()
for mix in Q4_K_M Q5_K_M; do
    file="$dir/synthetic.$mix.gguf"
    if [[ ! -f "$file" ]]; then
        "$llama_python" - "$f32" "$file" "$mix" >"$dir/$mix.quantize.log" 2>&1 <<'PY' \
            || { tail -n 3 "$dir/$mix.quantize.log" >&2; die "llama.cpp could not write $mix"; }
import ctypes, sys
import llama_cpp
src, out, mix = sys.argv[1:]
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = {"Q4_K_M": 15, "Q5_K_M": 17}[mix]
sys.exit(llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params)))
PY
    fi
    echo "$mix:"
    run "$file" "$dir/$mix.blocks.safetensors"
    run "$file" "$dir/$mix.f32.safetensors" --dequantize
    "$llama_python" "$root/scripts/reference/compare_logits.py" "$dir/$mix.blocks.safetensors" \
        "$dir/$mix.f32.safetensors" --gguf "$file" || failed+=("$mix")
done
[[ ${#failed[@]} -eq 0 ]] || die "failed: ${failed[*]}"
echo "kquant-mix: every mix agrees"
