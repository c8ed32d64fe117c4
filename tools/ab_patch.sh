#!/usr/bin/env bash
# A/B of a patch in one GPU call: builds this tree (build/) and a copy of it with the patch
# applied (AB_DIR, default /tmp/ab_patched) side by side, then runs each given command line
# ROUNDS times in both trees, taking turns (main, patched, main, ...), so that the power
# limit's clock changes fall on both alike (docs/decisions/0013-power-limit-timing). A
# command line runs from the tree's root, so "build/tests/gpu/test_gemm_sm90_bwd
# time_qwen3_30b" runs each tree's own binary. Correctness commands belong in the list too.
#
#   tools/ab_patch.sh PATCH ROUNDS 'command line' ['command line' ...]
#
# Logs: build/ab-logs/<tree>_<command index>_<round>.log; printed last: each run's exit
# code, seconds and the lines of its log that hold a time in ms or a bench_forward.py row
# (they start with the model's name). The copy is made from the working tree (not git),
# without build/ and exp/.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
    sed -n '2,14p' "$0" >&2
    exit 2
fi
patch_file=$(realpath "$1") rounds=$2
shift 2
AB_DIR=${AB_DIR:-/tmp/ab_patched}
LOG_DIR=build/ab-logs
source tools/gpu_env.sh

rm -rf "$AB_DIR" && mkdir -p "$AB_DIR" "$LOG_DIR" || exit 1
tar cf - --exclude=./build --exclude=./exp . | tar xf - -C "$AB_DIR" || exit 1
# git apply works outside a repository; patch(1) where git is missing
(cd "$AB_DIR" && if command -v git >/dev/null; then git apply "$patch_file"
                 else patch -s -p1 < "$patch_file"; fi) ||
    { echo "ab_patch: $1 does not apply" >&2; exit 1; }
jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
make -j"$jobs" all > "$LOG_DIR/build_main.log" 2>&1 &
main_build=$!
(cd "$AB_DIR" && make -j"$jobs" all) > "$LOG_DIR/build_patched.log" 2>&1
patched_rc=$?
wait "$main_build"
main_rc=$?
if [ "$main_rc" != 0 ] || [ "$patched_rc" != 0 ]; then
    echo "ab_patch: build failed (main rc=$main_rc, patched rc=$patched_rc; $LOG_DIR/build_*.log)" >&2
    exit 1
fi

summary=()
for ((r = 1; r <= rounds; ++r)); do
    i=0
    for cmd in "$@"; do
        i=$((i + 1))
        for tree in main patched; do
            dir=.
            [ "$tree" = patched ] && dir=$AB_DIR
            log=$LOG_DIR/${tree}_${i}_${r}.log
            t0=$SECONDS
            (cd "$dir" && MOEFUSE_LIB="$PWD/build/libmoefuse.so" bash -c "$cmd") > "$log" 2>&1
            rc=$?
            summary+=("$(printf '%-7s #%d round %d rc=%-3s %4ss  %s' "$tree" "$i" "$r" "$rc" \
                $((SECONDS - t0)) "$cmd")")
            while IFS= read -r line; do summary+=("    $line"); done < <(grep -E '[0-9] ms|^qwen3-' "$log")
        done
    done
done
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.txt"
