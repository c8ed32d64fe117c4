#!/usr/bin/env bash
# `make bench`: the benchmarks, on a CUDA device. Each prints one line per case.
#  1. bench/bench_forward.py: moefuse vs the TorchTitan-style PyTorch MoE, same run,
#     with the bf16 matmul peak measured in that run; once with every call alone and
#     synchronized (host time included), once with 4 calls queued per sample (the host
#     ahead of the GPU, as in training), their samples interleaved; then at T = 16384
#     with each variant sustained at the GPU's power limit (--sustained).
#  2. build/bench/bench_forward_cuda: the forward, staged and fused, and its small stages
#     alone.
#  3. build/bench/bench_precision_cuda: forward and backward in FP8 against bf16; then
#     bench/bench_forward.py --precision fp8: the layer in FP8 and bf16 from PyTorch against
#     the FP8 peer (torchao's FP8 rowwise MoE recipe, bench/torch_moe_fp8_baseline.py),
#     4 calls queued per sample, with the dense FP8 peak and both recipes' error.
#  4. bench/ep_memory.py: the MoE layers' device memory per GPU with expert parallelism
#     (R = 8, T = 16384), computed by the library's arithmetic (no GPU needed).
#  5. bench/kernel_floors.py: where the time goes, each kernel of a bf16 and an FP8
#     forward + backward at T = 16384 against its floor (FLOPs at the matmul peak, bytes
#     at the copy rate, both measured in that run).
# Each benchmark also writes its table as markdown under build/bench/results/; the script
# then rewrites bench/RESULTS.md from them, headed by the GPU, the date and the commit.
# Where no timed benchmark ran (no GPU: each prints SKIP), bench/RESULTS.md is left as it
# is (the computed memory table alone does not rewrite it).
# Why three tables: docs/decisions/0013-power-limit-timing.
set -euo pipefail
cd "$(dirname "$0")/.."
export MOEFUSE_LIB="${MOEFUSE_LIB:-$PWD/build/libmoefuse.so}"
MD_DIR=build/bench/results
rm -rf "$MD_DIR"
mkdir -p "$MD_DIR"

python3 bench/bench_forward.py --markdown "$MD_DIR/1_forward_sync.md" "$@"
python3 bench/bench_forward.py --queue 4 --markdown "$MD_DIR/2_forward_queued.md" "$@"
python3 bench/bench_forward.py --queue 4 --sustained --tokens 16384 \
    --markdown "$MD_DIR/3_forward_sustained.md" "$@"
if [ -x build/bench/bench_forward_cuda ]; then
    build/bench/bench_forward_cuda | tee "$MD_DIR/forward_cuda.txt"
    # Its lines: "model T staged_ms TFLOP/s fused_ms TFLOP/s" per case, each followed by
    # "    stages T=N: plan X us | dispatch X us (X TB/s, N rows) | reduce X us (X TB/s)".
    awk '
        function numbers(s, v,   n) {
            n = 0
            while (match(s, /[0-9]+(\.[0-9]+)?/)) {
                v[++n] = substr(s, RSTART, RLENGTH)
                s = substr(s, RSTART + RLENGTH)
            }
            return n
        }
        $1 == "model" || /^SKIP/ { next }
        /^ +stages / {
            if (numbers($0, v) == 7)
                st[++ns] = sprintf("| %s | %s | %s | %s | %s | %s | %s | %s |", model,
                                   v[1], v[2], v[3], v[4], v[5], v[6], v[7])
            next
        }
        NF == 6 {
            model = $1
            fw[++nf] = sprintf("| %s | %s | %s | %s | %s | %s |", $1, $2, $3, $4, $5, $6)
        }
        END {
            if (nf == 0) exit
            print "### bench_forward_cuda: the forward, staged and fused alternating"
            print ""
            print "CUDA events, median of 20 after 3 warm-ups; TFLOP/s with FLOPs = 6 T K H I."
            print ""
            print "| model | T | staged ms | staged TFLOP/s | fused ms | fused TFLOP/s |"
            print "|---|---|---|---|---|---|"
            for (i = 1; i <= nf; i++) print fw[i]
            if (ns == 0) exit
            print ""
            print "### bench_forward_cuda: the small stages alone (100 back-to-back calls)"
            print ""
            print "| model | T | plan us | dispatch us | dispatch TB/s | rows | reduce us | reduce TB/s |"
            print "|---|---|---|---|---|---|---|---|"
            for (i = 1; i <= ns; i++) print st[i]
        }' "$MD_DIR/forward_cuda.txt" > "$MD_DIR/4_forward_cuda.md"
else
    echo "SKIP bench_forward_cuda: built only when nvcc is found"
fi
python3 bench/ep_memory.py --markdown "$MD_DIR/5_ep_memory.md"

if [ -x build/bench/bench_precision_cuda ]; then
    MOEFUSE_FP8_PEAK_TFLOPS=$(python3 bench/fp8_peak.py 2>/dev/null || true) \
        build/bench/bench_precision_cuda "$MD_DIR/precision.txt.md"
    if [ -s "$MD_DIR/precision.txt.md" ]; then
        { echo "### bench_precision_cuda: the layer in FP8 (block scales) against bf16"
          echo
          cat "$MD_DIR/precision.txt.md"; } > "$MD_DIR/5_precision_cuda.md"
    fi
else
    echo "SKIP bench_precision_cuda: built only when nvcc is found"
fi
python3 bench/bench_forward.py --precision fp8 --queue 4 \
    --markdown "$MD_DIR/5_precision_torch.md" "$@"
python3 bench/kernel_floors.py --markdown "$MD_DIR/6_kernel_floors.md"

# bench/RESULTS.md from the tables that were written (empty ones are left out)
parts=()
timed=0
for f in "$MD_DIR"/[0-9]_*.md; do
    [ -s "$f" ] || continue
    parts+=("$f")
    [ "$f" = "$MD_DIR/5_ep_memory.md" ] || timed=$((timed + 1))
done
if [ "$timed" -eq 0 ]; then
    echo "bench/RESULTS.md not rewritten: no benchmark ran"
    exit 0
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 ||
      true)
if [ -z "$gpu" ]; then
    gpu=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null ||
          echo "unknown GPU")
else
    gpu="${gpu%%,*} (driver${gpu#*,})"
fi
# MOEFUSE_BENCH_COMMIT names the commit where git cannot (a copy of the tree whose .git
# is not its own, as on a lent GPU machine).
commit=${MOEFUSE_BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "unknown")}
if [ -z "${MOEFUSE_BENCH_COMMIT:-}" ] && [ "$commit" != unknown ] &&
   ! git diff --quiet HEAD -- src include 2>/dev/null; then
    commit="$commit with local changes in src/ or include/"
fi
{
    echo "# Benchmark results"
    echo
    echo "The numbers as they are now, written by \`make bench\` (tools/run_bench.sh); older"
    echo "numbers are in git's history of this file, the decisions they led to in"
    echo "docs/decisions/. How and why each table is timed: docs/decisions/0013-power-limit-timing."
    echo
    echo "- GPU: $gpu"
    echo "- date: $(date -u +%Y-%m-%d)"
    echo "- commit: $commit"
    for f in "${parts[@]}"; do
        echo
        cat "$f"
    done
} > bench/RESULTS.md
echo "wrote bench/RESULTS.md (${#parts[@]} tables)"
