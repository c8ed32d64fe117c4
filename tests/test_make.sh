#!/usr/bin/env bash
# The Makefile: a build follows its flags (a build with other flags, with or without
# CUDA, recompiles what they change instead of linking stale objects), builds with and
# without CUDA live in their own directories, and every target the Makefile declares
# does something. Builds the host library at -O0 in a scratch directory (seconds);
# CUDA builds are only dry-run (NVCC=/bin/false stands in for a compiler).
set -u
cd "$(dirname "$0")/.."
unset MAKEFLAGS MFLAGS MAKELEVEL
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
B="$scratch/build"
passed=0 failed=0
check() { # $1 = name, then a command that must succeed
    local name=$1; shift
    if "$@" > "$scratch/out" 2>&1; then passed=$((passed + 1)); echo "ok $name"
    else failed=$((failed + 1)); echo "FAIL $name"; tail -20 "$scratch/out"; fi
}
# CFLAGS from the environment: make adds the project's flags to them.
export CFLAGS=-O0
mk() { make --no-print-directory "$@" BUILD="$B"; }
quiet_up_to_date() { mk -q "$@"; }
out_of_date() { ! mk -q "$@"; }
dry_run_has() { # $1 = extended regex, then make arguments
    local re=$1; shift
    mk -n "$@" | grep -qE -- "$re"
}

check "CPU build" mk -j2 lib NVCC=none
check "CPU build: up to date after it" quiet_up_to_date lib NVCC=none
check "other CFLAGS: out of date" env CFLAGS="-O0 -DMF_TEST_FLAGS" bash -c "! make -q lib NVCC=none BUILD='$B'"
check "CPU build again" mk -j2 lib NVCC=none
check "with CUDA after without: host objects compiled again, with CUDA" \
    dry_run_has '-DMOEFUSE_HAVE_CUDA=1 .*-c src/host/layer.c' lib NVCC=/bin/false
check "without CUDA after with: host objects compiled again, without CUDA" \
    bash -c "make --no-print-directory -n lib NVCC=none BUILD='$B' |
             grep -E -- '-c src/host/layer.c' | grep -qv MOEFUSE_HAVE_CUDA"
# Default directories: build/ with CUDA, build/cpu/ without (asked in an empty
# directory, so that this checkout's build/ keeps its flag records).
mkdir -p "$scratch/empty"
default_lib() { # $1 = NVCC
    make --no-print-directory -C "$scratch/empty" -f "$PWD/Makefile" -n lib NVCC="$1" 2>/dev/null |
        grep -oE '[^ ]*libmoefuse.so' | head -1
}
check "NVCC=none builds in build/cpu" test "$(default_lib none)" = build/cpu/libmoefuse.so
check "with CUDA builds in build/" test "$(default_lib /bin/false)" = build/libmoefuse.so
check "make test-c runs the C tests" dry_run_has 'run_tests.sh --no-python .*test_plan' \
    test-c NVCC=none
check "make test-python runs the Python tests" dry_run_has 'run_tests.sh --python-only' \
    test-python NVCC=none
echo "$passed passed, $failed failed, 0 skipped"
[ "$failed" -eq 0 ]
