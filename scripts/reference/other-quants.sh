#!/usr/bin/env bash
# Checks kvjit on llama.cpp's other quantizations of SmolLM2-135M-Instruct,
# each against its own independent reference: for every mix below,
# llama.cpp (llama-cpp-python's llama_model_quantize, requantizing the
# pinned Q4_1 file) writes the GGUF, scripts/reference/run.sh --model writes
# that file's reference fixtures (gguf-py's dequantization, a numpy f64
# forward pass), and tests/smollm2.rs runs against them
# (KVJIT_SMOLLM2_GGUF, KVJIT_SMOLLM2_FIXTURES): token ids, the chat
# template, greedy text and logits, with the weights dequantized and kept in
# their blocks. On SmolLM2's 576-wide rows llama.cpp stores most matrices
# of a K-quant mix in Q5_0, Q5_1, IQ4_NL or Q4_0 (rows not a multiple of
# 256), so the mixes cover every GGML type kvjit reads.
#
#   scripts/reference/other-quants.sh [DIR] [MIX ...]
#       DIR: where the files and fixtures go (default target/smollm2-quants)
#       MIX: Q4_K_M Q5_K_M Q3_K_M Q2_K IQ4_XS Q5_1 (default: all)
#
# Needs the Q4_1 file (scripts/get-smollm2.sh) and llama-cpp-python
# (scripts/install-llama-cpp.sh; $KVJIT_LLAMA_CPP=python:PATH, else its
# default venv). About a minute a mix on 2 cores. Exits 1 if a mix fails.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
die() {
    echo "error: other-quants: $*" >&2
    exit 1
}

dir="${1:-$root/target/smollm2-quants}"
shift || true
mixes=("$@")
[[ ${#mixes[@]} -gt 0 ]] || mixes=(Q4_K_M Q5_K_M Q3_K_M Q2_K IQ4_XS Q5_1)
source="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f "$source" ]] || die "no $source (run scripts/get-smollm2.sh)"
python="${KVJIT_LLAMA_CPP:-python:$HOME/.cache/kvjit/llama-cpp-venv/bin/python}"
python="${python#python:}"
"$python" -c "import llama_cpp" 2>/dev/null || die "no llama-cpp-python at $python (run scripts/install-llama-cpp.sh)"
mkdir -p -- "$dir"

failed=()
for mix in "${mixes[@]}"; do
    file="$dir/SmolLM2-135M-Instruct.$mix.gguf"
    if [[ ! -f "$file" ]]; then
        "$python" - "$source" "$file.tmp" "$mix" >"$dir/$mix.quantize.log" 2>&1 <<'PY' \
            || { tail -n 3 "$dir/$mix.quantize.log" >&2; die "llama.cpp could not write $mix"; }
import ctypes, sys
import llama_cpp
ftypes = {"Q4_K_M": 15, "Q5_K_M": 17, "Q3_K_M": 12, "Q2_K": 10, "IQ4_XS": 30, "Q5_1": 9}
src, out, mix = sys.argv[1:]
if mix not in ftypes:
    sys.exit(f"unknown mix {mix} (one of {', '.join(ftypes)})")
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftypes[mix]
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params)))
PY
        mv -- "$file.tmp" "$file"
    fi
    fixtures="$dir/$mix"
    mkdir -p -- "$fixtures"
    "$root/scripts/reference/run.sh" --model "$file" --out "$fixtures/smollm2_reference.json" \
        --tokens-out "$fixtures/smollm2_tokens.json" >"$fixtures/reference.log" 2>&1 \
        || { tail -n 3 "$fixtures/reference.log" >&2; die "the reference failed on $mix"; }
    if (cd "$root" && KVJIT_SMOLLM2_GGUF="$file" KVJIT_SMOLLM2_FIXTURES="$fixtures" \
            cargo test --release --quiet --test smollm2 -- --nocapture) >"$fixtures/test.log" 2>&1; then
        echo "$mix: greedy text equal; $(grep -oh '[a-z0-9 ]*weights: worst logit error [0-9.]*' "$fixtures/test.log" \
            | paste -sd ';' | sed 's/;/; /g')"
    else
        echo "$mix: FAILED (see $fixtures/test.log)"
        failed+=("$mix")
    fi
done
[[ ${#failed[@]} -eq 0 ]] || die "failed: ${failed[*]}"
