#!/usr/bin/env bash
# Compares kvjit's tokenizer with llama.cpp's on random strings: the ids of
# each string, plain and with special tokens parsed, for one GGUF
# vocabulary; each mismatch shrunk to a minimal string.
#
#   scripts/tokenizer-diff.sh MODEL.gguf [STRINGS] [SEED]   default: 5000 strings, seed 1
#
# The llama.cpp side is llama-cpp-python (`scripts/install-llama-cpp.sh`
# builds it and prints KVJIT_LLAMA_CPP=python:PATH, which this script
# reads). Writes the report beside the strings in a temporary directory
# and prints its path; exits 1 when any string differs.
set -euo pipefail
die() {
    echo "error: tokenizer-diff: $*" >&2
    exit 1
}
[[ $# -ge 1 && $# -le 3 ]] || die "usage: scripts/tokenizer-diff.sh MODEL.gguf [STRINGS] [SEED]"
model="$1"
count="${2:-5000}"
seed="${3:-1}"
[[ -f "$model" ]] || die "$model is not a file"
python="${KVJIT_LLAMA_CPP#python:}"
[[ -n "${KVJIT_LLAMA_CPP:-}" && -x "$python" ]] ||
    die "set KVJIT_LLAMA_CPP=python:PATH (scripts/install-llama-cpp.sh prints it)"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
cargo build --release --quiet --example tokenize_jsonl
binary="$repo_root/target/release/examples/tokenize_jsonl"
work="$(mktemp -d "${TMPDIR:-/tmp}/tokenizer-diff.XXXXXX")"
python3 scripts/tokenizer-diff/gen.py "$seed" "$count" >"$work/strings.jsonl"
status=0
"$python" scripts/tokenizer-diff/compare.py "$binary" "$model" "$work/strings.jsonl" "$work/report.json" || status=$?
echo "report: $work/report.json"
exit "$status"
