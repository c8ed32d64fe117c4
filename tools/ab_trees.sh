#!/usr/bin/env bash
# A/B of source trees in one GPU call: builds this tree (build/) and each OTHER (its own
# build/) side by side, then runs each given command line ROUNDS times in every tree,
# taking turns (this, other, [other2, ...,] this, ...), so that the power limit's clock
# changes fall on all alike (docs/decisions/0013-power-limit-timing). A command line runs
# from the tree's root with MOEFUSE_LIB pointing at that tree's library, so
# "build/tests/kernels/test_gemm_sm90_bwd_time time_qwen3_30b" runs each tree's own binary.
# Correctness commands belong in the list too.
#
#   tools/ab_trees.sh OTHER[,OTHER2,...] ROUNDS 'command line' ['command line' ...]
#
# Logs: build/ab-logs/<tree>_<command index>_<round>.log, the trees named this, other,
# other2, ... in the order given; printed as each run ends (and kept in
# build/ab-logs/summary.txt): its exit code, seconds and the lines of its log that hold a
# time in ms or a bench_forward.py row (they start with the model's name).
# tools/ab_patch.sh A/B-tests patches through this script.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 3 ]; then
    sed -n '2,16p' "$0" >&2
    exit 2
fi
IFS=, read -ra other_list <<< "$1"
rounds=$2
shift 2
LOG_DIR=build/ab-logs
source tools/gpu_env.sh
mkdir -p "$LOG_DIR" || exit 1

# tree names and their directories, this tree first
names=(this) dirs=(.)
for ((k = 0; k < ${#other_list[@]}; ++k)); do
    [ -d "${other_list[$k]}" ] || { echo "ab_trees: no tree at ${other_list[$k]}" >&2; exit 2; }
    names+=("other$([ "$k" -gt 0 ] && echo $((k + 1)))")
    dirs+=("$(realpath "${other_list[$k]}")")
done

# the builds side by side, the cores shared
jobs=$(( $(nproc) / ${#names[@]} > 0 ? $(nproc) / ${#names[@]} : 1 ))
pids=()
for ((k = 0; k < ${#names[@]}; ++k)); do
    (cd "${dirs[$k]}" && make -j"$jobs" all) > "$LOG_DIR/build_${names[$k]}.log" 2>&1 &
    pids+=($!)
done
failed=()
for ((k = 0; k < ${#names[@]}; ++k)); do
    wait "${pids[$k]}" || failed+=("${names[$k]}")
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "ab_trees: build failed: ${failed[*]} ($LOG_DIR/build_*.log)" >&2
    exit 1
fi

summary=$LOG_DIR/summary.txt
: > "$summary"
for ((r = 1; r <= rounds; ++r)); do
    i=0
    for cmd in "$@"; do
        i=$((i + 1))
        for ((k = 0; k < ${#names[@]}; ++k)); do
            tree=${names[$k]}
            log=$LOG_DIR/${tree}_${i}_${r}.log
            t0=$SECONDS
            (cd "${dirs[$k]}" && MOEFUSE_LIB="$PWD/build/libmoefuse.so" bash -c "$cmd") > "$log" 2>&1
            rc=$?
            { printf '%-6s #%d round %d rc=%-3s %4ss  %s\n' "$tree" "$i" "$r" "$rc" \
                  $((SECONDS - t0)) "$cmd"
              grep -E '[0-9] ms|^qwen3-' "$log" | sed 's/^/    /'; } | tee -a "$summary"
        done
    done
done
