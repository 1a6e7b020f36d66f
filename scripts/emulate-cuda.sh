#!/usr/bin/env bash
# Run the fused op's CUDA kernel bodies on the CPU and check them against a
# double-precision reference: every variant (decode/prefill x f32/bf16/f16 x
# cache dtype) and the row-gather kernel, on fixed and random shapes with
# tails in every dimension, NaN-poisoned outputs and caches, and guard bytes
# around every buffer. See ops/fused_qkv_matmul/cuda/emulate/emulate.cpp for
# what the emulation covers (the kernels' logic, fragment layouts, barriers)
# and what it cannot (nvcc/ptxas code generation, real timing): that needs a
# GPU, scripts/gpu-check.sh.
#
#   scripts/emulate-cuda.sh [SEED]     (needs g++ with C++20; ~30 s on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
g++ -std=c++20 -O2 -pthread -Wall -Wextra -Werror -Wno-unknown-pragmas -x c++ \
    ops/fused_qkv_matmul/cuda/emulate/emulate.cpp -o "$out/emulate"
"$out/emulate" "${1:-7}"
