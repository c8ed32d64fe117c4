#!/usr/bin/env bash
# Installs what the build and the tests need on a fresh Debian 12 machine (as root):
# OpenBLAS (OpenMP build) for the CPU backend, clang + libFuzzer for the fuzz target,
# and PyTorch + pytest for the Python binding's tests, with transformers for the test that
# compares the drop-in block against its Qwen3MoeSparseMoeBlock, and TorchTitan 0.2.2 (the
# newest release that runs on torch 2.11) for the tests of moefuse.torchtitan; pip is held
# to the installed torch so that TorchTitan's requirements never replace it. nvcc is
# optional: with it the CUDA kernels are compiled for sm_90a too.
set -euo pipefail
need_apt=()
[ -e /usr/include/x86_64-linux-gnu/openblas-openmp/cblas.h ] || [ -e /usr/include/aarch64-linux-gnu/openblas-openmp/cblas.h ] || need_apt+=(libopenblas-openmp-dev)
command -v clang >/dev/null || need_apt+=(clang)
dpkg -s libfuzzer-14-dev >/dev/null 2>&1 || need_apt+=(libfuzzer-14-dev libclang-rt-14-dev)
command -v make >/dev/null || need_apt+=(make)
if [ ${#need_apt[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}"
fi
python3 -c 'import torch, pytest, numpy' 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check torch==2.11.0 pytest numpy
python3 -c 'import transformers' 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check transformers==5.24.0
python3 -c 'from importlib.metadata import version; assert version("torchtitan") == "0.2.2"' 2>/dev/null ||
    python3 -m pip install -q --disable-pip-version-check torchtitan==0.2.2 \
        -c <(python3 -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')
