#!/usr/bin/env bash
# Installs OpenBLAS for the benchmark's optional OpenBLAS peer (feature
# `openblas` of kvjit-bench): Debian's libopenblas-dev, which puts
# libopenblas.so in the linker's default search path (no pkg-config needed).
#
#   scripts/install-openblas.sh
#   cargo run --release --locked --features kvjit-bench/openblas -- bench
#
# Idempotent and non-interactive: does nothing when dpkg reports the package
# installed; otherwise runs apt-get (through sudo when not root and sudo
# exists). Debian and Ubuntu only.
set -euo pipefail

PACKAGE=libopenblas-dev

installed() {
    dpkg -s "$PACKAGE" 2>/dev/null | grep -q '^Status: install ok installed$'
}

if installed; then
    echo "$PACKAGE is already installed"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: apt-get not found; install OpenBLAS (libopenblas.so) with your system's package manager" >&2
    exit 1
fi

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=(sudo)
    else
        echo "error: not root and sudo not found; run this script as root" >&2
        exit 1
    fi
fi

"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
"${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$PACKAGE"

if ! installed; then
    echo "error: $PACKAGE did not install" >&2
    exit 1
fi
echo "$PACKAGE installed"
