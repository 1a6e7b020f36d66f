#!/usr/bin/env bash
# The optional llama.cpp peer of `kvjit bench --ops model`: llama-cpp-python
# (pinned) built from source into a virtual environment, AVX2 only (a native
# build can crash in llama.cpp's AMX path on AVX-512/AMX hosts). Takes 6-15
# minutes on two cores. Prints the KVJIT_LLAMA_CPP value the bench reads.
#
#   scripts/install-llama-cpp.sh [VENV]     (default ~/.cache/kvjit/llama-cpp-venv)
set -euo pipefail
venv=${1:-$HOME/.cache/kvjit/llama-cpp-venv}
version=0.3.36
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$version')" 2>/dev/null; then
    echo "export KVJIT_LLAMA_CPP=python:$venv/bin/python   # llama-cpp-python $version already there"
    exit 0
fi
python3 -m venv "$venv" || { echo "error: cannot make a virtual environment at $venv (python3-venv installed?)" >&2; exit 1; }
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON \
  -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
  -DGGML_AMX_BF16=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF" \
  "$venv/bin/pip" install --quiet "llama-cpp-python==$version" \
  || { echo "error: building llama-cpp-python $version failed (a C++ compiler and cmake are needed)" >&2; exit 1; }
echo "export KVJIT_LLAMA_CPP=python:$venv/bin/python   # llama-cpp-python $version built"
