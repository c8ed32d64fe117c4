#!/usr/bin/env bash
# A/B of two source trees in one GPU call: builds this tree (build/) and OTHER (its own
# build/) side by side, then runs each given command line ROUNDS times in both, taking
# turns (this, other, this, ...), so that the power limit's clock changes fall on both
# alike (docs/decisions/0013-power-limit-timing). A command line runs from the tree's root
# with MOEFUSE_LIB pointing at that tree's library, so
# "build/tests/kernels/test_gemm_sm90_bwd_time time_qwen3_30b" runs each tree's own binary.
# Correctness commands belong in the list too.
#
#   tools/ab_trees.sh OTHER ROUNDS 'command line' ['command line' ...]
#
# Logs: build/ab-logs/<this|other>_<command index>_<round>.log; printed as each run ends
# (and kept in build/ab-logs/summary.txt): its exit code, seconds and the lines of its log
# that hold a time in ms or a bench_forward.py row (they start with the model's name).
# tools/ab_patch.sh A/B-tests a patch through this script.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
    sed -n '2,13p' "$0" >&2
    exit 2
fi
other=$(realpath "$1") rounds=$2
shift 2
LOG_DIR=build/ab-logs
source tools/gpu_env.sh
mkdir -p "$LOG_DIR" || exit 1

jobs=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
make -j"$jobs" all > "$LOG_DIR/build_this.log" 2>&1 &
this_build=$!
(cd "$other" && make -j"$jobs" all) > "$LOG_DIR/build_other.log" 2>&1
other_rc=$?
wait "$this_build"
this_rc=$?
if [ "$this_rc" != 0 ] || [ "$other_rc" != 0 ]; then
    echo "ab_trees: build failed (this rc=$this_rc, other rc=$other_rc; $LOG_DIR/build_*.log)" >&2
    exit 1
fi

summary=$LOG_DIR/summary.txt
: > "$summary"
for ((r = 1; r <= rounds; ++r)); do
    i=0
    for cmd in "$@"; do
        i=$((i + 1))
        for tree in this other; do
            dir=.
            [ "$tree" = other ] && dir=$other
            log=$LOG_DIR/${tree}_${i}_${r}.log
            t0=$SECONDS
            (cd "$dir" && MOEFUSE_LIB="$PWD/build/libmoefuse.so" bash -c "$cmd") > "$log" 2>&1
            rc=$?
            { printf '%-5s #%d round %d rc=%-3s %4ss  %s\n' "$tree" "$i" "$r" "$rc" \
                  $((SECONDS - t0)) "$cmd"
              grep -E '[0-9] ms|^qwen3-' "$log" | sed 's/^/    /'; } | tee -a "$summary"
        done
    done
done
