#!/usr/bin/env bash
# The main job (tools/moefuse_step.c) as the README runs it: a CPU step of
# qwen3-30b-a3b at T = 513, which takes the sampled check (the one qwen3-235b-a22b
# needs), must pass within the memory of the step itself (bf16 weights and fp32
# gradients, 6 bytes per parameter) plus 1 GiB: the check widens one expert at a time.
# And the job uses the public header (plus the fp64 reference's), nothing internal.
set -u
cd "$(dirname "$0")/.."
step="$(dirname "${MOEFUSE_LIB:-build/libmoefuse.so}")/moefuse_step"
passed=0 failed=0
check() { # $1 = name, $2 = 0 when it holds, $3 = what was seen
    if [ "$2" -eq 0 ]; then passed=$((passed + 1)); echo "ok $1"
    else failed=$((failed + 1)); echo "FAIL $1: $3"; fi
}

includes=$(grep -oE '^#include "[^"]+"' tools/moefuse_step.c | tr '\n' ' ')
[ "$includes" = '#include "moefuse.h" #include "reference.h" ' ]
check "moefuse_step includes moefuse.h and reference.h only" $? "$includes"

if [ ! -x "$step" ]; then
    echo "FAIL $step is not built"; echo "$passed passed, $((failed + 1)) failed, 0 skipped"; exit 1
fi
# qwen3-30b-a3b: E * 3 * I * H parameters
params=$((128 * 3 * 768 * 2048))
bound_kib=$(((params * 6 + (1 << 30)) / 1024))
out=$(python3 - "$step" <<'EOF'
import resource, subprocess, sys
run = subprocess.run([sys.argv[1], "--model", "qwen3-30b-a3b", "--backend", "cpu",
                      "--tokens", "513", "--iters", "1"], capture_output=True, text=True)
print(run.stdout + run.stderr)
print("exit", run.returncode, "maxrss_kib", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
EOF
)
rc=$(sed -nE 's/^exit (-?[0-9]+) .*/\1/p' <<<"$out")
rss=$(sed -nE 's/.*maxrss_kib ([0-9]+)/\1/p' <<<"$out")
grep -q "sampled tokens" <<<"$out" && [ "$rc" = 0 ]
check "qwen3-30b-a3b T=513: the sampled check passes" $? "$(tail -8 <<<"$out")"
[ -n "$rss" ] && [ "$rss" -le "$bound_kib" ]
check "qwen3-30b-a3b T=513: peak RSS within weights, gradients and 1 GiB" $? \
    "${rss:-?} KiB > $bound_kib KiB"
echo "$passed passed, $failed failed, 0 skipped"
[ "$failed" -eq 0 ]
