#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test vectors: the vocabulary-only GGUF files
# `models/ggml-vocab-NAME.gguf` of llama.cpp (MIT) with their `.inp` (test
# strings) and `.out` (the token ids llama.cpp gives them), which its
# `test-tokenizer-0` checks. They ship inside the pinned llama-cpp-python
# source distribution on PyPI (the only registry this project can reach
# hosts them there); `tests/llama_cpp_vocabs.rs` checks kvjit's tokenizer
# against them and skips in one line when they are absent.
#
#   scripts/get-llama-cpp-vocabs.sh [DIR]   default DIR: models/llama-cpp-vocabs
#
# Downloads the pinned sdist (76 MB) from PyPI's file host into memory,
# checks its sha256 and extracts the vocabularies below into DIR.
# Idempotent: when DIR holds every file it downloads nothing. Prints one
# line at the end; failures print one `error: ...` line and exit 1. Needs
# python3 (its urllib and tarfile); nothing is installed.
set -euo pipefail

VERSION=0.3.36
URL=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-${VERSION}.tar.gz
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# The byte-level BPE vocabularies kvjit's pre-tokenizers cover, and the
# SentencePiece ones.
NAMES=(gpt-2 llama-bpe qwen2 mpt starcoder refact command-r llama-spm phi-3)

die() {
    echo "error: get-llama-cpp-vocabs: $*" >&2
    exit 1
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo_root/models/llama-cpp-vocabs}"
[[ $# -le 1 ]] || die "usage: scripts/get-llama-cpp-vocabs.sh [DIR]"
mkdir -p -- "$dir" 2>/dev/null || die "cannot create directory $dir"
dir="$(cd -- "$dir" && pwd)"

files=()
for name in "${NAMES[@]}"; do
    files+=("ggml-vocab-$name.gguf" "ggml-vocab-$name.gguf.inp" "ggml-vocab-$name.gguf.out")
done
missing=0
for f in "${files[@]}"; do
    [[ -f "$dir/$f" ]] || missing=1
done
if [[ $missing == 0 ]]; then
    echo "$dir: already holds the ${#NAMES[@]} vocabularies"
    exit 0
fi

command -v python3 >/dev/null 2>&1 || die "python3 not found"
if ! python3 - "$URL" "$SHA256" "$dir" "$VERSION" "${files[@]}" <<'EOF'
import hashlib, io, os, sys, tarfile, urllib.request
url, sha256, out, version, *files = sys.argv[1:]
try:
    with urllib.request.urlopen(url, timeout=180) as r:
        data = r.read()
except OSError as e:
    sys.exit(f"download failed: {e}")
have = hashlib.sha256(data).hexdigest()
if have != sha256:
    sys.exit(f"the sdist has sha256 {have}, expected {sha256}")
prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/models/"
with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
    for f in files:
        member = t.getmember(prefix + f)
        src = t.extractfile(member)
        part = os.path.join(out, f + ".part")
        with open(part, "wb") as dst:
            dst.write(src.read())
        os.replace(part, os.path.join(out, f))
EOF
then
    die "cannot fetch llama-cpp-python $VERSION's vocabularies into $dir"
fi
echo "$dir: ${#NAMES[@]} vocabularies from llama-cpp-python $VERSION (sdist sha256 $SHA256)"
