#!/usr/bin/env bash
# Everything a change to the CUDA code needs on the GPU machine, in one go, in order of
# importance (a lease is short): build, GPU tests, the main job, benchmarks, Python
# GPU tests, the training-step benchmark, SASS and sanitizer checks. Logs go to
# build/gpu-logs; on the lent machine ($OUT set) they also come back as one archive
# (the lease returns at most 8 files), with the loss-curve plot. A summary is printed last.
#
#   tools/gpu_checks.sh [quick]     quick: build, GPU tests and the forward bench only
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=build/gpu-logs
mkdir -p "$LOG_DIR"
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1 MOEFUSE_LIB="$PWD/build/libmoefuse.so"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
summary=()
step() { # name, log file, command...
    local name=$1 log=$2; shift 2
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" > "$LOG_DIR/$log" 2>&1
    local rc=$?
    local line
    line=$(printf '%-20s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) \
        "$(grep -E '[0-9]+ passed|PASS|FAIL' "$LOG_DIR/$log" | tail -1)")
    echo "$line"
    summary+=("$line")
    return $rc
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
step build build.log make -j"$(nproc)" all || { tail -30 "$LOG_DIR/build.log"; exit 1; }
step test_gemm_sm90 test_gemm_fwd.log build/tests/kernels/test_gemm_sm90
step test_gemm_sm90_bwd test_gemm_bwd.log build/tests/kernels/test_gemm_sm90_bwd
step test_gemm_sm90_bwd_time test_gemm_bwd_time.log build/tests/kernels/test_gemm_sm90_bwd_time
step test_dispatch_rows test_dispatch_rows.log build/tests/kernels/test_dispatch_rows
step test_fp8_quant test_fp8_quant.log build/tests/kernels/test_fp8_quant
step test_cuda_fp8 test_cuda_fp8.log build/tests/api/test_cuda_fp8
# The CUDA API suites, staged (the default) and fused.
for t in forward forward_bitwise backward backward_modes; do
    step test_cuda_$t test_cuda_$t.log build/tests/api/test_cuda_$t
    step test_cuda_${t}_fused test_cuda_${t}_fused.log \
        env MOEFUSE_TEST_PIPELINE=fused build/tests/api/test_cuda_$t
done
for t in ep ep_failures ep_iterations; do
    step test_cuda_$t test_cuda_$t.log build/tests/api/test_cuda_$t
done
step moefuse_step moefuse_step.log build/moefuse_step
step moefuse_step_fused moefuse_step_fused.log build/moefuse_step --pipeline fused
step bench bench.log tools/run_bench.sh
if [ "${1:-}" != quick ]; then
    step python_tests python_tests.log python3 -m pytest -q -rs python/tests
    step bench_ep_r1 bench_ep.log timeout 240 torchrun --standalone --nproc-per-node 1 \
        bench/bench_ep.py --tokens 4096 --check --bench
    [ -f bench/bench_train_step.py ] &&
        step bench_train_step train_step.log python3 bench/bench_train_step.py --plot "$LOG_DIR/loss_curves.png"
    step sass sass.log bash -c 'for o in build/src/cuda/sm90_*.o; do
        echo "$o HGMMA=$(cuobjdump --dump-sass $o | grep -c HGMMA) LDL_STL=$(cuobjdump --dump-sass $o | grep -cE "LDL|STL")"; done'
    step memcheck memcheck.log timeout 120 compute-sanitizer --error-exitcode 1 --tool memcheck build/tests/api/test_cuda_backward 30b "T=7"
    step memcheck_fused memcheck_fused.log timeout 120 env MOEFUSE_TEST_PIPELINE=fused \
        compute-sanitizer --error-exitcode 1 --tool memcheck build/tests/api/test_cuda_forward 30b "T=512"
    step racecheck racecheck.log timeout 140 compute-sanitizer --error-exitcode 1 --tool racecheck build/tests/kernels/test_gemm_sm90_bwd _bn
    step racecheck_bwd_fused racecheck_bwd_fused.log timeout 140 env MOEFUSE_TEST_PIPELINE=fused \
        compute-sanitizer --error-exitcode 1 --tool racecheck build/tests/api/test_cuda_backward 30b "T=7"
    step racecheck_fwd racecheck_fwd.log timeout 140 compute-sanitizer --error-exitcode 1 --tool racecheck build/tests/kernels/test_gemm_sm90 paths
    step memcheck_ep memcheck_ep.log timeout 150 compute-sanitizer --error-exitcode 1 --tool memcheck build/tests/api/test_cuda_ep "R=1 comm"
    step memcheck_ep_fused memcheck_ep_fused.log timeout 150 compute-sanitizer --error-exitcode 1 \
        --tool memcheck build/tests/api/test_cuda_ep "R=4 T={512,0,37,300} fused"
fi
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.txt"
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-logs.tgz" -C build gpu-logs
    cp "$LOG_DIR"/summary.txt "$OUT/"
    [ -f "$LOG_DIR/loss_curves.png" ] && cp "$LOG_DIR/loss_curves.png" "$OUT/"
fi
