#!/usr/bin/env bash
# Run every kvjit fuzz target (cargo-fuzz / libFuzzer) for N seconds.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     one target after another (default 60 s, all targets)
#   scripts/fuzz.sh --parallel SECONDS        all targets at once, each under `nice -n 19`
#
# Targets (fuzz/fuzz_targets/): graph_file, safetensors_inputs, artifact, gguf, op_call.
# Needs cargo-fuzz (`cargo install cargo-fuzz`). Works on stable Rust:
# RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its nightly-only flags. The
# sanitizer is AddressSanitizer unless KVJIT_FUZZ_SANITIZER says otherwise
# (`none` if your toolchain lacks the ASan runtime); debug assertions (and so
# overflow checks) are on.
#
# New inputs go to fuzz/work/<target>/ (not committed); the committed seeds in
# fuzz/corpus/<target>/ are only read. Crashes land in fuzz/artifacts/<target>/
# and make the script exit 1; libFuzzer's final stats (executions, new units,
# peak RSS) are printed per target and kept in fuzz/work/<target>.log.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

parallel=0
if [[ "${1:-}" == "--parallel" ]]; then
    parallel=1
    shift
fi
seconds="${1:-60}"
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
    targets=(graph_file safetensors_inputs artifact gguf op_call)
fi
sanitizer="${KVJIT_FUZZ_SANITIZER:-address}"
export RUSTC_BOOTSTRAP=1

declare -A max_len=([graph_file]=8192 [safetensors_inputs]=4096 [op_call]=512)
declare -A extra=([graph_file]="-dict=dict/graph_file.dict" [safetensors_inputs]="-dict=dict/safetensors_inputs.dict" [op_call]="-len_control=0")

cargo fuzz build -a --sanitizer "$sanitizer"

run_target() {
    local t="$1"
    mkdir -p "work/$t" "corpus/$t" "artifacts/$t"
    # shellcheck disable=SC2086
    cargo fuzz run -a --sanitizer "$sanitizer" "$t" "work/$t" "corpus/$t" -- \
        -max_total_time="$seconds" -max_len="${max_len[$t]}" -timeout=30 -rss_limit_mb=4096 \
        -print_final_stats=1 ${extra[$t]:-} >"work/$t.log" 2>&1
}

status=0
if [[ $parallel -eq 1 ]]; then
    pids=()
    for t in "${targets[@]}"; do
        nice -n 19 bash -c "$(declare -f run_target); $(declare -p max_len extra); sanitizer=$sanitizer seconds=$seconds; run_target $t" &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do
        wait "$pid" || status=1
    done
else
    for t in "${targets[@]}"; do
        run_target "$t" || status=1
    done
fi

for t in "${targets[@]}"; do
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "work/$t.log" | grep -o '[0-9]*$' || echo "?")
    units=$(grep -o 'stat::new_units_added: *[0-9]*' "work/$t.log" | grep -o '[0-9]*$' || echo "?")
    crashes=$(find "artifacts/$t" -type f \( -name 'crash-*' -o -name 'oom-*' -o -name 'timeout-*' -o -name 'leak-*' \) | wc -l)
    echo "$t: ${seconds} s, ${execs} executions, ${units} new units, ${crashes} crash/oom/timeout artifacts (work/$t.log)"
done
exit $status
