#!/usr/bin/env bash
# The GPU machine's checks, in phases that each fit one call of the lent machine (at most
# 10 minutes), most important first. Logs go to build/gpu-logs, or to $OUT/gpu-logs on the
# lent machine (packed into $OUT/gpu-logs.tgz at the end), with the summary and any plots.
# A summary is printed last.
#
#   tools/gpu_checks.sh verify   build; the correctness tests of the newest CUDA code:
#                                the kernels' tests, FP8, EP (FP8 with a comm included),
#                                EP memory, the output hashes packed = halves, the Python
#                                GPU tests
#   tools/gpu_checks.sh kernels  build; the kernels' own tests, the bf16 backward
#                                and FP8 API suites (a default kernel change's quick check)
#   tools/gpu_checks.sh suites   the CUDA API suites staged and fused (W13 halves among
#                                them), the long EP iterations
#   tools/gpu_checks.sh deep     the whole Python suite, the main job, SASS (HGMMA, no
#                                local memory), compute-sanitizer memcheck and racecheck
#   tools/gpu_checks.sh bench    make bench's tables (bench/RESULTS.md)      (~4 min)
#   tools/gpu_checks.sh parity   bench/train_parity.py: FP8 against BF16 on real text
#                                (2 x 2000 steps, ~7.5 min on an H100; PARITY_RUNS="bf16@1
#                                fp8@1" for another seed's initial weights)
#   tools/gpu_checks.sh fp8_diag where FP8 loses: training-sized FP8 calls against the recipe
#                                emulated on the device, token by token, six of them
#                                bitwise equal, and two layers interleaved as in a model
#                                against each alone; one layer's calls of FP8 training
#                                steps against the recipe and repeated (fp8_layer_check.py
#                                training); a 300-step parity run of bf16, fp8 and the
#                                recipe emulated in PyTorch (emul:all: the library's
#                                kernels or the recipe?); and
#                                profile_step.py's per-kernel table of the FP8 layer on
#                                both shapes
#   tools/gpu_checks.sh opt_in_ab  an opt-in kernel path (OPT_IN="-DNAME=1 ...", its nvcc
#                                flags) built apart: the backward GEMMs' and FP8 tests, the
#                                quantizers' times and the layer's profile beside the
#                                default's (OPT_IN_PRECISIONS, default fp8; OPT_IN_PROFILE:
#                                more profile_step.py flags, e.g. "--weights fp32";
#                                OPT_IN_SUITES: the CUDA API suites run on it, by default
#                                "backward backward_modes backward_halves")
#   tools/gpu_checks.sh saved_modes  profile_step.py of both precisions in the three saved
#                                modes (qwen3-30b-a3b; FP8 without saved inputs quantizes x
#                                in its dispatch: which mode is fastest for each precision)
#   tools/gpu_checks.sh ncu_fp8  ncu's speed-of-light, memory, warp-state and scheduler
#                                sections of one launch of each FP8 GEMM and quantizer
#                                (NCU_KERNELS, NCU_LIBS="build build/opt" after opt_in_ab)
#   tools/gpu_checks.sh ncu_stalls  where each warp stalls, per SASS instruction: ncu's full
#                                set with the source page of one launch of each NCU_KERNELS
#                                kernel (default wgrad_grouped, gemm2_dgrad_swiglu), read by
#                                tools/ncu_stalls.py (NCU_LIBS as for ncu_fp8; NCU_KEEP_CSV=1
#                                keeps the source pages, gzipped)
#   tools/gpu_checks.sh ablation the parity run with the FP8 recipe emulated, one stage's
#                                GEMMs (forward, data gradients, weight gradients) in bf16,
#                                beside bf16 and fp8 (two runs of 4 models, ~8 min each:
#                                ABLATION_GROUPS=1 or 2 picks one; ABLATION_RUNS others)
#   tools/gpu_checks.sh step     bench_train_step.py, 12 layers (6 on an 80 GB card), both
#                                precisions, with the MoE layers' profiled share and the
#                                longest kernels (~3 min)
#   tools/gpu_checks.sh titan    bench/bench_torchtitan.py: TorchTitan's step native and
#                                with moefuse (bf16, fp8), 30B-A3B truncated to what fits
#                                (or to TITAN_LAYERS),
#                                with the for-loop experts' control run; needs TorchTitan's
#                                wheels in .whl (carried; the script's docstring says which)
#   tools/gpu_checks.sh titan_235b  the same for 235B-A22B (no control)
#   tools/gpu_checks.sh titan_loss  debugmodel_moe 200 steps (loss curves), and the
#                                TorchTitan EP virtual-rank tests
# Several phases in one call: tools/gpu_checks.sh verify deep.
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs go straight under $OUT on the device machine, so a call cut off at its limit still
# returns what ran.
export LOG_DIR=${OUT:+$OUT/gpu-logs}
LOG_DIR=${LOG_DIR:-build/gpu-logs}
mkdir -p "$LOG_DIR"
source tools/gpu_env.sh
export PYTHONUNBUFFERED=1 MOEFUSE_LIB="$PWD/build/libmoefuse.so"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
# The virtual-rank tests need 2 hardware queues per rank (peers.cu says why).
export CUDA_DEVICE_MAX_CONNECTIONS=32
summary=()
step() { # name, log file, command...
    local name=$1 log=$2; shift 2
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" > "$LOG_DIR/$log" 2>&1
    local rc=$?
    local line
    line=$(printf '%-24s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) \
        "$(grep -E '[0-9]+ passed|PASS|FAIL' "$LOG_DIR/$log" | tail -1)")
    echo "$line"
    summary+=("$line")
    return $rc
}

kernel_tests() {   # the kernels' own tests
    step test_gemm_sm90 test_gemm_fwd.log build/tests/kernels/test_gemm_sm90
    step test_gemm_sm90_bwd test_gemm_bwd.log build/tests/kernels/test_gemm_sm90_bwd
    step test_dispatch_rows test_dispatch_rows.log build/tests/kernels/test_dispatch_rows
    step test_fp8_quant test_fp8_quant.log build/tests/kernels/test_fp8_quant
}

verify() {
    kernel_tests
    step test_cuda_fp8 test_cuda_fp8.log build/tests/api/test_cuda_fp8
    for t in ep ep_failures ep_memory; do
        step test_cuda_$t test_cuda_$t.log build/tests/api/test_cuda_$t
    done
    step output_hashes_halves output_hashes.log bash -c \
        'build/tools/output_hashes > "$LOG_DIR"/hashes_packed.txt &&
         build/tools/output_hashes halves > "$LOG_DIR"/hashes_halves.txt &&
         diff "$LOG_DIR"/hashes_packed.txt "$LOG_DIR"/hashes_halves.txt &&
         echo "PASS $(wc -l < "$LOG_DIR"/hashes_packed.txt) lines, halves = packed"'
    step python_gpu python_gpu.log python3 -m pytest -q -rs python/tests/test_fp8_cuda.py \
        python/tests/test_ops_cuda.py python/tests/test_distributed_gpu.py \
        python/tests/test_fp8_peer.py
}

kernels() {
    # the kernels' own tests and the two layer suites a kernel change touches first
    # (bf16 backward, FP8): a default change's quick check (~150 s)
    kernel_tests
    step test_cuda_backward test_cuda_backward.log build/tests/api/test_cuda_backward
    step test_cuda_fp8 test_cuda_fp8.log build/tests/api/test_cuda_fp8
}

suites() {
    # The CUDA API suites, staged (the default) and fused.
    for t in forward forward_bitwise backward backward_modes backward_halves; do
        step test_cuda_$t test_cuda_$t.log build/tests/api/test_cuda_$t
        step test_cuda_${t}_fused test_cuda_${t}_fused.log \
            env MOEFUSE_TEST_PIPELINE=fused build/tests/api/test_cuda_$t
    done
    step test_cuda_ep_iterations test_cuda_ep_iterations.log build/tests/api/test_cuda_ep_iterations
}

deep() {
    step python_all python_all.log python3 -m pytest -q -rs python/tests
    step test_gemm_sm90_bwd_time test_gemm_bwd_time.log build/tests/kernels/test_gemm_sm90_bwd_time
    step test_fp8_quant_time test_fp8_quant_time.log build/tests/kernels/test_fp8_quant_time
    step moefuse_step moefuse_step.log build/moefuse_step
    step sass sass.log bash -c 'for o in build/src/cuda/sm90/*.o; do
        s=$(cuobjdump --dump-sass "$o"); echo "$o HGMMA=$(grep -c HGMMA <<< "$s") QGMMA=$(grep -c QGMMA <<< "$s") LDL_STL=$(grep -cE "LDL|STL" <<< "$s")"; done'
    step memcheck memcheck.log timeout 120 compute-sanitizer --error-exitcode 1 --tool memcheck \
        build/tests/api/test_cuda_backward 30b "T=7"
    step memcheck_fp8 memcheck_fp8.log timeout 150 compute-sanitizer --error-exitcode 1 \
        --tool memcheck build/tests/api/test_cuda_fp8 "dropped slots"
    step racecheck_fp8 racecheck_fp8.log timeout 150 compute-sanitizer --error-exitcode 1 \
        --tool racecheck build/tests/api/test_cuda_fp8 "dropped slots"
    step racecheck_bwd_fused racecheck_bwd_fused.log timeout 140 env MOEFUSE_TEST_PIPELINE=fused \
        compute-sanitizer --error-exitcode 1 --tool racecheck build/tests/api/test_cuda_backward 30b "T=7"
    step memcheck_ep memcheck_ep.log timeout 150 compute-sanitizer --error-exitcode 1 \
        --tool memcheck build/tests/api/test_cuda_ep "R=1 comm"
}

bench() {
    # the rewritten bench/RESULTS.md comes back with the logs (copy it into the tree); the
    # lent machine's copy of .git may lag the tree: name the commit with
    # MOEFUSE_BENCH_COMMIT=<hash> on the command line (tools/run_bench.sh)
    STEP_TIMEOUT=540 step bench bench.log tools/run_bench.sh &&
        cp bench/RESULTS.md "$LOG_DIR/RESULTS.md"
}

parity() {
    # the loop's own budget below the call's 10 minutes; its CSV lands in $OUT as it goes
    # (2000 steps of bf16 + fp8 take about 420 s on an H100)
    # PARITY_RUNS picks the runs (e.g. "bf16@1 fp8@1": both from seed 1's weights, a
    # second sample of the gap, and bf16's spread against seed 0's bf16 run)
    STEP_TIMEOUT=540 step train_parity train_parity.log python3 bench/train_parity.py \
        --time-budget 480 --precisions ${PARITY_RUNS:-bf16 fp8} --out "${OUT:-$LOG_DIR}/parity"
}

fp8_diag() {
    step fp8_training_sized fp8_training_sized.log python3 -m pytest -q -rs \
        python/tests/test_fp8_cuda.py -k "training_sized or interleaved"
    STEP_TIMEOUT=120 step fp8_training_calls fp8_training_calls.log python3 \
        tools/fp8_layer_check.py training --steps 0 50 120 --repeat 3
    STEP_TIMEOUT=290 step parity_emulated parity_emulated.log python3 bench/train_parity.py \
        --steps 300 --eval-every 100 --time-budget 240 --precisions bf16 fp8 emul:all \
        --out "${OUT:-$LOG_DIR}/parity_emulated"
    for model in qwen3-30b-a3b qwen3-235b-a22b; do
        STEP_TIMEOUT=90 step profile_fp8_$model profile_fp8_$model.log python3 \
            bench/profile_step.py --model $model --precision fp8 --sustain-s 2
        # FP8's default saves no inputs (its dispatch quantizes x, decision 0026); with them
        STEP_TIMEOUT=90 step profile_fp8_inputs_$model profile_fp8_inputs_$model.log \
            python3 bench/profile_step.py --model $model --precision fp8 --sustain-s 2 \
            --saved inputs
    done
}

opt_in_ab() {
    # an opt-in kernel path built apart (OPT_IN: its nvcc -D flags): the backward GEMMs'
    # tests, the BF16 backward suite and the FP8 tests on it, then the quantizers' times
    # and the layer's profile (OPT_IN_PRECISIONS, OPT_IN_PROFILE), the builds interleaved
    # and the default's profile again last (the clocks' drift); OPT_IN is checked at start
    STEP_TIMEOUT=400 step build_opt_in build_opt_in.log make -j"$(nproc)" BUILD=build/opt \
        NVCC_EXTRA="$OPT_IN" all
    step opt_test_gemm_sm90 opt_test_gemm_fwd.log build/opt/tests/kernels/test_gemm_sm90
    step opt_test_gemm_sm90_bwd opt_test_gemm_bwd.log build/opt/tests/kernels/test_gemm_sm90_bwd
    local t
    for t in ${OPT_IN_SUITES-backward backward_modes backward_halves}; do
        step opt_test_cuda_$t opt_test_cuda_$t.log build/opt/tests/api/test_cuda_$t
    done
    step opt_test_fp8_quant opt_test_fp8_quant.log build/opt/tests/kernels/test_fp8_quant
    step opt_test_dispatch_rows opt_test_dispatch_rows.log build/opt/tests/kernels/test_dispatch_rows
    step opt_test_cuda_fp8 opt_test_cuda_fp8.log build/opt/tests/api/test_cuda_fp8
    step opt_python_fp8 opt_python_fp8.log env MOEFUSE_LIB="$PWD/build/opt/libmoefuse.so" \
        python3 -m pytest -q -rs python/tests/test_fp8_cuda.py -k "not training_sized"
    local lib precision run=0
    for lib in build build/opt; do
        step "quant_time_${lib//\//_}" "quant_time_${lib//\//_}.log" \
            "$lib/tests/kernels/test_fp8_quant_time"
    done
    for precision in ${OPT_IN_PRECISIONS:-fp8}; do
        for lib in build build/opt build; do
            run=$((run + 1))
            STEP_TIMEOUT=90 step "profile_${run}_${precision}_${lib//\//_}" \
                "profile_${run}_${precision}_${lib//\//_}.log" \
                env MOEFUSE_LIB="$PWD/$lib/libmoefuse.so" python3 bench/profile_step.py \
                --model qwen3-30b-a3b --precision "$precision" --sustain-s 2 ${OPT_IN_PROFILE:-}
        done
    done
}

saved_modes() {
    # the Python default saves the inputs in bf16 and not in FP8 (decision 0012): an FP8
    # forward that saves them dispatches bf16 rows and quantizes them again (0026)
    local precision saved
    for precision in bf16 fp8; do
        for saved in inputs activations recompute; do
            STEP_TIMEOUT=60 step "profile_${precision}_$saved" "profile_${precision}_$saved.log" \
                python3 bench/profile_step.py --model qwen3-30b-a3b --precision "$precision" \
                --saved "$saved" --sustain-s 2
        done
    done
}

ncu_fp8() {
    # where the FP8 kernels' time goes: ncu's sections of one launch of each (the third,
    # past the warm-up) in qwen3-30b-a3b's forward + backward at T = 16384; NCU_KERNELS
    # picks them, NCU_LIBS the libraries (e.g. "build build/opt" after opt_in_ab's build)
    local k lib
    for lib in ${NCU_LIBS:-build}; do
        for k in ${NCU_KERNELS:-gemm2_dgrad_swiglu wgrad_grouped gemm1_swiglu \
            fp8_quantize_tokens_kernel fp8_quantize_rows_kernel}; do
            STEP_TIMEOUT=150 step "ncu_${k}_${lib//\//_}" "ncu_${k}_${lib//\//_}.log" \
                env MOEFUSE_LIB="$PWD/$lib/libmoefuse.so" ncu --kernel-name "regex:$k" \
                --launch-skip 2 --launch-count 1 --section SpeedOfLight \
                --section MemoryWorkloadAnalysis --section WarpStateStats \
                --section SchedulerStats --section Occupancy --section LaunchStats \
                python3 tools/fp8_layer_check.py repeat 16384:3 --shape qwen3-30b-a3b
        done
    done
}

ncu_stalls() {
    # the stall samples per instruction of one launch of each kernel in qwen3-30b-a3b's FP8
    # forward + backward at T = 16384 (the second call's; wgrad's is dW13, the larger: a
    # backward runs dW2 then dW13), summed by tools/ncu_stalls.py; the report and its
    # source page are dropped once read (tens of MB), the page kept gzipped in the logs
    # with NCU_KEEP_CSV=1 (for tools/ncu_stalls.py --ranges: the roles' address ranges)
    local k lib name skip
    for lib in ${NCU_LIBS:-build}; do
        for k in ${NCU_KERNELS:-wgrad_grouped gemm2_dgrad_swiglu}; do
            name="${k}_${lib//\//_}"
            skip=1
            [ "$k" = wgrad_grouped ] && skip=3
            STEP_TIMEOUT=300 step "ncu_full_$name" "ncu_full_$name.log" bash -c "
                MOEFUSE_LIB='$PWD/$lib/libmoefuse.so' ncu --set full --import-source yes \
                    --kernel-name 'regex:$k' --launch-skip $skip --launch-count 1 -f \
                    -o /tmp/stalls_$name python3 tools/fp8_layer_check.py repeat 16384:3 \
                    --shape qwen3-30b-a3b &&
                ncu -i /tmp/stalls_$name.ncu-rep --page source --csv --print-source sass \
                    > /tmp/stalls_$name.csv" &&
                step "stalls_$name" "stalls_$name.txt" python3 tools/ncu_stalls.py \
                    "/tmp/stalls_$name.csv"
            [ -n "${NCU_KEEP_CSV:-}" ] && [ -f "/tmp/stalls_$name.csv" ] &&
                gzip -c "/tmp/stalls_$name.csv" > "$LOG_DIR/stalls_$name.csv.gz"
            rm -f "/tmp/stalls_$name.ncu-rep" "/tmp/stalls_$name.csv"
        done
    done
}

ablation() {
    # the FP8 recipe emulated with one stage's GEMMs left in bf16, in two runs of four models
    # (fp32 weights and AdamW state, ~10 GB each between steps, fit an 80 GB card), each
    # under its own budget: 1 = bf16, fp8, the whole recipe emulated, the forward in bf16;
    # 2 = bf16, bf16 from seed 1's weights (the spread), the data gradients in bf16, the
    # weight gradients in bf16. The emulation's per-expert fp32 GEMMs take ~720 ms a step on
    # an H100 (bf16 and fp8 ~100): group 2 ran its 300 steps in 450 s, group 1 (1.6 s a
    # step) was cut to 283; one group a call (ABLATION_GROUPS=1 or 2).
    # ABLATION_RUNS="emul:all-gemm1 ..." runs bf16 and those instead
    local i=0 runs budget=${ABLATION_BUDGET:-480}
    local groups=("bf16 fp8 emul:all emul:all-gemm1,gemm2"
                  "bf16 bf16@1 emul:all-dgrad2,dgrad1 emul:all-dw2,dw13")
    [[ -n ${ABLATION_RUNS:-} ]] && groups=("bf16 $ABLATION_RUNS")
    for runs in "${groups[@]}"; do
        i=$((i + 1))
        [[ -n ${ABLATION_RUNS:-} || " ${ABLATION_GROUPS:-1 2} " == *" $i "* ]] || continue
        STEP_TIMEOUT=$((budget + 40)) step ablation_$i ablation_$i.log python3 \
            bench/train_parity.py --steps 300 --eval-every 100 --time-budget "$budget" \
            --precisions $runs --out "${OUT:-$LOG_DIR}/ablation_$i"
    done
}

step_time() {
    # 12 layers where they fit (pure bf16 state, 8 bytes a parameter: ~60 GB at 12 layers,
    # plus activations: an H200), 6 on an 80 GB card (8 ran out of memory in the FP8 run's
    # loss); STEP_LAYERS chooses, and STEP_MICRO_BATCHES the micro-batches accumulated
    # per optimizer step (FP8 quantizes the weights once per optimizer step)
    local layers=${STEP_LAYERS:-$(python3 -c 'import torch
print(12 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 6)')}
    STEP_TIMEOUT=400 step bench_train_step train_step.log env \
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 bench/bench_train_step.py \
        --layers "$layers" --precision bf16 fp8 --micro-batches "${STEP_MICRO_BATCHES:-1}" \
        --plot "$LOG_DIR/loss_curves.png"
}

install_titan() {
    if ! python3 -c 'import torchtitan' 2>/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl > "$LOG_DIR/titan_install.log" 2>&1
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
}

titan() {   # the step benchmark; the layers that fit the GPU (bench_torchtitan.py) or TITAN_LAYERS
    install_titan
    STEP_TIMEOUT=480 step titan_30b titan_30b.log python3 bench/bench_torchtitan.py \
        --model 30B-A3B --steps 30 --warmup 10 --fp8 --control ${TITAN_LAYERS:+--layers $TITAN_LAYERS} \
        --plot "$LOG_DIR/torchtitan_30b_loss.png"
}

titan_235b() {
    install_titan
    STEP_TIMEOUT=400 step titan_235b titan_235b.log python3 bench/bench_torchtitan.py \
        --model 235B-A22B --steps 20 --warmup 8 --fp8 --plot "$LOG_DIR/torchtitan_235b_loss.png"
}

titan_loss() {   # debugmodel_moe, 200 steps: the loss curves, native against moefuse
    install_titan
    STEP_TIMEOUT=240 step titan_debugmodel titan_debugmodel.log python3 bench/bench_torchtitan.py \
        --steps 200 --plot "$LOG_DIR/torchtitan_loss.png"
    STEP_TIMEOUT=150 step test_torchtitan_ep test_torchtitan_ep.log python3 -m pytest -q -rs \
        python/tests/test_torchtitan_ep.py
}

phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(verify)
for p in "${phases[@]}"; do
    case "$p" in
    verify | kernels | suites | deep | bench | parity | fp8_diag | opt_in_ab | saved_modes | ncu_fp8 \
        | ncu_stalls | ablation | step | titan | titan_235b | titan_loss) ;;
    *) echo "tools/gpu_checks.sh: unknown phase '$p' (verify, kernels, suites, deep, bench, parity," \
            "fp8_diag, opt_in_ab, saved_modes, ncu_fp8, ncu_stalls, ablation, step, titan, titan_235b," \
            "titan_loss)" >&2
       exit 2 ;;
    esac
    if [ "$p" = opt_in_ab ] && [ -z "${OPT_IN:-}" ]; then
        echo "tools/gpu_checks.sh opt_in_ab: set OPT_IN to the opt-in's nvcc flags" \
            "(-DNAME=1 ...)" >&2
        exit 2
    fi
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
step build build.log make -j"$(nproc)" all || { tail -30 "$LOG_DIR/build.log"; exit 1; }
for p in "${phases[@]}"; do
    if [ "$p" = step ]; then step_time; else "$p"; fi
done
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.txt"
# At most 8 files come back from $OUT: the logs go back as one archive (a call cut off
# before this point still returns the first of them as they are).
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-logs.tgz" -C "$OUT" gpu-logs && rm -rf "$OUT/gpu-logs"
fi
