# Sourced by the GPU machine's scripts (gpu_checks.sh, ab_patch.sh): nvcc on PATH, NVLink
# multicast off (DESIGN 4), and the build against the libnccl PyTorch loads (the headers
# of the library that runs), unless NCCL_HOME is set already.
export PATH="$PATH:/usr/local/cuda/bin" NCCL_NVLS_ENABLE=0
if [ -z "${NCCL_HOME:-}" ]; then
    NCCL_HOME=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null) &&
        export NCCL_HOME || unset NCCL_HOME
fi
