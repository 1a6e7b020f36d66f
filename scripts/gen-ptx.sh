#!/usr/bin/env bash
# Regenerate the committed PTX of every op's CUDA sources with the pinned
# CUDA 13.0 toolchain, and assemble it with ptxas for sm_80 and sm_90.
#
#   scripts/gen-ptx.sh            regenerate ops/*/cuda/*.compute_{80,90}.ptx and ops/*/cuda/ptxas.txt
#   scripts/gen-ptx.sh --check    regenerate into a temp dir and fail if anything differs from the committed files
#
# For each ops/<op>/cuda/<name>.cu it writes <name>.compute_80.ptx and
# <name>.compute_90.ptx, each starting with the SHA-256 of the source (a
# unit test compares it with the .cu), and ops/<op>/cuda/ptxas.txt: registers,
# spills, shared memory per kernel and GPU, from `ptxas -v`.
#
# The toolchain: $KVJIT_CUDA_HOME if set (a folder with bin/nvcc and
# bin/ptxas, e.g. DIR/nvidia/cu13 of an earlier install), else the five
# pinned wheels from PyPI installed into a fresh temp dir (~100 MB, seconds).
# PTX must come from CUDA 13.0 exactly: the GPU machine's driver 580 accepts
# PTX ISA 9.0 and refuses newer. nvcc needs the system g++ to preprocess.
set -euo pipefail
cd "$(dirname "$0")/.."

CHECK=0
case "${1:-}" in
    --check) CHECK=1 ;;
    "") ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

ARCHS=(80 90)
NVCC_FLAGS=(-ptx -O3 -std=c++17)
WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if [[ -n "${KVJIT_CUDA_HOME:-}" ]]; then
    CUDA_HOME=$KVJIT_CUDA_HOME
else
    # --no-deps and every wheel pinned: unpinned, pip pulls 13.x nvvm/crt
    # beside nvcc 13.0. The target folder must be empty (pip skips files
    # that exist).
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-deps \
        --target "$WORK/toolchain" "${WHEELS[@]}"
    CUDA_HOME=$WORK/toolchain/nvidia/cu13
fi
NVCC=$CUDA_HOME/bin/nvcc
PTXAS=$CUDA_HOME/bin/ptxas
"$NVCC" --version | grep -q "release 13.0" || { echo "error: $NVCC is not CUDA 13.0" >&2; exit 1; }

status=0
for cu in ops/*/cuda/*.cu; do
    dir=$(dirname "$cu")
    name=$(basename "$cu" .cu)
    out=$WORK/out/$dir
    logs=$WORK/logs/$dir
    mkdir -p "$out" "$logs"
    sha=$(sha256sum "$cu" | cut -d' ' -f1)
    for arch in "${ARCHS[@]}"; do
        ptx=$name.compute_$arch.ptx
        "$NVCC" "${NVCC_FLAGS[@]}" -arch=compute_$arch "$cu" -o "$WORK/raw.ptx"
        {
            echo "// kvjit: generated from $name.cu by scripts/gen-ptx.sh (CUDA 13.0, -arch=compute_$arch ${NVCC_FLAGS[*]}); do not edit"
            echo "// kvjit-source-sha256: $sha"
            cat "$WORK/raw.ptx"
        } >"$out/$ptx"
        "$PTXAS" -arch=sm_$arch -v "$out/$ptx" -o /dev/null 2>"$logs/$name.$arch.log"
    done
done

# One report per op folder: kernel, GPU, registers, spill stores/loads, smem.
for dir in ops/*/cuda; do
    out=$WORK/out/$dir
    [[ -d $out ]] || continue
    {
        echo "# ptxas -v of the committed PTX (scripts/gen-ptx.sh). registers | spill stores/loads (bytes) | static shared memory"
        for log in "$WORK/logs/$dir"/*.log; do
            awk '
                /Compiling entry function/ { gsub(/\047/, "", $0); split($0, a, "function "); split(a[2], b, " for "); kernel = b[1]; gpu = b[2] }
                /bytes spill stores/ { split($0, f, ","); stores = f[2]; loads = f[3]; gsub(/[^0-9]/, "", stores); gsub(/[^0-9]/, "", loads) }
                /Used [0-9]+ registers/ {
                    regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
                    smem = "0"; if (match($0, /[0-9]+ bytes smem/)) { smem = substr($0, RSTART, RLENGTH); sub(/ bytes smem/, "", smem) }
                    printf "%s %s regs=%s spill=%s/%s smem=%s\n", kernel, gpu, regs, stores, loads, smem
                }' "$log"
        done | sort
    } >"$out/ptxas.txt"
done

if [[ $CHECK == 1 ]]; then
    for f in $(cd "$WORK/out" && find . -type f | sort); do
        if ! cmp -s "$WORK/out/$f" "$f"; then
            echo "error: ${f#./} differs from what scripts/gen-ptx.sh generates (run it and commit the result)" >&2
            diff <(head -c 2000 "$f" 2>/dev/null || true) <(head -c 2000 "$WORK/out/$f") | head -20 >&2 || true
            status=1
        fi
    done
    for f in ops/*/cuda/*.ptx; do
        [[ -f $WORK/out/$f ]] || { echo "error: $f has no .cu source (stale?)" >&2; status=1; }
    done
    [[ $status == 0 ]] && echo "ok: committed PTX and ptxas reports match a fresh CUDA 13.0 build; ptxas assembled every kernel for ${ARCHS[*]/#/sm_}"
else
    (cd "$WORK/out" && find . -type f -print0 | xargs -0 -I{} cp {} "$OLDPWD/{}")
    echo "wrote:"; (cd "$WORK/out" && find . -type f | sed 's|^\./|  |' | sort)
fi
exit $status
