#!/usr/bin/env bash
# `make bench`: the benchmarks, on a CUDA device. Each prints one line per case.
#  1. bench/bench_forward.py: moefuse vs the TorchTitan-style PyTorch MoE, same run,
#     with the bf16 matmul peak measured in that run; once with every call alone and
#     synchronized (host time included), once with 4 calls queued per sample (the host
#     ahead of the GPU, as in training), their samples interleaved; then at T = 16384
#     with each variant sustained at the GPU's power limit (--sustained).
#  2. build/bench/bench_forward_cuda: the forward and its small stages alone.
set -euo pipefail
cd "$(dirname "$0")/.."
export MOEFUSE_LIB="${MOEFUSE_LIB:-$PWD/build/libmoefuse.so}"
python3 bench/bench_forward.py "$@"
python3 bench/bench_forward.py --queue 4 "$@"
python3 bench/bench_forward.py --queue 4 --sustained --tokens 16384 "$@"
if [ -x build/bench/bench_forward_cuda ]; then
    build/bench/bench_forward_cuda
else
    echo "SKIP bench_forward_cuda: built only when nvcc is found"
fi
