#!/usr/bin/env bash
# Regenerates the independent SmolLM2 reference fixtures:
#   tests/fixtures/smollm2_reference.json and tests/fixtures/smollm2_tokens.json
#
#   scripts/reference/run.sh [ARGS...]     ARGS go to smollm2_reference.py (--help)
#   scripts/reference/run.sh --dequant-fixture
#       instead rewrites crates/gguf/tests/fixtures/gguf_py_dequant.json
#       (gguf_dequant_fixture.py: gguf-py's dequantization of random blocks)
#
# Makes (once) a virtual environment with the pinned requirements.txt under
# $KVJIT_REFERENCE_VENV, default ${XDG_CACHE_HOME:-~/.cache}/kvjit/reference-venv-<hash of
# requirements.txt>, then runs the script. The model must be there first
# (scripts/get-smollm2.sh). BLAS runs on 1 thread unless OPENBLAS_NUM_THREADS
# or --threads says otherwise. Takes a few minutes on 2 cores.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements.txt"

die() {
    echo "error: reference/run.sh: $*" >&2
    exit 1
}

command -v python3 >/dev/null 2>&1 || die "python3 not found"
hash="$(python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest()[:12])' "$req")"
venv="${KVJIT_REFERENCE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvjit/reference-venv-$hash}"

if [[ ! -f "$venv/.complete" ]]; then
    rm -rf -- "$venv"
    mkdir -p -- "$(dirname "$venv")" || die "cannot create $(dirname "$venv")"
    python3 -m venv "$venv" || die "python3 -m venv $venv failed (is the venv module installed?)"
    if ! "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
            --only-binary=:all: -r "$req" >"$venv/pip.log" 2>&1; then
        tail -n 5 "$venv/pip.log" >&2
        die "pip install -r $req failed (see $venv/pip.log)"
    fi
    touch "$venv/.complete"
    echo "reference venv ready: $venv" >&2
fi

if [[ "${1:-}" == --dequant-fixture ]]; then
    exec "$venv/bin/python" "$here/gguf_dequant_fixture.py"
fi
exec "$venv/bin/python" "$here/smollm2_reference.py" "$@"
