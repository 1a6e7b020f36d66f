#!/usr/bin/env bash
# Run the fused op's CUDA kernel bodies on the CPU and check them against a
# double-precision reference: every variant (decode/prefill x f32/bf16/f16 x
# cache dtype f32/bf16/f16/f8e4m3) and the row-gather kernel; FP8 variants:
# Q and the staged f32 K/V against f64, then codes and scales bit for bit
# against a port of kvjit_core::fp8::quantize_block on those same f32 values,
# g-blocks inside and across column tiles, NaN and ±inf beside finite values,
# ±inf beside zeros only, zero blocks, counters
# left zero, blocks launched in ascending, descending and random orders; the
# software E4M3 convert on ~5.4M values (every tie) against a port of
# e4m3_from_f32 and a brute-force search. All on fixed and random shapes with
# tails in every dimension and prefill pipelines up to 19 k-tiles deep,
# NaN-poisoned outputs, caches and shared memory, guard bytes around every
# buffer, deferred cp.async copies, barrier hazard checks and deterministic
# adversarial thread orders. See ops/fused_qkv_matmul/cuda/emulate/emulate.cpp
# for what the emulation covers (the kernels' logic, fragment layouts,
# barriers, cp.async groups) and what it cannot (nvcc/ptxas code generation,
# real timing): that needs a GPU, scripts/gpu-check.sh.
#
#   scripts/emulate-cuda.sh [SEED]            the emulation (g++ with C++20; ~30 s on 2 cores)
#   scripts/emulate-cuda.sh --mutants [SEED]  the emulation, and a mutation check next to it
#       (~3 min in all on 2 idle cores): the emulation built against copies of fused_qkv.cu
#       with one bug each must fail, as the unmodified kernels must pass: pipeline and barrier
#       bugs (a wrong cp.async.wait_group depth, a removed or misplaced __syncthreads, ...)
#       and FP8 bugs (rounding of the E4M3 convert, the scale, the absmax, ±inf, zero blocks,
#       the scale index, the per-g-block counting across column tiles). A mutant whose edit no longer matches the source is an error: update its
#       pattern along with the kernel.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=run
if [[ ${1:-} == --mutants ]]; then
    mode=mutants
    shift
fi
seed=${1:-7}
if [[ ! $seed =~ ^[0-9]+$ || $# -gt 1 ]]; then
    echo "usage: $0 [--mutants] [SEED]" >&2
    exit 2
fi

dir=ops/fused_qkv_matmul/cuda
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# build BINARY [KERNEL_SOURCE]: the emulator, with ../fused_qkv.cu or the given copy.
build() {
    local flags=(-std=c++20 -O2 -Wall -Wextra -Werror -Wno-unknown-pragmas)
    if [[ $# -gt 1 ]]; then flags+=("-DKVJIT_KERNEL_SOURCE=\"$2\""); fi
    g++ "${flags[@]}" -x c++ "$dir/emulate/emulate.cpp" -o "$1"
}

if [[ $mode == run ]]; then
    build "$out/emulate"
    "$out/emulate" "$seed"
    exit 0
fi

# ---------------------------------------------------------------- mutants

# mutant NAME CHANGED_LINES SED_ARGS...: writes $out/NAME/result. The copy must
# differ from fused_qkv.cu in exactly CHANGED_LINES diff lines ("<" and ">"),
# so a pattern that stopped matching is caught. NAME "control" is the plain
# emulation of the real source and must pass; every mutant must fail a check.
mutant() {
    local name=$1 changed=$2 m=$out/$1
    shift 2
    mkdir -p "$m"
    local src=()
    if [[ $name != control ]]; then
        sed "$@" "$dir/fused_qkv.cu" >"$m/fused_qkv.cu"
        local n
        n=$(diff "$dir/fused_qkv.cu" "$m/fused_qkv.cu" | grep -c '^[<>]' || true)
        if [[ $n != "$changed" ]]; then
            echo "ERROR   $name: the edit changed $n diff lines, expected $changed (pattern out of date?)" >"$m/result"
            return 0
        fi
        src=("$m/fused_qkv.cu")
    fi
    if ! build "$m/emulate" "${src[@]}" >"$m/build.log" 2>&1; then
        { echo "ERROR   $name: does not compile"; sed 's/^/    /' "$m/build.log" | head -20; } >"$m/result"
        return 0
    fi
    local rc=0 args=("$seed")
    [[ $name == control ]] || args+=(--fail-fast)
    "$m/emulate" "${args[@]}" >"$m/log" 2>&1 || rc=$?
    if [[ $name == control ]]; then
        if [[ $rc == 0 ]]; then
            echo "passed  control (the unmodified kernels): $(tail -n 1 "$m/log")" >"$m/result"
        else
            echo "ERROR   control (the unmodified kernels) failed, exit $rc" >"$m/result"
        fi
    elif [[ $rc == 1 ]] && grep -q '^  FAIL' "$m/log"; then
        {
            echo "killed  $name:"
            awk '/^  FAIL/ { if (!shown) print "    " last; shown = 1; print "    " $0; next } { last = $0 }' "$m/log"
        } >"$m/result"
    elif [[ $rc == 0 ]]; then
        echo "SURVIVED $name: every case passed" >"$m/result"
    else
        { echo "ERROR   $name: exit $rc without a failed check"; tail -n 5 "$m/log"; } >"$m/result"
    fi
}

names=()
jobs_max=$(nproc 2>/dev/null || echo 2)
spawn() {
    names+=("$1")
    while [[ $(jobs -rp | wc -l) -ge $jobs_max ]]; do wait -n || true; done
    mutant "$@" &
}

# The bf16/f16 prefill pipeline: tile kt is read after cp_async_wait<PF_STAGES - 2>
# and a barrier; the barrier also guards the prefetch that refills the stage
# computed in the previous iteration.
loop_wait='cp_async_wait<PF_STAGES - 2>();'
prefetch='if (next < ktiles) load_tile(next % PF_STAGES, next);'
spawn control 0
# 1. wait depth one too shallow: tile kt is read while its copies are pending.
spawn wait-depth 2 -e "s/$loop_wait/cp_async_wait<PF_STAGES - 1>();/"
# 2. no barrier in the main loop: other warps' copies unseen, stages refilled under readers.
spawn no-loop-barrier 1 -e "/$loop_wait/{n;/^ *sync_block();\$/d}"
# 3. the barrier after the prefetch instead of before: reads are ordered, but the
#    prefetch refills the stage that slower warps still read (needs >= 4 k-tiles).
spawn barrier-after-prefetch 2 -e "/$loop_wait/{n;/^ *sync_block();\$/d}" \
    -e "/$prefetch/{n;s/^\\( *\\)cp_async_commit();\$/&\\n\\1sync_block();/}"
# 4. commit only when a tile was loaded: the tail iterations' wait depth no longer
#    covers the last tile.
spawn commit-if-loaded 3 -e "/$prefetch/{N;s/$prefetch\\n *cp_async_commit();/if (next < ktiles) { load_tile(next % PF_STAGES, next); cp_async_commit(); }/}"
# 5. f32 prefill: no barrier between computing on the tile and overwriting it.
spawn f32-prefill-war-barrier 1 -e '/acc\[i\]\[j\] = fmaf(a\[i\], b\[j\], acc\[i\]\[j\]);/{n;n;/^ *sync_block();$/d}'
# 6. f32 prefill: no barrier between storing the tile and computing on it.
spawn f32-prefill-raw-barrier 1 -e '/Bs\[lk + e\]\[lrow\] = bv\[e\];/{n;n;/^ *sync_block();$/d}'
# 7. bf16/f16 decode: no barrier before the split-K reduction.
spawn decode-reduction-barrier 1 -e '/red\[warp\]\[g + 8\]\[c + 1\] = acc\[tile\]\[3\];/{n;n;/^ *sync_block();$/d}'
# The FP8 epilogue and convert (the _kvf8e4m3 variants; the emulation runs e4m3_sw, the sm_80 path).
# 8. normal values round half up instead of to even.
spawn fp8-ties-up 2 -e 's#(a + 0x7ffffu + ((a >> 20) \& 1u)) >> 20#(a + 0x80000u) >> 20#'
# 9. subnormal E4M3 codes round half up.
spawn fp8-subnormal-ties-up 2 -e 's#(rem > half || (rem == half \&\& (q \& 1u) != 0u))#(rem >= half)#'
# 10. the scale as amax times the rounded reciprocal of 448 (1 ulp off for some amax).
spawn fp8-scale-reciprocal 2 -e 's#const float scale = amax / E4M3_MAX;#const float scale = amax * (1.f / E4M3_MAX);#'
# 11. the absmax of the signed values (a block whose largest magnitude is negative saturates).
spawn fp8-signed-absmax 2 -e 's#const float a = fabsf(v);#const float a = v;#'
# 12. an absmax that propagates NaN (sticky NaN in the lane loop and the shuffle); the reference's
#     f32::max, like fmaxf, ignores NaN: a block with one NaN keeps the scale of its numbers.
spawn fp8-nan-absmax 4 \
    -e 's#amax = fmaxf(amax, finite_magnitude(v\[r\]));#amax = (amax != amax || v[r] != v[r]) ? amax + v[r] : fmaxf(amax, finite_magnitude(v[r]));#' \
    -e 's#amax = fmaxf(amax, shfl_xor(amax, mask));#{ const float o = shfl_xor(amax, mask); amax = (amax != amax || o != o) ? amax + o : fmaxf(amax, o); }#'
# 13. the absmax pass over values past the registers (g > 256) skips a stride.
spawn fp8-absmax-tail 2 -e 's#for (int e = sub + FP8_REGS \* S; e < n; e += S) amax#for (int e = sub + (FP8_REGS + 1) * S; e < n; e += S) amax#'
# 14. a zero block divided by its zero scale (0 / 0: NaN codes) instead of x * 0.
spawn fp8-zero-scale 2 -e 's#scale == 0.f \&\& fabsf(x) <= F32_MAX ? x \* 0.f : x / scale#x / scale#'
# 15. the V blocks' scale index without the K->V stride (the wrong scale slot).
spawn fp8-scale-index 2 -e 's#scales\[at / g\] = scale;#scales[(off + j) / g] = scale;#'
# 16. parts per g-block off by one where a block ends on a tile edge: never complete, never coded.
spawn fp8-parts 2 -e 's#(first + g - 1) / tile_n#(first + g) / tile_n#'
# 17. the completing block does not reset its counter: the launch does not leave the counters zero
#     (the host zeroes them before every launch, but zero afterwards shows every part counted once).
spawn fp8-counter-reset 1 -e '/^ *if (last) \*count = 0u;/d'
# 18. an absmax that counts ±inf (NaN still ignored): a block with one ±inf gets scale inf, its
#     finite values code 0 and the ±inf NaN (inf / inf).
spawn fp8-inf-absmax 2 -e 's#return a <= F32_MAX ? a : 0.f;#return a == a ? a : 0.f;#'
# 19. a block of scale 0 codes ±inf as x * 0 too: NaN instead of ±448.
spawn fp8-zero-scale-inf 2 -e 's#scale == 0.f \&\& fabsf(x) <= F32_MAX ? x \* 0.f#scale == 0.f ? x * 0.f#'
wait

[[ -f $out/control/log ]] && cat "$out/control/log"
echo
status=0
for name in "${names[@]}"; do
    [[ -f $out/$name/result ]] || echo "ERROR   $name: no result (the job died)" >"$out/$name/result"
    cat "$out/$name/result"
    case $(head -c 6 "$out/$name/result") in killed | passed) ;; *) status=1 ;; esac
done
if [[ $status == 0 ]]; then
    echo "mutation check: the unmodified kernels pass and all $((${#names[@]} - 1)) mutants are killed"
else
    echo "mutation check FAILED"
fi
exit $status
